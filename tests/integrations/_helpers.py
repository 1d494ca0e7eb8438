"""Shared by the integration tests: a small run directory (plan, examples, selection weights) made with the
real allocator, an independent reference of the token-exact step loss, and the README examples."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import transformers

from ray_cluster_ft.allocate import make_plan

ROOT = Path(__file__).resolve().parents[2]
README_PATHS = (ROOT / "docs" / "library.md",)  # the trainer examples live there, not in README.md
PATHS_LINE = 'run_dir, model_path = "runs/sel", resolve_model_path("demo")'


def make_run(run_dir: Path, n: int = 32, world: int = 2, mbs: int = 2, ga: int = 2, epochs: int = 2,
             vocab: int = 49152, seed: int = 0) -> dict:
    """Write ``plan.parquet``, ``examples.parquet`` and ``selection.parquet`` as a run would; return them."""
    rng = np.random.default_rng(seed)
    ids, toks, labels, lens = [], [], [], []
    for i in range(n):
        length = int(rng.integers(6, 16))
        x = rng.integers(1, vocab, size=length).astype(np.int32)
        y = x.copy()
        y[: int(rng.integers(1, 4))] = -100
        ids.append(f"ex{i:03d}")
        toks.append(x)
        labels.append(y)
        lens.append(length)
    examples = pa.table({
        "example_id": ids,
        "source": ["t"] * n,
        "input_ids": pa.array(toks, pa.list_(pa.int32())),
        "labels": pa.array(labels, pa.list_(pa.int32())),
        "n_tokens": pa.array(lens, pa.int32()),
    })
    clusters = rng.integers(0, 4, size=n)
    plan = make_plan(ids, clusters, lens, world, mbs, ga, epochs=epochs, seed=seed).plan
    weights = pd.Series(rng.uniform(0.5, 2.0, size=n), index=pd.Index(ids, name="example_id"), name="weight")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.to_parquet(run_dir / "plan.parquet", index=False)
    pq.write_table(examples, run_dir / "examples.parquet")
    sel = pd.DataFrame({"example_id": ids, "cluster": clusters, "reason": "test", "weight": weights.to_numpy()})
    sel.to_parquet(run_dir / "selection.parquet", index=False)
    return {"plan": plan, "examples": examples, "weights": weights}


def reference_step_loss(logits_of, plan: pd.DataFrame, examples: pa.Table, weights: pd.Series | None,
                        step: int):
    """``sum_i w_i sum_t l_it / sum_i w_i |T_i|`` over every row of ``step`` (all ranks), one example at a time
    (no padding, no collate): ``logits_of(input_ids (1, T) int64) -> (1, T, V)``. Returns a torch scalar."""
    import torch
    import torch.nn.functional as F

    by_id = {e: i for i, e in enumerate(examples.column("example_id").to_pylist())}
    ids_col, lab_col = examples.column("input_ids").to_pylist(), examples.column("labels").to_pylist()
    num, den = 0.0, 0.0
    for eid in plan.loc[plan["step"] == step, "example_id"]:
        i = by_id[eid]
        x = torch.tensor([ids_col[i]], dtype=torch.int64)
        y = torch.tensor(lab_col[i], dtype=torch.int64)
        w = 1.0 if weights is None else float(weights[eid])
        ce = F.cross_entropy(logits_of(x)[0, :-1].float(), y[1:], ignore_index=-100, reduction="sum")
        num = num + w * ce
        den += w * int((y[1:] != -100).sum())
    return num / den


def readme_example(name: str, run_dir: Path, model_path: str | Path) -> str:
    """The README code block that starts with ``# example: {name}``, with its paths line pointed at ``run_dir``
    and ``model_path``."""
    for path in README_PATHS:
        if not path.exists():
            continue
        for block in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            if block.startswith(f"# example: {name}\n"):
                assert PATHS_LINE in block, f"README example {name!r} lost its paths line {PATHS_LINE!r}"
                return block.replace(PATHS_LINE, f"run_dir, model_path = {str(run_dir)!r}, {str(model_path)!r}")
    raise AssertionError(f"no README code block starts with '# example: {name}' in {[str(p) for p in README_PATHS]}")


def planned_rows(plan: pd.DataFrame, rank: int) -> pd.DataFrame:
    """Rank's rows in training order (the plan is sorted by rank, epoch, step, micro_index, position)."""
    return plan[plan["rank"] == rank].sort_values(["epoch", "step", "micro_index"], kind="stable")


class ParamsAfterFirstStep(transformers.TrainerCallback):
    """A Trainer callback keeping a copy of every parameter after the first optimizer step (``.params``)."""

    def __init__(self):
        self.params = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.params = {k: p.detach().clone() for k, p in model.named_parameters()}
