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
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import SketchConfig

if TYPE_CHECKING:  # pragma: no cover
    import ray.data

__all__ = [
    "IGNORE_INDEX",
    "Projector",
    "select_modules",
    "make_projector",
    "sketch_batch",
    "exact_sketch",
    "GradientSketcher",
    "compute_sketches",
    "read_sketches",
]

IGNORE_INDEX = -100
"""Label of tokens without loss (prompt and padding), the Hugging Face convention."""

# A Ray batch holds this many sketch sub-batches: sorting a larger pool by length leaves less padding.
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
    maskf = mask.to(projector.dtype).unsqueeze(-1)
    n_mod = len(modules)
    xs: list[torch.Tensor | None] = [None] * n_mod
    ys: list[torch.Tensor | None] = [None] * n_mod

    def hook_for(i: int):
        p_in = projector.p_in[i]

        def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if ys[i] is not None:
                raise ValueError(f"sketch_batch: module {projector.names[i]} ran twice in one forward")
            with torch.no_grad(), _no_autocast(device_type):
                xs[i] = (args[0].detach().to(p_in.dtype) @ p_in.T) * maskf
            if not output.requires_grad:
                # A leaf: autograd records from the first sketched module on, nothing below it.
                output.requires_grad_(True)
            ys[i] = output

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
            missing = [projector.names[i] for i in range(n_mod) if ys[i] is None]
            if missing:
                raise ValueError(f"sketch_batch: modules {missing} did not run in the forward pass")
            deltas = torch.autograd.grad(losses.sum(), ys, allow_unused=True)
    finally:
        for h in handles:
            h.remove()

    blocks = []
    with torch.no_grad(), _no_autocast(device_type):
        for i in range(n_mod):
            x_p = xs[i]
            if deltas[i] is None:  # output does not reach the loss: zero gradient
                blocks.append(x_p.new_zeros(len(input_ids), projector.k_out * projector.k_in))
                continue
            d_p = (deltas[i].to(projector.dtype) @ projector.p_out[i].T) * maskf  # (B, T, k_out)
            blocks.append(torch.einsum("btk,btj->bkj", d_p, x_p).flatten(1))
        sketches = _finish(torch.cat(blocks, dim=1), projector, normalize)
    return sketches, losses.detach().float()


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
    weights = [m.weight for _, m in modules]
    with _frozen(model, keep=weights), torch.enable_grad():
        logits = model(input_ids=input_ids[None], use_cache=False).logits[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX)
        grads = torch.autograd.grad(loss, weights)
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


class GradientSketcher:
    """Ray Data callable class: a batch of tokenized examples -> their gradient sketches.

    Built once per actor: loads the model (eval mode, so dropout is off), selects the modules and draws the
    projector (identical in every actor, see :func:`make_projector`). Runs on CUDA with bf16 autocast where
    this process has a GPU, else fp32 on the CPU. Use with
    ``Dataset.map_batches(GradientSketcher, batch_format="numpy", fn_constructor_kwargs=...)``.

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

    def _sketch(self, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor):
        if self.device.type == "cuda":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return sketch_batch(self.model, self.modules, self.projector, input_ids, mask, labels)
        return sketch_batch(self.model, self.modules, self.projector, input_ids, mask, labels)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sketch one Ray batch.

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
        order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
        bs = self.cfg.batch_size
        for start in range(0, n, bs):
            idx = order[start : start + bs]
            sub_ids = _pad_right([ids[i] for i in idx], self.pad_token_id)
            sub_lab = _pad_right([labs[i] for i in idx], IGNORE_INDEX)
            mask = np.arange(sub_ids.shape[1])[None, :] < lengths[idx][:, None]
            s, loss = self._sketch(
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


class _ArrowGradientSketcher(GradientSketcher):
    """:class:`GradientSketcher` that returns Arrow tables with a plain fixed-size-list ``sketch`` column;
    converting inside the actor spares Ray a separate conversion task (and its worker process)."""

    def __call__(self, batch: dict[str, np.ndarray]):
        return _to_arrow(super().__call__(batch))


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


def compute_sketches(
    examples: "ray.data.Dataset",
    model_path: str,
    cfg: SketchConfig,
    out_dir: str,
    use_gpu: bool = False,
    trust_remote_code: bool = False,
    pad_token_id: int = 0,
) -> None:
    """Sketch every example with a pool of :class:`GradientSketcher` actors and write Parquet to ``out_dir``.

    ``examples`` needs the columns ``example_id``, ``input_ids``, ``labels``, ``n_tokens`` (the
    ``examples.parquet`` schema; other columns are dropped). The pool has ``cfg.num_actors`` actors, else one
    per GPU (``use_gpu``) or one per CPU of the Ray cluster, each with 1 GPU with ``use_gpu`` and up to 1 CPU
    (one CPU of the cluster stays free for Ray Data's read and write tasks, see :func:`_actor_resources`).
    A Ray batch holds ``8 * cfg.batch_size`` examples, sorted by length into sub-batches of
    ``cfg.batch_size`` inside the actor. Output columns: ``example_id`` (string), ``sketch``
    (``fixed_size_list<float32>[dim]``), ``loss`` (float32), ``n_tokens`` (int32); read them back with
    :func:`read_sketches`.

    On an autoscaling cluster whose GPU nodes are not up yet, ``ray.cluster_resources()`` shows no GPU and
    the default pool is a single actor: set ``cfg.num_actors`` there.

    Raises:
        ValueError: a required column is missing.
    """
    import ray.data

    need = ["example_id", "input_ids", "labels", "n_tokens"]
    missing = [c for c in need if c not in examples.columns()]
    if missing:
        raise ValueError(f"compute_sketches: examples lack columns {missing}")
    n_actors, cpus_per_actor = _actor_resources(cfg, use_gpu)
    ray_batch = _SUBBATCHES_PER_RAY_BATCH * cfg.batch_size
    # One Parquet file is often one block, and one block goes to one actor: cut blocks to one Ray batch
    # (streaming, no shuffle) so every actor of the pool gets work.
    blocks = examples.select_columns(need).repartition(target_num_rows_per_block=ray_batch)
    sketched = blocks.map_batches(
        _ArrowGradientSketcher,
        fn_constructor_kwargs={
            "model_path": model_path,
            "sketch": cfg.model_dump(),
            "trust_remote_code": trust_remote_code,
            "pad_token_id": pad_token_id,
        },
        batch_size=ray_batch,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=n_actors),
        num_gpus=1 if use_gpu else 0,
        num_cpus=cpus_per_actor,
    )
    sketched.write_parquet(out_dir)


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
