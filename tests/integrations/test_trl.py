"""PlanSFTTrainer: TRL tokenizes, the plan is re-made from TRL's token counts, and one process takes the token-exact
weighted SGD step of that plan on TRL's labels (checked against a hand-computed step); errors; selected_dataset."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from ray_cluster_ft.allocate import make_plan
from ray_cluster_ft.integrations.torch import is_packed_plan, replan

from ._helpers import ParamsAfterFirstStep, planned_rows

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

N = 8


def _rows():
    return [{"example_id": f"e{i}", "prompt": [{"role": "user", "content": "say " + "word " * (i % 4 + 1)}],
             "completion": [{"role": "assistant", "content": "ok " * (3 * (i % 3) + 1)}]} for i in range(N)]


def _plan(world=1, b=2, g=2, lengths=None, **kw):
    ids = [f"e{i}" for i in range(N)]
    lengths = lengths if lengths is not None else [5] * N  # not TRL's counts: the trainer must re-plan
    return make_plan(ids, [i % 2 for i in range(N)], lengths, world, b, g, epochs=1, **kw).plan


def _config(tmp_path, **kw):
    base = dict(bf16=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
    return trl.SFTConfig(str(tmp_path / "out"), **{**base, **kw})


def test_plan_sft_trainer_replans_on_trls_tokens_and_takes_the_weighted_step(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_cluster_ft.integrations.trl import PlanSFTTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    weights = pd.Series(np.linspace(0.5, 2.0, N), index=[f"e{i}" for i in range(N)])
    probe, lr = ParamsAfterFirstStep(), 0.5
    trainer = PlanSFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), processing_class=tok,
        args=_config(tmp_path, optim="sgd", learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=0.0,
                     weight_decay=0.0, num_train_epochs=3, per_device_train_batch_size=7),
        train_dataset=datasets.Dataset.from_list(_rows()), plan=_plan(), weights=weights, callbacks=[probe])
    # TRL's own tokens: the chat template of prompt + completion, labels -100 on the prompt
    prepared = trainer.train_dataset
    lengths = {e: len(x) for e, x in zip(prepared["example_id"], prepared["input_ids"])}
    for row, x, y in zip(_rows(), prepared["input_ids"], prepared["labels"]):
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)
        assert x == full["input_ids"]
        assert y[-1] == x[-1] and y[0] == -100
    plan = trainer.plan
    assert dict(zip(plan["example_id"], plan["n_tokens"])) == lengths  # balanced on TRL's counts, not 5
    assert plan.equals(replan(_plan(), list(lengths), list(lengths.values())))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 2)
    assert (trainer.args.max_steps, trainer.args.num_train_epochs) == (2, 1)
    trainer.train()
    got = [r["example_id"] for r in trainer.trained_rows]
    assert got == planned_rows(plan, 0)["example_id"].tolist()

    # the first SGD step: -lr * d/dtheta of sum_i w_i sum_t l_it / sum_i w_i |T_i| over step 0's rows (TRL's labels)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    by_id = {e: (x, y) for e, x, y in zip(prepared["example_id"], prepared["input_ids"], prepared["labels"])}
    num, den = 0.0, 0.0
    for eid in plan.loc[plan["step"] == 0, "example_id"]:
        x, y = (torch.tensor(v, dtype=torch.int64) for v in by_id[eid])
        logits = ref(input_ids=x[None], use_cache=False).logits[0]
        num = num + weights[eid] * torch.nn.functional.cross_entropy(logits[:-1], y[1:], reduction="sum")
        den += weights[eid] * int((y[1:] != -100).sum())
    loss = num / den
    loss.backward()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged[0] == pytest.approx(float(loss.detach()), abs=2e-4)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(probe.params[k], p.detach() - lr * p.grad, rtol=1e-4, atol=1e-6)


def test_plan_sft_trainer_errors(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_cluster_ft.integrations.trl import PlanSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = datasets.Dataset.from_list(_rows())
    with pytest.raises(ValueError, match="set packing=False and padding_free=False"):
        PlanSFTTrainer(model=model, processing_class=tok, args=_config(tmp_path, packing=True), train_dataset=ds,
                       plan=_plan())
    packed = _plan(lengths=list(range(3, 3 + N)), packing=True, max_tokens_per_micro_batch=12)
    assert is_packed_plan(packed) and not is_packed_plan(_plan())
    with pytest.raises(ValueError, match="a packed plan .* cannot be trained as it is on TRL's tokens"):
        PlanSFTTrainer(model=model, processing_class=tok, args=_config(tmp_path), train_dataset=ds, plan=packed,
                       replan=False)
    with pytest.raises(ValueError, match="the plan is for 2 ranks but this Trainer runs 1 process"):
        PlanSFTTrainer(model=model, processing_class=tok, args=_config(tmp_path), train_dataset=ds,
                       plan=_plan(world=2, g=1))
    with pytest.raises(ValueError, match="needs an example_id column in train_dataset"):
        PlanSFTTrainer(model=model, processing_class=tok, args=_config(tmp_path),
                       train_dataset=ds.remove_columns("example_id"), plan=_plan())
    with pytest.raises(ValueError, match=r"1 of the plan's 8 rows are not among the tokenized rows, e.g. \['e3'\]"):
        PlanSFTTrainer(model=model, processing_class=tok, args=_config(tmp_path),
                       train_dataset=ds.filter(lambda r: r["example_id"] != "e3"), plan=_plan())


def test_replan_keeps_rows_clusters_and_shape():
    plan = _plan(world=2, b=2, g=1)
    ids = [f"e{i}" for i in range(N)]
    new = replan(plan, ids[::-1], list(range(20, 20 + N))[::-1], allocation={"seed": 3})
    assert sorted(new["example_id"]) == sorted(plan["example_id"])
    assert dict(zip(new["example_id"], new["cluster"])) == dict(zip(plan["example_id"], plan["cluster"]))
    assert dict(zip(new["example_id"], new["n_tokens"])) == {e: 20 + i for i, e in enumerate(ids)}
    assert new["rank"].nunique() == 2 and new["step"].nunique() == plan["step"].nunique()
    packed = _plan(lengths=list(range(3, 3 + N)), packing=True, max_tokens_per_micro_batch=12)
    with pytest.raises(ValueError, match="a packed plan has no micro-batch size: pass micro_batch_size"):
        replan(packed, ids, [4] * N)
    assert replan(packed, ids, [4] * N, micro_batch_size=2).groupby(["step", "micro_index"]).size().eq(2).all()
    with pytest.raises(ValueError, match="replan needs the plan's cluster column"):
        replan(plan.drop(columns="cluster"), ids, [4] * N)


def test_plan_trainer_given_untokenised_rows_says_what_to_use_instead(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ray_cluster_ft.integrations.hf import PlanTrainer

    with pytest.raises(ValueError, match=r"has no input_ids .*PlanTrainer trains tokenized rows\. Pass "
                                         r"ExamplesDataset"):
        PlanTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                    args=_config(tmp_path), train_dataset=_rows(), plan=_plan())


def test_selected_dataset_reads_the_planned_rows_as_prompt_completion(tmp_path):
    import yaml

    from ray_cluster_ft.integrations.trl import selected_dataset
    from tests.api.test_export_formats import _run

    _, run_dir, spec = _run(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.yaml is missing"):
        selected_dataset(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(spec))
    ds = selected_dataset(run_dir)
    plan = pd.read_parquet(run_dir / "plan.parquet")
    assert ds["example_id"] == list(pd.unique(plan["example_id"]))  # first-planned order, each row once
    by_id = dict(zip(ds["example_id"], zip(ds["prompt"], ds["completion"])))
    rows = {r["example_id"]: r for r in ds.to_list()}
    assert len(rows) == 3
    got = sorted(by_id.values(), key=lambda pc: pc[0][-1]["content"])
    assert got == [
        ([{"role": "user", "content": "Add 2 and 3."}], [{"role": "assistant", "content": "5"}]),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
         [{"role": "assistant", "content": "Paris"}]),
        ([{"role": "user", "content": "Ünïcode?"}], [{"role": "assistant", "content": "yes"}]),
    ]
