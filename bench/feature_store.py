"""The feature store on growing data: a job over N rows, then a job over the same N plus 10% new rows.

Three plan-only jobs (``run_pipeline(..., plan_only=True)``) on real rows of ``/work/shared/data`` (MBPP and
MedQuAD, alternating, in file order; the first N rows, then the first N + 10%):

  1. ``first``: N rows, ``sketch.store: WORK/store`` (empty): every feature computed and stored;
  2. ``second``: N + 10% rows, the same store: the N old rows are read from it, only the new ones computed;
  3. ``scratch``: N + 10% rows, no store: every feature computed, as a job before this feature;
  4. ``from_run`` (informational): N + 10% rows, the store, and ``clustering.from_run`` = the first job's run:
     the drift of the new rows against the first job's cluster map.

Checks: (a) the second job computes features for exactly the new rows (``counts.features_computed`` = new
candidates, ``features_reused`` = the first job's candidates); (b) its feature stage (the ``sketch`` timing:
store reads, the Ray Data actor pool on the missing rows, store writes) takes <= 15% of the first job's;
(c) its plan equals the scratch job's (the same features in, the same plan out): ``plan.parquet`` and
``selection.parquet`` compared whole, ``clusters.parquet``'s assignment (example_id, cluster), and the largest
feature and distance differences reported (the store's rows were sketched in other batches than the scratch
job's: float rounding).

Model: ``--model small`` (default) is a randomly initialised Llama built from a config by
``ray_cluster_ft.model.make_tiny_model`` (hidden 256, 4 layers, the SmolLM2 tokenizer and chat template; 12.6M
of its ~16M parameters are the tied embedding), seeded, so the run needs no download; the store does not care
what the weights mean. ``--model demo`` uses SmolLM2-135M-Instruct (slower: about 0.4 rows/s/core).

Usage::

    nice -n 10 python bench/feature_store.py --n 600

The side-by-side table goes to stdout, then one JSON line (last); the JSON is also written to ``--out``
(default ``bench/results/feature_store.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import shared_data_dir  # noqa: E402  (after the path insert)

DATA = shared_data_dir() or Path("/work/shared/data")


def real_rows(n: int) -> list[dict]:
    """The first ``n`` rows alternating MBPP and MedQuAD lines (question/answer), in file order."""
    srcs = [(DATA / "mbpp.jsonl").open(encoding="utf-8"), (DATA / "medquad.jsonl").open(encoding="utf-8")]
    rows = []
    try:
        while len(rows) < n:
            for f in srcs:
                if len(rows) < n:
                    r = json.loads(f.readline())
                    rows.append({"id": r["id"], "domain": r["domain"], "question": r["question"],
                                 "answer": r["answer"]})
    finally:
        for f in srcs:
            f.close()
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def file_hash(path: Path, columns: list[str] | None = None) -> str:
    """SHA-256 of a Parquet file's rows (pandas; all columns or ``columns``), order included."""
    import pandas as pd

    df = pd.read_parquet(path, columns=columns)
    return hashlib.sha256(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes()
                          + ",".join(df.columns).encode()).hexdigest()[:16]


def job(name: str, work: Path, data_path: str, model: str, store: str | None, args, from_run: str | None = None):
    """One plan-only run; returns its manifest."""
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.pipeline import run_pipeline

    out = work / name
    if out.exists():
        shutil.rmtree(out)
    cfg = parse_config({
        "data": {"paths": [data_path], "max_seq_len": args.max_seq_len, "overlong": "truncate",
                 "eval_fraction": 0.0, "seed": 0},
        "model": {"path": model},
        "sketch": {"last_blocks": 2, "k_in": 8, "k_out": 8, "dim": 64, "batch_size": 8, "seed": 0,
                   **({"store": store} if store else {})},
        "clustering": {"k": "auto", "seed": 0, **({"from_run": from_run} if from_run else {})},
        "selection": {"strategy": "balanced", "budget": 0.5, "seed": 0},
        "train": {"num_workers": 2, "micro_batch_size": 4, "epochs": 1},
        "output": {"dir": str(out)},
    })
    t0 = time.perf_counter()
    m = run_pipeline(cfg, plan_only=True)
    m["_wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[bench] {name}: sketch {m['timings_s'].get('sketch')} s, computed {m['counts']['features_computed']}, "
          f"reused {m['counts']['features_reused']}, wall {m['_wall_s']} s", flush=True)
    return m


