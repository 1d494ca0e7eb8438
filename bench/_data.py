"""The benchmarks' real data (bench/end_to_end.py, bench/paper_setup.py): pools and held-out files drawn from
``../shared/data`` and the demo packages, and the machine a figure was measured on."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench import _common

REPO = _common.REPO


def shared_data_dir() -> Path:
    """The shared data folder (:func:`bench._common.shared_data_dir`); SystemExit where it is absent."""
    root = _common.shared_data_dir()
    if root is None:
        raise SystemExit("bench: the shared data folder (../shared/data, or $RAY_CLUSTER_FT_SHARED_DATA) is "
                         "absent")
    return root


def sample(rows: list, n: int, seed: int) -> list:
    """A seeded sample of ``n`` rows, in file order (so the files read the same way every time)."""
    if len(rows) <= n:
        return rows
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=n, replace=False))
    return [rows[i] for i in keep]


def read_shared(name: str) -> list[dict]:
    path = shared_data_dir() / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (set RAY_CLUSTER_FT_SHARED_DATA to the shared data folder)")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


def demo_rows(examples: int | None, seed: int) -> dict[str, list]:
    """The demo's HumanEval and MMLU-medical rows (a seeded sample of ``examples`` each; None = all), with the
    task fields of :func:`ray_cluster_ft.evaluate.demo_eval_fields`."""
    from ray_cluster_ft.data.read import iter_demo_rows
    from ray_cluster_ft.evaluate.tasks import demo_eval_fields, humaneval_records

    he = humaneval_records()
    by_source: dict[str, list] = {"humaneval": [], "mmlu-medical": []}
    for _src, _pos, row in iter_demo_rows(limit=examples, seed=seed):
        by_source[row["source"]].append({**row, **demo_eval_fields(row, he)})
    return by_source


def medquad_split(rows: list[dict], n_pool: int, n_eval: int, seed: int) -> tuple[list, list]:
    """MedQuAD rows for the pool (whole documents in a seeded order until ``n_pool`` rows, the last one cut)
    and ``n_eval`` held-out rows from the other documents (none with a pool row's question and answer)."""
    docs: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        docs.setdefault((r.get("collection"), r.get("url") or r.get("focus")), []).append(i)
    keys = list(docs)
    order = np.random.default_rng(seed).permutation(len(keys))
    pool: list[int] = []
    used = set()
    for j in order:
        if len(pool) >= n_pool:
            break
        pool.extend(docs[keys[j]][: n_pool - len(pool)])
        used.add(keys[j])
    seen = {(rows[i]["question"], rows[i]["answer"]) for i in pool}
    rest = [r for k, idx in docs.items() if k not in used for r in (rows[i] for i in idx)
            if (r["question"], r["answer"]) not in seen]
    rest.sort(key=lambda r: r["id"])
    return [rows[i] for i in sorted(pool)], sample(rest, n_eval, seed + 1)


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages now, as ``"1.23 4.56 7.89"``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_info() -> dict:
    """The machine, the checkout's commit, the command and the date; ``load_before`` is the load now (a caller
    that writes its results after running gives the load at its start instead)."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "mem_gib": round(mem), "platform": platform.platform(terse=True),
            "python": platform.python_version(), "commit": commit,
            "load_before": load_average(),
            "command": " ".join(["python", Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")}
