"""What every example reads from a ``ray-cluster-ft select`` (or ``run``) output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def read_run(run_dir: str, model: str | None = None) -> dict:
    """``plan``, ``examples`` (tokens), ``weights`` (by example_id) and ``model_path`` of a run's folder.

    ``model_path``: ``model`` when given, else the folder the run resolved its model to (``manifest.json``'s
    ``models``: for ``demo`` the converted model in the shared model cache, ``~/.cache/ray-cluster-ft/models``).
    """
    d = Path(run_dir)
    if not (d / "plan.parquet").is_file():
        raise SystemExit(f"{d} holds no plan.parquet: pass the --output folder of `ray-cluster-ft select`")
    path = model or json.loads((d / "manifest.json").read_text())["models"]["model.path"]
    return {"plan": pd.read_parquet(d / "plan.parquet"),
            "examples": pd.read_parquet(d / "examples.parquet"),
            "weights": pd.read_parquet(d / "selection.parquet").set_index("example_id")["weight"],
            "model_path": path}
