"""Pieces of the factorised sketch that the exact references share (:mod:`.projection`, :mod:`.reference`): the
projector check, the final projection and normalisation, frozen parameters, autocast off. Pure torch. A
``projector`` here is a :class:`~ray_cluster_ft.features.projection.Projector` (not imported: projection.py
imports this module)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


def _check_projector(modules: Sequence[tuple[str, nn.Linear]], projector) -> None:
    """The projector was built for exactly these modules, in this order, with these shapes (else ValueError)."""
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


def _finish(blocks: torch.Tensor, projector, normalize: bool) -> torch.Tensor:
    """Concatenated blocks ``(B, raw_dim)`` -> final ``R`` -> optional L2 normalisation -> float32."""
    s = blocks.to(projector.dtype)
    if projector.r is not None:
        s = s @ projector.r.T
    if normalize:
        s = s / s.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)
    return s.float()


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
    """Autocast off: the projections run in the projector's dtype whatever the caller's autocast."""
    return torch.autocast(device_type=device_type, enabled=False)
