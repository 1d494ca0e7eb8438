"""PlanTrainer: one process against a hand-computed SGD step, errors, and the README example under
``accelerate launch`` with two gloo processes (each rank trains exactly its planned rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from ray_cluster_ft.integrations.torch import ExamplesDataset, loss_positions
from ray_cluster_ft.train import verify_trained
from tests.conftest import free_port

from ._helpers import (
    ParamsAfterFirstStep,
    make_run,
    planned_rows,
    readme_example,
    reference_step_loss,
)

transformers = pytest.importorskip("transformers")


def _args(out: Path, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def test_plan_trainer_one_process_takes_the_token_exact_sgd_step(tmp_path, tiny_model_dir):
    """W = 1, G = 2: the first SGD step moves every parameter by -lr * d(step loss)/dtheta, the step loss being
    sum_i w_i sum_t l_it / D over both micro-batches (so the Trainer neither averages per micro-batch nor
    divides by G again), and the trained rows are the plan's."""
    from transformers import AutoModelForCausalLM

    from ray_cluster_ft.integrations.hf import PlanTrainer

    made = make_run(tmp_path / "run", n=8, world=1, mbs=2, ga=2, epochs=1)
    plan, ex, w = made["plan"], made["examples"], made["weights"]
    probe = ParamsAfterFirstStep()
    lr = 0.5
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head_rows = []  # positions per row the LM head computed, per micro-batch
    model.lm_head.register_forward_hook(lambda mod, inp, out: head_rows.append(out.shape[1]))
    trainer = PlanTrainer(
        model=model,
        args=_args(tmp_path / "out", optim="sgd", learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=0.0,
                   weight_decay=0.0, gradient_accumulation_steps=7, num_train_epochs=3),
        train_dataset=ExamplesDataset(ex), plan=plan, weights=w, callbacks=[probe],
        trained_log=tmp_path / "out" / "trained_rank{rank}.jsonl",
    )
    assert (trainer.args.gradient_accumulation_steps, trainer.args.per_device_train_batch_size) == (2, 2)
    assert (trainer.args.max_steps, trainer.args.num_train_epochs) == (2, 1)
    loader = trainer.get_train_dataloader()
    assert loader.batch_sampler is trainer.plan_sampler and len(loader) == 4
    trainer.train()
    assert trainer.state.global_step == 2
    # The LM head ran only where a label follows (logits_to_keep), not over prompts and padding; the loss and the
    # step below still equal the reference over all logits.
    batches = list(loader)
    assert head_rows == [len(loss_positions(b["labels"])) for b in batches]
    assert sum(head_rows) < sum(b["labels"].shape[1] for b in batches)

    trained = pd.read_json(tmp_path / "out" / "trained_rank0.jsonl", lines=True, dtype={"example_id": str})
    assert trained.to_dict("records") == trainer.trained_rows
    assert verify_trained(plan, trained)["matches_plan"]
    want = planned_rows(plan, 0)
    assert trained[["epoch", "step", "micro_index"]].to_numpy().tolist() == \
        want[["epoch", "step", "micro_index"]].to_numpy().tolist()

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref = reference_step_loss(lambda x: ref_model(input_ids=x, use_cache=False).logits, plan, ex, w, step=0)
    ref.backward()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[0] == pytest.approx(float(ref.detach()), abs=2e-4)
    for k, p in ref_model.named_parameters():
        torch.testing.assert_close(probe.params[k], p.detach() - lr * p.grad, rtol=1e-4, atol=1e-6)


