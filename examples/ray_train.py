"""Train a ``ray-cluster-ft select`` folder's plan with your own Ray Train ``TorchTrainer``: ``plan_datasets`` gives
rank r the dataset ``train_rank{r}`` (its planned rows, in plan order, with ``weight`` and the step's token
denominator), ``plan_data_config`` keeps Ray from splitting it, ``rank_shard`` reads it in the worker.

    ray-cluster-ft select jobs/demo.yaml --output runs/sel
    python examples/ray_train.py runs/sel                 # a new local Ray; --address to join a cluster
"""

import argparse
import itertools
import sys
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from transformers import AutoModelForCausalLM

from ray_cluster_ft.integrations.ray_train import plan_data_config, plan_datasets, rank_shard
from ray_cluster_ft.integrations.torch import TokenCollator, is_packed_plan, plan_shape
from ray_cluster_ft.train.step import token_exact_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _run import read_run  # noqa: E402

MICRO_BATCH = ("epoch", "step", "micro_index")


def train_loop(cfg):
    device = ray.train.torch.get_device()
    model = ray.train.torch.prepare_model(AutoModelForCausalLM.from_pretrained(cfg["model_path"]).train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = ray.train.get_context().get_world_size()
    collate = TokenCollator(pad_token_id=0, packed=cfg["packed"])
    # The rows come in plan order; consecutive rows of one (epoch, step, micro_index) are one micro-batch (a pack).
    rows = rank_shard().iter_rows()
    metrics, step_loss = None, 0.0
    for i, (_, group) in enumerate(itertools.groupby(rows, key=lambda r: tuple(int(r[k]) for k in MICRO_BATCH))):
        mb = list(group)
        batch = collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in mb])
        w = torch.tensor([r["weight"] for r in mb], dtype=torch.float32)
        if cfg["packed"]:  # a pack: each example's weight on each of its tokens
            w = torch.repeat_interleave(w, torch.tensor([len(r["input_ids"]) for r in mb]))[None, :]
        inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**inputs, use_cache=False).logits
        loss = token_exact_loss(logits, batch["labels"].to(device), w.to(device)) * world / mb[0]["step_weighted_tokens"]
        loss.backward()  # DDP averages over the ranks; the G micro-batches of a step add up
        step_loss += float(loss.detach()) / world  # this rank's share of the step's token-exact loss
        if (i + 1) % cfg["G"] == 0:
            opt.step()
            opt.zero_grad()
            total = torch.tensor(step_loss, device=device)
            torch.distributed.all_reduce(total)  # the ranks' shares add up to the step's loss
            metrics, step_loss = {"step": int(mb[0]["step"]), "loss": float(total)}, 0.0
            ray.train.report(metrics)
    # Ray Train 2's Result.metrics holds only metrics reported with a checkpoint; rank 0's return value reaches
    # Result.return_value.
    return metrics


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="output folder of `ray-cluster-ft select`")
    p.add_argument("--model", help="model folder (default: the run's own model)")
    p.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or a new local Ray)")
    p.add_argument("--storage", default=str(Path("ray_out").resolve()), help="Ray Train storage_path")
    a = p.parse_args()
    run = read_run(a.run_dir, a.model)
    plan = run["plan"]
    packed = is_packed_plan(plan)
    shape = plan_shape(plan, packed=packed)
    datasets = plan_datasets(plan, run["examples"], shape.world_size, run["weights"], address=a.address)
    trainer = ray.train.torch.TorchTrainer(
        train_loop,
        train_loop_config={"model_path": run["model_path"], "G": shape.grad_accum, "packed": packed},
        scaling_config=ray.train.ScalingConfig(num_workers=shape.world_size),
        run_config=ray.train.RunConfig(name="plan", storage_path=a.storage),
        datasets=datasets,
        dataset_config=plan_data_config(),
    )
    result = trainer.fit()
    m = result.return_value
    print(f"trained {shape.steps} steps on {shape.world_size} workers; last step {m['step']}, loss {m['loss']:.4f}")


if __name__ == "__main__":
    main()
