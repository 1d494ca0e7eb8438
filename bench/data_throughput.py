"""Rows per second of the data stage, one process against Ray Data (``data.ray_data_rows``), side by side on the
same synthetic JSON Lines pool (mixed formats, ~1% malformed lines, ~2% duplicates), and a check that both accept
and reject the same rows.

    python bench/data_throughput.py --rows 100000 --cpus 2 --model demo

Each size: the pool written once, then ``load_examples`` (one process) and ``load_examples_ray`` (a local Ray with
``--cpus`` CPUs, started before the clock; the Ray Data start-up of each run is inside it) timed; the last line is
the JSON summary ``{"sizes": [{"rows", "single_rows_per_s", "ray_rows_per_s", "ray_over_single", "same"}], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def write_pool(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` JSON Lines of mixed formats: 1% malformed, 2% repeats of an earlier row."""
    import random

    rnd = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            r = rnd.random()
            if r < 0.01:
                fh.write('{"prompt": "broken\n')
                continue
            j = rnd.randrange(max(1, i)) if r < 0.03 else i
            kind = j % 3
            if kind == 0:
                row = {"instruction": f"Add {j} and {j + 1}.", "input": "", "output": str(2 * j + 1)}
            elif kind == 1:
                row = {"messages": [{"role": "user", "content": f"What is item {j}?"},
                                    {"role": "assistant", "content": f"Item {j} is number {j} of the list."}]}
            else:
                row = {"prompt": f"Question {j}: why is the sky blue?", "response": f"Rayleigh scattering ({j})."}
            fh.write(json.dumps(row) + "\n")


def _same(a, b) -> bool:
    return (a.train.equals(b.train) and a.eval.equals(b.eval) and a.n_read == b.n_read
            and [(r.source, r.position, r.reason) for r in a.rejected] == [(r.source, r.position, r.reason)
                                                                          for r in b.rejected]
            and a.formats == b.formats and a.unused == b.unused)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100_000], help="pool sizes (rows)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--model", default="demo", help="model.path whose tokenizer is used")
    p.add_argument("--chunk-bytes", type=int, default=None, help="bytes per Ray read task (default the package's)")
    p.add_argument("--out", help="write the summary JSON here too")
    args = p.parse_args()

    import ray

    from ray_cluster_ft.config import DataConfig
    from ray_cluster_ft.data.examples import load_examples
    from ray_cluster_ft.data.ray_data import load_examples_ray
    from ray_cluster_ft.model import load_tokenizer

    tok = load_tokenizer(args.model)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    sizes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.rows:
                path = Path(tmp) / f"pool-{n}.jsonl"
                write_pool(path, n)
                cfg = DataConfig(source="files", paths=[str(path)], max_seq_len=512, eval_fraction=0.01)
                t0 = time.perf_counter()
                one = load_examples(cfg, tok)
                t1 = time.perf_counter()
                many = load_examples_ray(cfg, tok, chunk_bytes=args.chunk_bytes)
                t2 = time.perf_counter()
                single, on_ray = n / (t1 - t0), n / (t2 - t1)
                sizes.append({"rows": n, "single_s": round(t1 - t0, 2), "ray_s": round(t2 - t1, 2),
                              "single_rows_per_s": round(single, 1), "ray_rows_per_s": round(on_ray, 1),
                              "ray_over_single": round(on_ray / single, 3), "same": _same(one, many),
                              "accepted": one.train.num_rows + one.eval.num_rows, "rejected": len(one.rejected)})
                print(f"rows {n}: one process {single:,.0f} rows/s ({t1 - t0:.1f} s), Ray Data {on_ray:,.0f} "
                      f"rows/s ({t2 - t1:.1f} s), ratio {on_ray / single:.2f}, same rows: {sizes[-1]['same']}",
                      flush=True)
    finally:
        ray.shutdown()
    summary = {"sizes": sizes, "cpus": args.cpus, "model": args.model, "load_avg_1m": round(os.getloadavg()[0], 2)}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
