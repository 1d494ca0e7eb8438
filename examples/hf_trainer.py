"""Train a ``ray-cluster-ft select`` folder's plan with a Hugging Face ``Trainer`` (``PlanTrainer``): each process
trains exactly its rank's planned micro-batches, in plan order, with the selection weights (token-exact loss).

    ray-cluster-ft select jobs/demo.yaml --output runs/sel
    torchrun --nproc_per_node 2 examples/hf_trainer.py runs/sel        # one process per planned rank

On CPUs ``use_cpu=True`` (set below when there is no CUDA) makes torchrun's processes one run; ``--model`` trains
another model than the run's own (the one its tokens came from).
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from ray_cluster_ft.integrations.hf import PlanTrainer
from ray_cluster_ft.integrations.torch import ExamplesDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _run import read_run  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("run_dir", help="output folder of `ray-cluster-ft select`")
p.add_argument("--model", help="model folder (default: the run's own model)")
p.add_argument("--output", default="hf_out", help="Trainer output_dir (default hf_out)")
a = p.parse_args()
run = read_run(a.run_dir, a.model)

trainer = PlanTrainer(
    model=AutoModelForCausalLM.from_pretrained(run["model_path"]),
    args=TrainingArguments(a.output, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none",
                           use_cpu=not torch.cuda.is_available()),
    train_dataset=ExamplesDataset(run["examples"]), plan=run["plan"], weights=run["weights"],
    trained_log=f"{a.output}/trained_rank{{rank}}.jsonl",  # the ids each rank trained, to check against the plan
)
trainer.train()
trainer.end()  # every rank: PlanTrainer.end waits for all, then Trainer.end; without it a rank can abort at exit