def stored_features(store: str, key: str):
    """Every row under one store key: ``{example_id: feature}`` (a row stored twice: the first)."""
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(str(Path(store) / "v1" / key))
    col = t.column("sketch").combine_chunks()
    sk = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    out = {}
    for i, eid in enumerate(t.column("example_id").to_pylist()):
        out.setdefault(eid, sk[i])
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600, help="rows of the first job")
    ap.add_argument("--grow", type=float, default=0.10, help="share of new rows in the second job")
    ap.add_argument("--model", choices=("small", "tiny", "demo"), default="small",
                    help="small: hidden 256, 4 layers; tiny: hidden 32, 2 layers (the smoke test); demo: SmolLM2-135M")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--work", default="/tmp/ray-cluster-ft-bench-feature-store", help="scratch folder (wiped)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "feature_store.json"))
    ap.add_argument("--no-from-run", action="store_true", help="skip the informational from_run job")
    ap.add_argument("--smoke", action="store_true",
                    help="one Ray for every job (its idle workers make later jobs' times incomparable: a check that "
                         "the script runs, not a measurement)")
    args = ap.parse_args()

    import numpy as np
    import pandas as pd

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if args.model == "small":
        from ray_cluster_ft.model import make_tiny_model

        model = str(make_tiny_model(work / "model", hidden_size=256, num_layers=4, seed=0))
        model_desc = "Llama from a config (hidden 256, 4 layers, SmolLM2 tokenizer), random seeded weights"
    elif args.model == "tiny":
        from ray_cluster_ft.model import make_tiny_model

        model = str(make_tiny_model(work / "model", seed=0))
        model_desc = "Llama from a config (hidden 32, 2 layers, SmolLM2 tokenizer), random seeded weights"
    else:
        model, model_desc = "demo", "SmolLM2-135M-Instruct (demo)"
    n2 = round(args.n * (1 + args.grow))
    rows = real_rows(n2)
    first_data = write_jsonl(work / "data" / "first.jsonl", rows[:args.n])
    grown_data = write_jsonl(work / "data" / "grown.jsonl", rows)
    store = str(work / "store")
    load_before = os.getloadavg()[0]

    import contextlib

    from ray_cluster_ft.pipeline import ray_session

    with ray_session() if args.smoke else contextlib.nullcontext():
        first = job("first", work, first_data, model, store, args)
        second = job("second", work, grown_data, model, store, args)
        scratch = job("scratch", work, grown_data, model, None, args)
        reuse = None if args.no_from_run else job("from_run", work, grown_data, model, store, args,
                                                  from_run=str(work / "first"))
    load_after = os.getloadavg()[0]

    c1, c2, c3 = first["counts"], second["counts"], scratch["counts"]
    new_candidates = c2["candidates"] - c1["candidates"]
    exact_new = (c2["features_computed"] == new_candidates and c2["features_reused"] == c1["candidates"])
    t1, t2, t3 = (m["timings_s"]["sketch"] for m in (first, second, scratch))
    # clusters.parquet: the assignment (its float distances carry the features' rounding, compared below).
    cols = {"clusters": ["example_id", "cluster"], "selection": None, "plan": None}
    same = {name: file_hash(work / "second" / f"{name}.parquet", c) == file_hash(work / "scratch" / f"{name}.parquet", c)
            for name, c in cols.items()}
    dist_diff = float(np.max(np.abs(pd.read_parquet(work / "second" / "clusters.parquet")["distance"].to_numpy()
                                    - pd.read_parquet(work / "scratch" / "clusters.parquet")["distance"].to_numpy())))
    # The features themselves: the store's copy (second job) against the scratch job's own shards.
    from ray_cluster_ft.features import read_sketches

    fresh = read_sketches(str(work / "scratch" / "sketches"))
    stored = stored_features(store, second["sketch"]["feature_key"])
    diff = float(np.max(np.abs(np.stack([stored[e] for e in fresh["example_id"]]) - fresh["sketch"])))
    plan2 = pd.read_parquet(work / "second" / "plan.parquet")

    fig = {
        "rows_first": args.n, "rows_second": n2, "candidates_first": c1["candidates"],
        "candidates_second": c2["candidates"], "new_candidates": new_candidates,
        "second_features_computed": c2["features_computed"], "second_features_reused": c2["features_reused"],
        "computes_exactly_the_new_rows": bool(exact_new),
        "sketch_s_first": t1, "sketch_s_second": t2, "sketch_s_scratch": t3,
        "sketch_ratio_second_over_first": round(t2 / t1, 4),
        "sketch_ratio_second_over_scratch": round(t2 / t3, 4),
        "ratio_goal": 0.15, "ratio_met": bool(t2 / t1 <= 0.15),
        "compute_s_second": second["sketch"].get("seconds"), "compute_s_first": first["sketch"].get("seconds"),
        "plan_equals_scratch": bool(same["plan"]), "clusters_equal_scratch": bool(same["clusters"]),
        "selection_equals_scratch": bool(same["selection"]), "plan_rows": len(plan2),
        "feature_max_abs_diff_store_vs_scratch": diff, "cluster_distance_max_abs_diff": dist_diff,
        "wall_s": {"first": first["_wall_s"], "second": second["_wall_s"], "scratch": scratch["_wall_s"]},
        "model": model_desc, "data": "alternating mbpp.jsonl / medquad.jsonl rows from /work/shared/data, file order",
        "sketch": "gradient, last 2 blocks, k_in = k_out = 8, dim 64, batch 8; max_seq_len "
                  f"{args.max_seq_len} (truncate); k auto, balanced 50%, W = 2",
        "cpus": os.cpu_count(), "load_avg_1m_before": round(load_before, 2), "load_avg_1m_after": round(load_after, 2),
        "platform": platform.platform(),
    }
    if reuse is not None:
        d = reuse["clustering"]["from_run"]["drift"]
        fig.update(from_run_cluster_s=reuse["timings_s"]["cluster"], scratch_cluster_s=scratch["timings_s"]["cluster"],
                   from_run_new_rows=d["new_rows"], from_run_share_new_beyond_p95=d["share_new_beyond_p95"],
                   from_run_suggest_recluster=d["suggest_recluster"],
                   from_run_features_computed=reuse["counts"]["features_computed"])

    print()
    print(f"{'':34}{'first':>12}{'second':>12}{'scratch':>12}")
    print(f"{'rows (candidates)':34}{c1['candidates']:>12}{c2['candidates']:>12}{c3['candidates']:>12}")
    print(f"{'features computed':34}{c1['features_computed']:>12}{c2['features_computed']:>12}"
          f"{c3['features_computed']:>12}")
    print(f"{'features reused':34}{c1['features_reused']:>12}{c2['features_reused']:>12}{c3['features_reused']:>12}")
    print(f"{'feature stage s':34}{t1:>12.1f}{t2:>12.1f}{t3:>12.1f}")
    print(f"{'feature stage / first':34}{1.0:>12.3f}{t2 / t1:>12.3f}{t3 / t1:>12.3f}")
    print(f"second computes exactly the {new_candidates} new rows: {exact_new}; feature stage {t2 / t1:.1%} of the "
          f"first's (goal <= 15%: {'met' if t2 / t1 <= 0.15 else 'NOT met'})")
    print(f"second vs scratch: plan equal {same['plan']}, cluster assignment equal {same['clusters']}, selection "
          f"equal {same['selection']}; largest feature difference {diff:.3g} (distances {dist_diff:.3g})")
    if reuse is not None:
        print(f"from_run: {fig['from_run_new_rows']} new rows, {fig['from_run_share_new_beyond_p95']:.1%} beyond the "
              f"first run's p95 distance; cluster stage {fig['from_run_cluster_s']:.2f} s vs {fig['scratch_cluster_s']:.2f}"
              f" s from scratch")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(fig, indent=2) + "\n")
    print(json.dumps(fig))
    return fig


if __name__ == "__main__":
    main()
