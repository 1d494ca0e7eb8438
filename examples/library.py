"""ray-cluster-ft as a library on rows written inline: features, clusters, selection and the plan, with no files
and no Ray (small jobs are sketched in this process), then one token-exact weighted step of a plain PyTorch loop.

    python examples/library.py                 # the demo model (SmolLM2-135M-Instruct, converted once)
    python examples/library.py --model PATH    # any local model folder
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import ray_cluster_ft as rcf
from ray_cluster_ft.integrations.torch import (
    ExamplesDataset, PlanBatchSampler, TokenCollator, is_packed_plan, micro_batch_loss, plan_loss_weights)
from ray_cluster_ft.model import resolve_model_path

TOPICS = ["Python lists", "SQL joins", "unit tests", "HTTP caching", "fever in children", "vitamin D",
          "blood pressure", "sleep hygiene"]
ROWS = [{"prompt": f"Explain {t} in one sentence.", "response": f"{t.capitalize()} are explained here, briefly."}
        for t in TOPICS] + \
       [{"messages": [{"role": "user", "content": f"Give one tip about {t}."},
                      {"role": "assistant", "content": f"A tip about {t}: start small and check often."}]}
        for t in TOPICS]

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="demo", help="demo, or a local model folder")
a = p.parse_args()

cfg = rcf.parse_config({"data": {"max_seq_len": 256}, "selection": {"budget": 0.5},
                        "train": {"num_workers": 1, "micro_batch_size": 2, "epochs": 1}})
feats = rcf.compute_features(ROWS, a.model, cfg)  # row i is ROWS[i]
plan = rcf.select_and_plan(feats, feats.n_tokens, cfg)
print(f"features {feats.features.shape}, {len(plan.selection)} of {len(ROWS)} rows selected, "
      f"{plan.plan['step'].nunique()} steps")
print(plan.selection[["example_id", "cluster", "weight"]].to_string(index=False))

# One rank (W = 1): every step of the plan in order, each example's loss weighed by its selection weight.
packed = is_packed_plan(plan.plan)
data = ExamplesDataset(feats.examples)
sampler = PlanBatchSampler(plan.plan, data.example_ids, 0, packed=packed)
loader = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(packed=packed))
weights = plan.selection.set_index("example_id")["weight"]
model = AutoModelForCausalLM.from_pretrained(resolve_model_path(a.model))  # demo: the shared model cache
model.train()  # from_pretrained returns the model in eval mode
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for i, (batch, mw) in enumerate(zip(loader, plan_loss_weights(plan.plan, feats.examples, 0, weights, packed=packed))):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    loss = micro_batch_loss(model(**inputs, use_cache=False).logits, batch["labels"], mw, world_size=1)
    loss.backward()
    if (i + 1) % sampler.grad_accum == 0:
        opt.step()
        opt.zero_grad()
        print(f"step {mw.step}: loss share {float(loss.detach()):.4f}")
