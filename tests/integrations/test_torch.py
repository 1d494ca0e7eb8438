"""PlanBatchSampler and the token-exact loss helpers in plain PyTorch: unit tests, two gloo processes that
iterate their planned rows and take a DDP step equal to a single-process reference, and the README example."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from ray_cluster_ft.integrations.torch import (
    ExamplesDataset,
    MicroBatchWeights,
    PlanBatchSampler,
    TokenCollator,
    loss_positions,
    micro_batch_loss,
    plan_loss_weights,
    plan_shape,
)
from ray_cluster_ft.train import build_rank_tables
from tests.conftest import free_port

from ._helpers import (
    make_run,
    planned_rows,
    readme_example,
    reference_step_loss,
)

TOY_VOCAB = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    return {"dir": d, **make_run(d, vocab=TOY_VOCAB)}


# ---------------------------------------------------------------------------------------------- one process


def test_sampler_yields_each_ranks_planned_rows_in_order(run):
    plan, data = run["plan"], ExamplesDataset(run["examples"])
    lens = []
    for rank in (0, 1):
        sampler = PlanBatchSampler(plan, data.example_ids, rank)
        assert (sampler.world_size, sampler.micro_batch_size, sampler.grad_accum, sampler.steps) == (2, 2, 2, 8)
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(0))
        got = [eid for batch in loader for eid in batch["example_id"]]
        assert got == planned_rows(plan, rank)["example_id"].tolist()
        assert all(len(b) == 2 for b in sampler)
        lens.append(len(sampler))
        # keys follow the plan's (epoch, step, micro_index) order
        want = planned_rows(plan, rank)[["epoch", "step", "micro_index"]].to_numpy()[::2]
        assert np.array_equal(sampler.keys, want)
        assert list(sampler) == list(sampler)  # iterating again gives the same batches
    assert lens[0] == lens[1] == plan_shape(plan).micro_batches_per_rank == 16


def test_sampler_positions_follow_the_datasets_order(run):
    """Positions index the user's dataset, whatever its order or extra rows."""
    plan = run["plan"]
    ids = list(reversed(run["examples"].column("example_id").to_pylist())) + ["not-planned"]
    sampler = PlanBatchSampler(plan, ids, 1)
    flat = [ids[p] for batch in sampler for p in batch]
    assert flat == planned_rows(plan, 1)["example_id"].tolist()


def test_sampler_errors(run):
    plan, ids = run["plan"], run["examples"].column("example_id").to_pylist()
    with pytest.raises(ValueError, match=r"rank 2 is outside the plan: it has ranks 0\.\.1"):
        PlanBatchSampler(plan, ids, 2)
    with pytest.raises(ValueError, match="rank -1 is outside the plan"):
        PlanBatchSampler(plan, ids, -1)
    with pytest.raises(ValueError, match="rank must be an int"):
        PlanBatchSampler(plan, ids, "0")
    with pytest.raises(ValueError, match=r"1 of the plan's 32 example ids are not in the dataset.*'ex005'"):
        PlanBatchSampler(plan, [i for i in ids if i != "ex005"], 0)
    with pytest.raises(ValueError, match="example_ids hold duplicates"):
        PlanBatchSampler(plan, ids + ids[:1], 0)
    with pytest.raises(ValueError, match=r"missing columns \['micro_index'\]"):
        PlanBatchSampler(plan.drop(columns="micro_index"), ids, 0)
    with pytest.raises(ValueError, match="plan is empty"):
        PlanBatchSampler(plan.iloc[:0], ids, 0)
    with pytest.raises(ValueError, match="must be a pandas DataFrame"):
        PlanBatchSampler(plan.to_dict(), ids, 0)
    # a world size other than the plan's
    with pytest.raises(ValueError, match="the plan is for 2 ranks but this job runs 3 processes"):
        PlanBatchSampler(plan, ids, 0, world_size=3)
    # an uneven plan: rank 1 loses its last step
    last = plan["step"].max()
    uneven = plan[~((plan["rank"] == 1) & (plan["step"] == last))]
    with pytest.raises(ValueError, match="uneven plan: rank 1 has 14 micro-batches, rank 0 has 16"):
        PlanBatchSampler(uneven, ids, 0)


