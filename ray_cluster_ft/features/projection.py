"""Per-example gradient sketches: the factorised random projection of LoGra (the maths; no Ray, no I/O).

For a linear layer ``y = W x`` the gradient of one example's loss is ``G = sum_t delta_t x_t^T``
(``delta_t = dL/dy_t``, an out x in matrix). LoGra (Choe et al. 2024, "What is Your Data Worth to GPT?",
Sec. 3) projects it with two small seeded Gaussian matrices, without ever forming ``G``::

    P_out G P_in^T = sum_t (P_out delta_t) (P_in x_t)^T          (k_out x k_in)

which equals the Kronecker projection ``(P_out (x) P_in) vec(G)`` of the row-major ``vec(G)``. One batched
forward (hooks keep ``P_in x`` and ``y``) and one backward through the activations only (``autograd.grad``
w.r.t. the hooked outputs, all weights frozen) give every example's blocks at once. The blocks of all chosen
modules are concatenated, optionally projected once more to ``dim`` with a seeded Gaussian ``R``, and
L2-normalised (docs/design.md, "Features").

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
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.collate import IGNORE_INDEX
from ._sketch_ops import _check_projector, _finish, _frozen, _no_autocast

__all__ = [
    "Projector",
    "select_modules",
    "make_projector",
    "sketch_batch",
]


# Container names under which transformer blocks are numbered: Llama/Mistral/Qwen `layers.<i>.`,
# GPT-2 `h.<i>.`, others `blocks.<i>.` / `layer.<i>.`.
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(\d+)\.")


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


class _Blocks:
    """The per-call state of :func:`sketch_batch` that its forward hooks, tensor hooks and backward share: each
    module's projected inputs ``P_in x`` (until its block is made), its block, whether it ran, and the outputs
    that start autograd's record (the leaves)."""

    def __init__(self, projector: Projector, device_type: str, maskf: torch.Tensor | None):
        n = len(projector.names)
        self.projector, self.device_type, self.maskf = projector, device_type, maskf
        self.xs: list[torch.Tensor | None] = [None] * n
        self.blocks: list[torch.Tensor | None] = [None] * n
        self.ran = [False] * n
        self.leaves: list[tuple[int, torch.Tensor]] = []

    def project(self, i: int, delta: torch.Tensor) -> None:
        # Called from inside the backward for every non-leaf output: each delta (B, T, out) is reduced to its
        # (B, k_out * k_in) block as soon as autograd has it and is then freed, instead of all modules'
        # deltas being held until autograd.grad returns.
        with torch.no_grad(), _no_autocast(self.device_type):
            d_p = delta.to(self.projector.dtype) @ self.projector.p_out[i].T  # (B, T, k_out)
            if self.maskf is not None:
                d_p = d_p * self.maskf
            self.blocks[i] = torch.einsum("btk,btj->bkj", d_p, self.xs[i]).flatten(1)
        self.xs[i] = None

    def hook_for(self, i: int):
        """The forward hook of module ``i``: keeps ``P_in x`` (padding masked) and hooks the output's gradient."""
        p_in, pdtype, maskf = self.projector.p_in[i], self.projector.dtype, self.maskf

        def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self.ran[i]:
                raise ValueError(f"sketch_batch: module {self.projector.names[i]} ran twice in one forward")
            self.ran[i] = True
            with torch.no_grad(), _no_autocast(self.device_type):
                x_p = args[0].detach().to(pdtype) @ p_in.T  # (B, T, k_in)
                self.xs[i] = x_p * maskf if maskf is not None else x_p
            if output.requires_grad:
                output.register_hook(lambda g: self.project(i, g))
            else:
                # A leaf: autograd records from the first sketched modules on, nothing below them. The
                # backward is asked for the leaves' gradients only; every other sketched output lies on a
                # path from the loss to a leaf, so its tensor hook fires on the way.
                output.requires_grad_(True)
                self.leaves.append((i, output))

        return hook

    def concatenated(self, batch: int, device: torch.device) -> torch.Tensor:
        """All modules' blocks side by side ``(B, raw_dim)``; a module whose output does not reach the loss has
        a zero gradient, so a zero block."""
        zero = None
        for i, b in enumerate(self.blocks):
            if b is None:
                zero = zero if zero is not None else torch.zeros(
                    batch, self.projector.k_out * self.projector.k_in, dtype=self.projector.dtype, device=device)
                self.blocks[i] = zero
        return torch.cat(self.blocks, dim=1)


