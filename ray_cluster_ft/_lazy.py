"""Lazy re-exports for package ``__init__`` files (PEP 562 module ``__getattr__``): a name is imported from its
module the first time it is asked for, so ``import ray_cluster_ft`` (and ``ray-cluster-ft check``) pulls in
neither torch nor Ray nor transformers until a stage that needs them is used."""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, where: dict[str, str], submodules: tuple[str, ...] = ()
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__``.

    Args:
        package: the package's ``__name__``.
        where: public name -> the module it is defined in, relative to ``package`` (``"allocate"``,
            ``"data.stage"``).
        submodules: submodule names reachable as attributes (``ray_cluster_ft.pipeline``) before anything imported
            them.

    Returns:
        ``(__getattr__, __dir__)``; ``__getattr__`` imports the module, caches the value in the package's namespace
        and raises ``AttributeError`` for any other name (as a plain module does).
    """
    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(f".{where[name]}", package), name)
        elif name in submodules:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(importlib.import_module(package), name, value)  # later look-ups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(where) | set(submodules))

    return __getattr__, __dir__