def test_loss_weights_reuse_build_rank_tables_and_match_the_definition(run):
    plan, ex, w = run["plan"], run["examples"], run["weights"]
    labels = dict(zip(ex.column("example_id").to_pylist(), ex.column("labels").to_pylist()))
    n_lab = {k: int((np.asarray(v[1:]) != -100).sum()) for k, v in labels.items()}
    tables = build_rank_tables(plan, ex, 2, w)
    for rank in (0, 1):
        mws = plan_loss_weights(plan, ex, rank, w)
        sampler = PlanBatchSampler(plan, ex.column("example_id").to_pylist(), rank)
        assert len(mws) == len(sampler)
        rows = planned_rows(plan, rank)
        assert [i for mw in mws for i in mw.example_ids] == rows["example_id"].tolist()
        assert [(mw.epoch, mw.step, mw.micro_index) for mw in mws] == [tuple(k) for k in sampler.keys.tolist()]
        np.testing.assert_allclose(np.concatenate([mw.weight for mw in mws]), tables[rank].column("weight").to_numpy())
        for mw in mws:
            step_ids = plan.loc[plan["step"] == mw.step, "example_id"]
            d = sum(w[i] * n_lab[i] for i in step_ids)  # the definition: every rank, every micro-batch
            assert mw.denominator == pytest.approx(d, rel=1e-12)
            assert mw.label_tokens.tolist() == [n_lab[i] for i in mw.example_ids]
            assert mw.loss_scale(2, 3) == pytest.approx(6 / d)
    # unweighted: w = 1
    assert all((mw.weight == 1).all() for mw in plan_loss_weights(plan, ex, 0))
    with pytest.raises(ValueError, match="rank 5 is outside the plan"):
        plan_loss_weights(plan, ex, 5)
    with pytest.raises(ValueError, match="finite, positive loss weight"):
        plan_loss_weights(plan, ex, 0, w.iloc[1:])


def test_micro_batch_loss_checks_the_labels(run):
    plan, ex = run["plan"], run["examples"]
    data = ExamplesDataset(ex)
    sampler = PlanBatchSampler(plan, data.example_ids, 0)
    batch = next(iter(DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(0))))
    mws = plan_loss_weights(plan, ex, 0)
    logits = torch.zeros(*batch["input_ids"].shape, TOY_VOCAB)
    loss = micro_batch_loss(logits, batch["labels"], mws[0], world_size=2)
    # uniform logits: every label token costs log V
    assert float(loss) == pytest.approx(2 * mws[0].label_tokens.sum() * np.log(TOY_VOCAB) / mws[0].denominator, rel=1e-5)
    with pytest.raises(ValueError, match="is this the planned micro-batch"):
        micro_batch_loss(logits, batch["labels"], mws[1], world_size=2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_micro_batch_loss_at_the_loss_positions_equals_the_loss_over_all_logits(packed):
    """Logits kept only where a label follows (what ``logits_to_keep=loss_positions(labels)`` returns) give the
    loss of all logits, for a padded batch (the union of the rows' positions) and for a pack; prompt and padding
    positions are skipped."""
    torch.manual_seed(0)
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
            {"input_ids": [3, 4, 5], "labels": [-100, 4, -100]}]
    batch = TokenCollator(0, packed=packed)(rows)
    labels = batch["labels"]
    mw = MicroBatchWeights(epoch=0, step=0, micro_index=0, example_ids=("a", "b"), weight=np.array([0.5, 2.0]),
                           label_tokens=np.array([3, 1]), denominator=7.0, lengths=np.array([5, 3]))
    logits = torch.randn(*labels.shape, TOY_VOCAB)
    keep = loss_positions(labels)
    # padded: row 0 labels follow t = 1, 2, 3, row 1 t = 0; packed (one row of 8): t = 1, 2, 3 and 5 + 0
    assert keep.tolist() == ([0, 1, 2, 3] if not packed else [1, 2, 3, 5])
    assert keep.dtype == torch.int64
    full = micro_batch_loss(logits, labels, mw, world_size=2)
    kept = micro_batch_loss(logits[:, keep], labels, mw, world_size=2, positions=keep)
    torch.testing.assert_close(kept, full, rtol=1e-6, atol=0)
    # the weights are spread per token (0.5 on a's three labels, 2.0 on b's one): not the same loss unweighted
    even = dataclasses.replace(mw, weight=np.array([1.0, 1.0]))
    assert float(micro_batch_loss(logits[:, keep], labels, even, 2, positions=keep)) != pytest.approx(float(full))
    # positions that leave a label out would drop its loss silently: refused, as are logits of other positions
    with pytest.raises(ValueError, match=rf"positions miss 1 position\(s\) whose next token is a label \(first {int(keep[-1])}\)"):
        micro_batch_loss(logits[:, keep[:-1]], labels, mw, 2, positions=keep[:-1])
    with pytest.raises(ValueError, match="logits hold 4 positions per row, positions lists 3"):
        micro_batch_loss(logits[:, keep], labels, mw, 2, positions=keep[:-1])
    twice = torch.cat([keep, keep[-1:]])
    with pytest.raises(ValueError, match="strictly ascending"):
        micro_batch_loss(logits[:, twice], labels, mw, 2, positions=twice)


def test_examples_dataset_and_collator_errors(run):
    with pytest.raises(ValueError, match=r"missing columns \['labels'\]"):
        ExamplesDataset(run["examples"].drop(["labels"]))
    with pytest.raises(ValueError, match="pyarrow Table or pandas DataFrame"):
        ExamplesDataset([{"example_id": "a"}])
    out = TokenCollator(7)([{"input_ids": [1, 2, 3]}, {"input_ids": [4], "labels": [-100]}])
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert out["labels"].tolist() == [[1, 2, 3], [-100, -100, -100]]
    assert "example_id" not in out


