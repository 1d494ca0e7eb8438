"""The data stage: the model's tokenizer, every source read and tokenized, the artifacts written."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pyarrow.parquet as pq

from ..config import ConfigError, JobConfig
from ..rundir import claim, same_as_before
from .examples import DataResult, load_examples
from .read import reason_category

__all__ = ["DataOutput", "check", "file_stats", "run"]


@dataclass(frozen=True)
class DataOutput:
    """What the data stage hands on.

    Attributes:
        model_path: ``model.path`` resolved to a local folder (or a hub id).
        tokenizer: the model's tokenizer.
        pad_token_id: its padding id.
        result: the accepted (candidate and held-out) and rejected rows, :class:`DataResult`.
        reasons: rejected rows per reason category (:func:`reason_category`).
        eval_files: per ``evaluation.paths`` entry, its rows (all accepted rows in ``train``, none held out).
        eval_overlap: per ``evaluation.paths`` entry, how many of its rows are also training candidates (same
            content hash).
    """

    model_path: str
    tokenizer: Any
    pad_token_id: int
    result: DataResult
    reasons: dict
    eval_files: dict = field(default_factory=dict)
    eval_overlap: dict = field(default_factory=dict)

    @property
    def summary(self) -> dict:
        """The data stage's part of the manifest's ``counts``: ``read``, ``accepted`` (candidates + held out),
        ``rejected``, ``held_out``, ``candidates``, ``truncated`` and ``rejected_by_reason``."""
        d = self.result
        return {"read": d.n_read, "accepted": d.train.num_rows + d.eval.num_rows, "rejected": len(d.rejected),
                "held_out": d.eval.num_rows, "candidates": d.train.num_rows, "truncated": d.truncated,
                "rejected_by_reason": self.reasons}

    @property
    def files(self) -> dict:
        """The manifest's ``data_files``: per file read, ``{"rows": rows read, "formats": {format: rows},
        "unused_fields": {field: rows where it was not used}}`` (:mod:`.formats`)."""
        return file_stats(self.result)

    @property
    def eval_file_stats(self) -> dict:
        """Per ``evaluation.paths`` entry, :func:`file_stats` of the files it names (a glob or folder names
        several): the manifest's ``eval_files.<entry>.data_files``."""
        return {path: file_stats(res) for path, res in self.eval_files.items()}


def file_stats(data: DataResult) -> dict:
    """Per file read into ``data``: ``{"rows": rows read, "formats": {format: rows}, "unused_fields": {field: rows
    where it was not used}}``."""
    return {src: {"rows": n, "formats": data.formats.get(src, {}), "unused_fields": data.unused.get(src, {})}
            for src, n in data.sources.items()}


