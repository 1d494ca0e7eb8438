"""Time and peak memory of the driver's decisions (cluster + select + allocate) at 10^4..10^6 examples.

Synthetic sketches: a mixture of ``n_blobs`` Gaussian blobs on the unit sphere in dimension 256 (so k-means
has structure to find), token lengths lognormal around 200 (clipped to 8..4096). The stages run as the
pipeline runs them: ``cluster_sketches(k="auto")``, ``select("balanced", budget=31%, within="kcenter")``,
``make_plan(cluster, W=8, micro-batch 4, 3 epochs)`` and ``plan_metrics``.

Each size runs in a fresh subprocess so that its peak RSS (``ru_maxrss``) is its own. The table goes to
stdout, the last line is one JSON object (``seconds_1e4`` ... ``peak_rss_mib_1e6``), and the same object is
written to ``bench/results/plan_scale.json``.

Usage::

    OMP_NUM_THREADS=2 python bench/plan_scale.py                 # 10^4, 10^5, 10^6
    python bench/plan_scale.py --sizes 10000 100000              # fewer
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DIM = 256
WORLD_SIZE = 8
MICRO_BATCH = 4
EPOCHS = 3
BUDGET_FRACTION = 0.31


def synthetic(n: int, dim: int = DIM, n_blobs: int = 100, noise: float = 0.6, seed: int = 0):
    """(sketches float32 (n, dim) on the unit sphere around ``n_blobs`` random centres, n_tokens int64 (n,)).

    ``noise`` is the norm of the Gaussian offset added to a unit centre before renormalising (0.6: a point's
    cosine to its centre is about 0.85, to other centres about 0).
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_blobs, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    blob = rng.integers(0, n_blobs, n)
    x = np.empty((n, dim), dtype=np.float32)
    step = 65_536
    for lo in range(0, n, step):  # chunked: bounds the temporaries at 10^6 rows
        hi = min(lo + step, n)
        part = rng.standard_normal((hi - lo, dim), dtype=np.float32) * np.float32(noise / math.sqrt(dim))
        part += centres[blob[lo:hi]]
        part /= np.linalg.norm(part, axis=1, keepdims=True)
        x[lo:hi] = part
    n_tokens = np.clip(np.round(rng.lognormal(math.log(200.0), 0.6, n)), 8, 4096).astype(np.int64)
    return x, n_tokens


def run_one(n: int, seed: int = 0) -> dict:
    """All stages at size n in this process; returns seconds per stage and peak RSS (MiB)."""
    from ray_cluster_ft.allocate import make_plan, plan_metrics
    from ray_cluster_ft.cluster import cluster_sketches
    from ray_cluster_ft.select import select

    import sklearn.cluster  # noqa: F401  (a one-off import of several seconds: kept out of the stage timings)

    x, n_tokens = synthetic(n, seed=seed)
    ids = np.array([f"ex{i:07d}" for i in range(n)])
    t = {}
    t0 = time.perf_counter()
    cres = cluster_sketches(x, k="auto", world_size=WORLD_SIZE, seed=seed, min_cluster_size=2)
    t["cluster"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    budget = int(round(BUDGET_FRACTION * n))
    sres = select("balanced", x, cres.labels, cres.dist, budget, within="kcenter", seed=seed)
    t["select"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sel = sres.indices
    pres = make_plan(ids[sel], cres.labels[sel], n_tokens[sel], WORLD_SIZE, MICRO_BATCH, 1, EPOCHS, seed=seed)
    t["allocate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = plan_metrics(pres.plan, WORLD_SIZE)
    t["metrics"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    return {
        "n": n,
        "k": cres.k,
        "selected": int(sel.size),
        "plan_rows": int(len(pres.plan)),
        "seconds": t,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "collisions_per_step": m["collisions_per_step"],
        "token_imbalance_mean": m["token_imbalance_mean"],
        "padding_fraction": m["padding_fraction"],
    }


def _tag(n: int) -> str:
    e = math.log10(n)
    return f"1e{int(round(e))}" if abs(e - round(e)) < 1e-9 else str(n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child mode: run one size, print its JSON
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_scale.json")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.seed)))
        return {}

    rows = []
    for n in args.sizes:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(n), "--seed", str(args.seed)],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"size {n} failed (exit {proc.returncode})")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    hdr = f"{'N':>9} {'k':>4} {'cluster s':>10} {'select s':>9} {'allocate s':>10} {'metrics s':>9} " \
          f"{'total s':>8} {'x per 10x':>9} {'peak RSS MiB':>12} {'collisions':>10} {'max/mean':>8} {'padding':>7}"
    print(f"load average {os.getloadavg()[0]:.2f}; W={WORLD_SIZE}, micro-batch {MICRO_BATCH}, {EPOCHS} epochs, "
          f"budget {BUDGET_FRACTION:.0%}, dim {DIM}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")
    print(hdr)
    result: dict = {}
    prev = None
    for r in rows:
        s = r["seconds"]
        growth = ""
        if prev is not None:
            per10 = (s["total"] / prev["seconds"]["total"]) ** (1.0 / math.log10(r["n"] / prev["n"]))
            growth = f"{per10:.1f}"
            result[f"growth_per_10x_{_tag(r['n'])}"] = per10
        print(f"{r['n']:>9} {r['k']:>4} {s['cluster']:>10.2f} {s['select']:>9.2f} {s['allocate']:>10.2f} "
              f"{s['metrics']:>9.2f} {s['total']:>8.2f} {growth:>9} {r['peak_rss_mib']:>12.0f} "
              f"{r['collisions_per_step']:>10.3f} {r['token_imbalance_mean']:>8.4f} {r['padding_fraction']:>7.4f}")
        tag = _tag(r["n"])
        result[f"seconds_{tag}"] = s["total"]
        result[f"peak_rss_mib_{tag}"] = r["peak_rss_mib"]
        result[f"stages_{tag}"] = s
        prev = r
    result["load_average_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