class _NoLabelsForward(torch.nn.Module):
    """A causal LM behind a ``forward`` without ``labels`` (a custom head, a wrapper): Trainer drops the dataset
    columns such a forward does not take."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_a_forward_without_labels_still_trains_the_planned_labels(tmp_path, tiny_model_dir):
    """PlanTrainer reads the labels itself: they must reach it whatever the model's forward takes, and the first
    step's loss is the reference's over the planned label tokens (not over labels the collator made of every
    input token)."""
    from transformers import AutoModelForCausalLM

    from ray_cluster_ft.integrations.hf import PlanTrainer

    made = make_run(tmp_path / "run", n=8, world=1, mbs=2, ga=2, epochs=1)
    plan, ex, w = made["plan"], made["examples"], made["weights"]
    trainer = PlanTrainer(model=_NoLabelsForward(AutoModelForCausalLM.from_pretrained(tiny_model_dir)),
                          args=_args(tmp_path / "out", learning_rate=0.0), train_dataset=ExamplesDataset(ex),
                          plan=plan, weights=w)
    assert trainer.args.remove_unused_columns and "labels" not in trainer.label_names
    trainer.train()
    assert verify_trained(plan, pd.DataFrame(trainer.trained_rows))["matches_plan"]
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref = reference_step_loss(lambda x: ref_model(input_ids=x, use_cache=False).logits, plan, ex, w, step=0)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[0] == pytest.approx(float(ref.detach()), abs=2e-4)


def test_plan_trainer_errors(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ray_cluster_ft.integrations.hf import PlanTrainer

    made = make_run(tmp_path / "run", n=16, world=2, mbs=2, ga=2, epochs=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    data = ExamplesDataset(made["examples"])
    with pytest.raises(ValueError, match="the plan is for 2 ranks but this Trainer runs 1 process: this is a single "
                                         "process started without a launcher"):
        PlanTrainer(model=model, args=_args(tmp_path / "o"), train_dataset=data, plan=made["plan"])
    one = make_run(tmp_path / "run1", n=8, world=1, mbs=2, ga=2, epochs=1)
    with pytest.raises(ValueError, match="not in the dataset"):
        PlanTrainer(model=model, args=_args(tmp_path / "o"), train_dataset=data, plan=one["plan"].assign(
            example_id=lambda p: p["example_id"] + "x"))
    with pytest.raises(ValueError, match="do not pass compute_loss_func"):
        PlanTrainer(model=model, args=_args(tmp_path / "o"), train_dataset=data, plan=one["plan"],
                    compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        PlanTrainer(model=model, args=_args(tmp_path / "o", auto_find_batch_size=True), train_dataset=data,
                    plan=one["plan"])
    raw = [{"example_id": f"ex{i:03d}", "prompt": "p", "completion": "c"} for i in range(16)]
    with pytest.raises(ValueError, match=r"train_dataset row 0 has no input_ids \(its fields: \['completion', "
                                         r"'example_id', 'prompt'\]\): PlanTrainer trains tokenized rows"):
        PlanTrainer(model=model, args=_args(tmp_path / "o"), train_dataset=raw, plan=one["plan"])
    with pytest.raises(ValueError, match="needs the example id of every train_dataset row"):
        PlanTrainer(model=model, args=_args(tmp_path / "o"), train_dataset=[{"input_ids": [1, 2]}] * 8,
                    plan=one["plan"])


# Appended to the README example in the launched script: what each rank saw, written for the test to read.
_CHECKS = '''

# ---- test-only checks, appended to the README example ----
import json as _json
from torch.utils.data import DataLoader as _DataLoader

_rank = trainer.args.process_index
_loader = trainer.get_train_dataloader()
# What plain accelerator.prepare does to a rank-aware batch sampler: BatchSamplerShard keeps every W-th batch.
_resharded = trainer.accelerator.prepare(_DataLoader(list(range(len(trainer.train_dataset))),
                                                     batch_sampler=trainer.plan_sampler))
_json.dump({
    "world": trainer.args.world_size,
    "global_step": trainer.state.global_step,
    "len": len(_loader),
    "sampler_is_plan": _loader.batch_sampler is trainer.plan_sampler,
    "resharded_len": len(_resharded),
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
}, open(f"hf_out/result_rank{_rank}.json", "w"))
'''


@pytest.mark.slow
def test_readme_hf_example_under_accelerate_launch_trains_each_ranks_plan(tmp_path, tiny_model_dir):
    made = make_run(tmp_path / "run")  # W=2, B=2, G=2, 2 epochs: 8 steps
    plan = made["plan"]
    script = tmp_path / "train_hf.py"
    script.write_text(readme_example("hf", tmp_path / "run", tiny_model_dir) + _CHECKS)
    accelerate = Path(sys.executable).with_name("accelerate")
    # On a CPU-only machine `--cpu` starts one process (several need MPI); the torchrun launcher behind
    # --multi_gpu starts two, and ACCELERATE_USE_CPU makes TrainingArguments pick the CPU and gloo.
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(script)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    frames = []
    for r in (0, 1):
        res = json.loads((tmp_path / "hf_out" / f"result_rank{r}.json").read_text())
        assert res["world"] == 2 and res["global_step"] == 8 and res["len"] == 16 and res["sampler_is_plan"]
        assert res["resharded_len"] == 8  # what the workaround avoids
        t = pd.read_json(tmp_path / "hf_out" / f"trained_rank{r}.jsonl", lines=True, dtype={"example_id": str})
        want = planned_rows(plan, r)
        assert t["example_id"].tolist() == want["example_id"].tolist()
        assert t[["epoch", "step", "micro_index"]].to_numpy().tolist() == \
            want[["epoch", "step", "micro_index"]].to_numpy().tolist()
        frames.append(t)
        if r == 0:
            losses = res["losses"]
    check = verify_trained(plan, pd.concat(frames, ignore_index=True))
    assert check["matches_plan"] and check["once_per_epoch"]

    # the logged step-0 loss is the token-exact weighted loss of all of step 0's rows (both ranks)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = reference_step_loss(lambda x: model(input_ids=x, use_cache=False).logits, plan, made["examples"],
                                  made["weights"], step=0)
    assert len(losses) == 8
    assert losses[0] == pytest.approx(float(ref), abs=2e-4)


def test_logits_are_kept_at_label_positions_only_where_positions_mean_the_input(tiny_model_dir):
    """A causal LM, a LoRA model and a prefix-tuning model around one keep logits at the loss positions; PEFT prompt
    tuning and p-tuning do not (their virtual tokens come first, so the input's positions would read other logits),
    nor a module whose forward lacks ``logits_to_keep``: those compute all logits."""
    from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ray_cluster_ft.model import forward_keeps_logits

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    assert forward_keeps_logits(load())
    assert forward_keeps_logits(get_peft_model(load(), LoraConfig(r=2, target_modules=["q_proj"])))
    prompt = get_peft_model(load(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert not forward_keeps_logits(prompt)
    x = torch.tensor([[5, 6, 7, 8]])
    assert prompt(input_ids=x).logits.shape[1] == 3 + 4  # the virtual tokens' logits come first
    p_tuning = PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8)
    assert not forward_keeps_logits(get_peft_model(load(), p_tuning))
    # prefix tuning's virtual tokens are key/value prefixes: the logits are the input's, and keeping some is exact
    prefix = get_peft_model(load(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert forward_keeps_logits(prefix)
    keep = torch.tensor([1, 3])
    torch.testing.assert_close(prefix(input_ids=x, logits_to_keep=keep).logits, prefix(input_ids=x).logits[:, keep])

    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert not forward_keeps_logits(Plain())
