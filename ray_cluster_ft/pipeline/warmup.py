"""Warm-up training of the sketch model before sketching (``sketch.warmup_steps``; LESS, Xia et al. 2024,
Sec. 4.1: gradients of the raw base model select little better than random).

It trains (:mod:`ray_cluster_ft.train`) on a plan (:mod:`ray_cluster_ft.allocate`), so it sits above both, here in
the pipeline; the feature stage then sketches with the model folder it returns.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..allocate import make_plan
from ..features.store import model_files_fingerprint
from ..train import train

if TYPE_CHECKING:  # pragma: no cover
    from ..features.inputs import SketchInputs


__all__ = [
    "warmup_sample",
    "warmup_plan",
    "warm_up",
]


def warmup_sample(n_candidates: int, per_step: int, steps: int, fraction: float) -> tuple[int, int]:
    """Size of the warm-up sample and the epochs over it that give ``steps`` optimizer steps.

    The sample is ``round(fraction * n_candidates)`` rows, at least one step's worth (``per_step`` = ranks x
    micro-batch x grad_accum) and at most every candidate, rounded down to whole steps; the epochs are as
    many as ``steps`` needs (the plan is then cut at ``steps``). LESS (Xia et al. 2024, Sec. 4.1) warms up on
    5% of the data.

    Returns:
        ``(rows, epochs)``.

    Raises:
        ValueError: ``steps < 1``, ``per_step < 1``, a fraction outside (0, 1], or fewer candidates than one step.
    """
    if steps < 1 or per_step < 1 or not 0 < fraction <= 1:
        raise ValueError(f"warmup_sample: steps={steps}, per_step={per_step} must be >= 1, fraction={fraction} "
                         f"in (0, 1]")
    if n_candidates < per_step:
        raise ValueError(f"warmup_sample: {n_candidates} candidates cannot fill one warm-up step of {per_step}")
    rows = min(n_candidates, max(per_step, int(round(fraction * n_candidates))))
    rows -= rows % per_step
    return rows, math.ceil(steps / (rows // per_step))


def warmup_plan(example_ids, n_tokens, train_cfg, sketch_cfg):
    """The warm-up's training plan: a seeded random sample of the candidates, in the random allocation.

    The sample (:func:`warmup_sample` rows, drawn with ``sketch_cfg.seed``) is planned by
    :func:`ray_cluster_ft.allocate.make_plan` (``strategy='random'``, the train section's world size,
    micro-batch and grad_accum) over as many epochs as needed, then cut to the first
    ``sketch_cfg.warmup_steps`` optimizer steps.

    Args:
        example_ids: str ``(N,)`` candidate ids.
        n_tokens: int ``(N,)`` their token counts.
        train_cfg: the ``train`` section.
        sketch_cfg: the ``sketch`` section (``warmup_steps >= 1``).

    Returns:
        Plan ``DataFrame`` (columns of :func:`~ray_cluster_ft.allocate.make_plan`) with exactly
        ``warmup_steps`` steps.

    Raises:
        ValueError: see :func:`warmup_sample`.
    """
    t = train_cfg
    ids = np.asarray(example_ids).astype(str)
    per_step = t.num_workers * t.micro_batch_size * t.grad_accum
    n, epochs = warmup_sample(len(ids), per_step, sketch_cfg.warmup_steps, sketch_cfg.warmup_fraction)
    pick = np.sort(np.random.default_rng(sketch_cfg.seed).choice(len(ids), size=n, replace=False))
    plan = make_plan(ids[pick], np.zeros(n, dtype=np.int64), np.asarray(n_tokens, dtype=np.int64)[pick],
                     t.num_workers, t.micro_batch_size, t.grad_accum, epochs, strategy="random",
                     seed=sketch_cfg.seed).plan
    return plan[plan["step"] < sketch_cfg.warmup_steps].reset_index(drop=True)


def warm_up(inputs: SketchInputs, cfg, out_dir: str | Path) -> str:
    """Warm-up training of the sketch model before sketching (``sketch.warmup_steps``; LESS, Xia et al. 2024).

    Trains :func:`warmup_plan` with :func:`ray_cluster_ft.train.train` under the ``train`` section (LoRA
    adapters, if any, are merged so the result loads as a plain model), on the sketch model's own token ids.
    A finished warm-up of the same plan, train settings and start model in ``out_dir`` is reused
    (``out_dir/warmup.json``), so a re-run of an interrupted sketch stage does not train again. The warm-up's
    training checkpoint (``out_dir/ray_train``) is deleted once ``final_model`` is written.

    Args:
        inputs: from :func:`~ray_cluster_ft.features.inputs.prepare_sketch_inputs` (the sketch model and its token
            ids).
        cfg: the :class:`~ray_cluster_ft.config.JobConfig`; Ray must be initialised.
        out_dir: the warm-up run folder (``run_dir/warmup``).

    Returns:
        The warmed-up model folder, ``out_dir/final_model``.
    """
    import json

    import pyarrow as pa

    t = cfg.train
    if hasattr(t, "lora") and t.lora.enabled and not t.lora.merge:
        t = t.model_copy(update={"lora": t.lora.model_copy(update={"merge": True})})
    table = inputs.table
    plan = warmup_plan(table.column("example_id").to_pylist(), table.column("n_tokens").to_numpy(), t, cfg.sketch)
    used = plan["example_id"].unique()
    sample = table.filter(pa.array(np.isin(np.asarray(table.column("example_id").to_pylist()), used)))
    out = Path(out_dir)
    key = hashlib.sha256(json.dumps({
        "plan": plan[["rank", "step", "micro_index", "example_id"]].to_numpy().tolist(),
        "train": t.model_dump(mode="json"), "model": model_files_fingerprint(str(inputs.model_path)),
    }, sort_keys=True, default=str).encode()).hexdigest()
    marker, final = out / "warmup.json", out / "final_model"
    if marker.is_file() and (final / "config.json").is_file() and json.loads(marker.read_text()).get("key") == key:
        return str(final)
    marker.unlink(missing_ok=True)
    train(plan, sample, t, str(inputs.model_path), out, trust_remote_code=cfg.model.trust_remote_code,
          save_model=True, pad_token_id=inputs.pad_token_id)
    marker.write_text(json.dumps({"key": key, "examples": int(len(used)), "steps": cfg.sketch.warmup_steps}))
    # Only final_model is needed from here on; the DeepSpeed checkpoint (about 2 GB for the 135M demo model,
    # optimizer state included) would just fill the run directory.
    shutil.rmtree(out / "ray_train", ignore_errors=True)
    return str(final)