def check(cfg: JobConfig, sample_rows: int = 200, n_examples: int = 2, out=None) -> dict:
    """``ray-cluster-ft check``'s look at the data, with the tokenizer only (no model weights): every path
    stat-ed, each file's rows counted, its first ``sample_rows`` rows read, canonicalised and tokenized exactly as
    the data stage does; the formats and unused fields printed to ``out`` as a run prints them, then
    ``n_examples`` decoded examples with the trained part between ``[[`` and ``]]``. The ``evaluation.paths``
    files are sampled the same way and held to the same ``data.unused_fields`` policy; one of them with no
    accepted row is printed, not refused (a run only warns about it).

    Returns:
        ``{"files": {path: {"rows", "sampled", "rejected", "reasons", "formats", "unused_fields"}}, "eval_files":
        {path: the same}, "examples": [str]}`` (``reasons``: the sample's rejections per category).

    Raises:
        FileNotFoundError: a data or evaluation file is missing (the message ``run`` gives).
        ConfigError: a file is unreadable as a whole or of an unsupported type, ``data.unused_fields: error``
            with an unused field (training or evaluation file), or no row of a training file's sample is accepted
            (the reasons counted).
    """
    from ..model import load_tokenizer_only
    from .read import count_rows, expand_paths
    from .tokenize import marked_text

    d = cfg.data
    limit = min(d.limit or sample_rows, sample_rows)
    # A missing file, an empty glob or a file of a refused format fails before the tokenizer is even imported.
    counts = {p: count_rows(p) for p in expand_paths(d.paths)} if d.source == "files" else {}
    for path in counts:
        _refuse_unreadable(path, d, limit)
    empty = [p for p, n in counts.items() if n == 0]  # training files only: the evaluation files are added below
    for path in cfg.evaluation.paths:
        try:
            counts.update({p: count_rows(p) for p in expand_paths([path])})
        except FileNotFoundError as err:
            raise FileNotFoundError(f"evaluation.paths: {err}") from None
    try:
        tok = load_tokenizer_only(cfg.model.path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        if isinstance(err, (FileNotFoundError, ConfigError)):
            raise
        raise ConfigError(f"model.path {cfg.model.path!r}: cannot load its tokenizer: {err}") from None
    sample = load_examples(d.model_copy(update={"limit": limit, "eval_fraction": 0.0}), tok)
    evals = _eval_files(cfg, tok, limit)
    _report_fields(sample, d.unused_fields, out, evaluation=evals.values())
    files = {src: _sampled(sample, src, counts.get(src)) for src in sample.sources}
    for src, f in files.items():
        if f["rejected"] == f["sampled"]:
            first = next(r.reason for r in sample.rejected if r.source == src)
            raise _refused(src, f["sampled"], f["reasons"], first)
    eval_files = {src: _sampled(res, src, counts.get(src)) for res in evals.values() for src in res.sources}
    for label, per in (("", files), ("evaluation file ", eval_files)):
        for src, f in per.items():
            print(f"[ray-cluster-ft] check: {label}{src}: {f['rows'] if f['rows'] is not None else 'demo'} rows; of "
                  f"the first {f['sampled']}: {f['sampled'] - f['rejected']} accepted, {f['rejected']} rejected"
                  + (f" {f['reasons']}" if f["reasons"] else ""), file=out, flush=True)
    for src in empty:  # nothing to sample, so no line above: say so rather than leave the file out
        print(f"[ray-cluster-ft] check: {src}: 0 rows (an empty file: nothing from it is trained)", file=out, flush=True)
    if not sample.sources:
        raise ConfigError("no accepted training examples: the data files hold no rows"
                          + (f" ({', '.join(map(str, empty))} empty)" if empty else ""))
    t = sample.train.slice(0, n_examples)
    examples = [marked_text(tok, i, lab) for i, lab in zip(t.column("input_ids").to_pylist(),
                                                            t.column("labels").to_pylist())]
    for k, ex in enumerate(examples, 1):
        print(f"[ray-cluster-ft] check: example {k} as trained (masked text as is, trained text in [[ ]]):\n{ex}",
              file=out, flush=True)
    return {"files": files, "eval_files": eval_files, "examples": examples}


def _sampled(sample: DataResult, src: str, rows: int | None) -> dict:
    """One file of ``check``'s sample: its row count, rows sampled and rejected (and the reasons by category),
    formats and unused fields."""
    reasons: dict[str, int] = {}
    for rej in sample.rejected:
        if rej.source == src:
            reasons[reason_category(rej.reason)] = reasons.get(reason_category(rej.reason), 0) + 1
    return {"rows": rows, "sampled": sample.sources[src], "rejected": sum(reasons.values()), "reasons": reasons,
            "formats": sample.formats.get(src, {}), "unused_fields": sample.unused.get(src, {})}


def _refuse_unreadable(path: str, d, limit: int) -> None:
    """Raise ``ConfigError`` when none of the first ``limit`` rows of ``path`` is in a format of ``d``
    (``data.format``, ``data.columns``), naming the reasons by category and the first in full (a refused format's
    names the row's fields), or when a ``data.columns`` source field is in none of them
    (:func:`.examples.refuse_missing_sources`); no tokenizer needed."""
    from .examples import refuse_missing_sources
    from .formats import canonical_row
    from .read import Rejection, iter_file_rows

    reasons: dict[str, int] = {}
    fields: dict[str, None] = {}
    n, accepted, first = 0, False, ""
    for _src, _pos, row in iter_file_rows(path, limit):
        n += 1
        if isinstance(row, dict):
            fields.update(dict.fromkeys(row))
        try:
            if isinstance(row, Rejection):
                raise ValueError(row.reason)
            canonical_row(row, d.format, d.columns)
            accepted = True
        except ValueError as err:
            first = first or str(err)
            reasons[reason_category(str(err))] = reasons.get(reason_category(str(err)), 0) + 1
    refuse_missing_sources(path, d.columns, fields, n, accepted)
    if n and not accepted:
        raise _refused(path, n, reasons, first)


def _refused(path: str, n: int, reasons: dict, first: str) -> ConfigError:
    """The error for a file none of whose first ``n`` rows is accepted: the reasons by category, the first row's
    in full (its fields, for a refused format), and where the formats are described."""
    docs = "" if "docs/data.md" in first else "; see docs/data.md for the formats and data.columns"
    return ConfigError(f"data file {path}: none of its first {n} rows is accepted (rejected: {reasons}; the "
                       f"first: {first}){docs}")


def _tokenizer(cfg: JobConfig) -> tuple[str, Any]:
    from ..model import check_model_files, load_tokenizer, resolve_model_path

    model_path = resolve_model_path(cfg.model.path)
    check_model_files(model_path, "model.path")
    try:
        return model_path, load_tokenizer(model_path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:  # an unknown hub id, an unreadable folder, no usable tokenizer files
        if isinstance(err, FileNotFoundError):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.path {cfg.model.path!r}: cannot load its tokenizer (are its tokenizer files "
                          f"there?): {first}") from None


def run(cfg: JobConfig, run_dir: Path, *, resume: bool = False, on_ray: bool | None = None) -> DataOutput:
    """Read, canonicalise, tokenize and split every source of ``cfg.data``; write ``examples.parquet``,
    ``eval_examples.parquet`` and ``rejected.jsonl`` into ``run_dir``.

    Args:
        cfg: the job config.
        run_dir: the run directory.
        resume: the stopped run's ``examples.parquet`` / ``eval_examples.parquet`` must equal what is read
            now (checked before anything is overwritten).
        on_ray: read the training files on Ray Data (:mod:`.ray_data`; Ray must be initialised); None: when
            :func:`.ray_data.uses_ray_data` says so and Ray is initialised. The result is the same either way.

    Returns:
        :class:`DataOutput`.

    Raises:
        ConfigError: the tokenizer cannot be loaded, a data file is unreadable, or (``resume``) the data changed.
        FileNotFoundError: the model or a data file is missing.
    """
    model_path, tok = _tokenizer(cfg)
    data = _load(cfg.data, tok, on_ray)
    eval_files = _eval_files(cfg, tok)
    _report_fields(data, cfg.data.unused_fields, evaluation=eval_files.values())
    if resume:
        same_as_before(run_dir / "examples.parquet", data.train, ["example_id", "n_tokens"])
        same_as_before(run_dir / "eval_examples.parquet", data.eval, ["example_id"])
    claim(run_dir, "examples.parquet", "eval_examples.parquet", "rejected.jsonl")
    pq.write_table(data.train, run_dir / "examples.parquet")
    pq.write_table(data.eval, run_dir / "eval_examples.parquet")
    reasons: dict[str, int] = {}
    with open(run_dir / "rejected.jsonl", "w", encoding="utf-8") as fh:
        for rej in data.rejected:
            fh.write(rej.to_json() + "\n")
            key = reason_category(rej.reason)
            reasons[key] = reasons.get(key, 0) + 1
    print(
        f"[ray-cluster-ft] read {data.n_read} row{'' if data.n_read == 1 else 's'}: {data.train.num_rows} for "
        f"selection, {data.eval.num_rows} held out, {len(data.rejected)} rejected" + (f" {reasons}" if reasons else ""),
        flush=True,
    )
    if data.rejected:
        print(f"[ray-cluster-ft] rejected rows and their reasons: {run_dir / 'rejected.jsonl'}", flush=True)
    if cfg.evaluation.paths:
        with open(claim(run_dir, "eval_rejected.jsonl"), "w", encoding="utf-8") as fh:
            for res in eval_files.values():
                fh.writelines(rej.to_json() + "\n" for rej in res.rejected)
    candidates = set(data.train.column("example_id").to_pylist())
    overlap = {path: len(candidates.intersection(res.train.column("example_id").to_pylist()))
               for path, res in eval_files.items()}
    _warn_eval_files(eval_files, overlap)
    return DataOutput(model_path, tok, int(tok.pad_token_id), data, reasons, eval_files, overlap)


def _load(d, tok, on_ray: bool | None) -> DataResult:
    """The training files read in one process or on Ray Data (the same result, :mod:`.ray_data`)."""
    from .ray_data import load_examples_ray, uses_ray_data

    if on_ray is None and d.source == "files" and d.ray_data_rows is not None:
        import importlib.util

        on_ray = importlib.util.find_spec("ray") is not None and uses_ray_data(d)
        if on_ray:
            import ray

            on_ray = ray.is_initialized()
    if not on_ray:
        return load_examples(d, tok)
    print(f"[ray-cluster-ft] data: reading and tokenizing on Ray Data (data.ray_data_rows={d.ray_data_rows})",
          flush=True)
    return load_examples_ray(d, tok)


def _report_fields(data: DataResult, policy: str, out=None, evaluation: Iterable[DataResult] = ()) -> None:
    """The formats per file on the console, and the unused text fields by ``data.unused_fields``: one warning
    per file and field (``warn``), or a ``ConfigError`` naming every one (``error``), before anything is written.
    The ``evaluation.paths`` files' results (``evaluation``) are held to the same policy, named "evaluation file".

    Raises:
        ConfigError: ``policy == "error"`` and some text field went unused.
    """
    lines = []
    for label, res in [("", data)] + [("evaluation file ", r) for r in evaluation]:
        for src, per in res.formats.items():
            fmts = ", ".join(f"{f} ({n})" for f, n in sorted(per.items(), key=lambda kv: -kv[1]))
            print(f"[ray-cluster-ft] {label}{src}: format {fmts}", file=out, flush=True)
        lines += [f"{label}{src}: field {name!r} is not used by the row format in {n} row{'' if n == 1 else 's'}; "
                  f"to train on it: {res.hints[src][name]}"
                  for src, fields in res.unused.items() for name, n in fields.items()]
    if not lines or policy == "ignore":
        return
    if policy == "error":
        raise ConfigError("data.unused_fields is 'error' and text fields would not be trained on:\n  "
                          + "\n  ".join(lines) + "\n(map them with data.columns, or set data.unused_fields: warn)")
    for line in lines:
        print(f"[ray-cluster-ft] warning: {line}", file=out, flush=True)


def _eval_config(cfg: JobConfig, path: str, limit: int | None = None):
    """The data section that reads one ``evaluation.paths`` entry as the training files are read (same format,
    columns, template settings), every accepted row kept (none held out)."""
    from ..config import DataConfig

    d = cfg.data
    return DataConfig(source="files", paths=[path], max_seq_len=d.max_seq_len, overlong=d.overlong,
                      eval_fraction=0.0, max_eval=0, seed=d.seed, format=d.format, columns=d.columns,
                      train_on=d.train_on, default_system_prompt=d.default_system_prompt,
                      unused_fields=d.unused_fields, limit=limit)


def _eval_files(cfg: JobConfig, tok, limit: int | None = None) -> dict[str, DataResult]:
    """The ``evaluation.paths`` files, read and tokenized like the training data (:func:`_eval_config`), every
    accepted row kept for scoring (none held out, none a candidate); at most ``limit`` rows per file.

    Raises:
        FileNotFoundError: a file is missing (the message starts ``evaluation.paths:``).
    """
    out: dict[str, DataResult] = {}
    for path in cfg.evaluation.paths:
        try:
            out[path] = load_examples(_eval_config(cfg, path, limit), tok, eval_file=True)
        except FileNotFoundError as err:  # else it reads as a data.paths file
            raise FileNotFoundError(f"evaluation.paths: {err}") from None
    return out


def _warn_eval_files(eval_files: dict[str, DataResult], overlap: dict[str, int]) -> None:
    """One warning line per ``evaluation.paths`` file whose scores would mislead: no scorable row, or rows that
    are also training candidates (same content hash), so its "held-out" scores are partly on trained rows. The run
    goes on; the manifest's ``eval_files`` keeps the counts."""
    for path, res in eval_files.items():
        if not res.train.num_rows:
            print(f"[ray-cluster-ft] warning: evaluation file {path} has no row to score ({res.n_read} read, "
                  f"{len(res.rejected)} rejected, see eval_rejected.jsonl)", flush=True)
        elif overlap[path]:
            print(f"[ray-cluster-ft] warning: {overlap[path]} of the {res.train.num_rows} rows of evaluation file "
                  f"{path} are also training candidates: its scores are not held out", flush=True)
