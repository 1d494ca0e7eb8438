"""Train a ``ray-cluster-ft select`` folder's plan with TRL's ``SFTTrainer`` (``PlanSFTTrainer``): TRL tokenizes
the selected rows its own way, the plan is re-made for TRL's token counts, and each process trains exactly its
rank's micro-batches of that plan with the selection weights (token-exact loss on TRL's labels).

    pip install 'ray-cluster-ft[trl]'
    ray-cluster-ft select jobs/demo.yaml --output runs/sel
    torchrun --nproc_per_node 2 examples/trl_sft.py runs/sel
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from ray_cluster_ft.config import load_config
from ray_cluster_ft.integrations.trl import PlanSFTTrainer, selected_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _run import read_run  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("run_dir", help="output folder of `ray-cluster-ft select`")
p.add_argument("--model", help="model folder (default: the run's own model)")
p.add_argument("--output", default="trl_out", help="SFTConfig output_dir (default trl_out)")
a = p.parse_args()
run = read_run(a.run_dir, a.model)
cfg = load_config(Path(a.run_dir) / "config.yaml")  # the run's allocation settings, for the re-plan

cuda = torch.cuda.is_available()
trainer = PlanSFTTrainer(
    model=AutoModelForCausalLM.from_pretrained(run["model_path"]),
    processing_class=AutoTokenizer.from_pretrained(run["model_path"]),
    args=SFTConfig(a.output, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none",
                   bf16=cuda and torch.cuda.is_bf16_supported(), use_cpu=not cuda,  # SFTConfig defaults to bf16
                   max_length=cfg.data.max_seq_len),
    train_dataset=selected_dataset(a.run_dir),  # example_id, prompt, completion: the planned rows
    plan=run["plan"], weights=run["weights"], allocation=cfg.allocation,
    trained_log=f"{a.output}/trained_rank{{rank}}.jsonl",
)
trainer.train()
trainer.end()  # every rank: PlanTrainer.end waits for all, then Trainer.end; without it a rank can abort at exit
