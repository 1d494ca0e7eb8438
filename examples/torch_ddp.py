"""Train a ``ray-cluster-ft select`` folder's plan in a plain PyTorch DDP loop: ``PlanBatchSampler`` yields this
rank's planned micro-batches (packs, for a packed plan) and ``micro_batch_loss`` applies the token-exact weighted
loss.

    ray-cluster-ft select jobs/demo.yaml --output runs/sel
    torchrun --nproc_per_node 2 examples/torch_ddp.py runs/sel
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ray_cluster_ft.integrations.torch import (
    ExamplesDataset, PlanBatchSampler, TokenCollator, is_packed_plan, loss_positions, micro_batch_loss,
    plan_loss_weights)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _run import read_run  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("run_dir", help="output folder of `ray-cluster-ft select`")
p.add_argument("--model", help="model folder (default: the run's own model)")
p.add_argument("--output", default="torch_out", help="where each rank writes its trained rows and losses")
a = p.parse_args()
run = read_run(a.run_dir, a.model)
plan, examples, weights = run["plan"], run["examples"], run["weights"]

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK and WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
packed = is_packed_plan(plan)  # the select default packs the cluster plan (allocation.packing: auto)
data = ExamplesDataset(examples)
sampler = PlanBatchSampler(plan, data.example_ids, rank, world, packed=packed)  # this rank's micro-batches
loader = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(pad_token_id=0, packed=packed))
model = AutoModelForCausalLM.from_pretrained(run["model_path"]).to(device)
model.train()  # from_pretrained returns the model in eval mode
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
log = []
for i, (batch, mw) in enumerate(zip(loader, plan_loss_weights(plan, examples, rank, weights, world, packed))):
    inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    labels = batch["labels"].to(device)
    keep = loss_positions(labels)  # the LM head only where a label follows: no prompt tokens, no padding
    logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
    loss = micro_batch_loss(logits, labels, mw, world_size=world, positions=keep)  # DDP averages: W S_mb / D
    loss.backward()
    log.append({"step": mw.step, "micro_index": mw.micro_index, "example_id": list(mw.example_ids),
                "loss": float(loss.detach()) / world})  # this rank's share of the step's token-exact loss
    if (i + 1) % sampler.grad_accum == 0:
        opt.step()
        opt.zero_grad()
Path(a.output).mkdir(parents=True, exist_ok=True)
Path(a.output, f"trained_rank{rank}.json").write_text(json.dumps(log))
last = log[-1]["step"]
totals = torch.tensor([sum(len(m["example_id"]) for m in log), sum(m["loss"] for m in log if m["step"] == last)],
                      dtype=torch.float64, device=device)
dist.all_reduce(totals)  # the ranks' rows, and their shares of the last step's loss, add up
if rank == 0:
    print(f"trained {len({m['step'] for m in log})} steps, {int(totals[0])} rows on {world} ranks; "
          f"final loss {float(totals[1]):.4f}")
dist.destroy_process_group()