def _checked_targets(modules, projector: Projector, input_ids, attention_mask, labels, check_inputs: bool) -> tuple:
    """``(mask bool (B, T), target (B, T-1), valid bool (B, T-1), n_valid (B,))`` of a batch: position t predicts
    ``labels[t + 1]`` where both are real tokens. ValueError for shapes that disagree, a projector that does not
    fit the modules, and (``check_inputs``) a labelled pad or a row with nothing to predict."""
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape or input_ids.shape != labels.shape:
        raise ValueError(
            f"sketch_batch: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
            f"labels {tuple(labels.shape)} must be the same (B, T)"
        )
    _check_projector(modules, projector)
    mask = attention_mask.to(torch.bool)
    if check_inputs and (labels[~mask] != IGNORE_INDEX).any():
        raise ValueError("sketch_batch: a padding token (attention_mask 0) has a label other than -100")
    target = labels[:, 1:]
    # Position t predicts labels[t+1]; under left padding the first real token's label would be
    # "predicted" from a pad position, which an unpadded run never does: only real positions count.
    valid = (target != IGNORE_INDEX) & mask[:, :-1]
    n_valid = valid.sum(dim=1)
    if check_inputs and (n_valid == 0).any():
        bad = torch.nonzero(n_valid == 0).flatten().tolist()
        raise ValueError(f"sketch_batch: rows {bad} have no response token after the label shift (nothing to sketch)")
    return mask, target, valid, n_valid


def _backward_into(state: _Blocks, model: nn.Module, modules, input_ids, attention_mask, target, valid,
                   n_valid) -> torch.Tensor:
    """One hooked forward and one activation-only backward, filling ``state``'s blocks; returns the per-example
    losses ``(B,)`` (each example's token mean)."""
    # Only the positions that carry a loss need logits: the head (often a large share of the FLOPs for a
    # 50k vocabulary) then runs on those rows only. Used when the head is a plain Linear not being sketched.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_trick = isinstance(head, nn.Linear) and all(m is not head for _, m in modules)
    sel = valid.nonzero(as_tuple=True)  # (rows, positions) with a loss, row-major

    def head_pre_hook(mod: nn.Module, args: tuple) -> tuple:
        return (args[0][:, :-1][sel],) + tuple(args[1:])

    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    handles = [m.register_forward_hook(state.hook_for(i)) for i, (_, m) in enumerate(modules)]
    if head_trick:
        handles.append(head.register_forward_pre_hook(head_pre_hook))
    names = state.projector.names
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
            missing = [names[i] for i in range(len(names)) if not state.ran[i]]
            if missing:
                raise ValueError(f"sketch_batch: modules {missing} did not run in the forward pass")
            if not state.leaves:
                raise RuntimeError("sketch_batch: the first sketched module's input already requires grad; "
                                   "sketching needs every parameter and the input embeddings frozen")
            grads = torch.autograd.grad(losses.sum(), [y for _, y in state.leaves], allow_unused=True)
            for (i, _), g in zip(state.leaves, grads):
                if g is not None:
                    state.project(i, g)
            del grads, out, logits
    finally:
        for h in handles:
            h.remove()
    return losses


def sketch_batch(
    model: nn.Module, modules: Sequence[tuple[str, nn.Linear]], projector: Projector, input_ids: torch.Tensor,
    attention_mask: torch.Tensor, labels: torch.Tensor, normalize: bool = True, check_inputs: bool = True,
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
        check_inputs: check the label and padding values on the device (False when the caller checked the host
            arrays: each check is a device-to-host sync on a GPU).

    Returns:
        ``(sketches, losses)``: float32 ``(B, projector.dim)`` and float32 ``(B,)`` (nats per response token).

    Raises:
        ValueError: shapes disagree, a padding token carries a label, an example has no response token
            after the shift, or the projector does not fit the modules.
    """
    mask, target, valid, n_valid = _checked_targets(modules, projector, input_ids, attention_mask, labels,
                                                    check_inputs)
    device_type = input_ids.device.type
    # Only padding needs the mask; unchecked (GPU) it is applied unasked: x * 1 is exact, a sync is not free.
    maskf = None if check_inputs and bool(mask.all()) else mask.to(projector.dtype).unsqueeze(-1)
    state = _Blocks(projector, device_type, maskf)
    losses = _backward_into(state, model, modules, input_ids, attention_mask, target, valid, n_valid)
    with torch.no_grad(), _no_autocast(device_type):
        sketches = _finish(state.concatenated(len(input_ids), input_ids.device), projector, normalize)
    return sketches, losses.detach().float()
