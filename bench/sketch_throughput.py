"""Cost of a gradient sketch and of the forward-only features against one training step, measured in one run on
the same batches.

For the demo model (SmolLM2-135M-Instruct, fp32) and ``--batches`` batches of ``--batch`` x ``--seq`` tokens
(real mbpp + medquad rows of exactly ``--seq`` tokens after truncation, loss on their response tokens; random
tokens with a 64-token prompt where the shared data is absent), three computations are timed:

  (a) sketch: ``sketch_batch``, the batched factorised sketch (LoGra): one forward, one backward through the
      activations only (``autograd.grad`` w.r.t. the hooked module outputs), per-module projections;
  (b) exact: the per-example loop of the gradient selectors (LESS/TRAK style): one example at a time, forward,
      backward to the weight gradients of the sketched modules, each projected as ``P_out G P_in^T`` (the
      Kronecker projection, applied factor by factor: the explicit Kronecker matrix would hold k_out k_in x
      out x in numbers, 0.9 G per MLP matrix);
  (c) step: one plain training forward + backward with weight gradients of every parameter (Hugging Face
      loss over the batch, no optimizer step);
  (d) last_layer: ``last_layer_features``, CluSTER's last-layer gradient proxy (``sketch.method: last_layer``;
      Kim et al., arXiv 2609.12584): one inference-mode forward, no backward, no module settings;
  (e) hidden_mean: ``hidden_mean_features``, the RDS+ feature (``sketch.method: hidden_mean``; Ivison et al.
      2025, arXiv 2503.01807): one inference-mode forward of the base transformer, no LM head, weighted pooling;
  (f) forward: a plain inference-mode forward with logits (``model(...)``), so that (e) / (f) shows what leaving
      the LM head out saves: ``lm_head_share_of_forward`` = 1 - (e) / (f).

(d), (e) and (f) are timed once (not per sketch setting), interleaved with their own (c) on the same batches,
and their ratios are to that (c).

for two sketch settings: every block (``last_blocks: null``) and ``last_blocks: 4``, every projection
(q, k, v, o, gate, up, down), k_in = k_out = ``--k``, final dim ``--dim``. (a) and (c) are timed ``--repeats``
times per batch, interleaved, and the minimum per batch is kept; (b) runs once per batch. On the CPU the time
is the process CPU time (``time.process_time``) with ``--threads`` torch threads: it counts this process's
work only, so other jobs on a shared machine disturb it less than wall time (on an idle machine with 1 thread
the two agree). On CUDA it is wall time after ``torch.cuda.synchronize()``, with bf16 autocast for all three
(``--dtype auto``).

Peak memory of a computation: on the CPU the growth of the resident set's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` before each call; glibc's mmap threshold is pinned at 128 KiB so that freed
tensors leave the resident set), on CUDA ``torch.cuda.max_memory_allocated`` minus the memory allocated
before; the model's own weights are not counted.

Usage::

    python bench/sketch_throughput.py                     # 1 thread, 2 batches, 2 repeats, CPU
    python bench/sketch_throughput.py --device cuda --out bench/results/sketch_throughput_cuda.json

The table goes to stdout; the last line is one JSON object with ``sketch_over_step_all``,
``sketch_over_step_last4``, ``exact_over_sketch`` (all blocks), ``last_layer_ratio`` ((d) / (c)),
``hidden_mean_ratio`` ((e) / (c)), ``lm_head_share_of_forward`` and the rest, also written to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _pin_mmap_threshold() -> None:
    """glibc only: allocations above 128 KiB are mmap-ed and unmapped on free (the default threshold grows
    with freed blocks, after which freed tensors stay in the heap and the resident set hides the real peak)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Meter:
    """Time (CPU process time, or CUDA wall time) and peak extra memory of one call."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.hwm_ok = False
        if not self.cuda:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
                self.hwm_ok = True
            except OSError:
                pass

    def __call__(self, fn):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            if self.hwm_ok:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            base = _rss_kib("VmRSS")
            t0 = time.process_time()
            out = fn()
            dt = time.process_time() - t0
            peak = (_rss_kib("VmHWM") - base) / 1024 if self.hwm_ok else float("nan")
        return out, dt, peak


def make_batches(n_batches: int, batch: int, seq: int, tokenizer, seed: int = 0):
    """``n_batches`` of (input_ids, attention_mask, labels) int64 ``(batch, seq)``, no padding."""
    import torch

    from bench._common import shared_data_dir

    rows = []
    d = shared_data_dir()
    if d is not None:
        from ray_cluster_ft.config import DataConfig
        from ray_cluster_ft.data import load_examples

        need = n_batches * batch
        for name in ("mbpp.jsonl", "medquad.jsonl"):
            cfg = DataConfig(source="files", paths=[str(d / name)], limit=400, max_seq_len=seq,
                             overlong="truncate", eval_fraction=0.0)
            t = load_examples(cfg, tokenizer).train
            full = [(a, b) for a, b, n in zip(t.column("input_ids").to_pylist(), t.column("labels").to_pylist(),
                                              t.column("n_tokens").to_pylist()) if n == seq]
            rows += full[: (need + 1) // 2]
        source = "mbpp + medquad rows truncated to exactly %d tokens" % seq
    if len(rows) < n_batches * batch:
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(n_batches * batch):
            ids = rng.integers(0, 49_152, size=seq)
            lab = ids.copy()
            lab[: min(64, seq // 4)] = -100
            rows.append((ids.tolist(), lab.tolist()))
        source = f"random tokens, {min(64, seq // 4)}-token prompt"
    rows = rows[: n_batches * batch]
    out = []
    for b in range(n_batches):
        part = rows[b * batch:(b + 1) * batch]
        ids = torch.tensor([r[0] for r in part], dtype=torch.long)
        lab = torch.tensor([r[1] for r in part], dtype=torch.long)
        out.append((ids, torch.ones_like(ids), lab))
    return out, source


def _time_forward_only(meter, fns: dict, step, batches, repeats: int) -> dict:
    """Each forward-only computation of ``fns`` (name -> fn(batch)) and a fresh (c), interleaved per batch, the
    minimum of ``repeats`` kept per batch and summed: per name ``seconds``, ``step_seconds``, ``ratio``
    (= seconds / step_seconds) and ``peak_mib``."""
    for fn in fns.values():
        meter(lambda: fn(batches[0]))  # warm-up: first-call allocations, kernel selection
    t = {name: np.full((len(batches), repeats), np.inf) for name in (*fns, "step")}
    peak = dict.fromkeys(fns, 0.0)
    for r in range(repeats):
        for i, b in enumerate(batches):
            for name, fn in fns.items():
                _, t[name][i, r], m = meter(lambda: fn(b))
                peak[name] = max(peak[name], m)
            _, t["step"][i, r], _ = meter(lambda: step(b))
    step_seconds = float(t["step"].min(axis=1).sum())
    out = {}
    for name in fns:
        seconds = float(t[name].min(axis=1).sum())
        out[name] = {"seconds": seconds, "step_seconds": step_seconds, "ratio": seconds / step_seconds,
                     "peak_mib": peak[name]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="autocast: auto = bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--model", default="demo", help="model to time (default demo: SmolLM2-135M-Instruct); a "
                                                     "local folder, e.g. the tiny model of the smoke test")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/sketch_throughput.json)")
    args = ap.parse_args()

    _pin_mmap_threshold()
    import torch

    from ray_cluster_ft.features import make_projector, select_modules, sketch_batch
    from ray_cluster_ft.features.reference import weight_gradients
    from ray_cluster_ft.features.hidden_mean import hidden_mean_features
    from ray_cluster_ft.features.last_layer import last_layer_features
    from ray_cluster_ft.features._sketch_ops import _finish
    from ray_cluster_ft.features.sketchers import _autocast
    from ray_cluster_ft.model import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_before = os.getloadavg()
    model = load_model(args.model).to(device).eval()
    batches, source = make_batches(args.batches, args.batch, args.seq, load_tokenizer(args.model))
    batches = [tuple(t.to(device) for t in b) for b in batches]
    meter = Meter(device)
    amp = lambda: _autocast(device, args.dtype)  # noqa: E731

    def sketch(mods, proj, b):
        with amp():
            return sketch_batch(model, mods, proj, *b)[0]

    def exact(mods, proj, b):
        ids, _, lab = b
        out = []
        for i in range(len(ids)):
            with amp():
                grads = weight_gradients(model, mods, ids[i], lab[i])
            with torch.no_grad():
                blocks = [(p_out @ g.to(p_out.dtype) @ p_in.T).reshape(-1)
                          for g, p_in, p_out in zip(grads, proj.p_in, proj.p_out)]
                out.append(torch.cat(blocks))
            del grads
        return _finish(torch.stack(out), proj, normalize=True)

    def step(b):
        ids, mask, lab = b
        model.train()
        try:
            with amp():
                loss = model(input_ids=ids, attention_mask=mask, labels=lab, use_cache=False).loss
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()
        return loss.detach()

    def last_layer(b):
        with amp():
            return last_layer_features(model, *b)[0]

    def hidden_mean(b):
        with amp():
            return hidden_mean_features(model, b[0], b[1], "weighted")

    def forward(b):
        with torch.inference_mode(), amp():
            return model(input_ids=b[0], attention_mask=b[1], use_cache=False).logits

    n_tok = sum(int(b[1].sum()) for b in batches)
    n_ex = sum(len(b[0]) for b in batches)
    results = {}
    for name, last in (("all", None), ("last4", 4)):
        mods = select_modules(model, ALL_PROJ, last)
        proj = make_projector(mods, args.k, args.k, args.dim, seed=0).to(device)
        meter(lambda: sketch(mods, proj, batches[0]))  # warm-up: first-call allocations, kernel selection
        meter(lambda: step(batches[0]))
        ta = np.full((args.batches, args.repeats), np.inf)
        tc = np.full((args.batches, args.repeats), np.inf)
        tb = np.zeros(args.batches)
        mem = {"sketch": 0.0, "exact": 0.0, "step": 0.0}
        rel = 0.0
        for r in range(args.repeats):
            for i, b in enumerate(batches):
                s_a, ta[i, r], m = meter(lambda: sketch(mods, proj, b))
                mem["sketch"] = max(mem["sketch"], m)
                _, tc[i, r], m = meter(lambda: step(b))
                mem["step"] = max(mem["step"], m)
                if r == 0:
                    s_b, tb[i], m = meter(lambda: exact(mods, proj, b))
                    mem["exact"] = max(mem["exact"], m)
                    rel = max(rel, float(((s_a - s_b).norm(dim=1) / s_b.norm(dim=1)).max()))
        t = {"sketch": float(ta.min(axis=1).sum()), "exact": float(tb.sum()), "step": float(tc.min(axis=1).sum())}
        results[name] = {"modules": len(mods), "seconds": t, "peak_mib": mem, "sketch_vs_exact_rel_err": rel,
                         "examples_per_s": {k: n_ex / v for k, v in t.items()},
                         "tokens_per_s": {k: n_tok / v for k, v in t.items()},
                         "sketch_over_step": t["sketch"] / t["step"], "exact_over_sketch": t["exact"] / t["sketch"]}
    fwd = _time_forward_only(meter, {"last_layer": last_layer, "hidden_mean": hidden_mean, "forward": forward}, step,
                             batches, args.repeats)
    for r in fwd.values():
        r.update(examples_per_s=n_ex / r["seconds"], tokens_per_s=n_tok / r["seconds"])
    ll, hm = fwd["last_layer"], fwd["hidden_mean"]
    load_after = os.getloadavg()

    basis = "wall (CUDA synchronised)" if device.type == "cuda" else f"CPU process time, {args.threads} thread(s)"
    dt = {"auto": "bf16 autocast" if device.type == "cuda" else "fp32"}.get(args.dtype, args.dtype)
    name = "SmolLM2-135M-Instruct" if args.model == "demo" else args.model
    print(f"{name} on {device.type} ({dt}), {args.batches} batches x {args.batch} x {args.seq} tokens "
          f"({source}), k_in = k_out = {args.k}, dim {args.dim}; time basis: {basis}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("| blocks | modules | computation | s | examples/s | tokens/s | peak MiB | vs step | exact / sketch |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        for comp, label in (("sketch", "(a) factorised sketch"), ("exact", "(b) exact per-example loop"),
                            ("step", "(c) training fwd+bwd")):
            vs = r["seconds"][comp] / r["seconds"]["step"]
            ratio = f"{r['exact_over_sketch']:.2f}" if comp == "exact" else ""
            print(f"| {name} | {r['modules']} | {label} | {r['seconds'][comp]:.2f} | {r['examples_per_s'][comp]:.3f} | "
                  f"{r['tokens_per_s'][comp]:.0f} | {r['peak_mib'][comp]:.0f} | {vs:.2f} | {ratio} |")
    for key, label in (("last_layer", "(d) last-layer feature (CluSTER)"), ("hidden_mean", "(e) hidden_mean (RDS+)"),
                       ("forward", "(f) inference forward with logits")):
        r = fwd[key]
        print(f"| - | - | {label} | {r['seconds']:.2f} | {r['examples_per_s']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['peak_mib']:.0f} | {r['ratio']:.2f} |  |")
    head_share = 1.0 - hm["seconds"] / fwd["forward"]["seconds"]
    print(f"(d)-(f) are timed against their own (c) run: {ll['step_seconds']:.2f} s; the LM head's share of a "
          f"forward, 1 - (e) / (f): {head_share:.3f}")
    print("sketch vs exact, max relative difference: " +
          ", ".join(f"{k} {v['sketch_vs_exact_rel_err']:.1e}" for k, v in results.items()))
    summary = {
        "sketch_over_step_all": round(results["all"]["sketch_over_step"], 4),
        "sketch_over_step_last4": round(results["last4"]["sketch_over_step"], 4),
        "exact_over_sketch": round(results["all"]["exact_over_sketch"], 4),
        "exact_over_sketch_last4": round(results["last4"]["exact_over_sketch"], 4),
        "last_layer_ratio": round(ll["ratio"], 4),
        "last_layer_over_sketch_last4": round(ll["seconds"] / results["last4"]["seconds"]["sketch"], 4),
        "last_layer_examples_per_s": round(ll["examples_per_s"], 4),
        "last_layer_tokens_per_s": round(ll["tokens_per_s"], 1),
        "last_layer_peak_mib": round(ll["peak_mib"], 1),
        "hidden_mean_ratio": round(hm["ratio"], 4),
        "hidden_mean_over_sketch_last4": round(hm["seconds"] / results["last4"]["seconds"]["sketch"], 4),
        "hidden_mean_over_last_layer": round(hm["seconds"] / ll["seconds"], 4),
        "hidden_mean_examples_per_s": round(hm["examples_per_s"], 4),
        "hidden_mean_tokens_per_s": round(hm["tokens_per_s"], 1),
        "hidden_mean_peak_mib": round(hm["peak_mib"], 1),
        "forward_ratio": round(fwd["forward"]["ratio"], 4),
        "forward_examples_per_s": round(fwd["forward"]["examples_per_s"], 4),
        "lm_head_share_of_forward": round(head_share, 4),
        "forward_only_step_examples_per_s": round(n_ex / ll["step_seconds"], 4),
        "device": device.type, "dtype": dt, "threads": args.threads, "time_basis": basis,
        "batches": args.batches, "batch": args.batch, "seq": args.seq, "k": args.k, "dim": args.dim,
        "data": source, "load_avg_1m_before": round(load_before[0], 2), "load_avg_1m_after": round(load_after[0], 2),
    }
    for name, r in results.items():
        for comp in ("sketch", "exact", "step"):
            summary[f"{comp}_examples_per_s_{name}"] = round(r["examples_per_s"][comp], 4)
            summary[f"{comp}_tokens_per_s_{name}"] = round(r["tokens_per_s"][comp], 1)
            summary[f"{comp}_peak_mib_{name}"] = round(r["peak_mib"][comp], 1)
        summary[f"sketch_vs_exact_rel_err_{name}"] = float(f"{r['sketch_vs_exact_rel_err']:.3g}")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "sketch_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
