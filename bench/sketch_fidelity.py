"""Fidelity of gradient sketches on real data: sketch cosine vs full-gradient cosine, by final sketch size.

The demo model (SmolLM2-135M-Instruct) and ``--examples`` real examples, half from ``mbpp.jsonl`` and half
from ``medquad.jsonl`` of the shared data folder, tokenized with the demo chat template (overlong rows
truncated to ``--max-seq-len``). For every pair of examples: the cosine between their full per-example
gradients over the sketched modules (plain autograd w.r.t. the weights, one example at a time) and the cosine
between their sketches (the batched factorised sketch, then each dim's own final projection R);
``ray_cluster_ft.features.sketch_fidelity`` does the work. Reported per dim: mean and largest absolute error,
Pearson correlation, and the reference's own mean absolute deviation (the error of knowing only the mean).

The full gradients are held in memory: examples x parameters of the sketched modules in float32 (64 x 15.0 M
= 3.9 GB for the last 4 blocks of SmolLM2-135M).

Usage::

    python bench/sketch_fidelity.py                       # 64 examples, last 4 blocks, k_in = k_out = 16
    python bench/sketch_fidelity.py --k 32 --last-blocks 4

The table goes to stdout; the last line is one JSON object, also written to
``bench/results/sketch_fidelity[-<tag>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--last-blocks", type=int, default=4)
    ap.add_argument("--k", type=int, default=16, help="k_in = k_out")
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="demo", help="model to sketch (default demo: SmolLM2-135M-Instruct); a "
                                                     "local folder, e.g. the tiny model of the smoke test")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/sketch_fidelity.json)")
    args = ap.parse_args()

    import torch

    from bench._common import real_examples, shared_data_dir
    from ray_cluster_ft.features import select_modules
    from ray_cluster_ft.features.reference import sketch_fidelity
    from ray_cluster_ft.model import load_model, load_tokenizer

    if shared_data_dir() is None:
        sys.exit("sketch_fidelity: the shared data folder (../shared/data) is absent")
    torch.set_num_threads(args.threads)
    examples = real_examples(args.examples, args.max_seq_len, load_tokenizer(args.model))
    model = load_model(args.model).eval()
    mods = select_modules(model, ALL_PROJ, args.last_blocks)
    n_params = sum(m.weight.numel() for _, m in mods)
    t0 = time.perf_counter()
    res = sketch_fidelity(model, mods, examples, args.k, args.k, args.dims, seed=args.seed)
    seconds = time.perf_counter() - t0
    tokens = [len(e[0]) for e in examples]
    name = "SmolLM2-135M-Instruct" if args.model == "demo" else args.model
    print(f"{name}, {len(examples)} examples (mbpp + medquad, {min(tokens)}..{max(tokens)} tokens, "
          f"mean {sum(tokens) / len(tokens):.0f}), last {args.last_blocks} blocks x {len(ALL_PROJ)} projections "
          f"({len(mods)} modules, {n_params / 1e6:.1f} M weights), k_in = k_out = {args.k}, "
          f"{res[args.dims[0]]['pairs']} pairs, {seconds:.0f} s, {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.1f}")
    print("| dim | sketch length | MAE | max abs error | Pearson | reference MAD |")
    print("|---:|---:|---:|---:|---:|---:|")
    for d in args.dims:
        r = res[d]
        print(f"| {d} | {r['sketch_dim']} | {r['mae']:.4f} | {r['max_abs_error']:.4f} | {r['pearson']:.3f} | "
              f"{r['reference_mad']:.4f} |")
    summary = {"examples": len(examples), "last_blocks": args.last_blocks, "k": args.k, "seconds": round(seconds, 1),
               "threads": args.threads, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for d in args.dims:
        summary.update({f"mae_{d}": round(res[d]["mae"], 5), f"pearson_{d}": round(res[d]["pearson"], 4),
                        f"max_abs_error_{d}": round(res[d]["max_abs_error"], 4)})
    summary["reference_mad"] = round(res[args.dims[0]]["reference_mad"], 5)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "sketch_fidelity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
