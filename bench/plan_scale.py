"""Time and peak memory of the driver's decisions (cluster + select + allocate) at 10^4..10^7 examples.

Synthetic sketches: a mixture of ``n_blobs`` Gaussian blobs on the unit sphere in dimension 256 (so k-means
has structure to find), token lengths lognormal around 200 (clipped to 8..4096). The stages run as the
pipeline runs them: ``cluster_sketches(k="auto")``, ``select("balanced", budget=31%)``,
``make_plan(cluster, W=8, micro-batch 4, 3 epochs)`` and ``plan_metrics``. ``--within`` and ``--groups`` set the
selection's ``selection.within`` and ``selection.groups`` on both paths (default: the package's defaults, a random
sample in each cluster and ``groups: auto``; ``--within kcenter --groups none`` was the default before issue 31).

Each size runs in a fresh subprocess so that its peak RSS (``ru_maxrss``) is its own. The table goes to
stdout, the last line is one JSON object (``seconds_1e4`` ... ``peak_rss_mib_1e6``), and the same object is
written to ``bench/results/plan_scale.json``.

Every size also runs **streamed** (issue 30): synthetic rows of the same distribution and seed (drawn shard by
shard, so not the in-memory run's rows: the two paths' timings compare, their selections do not; the equality
of the two paths is tests/allocate/test_stream.py's) written as float16 feature shards of 20,000 rows to a
temporary folder (not timed), then the driver side as a job above ``sketch.stream_rows`` runs it, on a
local Ray of ``--cpus`` CPUs: ``cluster.stream.run_streamed`` (Ray Data passes over the shards, clusters.parquet
and centroids.parquet written), ``select.stream.select_streamed`` (Ray tasks per wave of clusters),
``allocate.stream.plan_positions`` + ``write_in_parts`` (plan.parquet in parts) and ``plan_metrics``. The
driver's peak RSS (``ru_maxrss``) and the Ray workers' peak RSS (the largest one worker reached and the largest sum
over workers at one time, polled every 0.2 s) are reported apart. Sizes above ``--max-in-memory`` (default 10^6)
run streamed only. The table prints both paths side by side (streamed / in-memory seconds).

Usage::

    OMP_NUM_THREADS=2 python bench/plan_scale.py                 # 10^4, 10^5, 10^6
    python bench/plan_scale.py --sizes 10000 100000              # fewer
    python bench/plan_scale.py --sizes 1000000 10000000          # the issue-30 sizes (10^7: streamed only)
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

from ray_cluster_ft.config import SelectionConfig

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script, bench/ is sys.path[0]: bench._data needs the repository root
    sys.path.insert(0, str(REPO))

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


def run_one(n: int, seed: int = 0, within: str = "kcenter", groups=None) -> dict:
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
    sres = select("balanced", x, cres.labels, cres.dist, budget, within=within, seed=seed, groups=groups)
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


SHARD_ROWS = 20_000


def write_synthetic_shards(n: int, folder: Path, seed: int = 0):
    """The rows of :func:`synthetic` written as float16 feature shards of :data:`SHARD_ROWS` rows, chunk by chunk
    (never all rows in memory). Returns (FeatureShards, example ids as a pyarrow string array, n_tokens int64)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ray_cluster_ft.features import feature_shards
    from ray_cluster_ft.features._shards import _to_arrow

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((100, DIM), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    n_tokens = np.clip(np.round(rng.lognormal(math.log(200.0), 0.6, n)), 8, 4096).astype(np.int64)
    ids = pc.binary_join_element_wise("ex", pc.cast(pa.array(np.arange(n)), pa.string()), "")
    files = []
    for i, lo in enumerate(range(0, n, SHARD_ROWS)):
        hi = min(n, lo + SHARD_ROWS)
        part = rng.standard_normal((hi - lo, DIM), dtype=np.float32) * np.float32(0.6 / math.sqrt(DIM))
        part += centres[rng.integers(0, 100, hi - lo)]
        part /= np.linalg.norm(part, axis=1, keepdims=True)
        f = folder / f"shard-{i:05d}.parquet"
        pq.write_table(_to_arrow({"example_id": np.asarray(ids.slice(lo, hi - lo).to_pylist()), "sketch": part,
                                  "loss": np.zeros(hi - lo, np.float32), "n_tokens": n_tokens[lo:hi]}, "float16"), f)
        files.append(str(f))
    return feature_shards(files), ids, n_tokens


class _WorkerRss:
    """Polls the Ray worker processes under this driver (``default_worker.py``) for their RSS, every 0.2 s."""

    def __init__(self):
        import threading

        self.peak_one = self.peak_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        import psutil

        me = psutil.Process()
        while not self._stop.wait(0.2):
            total = 0
            for p in me.children(recursive=True):
                try:
                    cmd = " ".join(p.cmdline())
                    if "default_worker" in cmd or cmd.startswith("ray::"):  # a worker retitles itself ray::...
                        rss = p.memory_info().rss
                        total += rss
                        self.peak_one = max(self.peak_one, rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_sum = max(self.peak_sum, total)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"worker_peak_rss_mib": self.peak_one / 2**20, "workers_peak_rss_sum_mib": self.peak_sum / 2**20}


def run_streamed(n: int, seed: int = 0, cpus: int = 2, within: str = "kcenter", groups=None) -> dict:
    """The streamed driver side at size n (see the module docstring); seconds per stage and peak RSS (MiB)."""
    import tempfile

    import ray

    from ray_cluster_ft.allocate import plan_metrics
    from ray_cluster_ft.allocate.stream import plan_positions, write_in_parts
    from ray_cluster_ft.cluster.stream import run_streamed as cluster_streamed
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.rundir import prepare_run_dir
    from ray_cluster_ft.select.stream import select_streamed

    import sklearn.cluster  # noqa: F401  (kept out of the stage timings, as in run_one)

    with tempfile.TemporaryDirectory(prefix="plan_scale_") as tmp:
        root = Path(tmp)
        (root / "shards").mkdir()
        t0 = time.perf_counter()
        shards, ids, n_tokens = write_synthetic_shards(n, root / "shards", seed)
        write_s = time.perf_counter() - t0
        run_dir = root / "run"
        prepare_run_dir(run_dir, False)
        cfg = parse_config({"train": {"num_workers": WORLD_SIZE, "micro_batch_size": MICRO_BATCH, "epochs": EPOCHS},
                            "selection": {"budget": BUDGET_FRACTION, "within": within, "groups": groups,
                                          "seed": seed},
                            "clustering": {"seed": seed}, "allocation": {"packing": False, "seed": seed},
                            "sketch": {"stream_rows": 1}})
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        mon = _WorkerRss()
        t = {}
        try:
            t0 = time.perf_counter()
            cl = cluster_streamed(cfg, run_dir, shards=shards, example_ids=ids)
            t["cluster"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            sel, _ = select_streamed(cfg, shards, cl.labels, cl.dist, n_tokens=n_tokens)
            t["select"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            res, _ = plan_positions(cfg, cl.labels, n_tokens, np.asarray(sel.result.indices))
            write_in_parts(run_dir / "plan.parquet", (res.plan.iloc[lo:lo + 1_000_000]
                                                     for lo in range(0, len(res.plan), 1_000_000)), ids)
            t["allocate"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            m = plan_metrics(res.plan, WORLD_SIZE)
            t["metrics"] = time.perf_counter() - t0
        finally:
            workers = mon.stop()
            ray.shutdown()
        t["total"] = sum(t.values())
        return {"n": n, "k": cl.result.k, "selected": int(sel.result.indices.size), "plan_rows": int(len(res.plan)),
                "seconds": t, "write_shards_s": write_s, "shards": len(shards.files),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, **workers,
                "collisions_per_step": m["collisions_per_step"], "token_imbalance_mean": m["token_imbalance_mean"],
                "padding_fraction": m["padding_fraction"], "nodes": cl.summary["nodes"]}


def _tag(n: int) -> str:
    e = math.log10(n)
    return f"1e{int(round(e))}" if abs(e - round(e)) < 1e-9 else str(n)


def _groups(v: str):
    return None if v.lower() in ("none", "null") else v if v == "auto" else int(v)


def _child(flag: str, n: int, args) -> dict:
    proc = subprocess.run([sys.executable, __file__, flag, str(n), "--seed", str(args.seed), "--cpus", str(args.cpus),
                           "--within", args.within, "--groups", str(args.groups)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"size {n} ({flag}) failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the streamed run's local Ray")
    ap.add_argument("--max-in-memory", type=int, default=1_000_000, help="larger sizes run streamed only")
    sel = SelectionConfig()
    ap.add_argument("--within", default=sel.within, choices=["kcenter", "strata", "random", "peripheral", "central"],
                    help=f"selection.within of both paths (default: the package's, {sel.within})")
    ap.add_argument("--groups", type=_groups, default=sel.groups,
                    help=f"selection.groups of both paths: none (flat), auto, or a count (default: {sel.groups})")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child mode: run one size, print its JSON
    ap.add_argument("--one-streamed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_scale.json")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.seed, args.within, args.groups)))
        return {}
    if args.one_streamed:
        print(json.dumps(run_streamed(args.one_streamed, args.seed, args.cpus, args.within, args.groups)))
        return {}

    from bench._data import machine_info

    machine = machine_info()  # commit, command and load before, so a result file names what it measured
    rows = [(_child("--one", n, args) if n <= args.max_in_memory else None, _child("--one-streamed", n, args))
            for n in args.sizes]
    print(f"load average {os.getloadavg()[0]:.2f}; W={WORLD_SIZE}, micro-batch {MICRO_BATCH}, {EPOCHS} epochs, "
          f"budget {BUDGET_FRACTION:.0%}, dim {DIM}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, "
          f"streamed on {args.cpus} Ray CPUs (float16 shards of {SHARD_ROWS} rows); within {args.within}, "
          f"groups {args.groups}")
    print(f"{'N':>9} {'k':>4} | {'in-mem s':>8} {'RSS MiB':>8} | {'cluster':>8} {'select':>7} {'alloc':>6} "
          f"{'metric':>6} {'stream s':>8} {'x in-mem':>8} {'drv MiB':>8} {'wkr MiB':>8} {'wkrs MiB':>8} "
          f"{'collis':>6} {'max/mean':>8}")
    result: dict = {}
    prev = None
    for mem, st in rows:
        tag, s = _tag(st["n"]), st["seconds"]
        ratio = s["total"] / mem["seconds"]["total"] if mem else None
        print(f"{st['n']:>9} {st['k']:>4} | {mem['seconds']['total'] if mem else float('nan'):>8.2f} "
              f"{mem['peak_rss_mib'] if mem else float('nan'):>8.0f} | {s['cluster']:>8.2f} {s['select']:>7.2f} "
              f"{s['allocate']:>6.2f} {s['metrics']:>6.2f} {s['total']:>8.2f} "
              f"{ratio if ratio else float('nan'):>8.2f} {st['peak_rss_mib']:>8.0f} {st['worker_peak_rss_mib']:>8.0f} "
              f"{st['workers_peak_rss_sum_mib']:>8.0f} {st['collisions_per_step']:>6.3f} "
              f"{st['token_imbalance_mean']:>8.4f}")
        if mem:
            result[f"seconds_{tag}"] = mem["seconds"]["total"]
            result[f"peak_rss_mib_{tag}"] = mem["peak_rss_mib"]
            result[f"stages_{tag}"] = mem["seconds"]
            if prev is not None:
                result[f"growth_per_10x_{tag}"] = (mem["seconds"]["total"] / prev["seconds"]["total"]) ** (
                    1.0 / math.log10(mem["n"] / prev["n"]))
            prev = mem
        result.update({f"streamed_seconds_{tag}": s["total"], f"streamed_stages_{tag}": s,
                       f"streamed_driver_peak_rss_mib_{tag}": st["peak_rss_mib"],
                       f"streamed_worker_peak_rss_mib_{tag}": st["worker_peak_rss_mib"],
                       f"streamed_workers_peak_rss_sum_mib_{tag}": st["workers_peak_rss_sum_mib"],
                       f"streamed_over_in_memory_{tag}": ratio, f"streamed_write_shards_s_{tag}": st["write_shards_s"]})
    result["load_average_end"] = os.getloadavg()[0]
    result["selection"] = {"within": args.within, "groups": args.groups}
    result["machine"] = machine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
