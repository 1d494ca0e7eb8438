"""The run directory, owned by proof: a marker holding the run's id and a ledger of every top-level path the
run wrote; the job spec saved for ``--resume``; the resume checks that a recomputed artifact equals the
stopped run's.

A fresh run into a folder removes or overwrites only the paths that folder's ledger lists. Anything else there,
a file named like an artifact included, makes the run stop with one line naming it, before anything is touched.
Stages claim their paths (:func:`claim`) before they write them, so the ledger never lags behind the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError, JobConfig

__all__ = ["RUN_MARKER", "claim", "input_paths", "prepare_run_dir", "read_ledger", "same_as_before", "write_spec"]

RUN_MARKER = ".ray-cluster-ft-run"
"""JSON file in the run directory: ``{"run_id": str, "paths": [top-level names the run wrote]}``."""

# Kept by a fresh run into its own earlier run directory: sketch shards are keyed by settings, model and
# inputs, so they are reused only where they still apply (the feature stage deletes the rest).
_KEPT_ON_FRESH_RUN = ("sketches",)


def _plain_name(name) -> bool:
    """A single entry of the run directory: not empty, no separator, not ``.``/``..``, not the marker."""
    return (isinstance(name, str) and name not in ("", ".", "..", RUN_MARKER) and "/" not in name
            and "\\" not in name and "\x00" not in name)


def read_ledger(run_dir: Path) -> dict | None:
    """The marker of ``run_dir`` (``{"run_id", "paths"}``), or ``None`` when there is none or it is not one of
    ours (an empty file, other JSON): names are no proof.

    Raises:
        ConfigError: the marker is not a regular file, or its ledger lists something that is not a plain name
            inside the folder (``..``, an absolute path, a path with a separator: a hand-edited ledger).
    """
    marker = Path(run_dir) / RUN_MARKER
    if os.path.lexists(marker) and (marker.is_symlink() or not marker.is_file()):
        raise ConfigError(f"output.dir {run_dir}: {RUN_MARKER} is not a ray-cluster-ft marker file; nothing was "
                          f"touched (use a new or empty directory)")
    try:
        obj = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("run_id"), str) or not isinstance(obj.get("paths"), list):
        return None
    bad = [p for p in obj["paths"] if not _plain_name(p)]
    if bad:
        raise ConfigError(f"output.dir {run_dir}: its ledger lists {bad[0]!r}, which is not a name inside the "
                          f"folder; nothing was touched (use a new or empty directory)")
    return {"run_id": obj["run_id"], "paths": list(obj["paths"])}


def _write_ledger(run_dir: Path, ledger: dict) -> None:
    tmp = run_dir / f"{RUN_MARKER}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(json.dumps(ledger, indent=1), encoding="utf-8")
        os.replace(tmp, run_dir / RUN_MARKER)
    finally:
        tmp.unlink(missing_ok=True)


def _top_level(run_dir: Path, path: str | Path) -> str:
    rel = Path(path)
    if rel.is_absolute():
        rel = rel.resolve().relative_to(run_dir)
    if not rel.parts or rel.parts[0] in ("..", RUN_MARKER):
        raise ValueError(f"claim: {path} is not a path inside the run directory")
    return rel.parts[0]


def claim(run_dir: str | Path, *paths: str | Path) -> Path:
    """Record ``paths`` (names relative to ``run_dir``, or absolute paths inside it) in the ledger before they
    are written; returns ``run_dir / paths[0]``.

    Raises:
        ConfigError: a path already exists but the ledger does not list it (a file this run did not write),
            or ``run_dir`` has no marker (it was not prepared by :func:`prepare_run_dir`).
    """
    run_dir = Path(run_dir)
    ledger = read_ledger(run_dir)
    if ledger is None:
        raise ConfigError(f"{run_dir} is not a prepared run directory (no {RUN_MARKER}); nothing was written")
    names = [_top_level(run_dir, p) for p in paths]
    new = [n for n in dict.fromkeys(names) if n not in ledger["paths"]]
    for n in new:
        if os.path.lexists(run_dir / n):
            raise ConfigError(f"output.dir {run_dir}: {n!r} appeared there during the run and no run wrote it; "
                              f"it was left as it is")
    for n in names:  # a run writes real files and folders only: a symlink would send its writes elsewhere
        if (run_dir / n).is_symlink():
            raise ConfigError(f"output.dir {run_dir}: {n!r} is a symlink, not what the run wrote; it was left as it "
                              f"is (remove it, or use a new directory)")
    if new:
        ledger["paths"] += new
        _write_ledger(run_dir, ledger)
    return run_dir / paths[0]


def input_paths(cfg: JobConfig) -> list[Path]:
    """The local files and folders a job reads: data files, the model folders, the DeepSpeed JSON."""
    out = [Path(p) for p in cfg.data.paths]
    for p in (cfg.model.path, cfg.sketch.model, cfg.train.deepspeed_config):
        if p and Path(p).expanduser().exists():
            out.append(Path(p))
    return [p.expanduser().resolve() for p in out]


def prepare_run_dir(run_dir: Path, resume: bool, inputs: Iterable[Path] = ()) -> str:
    """Create (or check) the run directory before anything is written into it; returns the run id.

    A new or empty directory gets a marker with a new run id. An existing directory must carry a marker whose
    ledger lists every entry in it; a fresh run then removes what the ledger lists (the sketch shards stay, to
    be reused where they still apply) and starts a new ledger, so a run that fails part-way never leaves an
    older manifest beside its new data. ``resume`` keeps everything and the run id.

    Raises:
        ConfigError: ``run_dir`` is a file or cannot be created, or lies inside another run's directory; an input
            of the job lies inside it; it holds
            an entry that no run recorded (named; nothing is touched); ``resume`` of a folder with no marker.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output.dir {run_dir} is a file, not a directory")
    here = run_dir.resolve() if run_dir.exists() else run_dir.absolute()
    outer = next((p for p in here.parents if (p / RUN_MARKER).is_file()), None)
    if outer is not None:  # the outer run could never run again: it refuses a folder its ledger does not list
        raise ConfigError(f"output.dir {run_dir} lies inside the run directory {outer}; give it a folder outside "
                          f"that run")
    for p in inputs:
        if p == here or here in p.parents:
            raise ConfigError(f"output.dir {run_dir} holds an input of this job ({p}); a run replaces what it wrote "
                              f"there, so give it a folder of its own")
    ledger = read_ledger(run_dir) if run_dir.is_dir() else None
    if run_dir.is_dir():
        listed = set(ledger["paths"]) if ledger else set()
        foreign = sorted(x.name for x in run_dir.iterdir() if x.name != RUN_MARKER and x.name not in listed)
        if foreign:
            why = ("which its ledger does not list" if ledger else
                   "and has no ray-cluster-ft run marker, so no run wrote it")
            raise ConfigError(f"output.dir {run_dir} holds {foreign[0]!r} {why}; nothing was touched "
                              f"(use a new or empty directory)")
        if resume and ledger is None:
            raise ConfigError(f"--resume {run_dir}: no ray-cluster-ft run marker there; nothing was touched")
        links = sorted(n for n in listed if (run_dir / n).is_symlink())
        if resume and links:  # resuming would write through it into whatever it points at
            raise ConfigError(f"--resume {run_dir}: {links[0]!r} is a symlink, not what the run wrote; nothing was "
                              f"touched")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output.dir {run_dir} cannot be created: {err.strerror or err}") from None
    if resume and ledger is not None:
        return ledger["run_id"]
    kept = []
    for name in ledger["paths"] if ledger else []:
        path = run_dir / name
        if name in _KEPT_ON_FRESH_RUN and path.is_dir() and not path.is_symlink():
            kept.append(name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a file, or a symlink put in place of the run's folder: the link goes, never its target
            path.unlink(missing_ok=True)
    run_id = uuid.uuid4().hex
    try:
        _write_ledger(run_dir, {"run_id": run_id, "paths": kept})
    except OSError as err:
        raise ConfigError(f"output.dir {run_dir} cannot be written: {err.strerror or err}") from None
    return run_id


def same_as_before(path: Path, table: pa.Table, columns: list[str]) -> None:
    """On ``--resume``: the artifact recomputed now must equal the one the run wrote (in ``columns``), checked
    before it is overwritten, so a refused resume leaves the run directory as it was.

    Raises:
        ConfigError: the recomputed ``columns`` differ from ``path``'s (the data or a package changed).
    """
    if not path.exists():
        return
    old = pq.read_table(path, columns=columns)
    if not old.equals(table.select(columns)):
        raise ConfigError(f"--resume: {path.name} computed now ({table.num_rows} rows) differs from the one in the "
                          f"run directory ({old.num_rows} rows); the data or a package changed since the run "
                          f"started. Start a fresh run directory.")


def write_spec(cfg: JobConfig, run_dir: Path) -> None:
    """Save the job spec as run to ``run_dir/config.yaml`` (for ``ray-cluster-ft run --resume RUN_DIR``), with
    ``output.dir`` and local paths absolute: paths relative to where this run started would break a resume
    started elsewhere."""
    import yaml

    spec = cfg.model_dump(mode="json")
    spec["output"]["dir"] = str(run_dir)
    spec["data"]["paths"] = [str(Path(x).expanduser().resolve()) for x in cfg.data.paths]
    for section, key in (("model", "path"), ("sketch", "model"), ("train", "deepspeed_config")):
        value = spec[section][key]
        if value and Path(value).expanduser().exists():
            spec[section][key] = str(Path(value).expanduser().resolve())
    claim(run_dir, "config.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