def test_package_exports_lazily():
    import ray_cluster_ft.integrations as integ

    assert integ.PlanBatchSampler is PlanBatchSampler
    assert "PlanTrainer" in integ.__all__ and "rank_shard" in integ.__all__
    with pytest.raises(AttributeError):
        integ.nope  # noqa: B018


# ---------------------------------------------------------------------------------------------- two processes


def _toy_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(TOY_VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, TOY_VOCAB))


def _gloo_worker(rank: int, world: int, store: str, run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A file rendezvous, not a TCP port picked ahead of time (under xdist another worker's Ray can take that port
    # between the pick and the bind); the timeout turns a stalled collective into an error.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        plan = pd.read_parquet(f"{run_dir}/plan.parquet")
        examples = pd.read_parquet(f"{run_dir}/examples.parquet")
        weights = pd.read_parquet(f"{run_dir}/selection.parquet").set_index("example_id")["weight"]
        data = ExamplesDataset(examples)
        sampler = PlanBatchSampler(plan, data.example_ids, rank)
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(0))
        seen = [list(batch["example_id"]) for batch in loader]

        # One optimizer step's gradient under DDP: sum the G micro-batches' backward of W * S_mb / D.
        model = torch.nn.parallel.DistributedDataParallel(_toy_model())
        mws = plan_loss_weights(plan, examples, rank, weights)
        loss_sum = torch.zeros(())
        for i, (batch, mw) in enumerate(zip(loader, mws)):
            if i == sampler.grad_accum:
                break
            last = i == sampler.grad_accum - 1
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = micro_batch_loss(model(batch["input_ids"]), batch["labels"], mw, world_size=world)
                loss.backward()
            loss_sum += loss.detach() / world
        grads = {k: p.grad for k, p in model.module.named_parameters()}
        torch.save({"grads": grads, "loss": loss_sum}, f"{out_dir}/step0_rank{rank}.pt")
        Path(f"{out_dir}/ids_rank{rank}.json").write_text(json.dumps({"batches": seen, "len": len(sampler)}))
        # The DDP model goes before the process group, and no Python-owned tensor goes through a collective: torch
        # 2.13's gloo group otherwise can be freed with a frame's locals, joining its worker thread under the GIL
        # while that thread waits for the GIL to free a finished all_reduce's tensor (seen: a 900 s hang in CI).
        del model
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_gloo_processes_train_their_planned_rows_and_the_token_exact_step(run, tmp_path):
    store = str(tmp_path / "rendezvous")
    mp.spawn(_gloo_worker, args=(2, store, str(run["dir"]), str(tmp_path)), nprocs=2, join=True)
    plan = run["plan"]
    out = [json.loads((tmp_path / f"ids_rank{r}.json").read_text()) for r in (0, 1)]
    assert out[0]["len"] == out[1]["len"] == 16
    for r in (0, 1):
        rows = planned_rows(plan, r)
        assert [i for b in out[r]["batches"] for i in b] == rows["example_id"].tolist()
        assert len(out[r]["batches"]) == out[r]["len"]
    assert not set(out[0]["batches"][0]) & set(out[1]["batches"][0])

    # the DDP gradient equals one process's gradient of the step's token-exact loss
    model = _toy_model()
    ref = reference_step_loss(model, plan, run["examples"], run["weights"], step=int(plan["step"].min()))
    ref.backward()
    got = [torch.load(tmp_path / f"step0_rank{r}.pt") for r in (0, 1)]
    # each rank's loss is its share of the step's token-exact loss; the shares add up to it
    assert float(got[0]["loss"] + got[1]["loss"]) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert 0 < float(got[0]["loss"]) < float(ref.detach())
    for r in (0, 1):
        for k, p in model.named_parameters():
            torch.testing.assert_close(got[r]["grads"][k], p.grad, rtol=1e-5, atol=1e-7)


def _readme_worker(rank: int, world: int, port: int, code: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ns: dict = {"__name__": "readme_torch"}
    try:
        exec(compile(code, "README:torch", "exec"), ns)
        trained = [list(b["example_id"]) for b in ns["loader"]]
        Path(f"{out_dir}/readme_rank{rank}.json").write_text(json.dumps({"batches": trained, "len": len(ns["sampler"])}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_torch_example_runs_under_two_processes(tmp_path_factory, tmp_path, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("run_tiny")
    made = make_run(run_dir)
    code = readme_example("torch", run_dir, tiny_model_dir)
    mp.spawn(_readme_worker, args=(2, free_port(), code, str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        got = json.loads((tmp_path / f"readme_rank{r}.json").read_text())
        assert got["len"] == 16
        assert [i for b in got["batches"] for i in b] == planned_rows(made["plan"], r)["example_id"].tolist()
