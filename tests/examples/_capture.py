"""Run an example script with every causal LM's forward recorded (``input_ids``, ``position_ids``, ``logits_to_keep``
when a tensor, ``logits``), for
the example tests: ``python _capture.py OUT_DIR SCRIPT ARGS...`` (under torchrun, one file per rank). The script
runs unchanged (``runpy``); only ``AutoModelForCausalLM.from_pretrained`` is wrapped to add a forward hook, and
``Trainer.train`` to keep the trainer of a script that never names it."""

import os
import runpy
import sys

import torch
import transformers

out_dir, script, *rest = sys.argv[1:]
calls = []
_load = transformers.AutoModelForCausalLM.from_pretrained


def _hook(module, args, kwargs, output):
    if module.training:
        keys = ("input_ids", "position_ids", "logits_to_keep")
        calls.append({k: kwargs[k].detach().cpu() for k in keys if isinstance(kwargs.get(k), torch.Tensor)}
                     | {"logits": output.logits.detach().float().cpu()})


def _from_pretrained(*a, **k):
    model = _load(*a, **k)
    model.register_forward_hook(_hook, with_kwargs=True)
    return model


_train = transformers.Trainer.train
trained = []


def _trainer_train(self, *a, **k):
    trained.append(self)
    return _train(self, *a, **k)


transformers.AutoModelForCausalLM.from_pretrained = _from_pretrained
transformers.Trainer.train = _trainer_train
sys.argv = [script, *rest]
ns = runpy.run_path(script, run_name="__main__")
trainer = ns.get("trainer") or (trained[-1] if trained else None)
extra = {}
if trainer is not None:
    extra["log"] = [h for h in trainer.state.log_history if "loss" in h]
    extra["global_step"] = trainer.state.global_step
    extra["train_loss"] = trainer.state.log_history[-1].get("train_loss") if trainer.state.log_history else None
    extra["plan"] = getattr(trainer, "plan", None)  # a plain SFTTrainer has none
    ds = trainer.train_dataset
    if hasattr(ds, "column_names") and "input_ids" in ds.column_names:  # TRL's prepared rows
        extra["tokens"] = {"example_id": list(ds["example_id"]), "input_ids": list(ds["input_ids"]),
                           "labels": list(ds["labels"])}
torch.save({"calls": calls, **extra}, os.path.join(out_dir, f"capture_rank{os.environ.get('RANK', '0')}.pt"))
