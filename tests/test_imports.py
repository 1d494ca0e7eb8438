"""The import rules of docs/design.md, read from the source with ``ast`` (nothing is imported or run):

- no import cycle between the package's modules;
- imports follow the pipeline order: base (config, _presets, _quiet, model, rundir) -> data -> features -> cluster ->
  select -> allocate -> train -> evaluate -> pipeline -> api, cli, integrations; a module imports nothing of a
  later layer (imports inside functions count);
- the algorithm modules import no Ray and do no file I/O;
- no module imports another module's private name (``from .x import _y`` only from a private module ``_x`` of
  the same package);
- no module over 600 lines and no function over 100 (issue 27's limits: a module or a function a reader can hold).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ray_cluster_ft"

LAYERS = {
    "config": 0, "_config_load": 0, "_config_checks": 0, "_config_docs": 0, "_config_base": 0, "_config_train": 0, "_lazy": 0, "_presets": 0, "_quiet": 0, "model": 0, "rundir": 0,
    "data": 1, "features": 2, "cluster": 3, "select": 4, "allocate": 5, "train": 6, "evaluate": 7,
    "pipeline": 8, "api": 9, "cli": 9, "integrations": 9,
}
TOP = 10  # ray_cluster_ft/__init__.py re-exports the public API of every layer

# Pure algorithms: numbers in, numbers out. The stage.py beside them does the files.
ALGORITHMS = [
    "cluster/kmeans.py", "cluster/passes.py", "cluster/capped.py", "cluster/cluster_map.py", "cluster/_vectors.py",
    "select/quotas.py", "select/within.py", "select/_checks.py",
    "allocate/plan.py", "allocate/_packs.py", "allocate/_slots.py", "allocate/_light.py",
    "features/projection.py", "features/_sketch_ops.py",
]
IO_MODULES = {"pyarrow.parquet", "pyarrow.json", "pyarrow.csv", "pyarrow.fs", "shutil", "pickle", "tempfile"}
IO_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "to_parquet", "read_parquet",
            "write_table", "read_table", "to_json", "read_json", "to_csv", "read_csv", "savez", "save", "load",
            "mkdir", "unlink", "rmtree"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def _targets(name: str, node) -> list[str]:
    """Package modules an import node refers to (the longest existing module of each imported name)."""
    is_pkg = MODULES[name].name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names if a.name.split(".")[0] == "ray_cluster_ft"]
    else:
        if node.level:
            root = base[: len(base) - (node.level - 1)]
            mod = ".".join(root + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if mod.split(".")[0] != "ray_cluster_ft":
            return []
        mods = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    out = []
    for m in mods:
        while m not in MODULES and "." in m:
            m = m.rsplit(".", 1)[0]
        if m in MODULES and m != name and not name.startswith(m + "."):  # a package's own __init__ re-exports
            out.append(m)
    return out


def _layer(name: str) -> int:
    parts = name.split(".")
    return TOP if len(parts) == 1 else LAYERS[parts[1]]


EDGES = {name: {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for t in _targets(name, node)} for name, tree in TREES.items()}


def test_every_module_has_a_layer():
    missing = sorted({n.split(".")[1] for n in MODULES if "." in n} - set(LAYERS))
    assert not missing, f"modules outside the pipeline order: {missing}; add them to LAYERS (docs/design.md)"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(v, stack):
        state[v] = 1
        for w in sorted(EDGES[v]):
            if state.get(w) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(w):] + [w]))
            if w not in state:
                visit(w, stack + [w])
        state[v] = 2

    for v in sorted(MODULES):
        if v not in state:
            visit(v, [v])


def test_imports_follow_the_pipeline_order():
    upward = sorted(f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
                    for a, targets in EDGES.items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("rel", ALGORITHMS)
def test_algorithm_modules_import_no_ray_and_do_no_file_io(rel):
    path = PKG / rel
    if not path.exists():
        pytest.skip(f"{rel} does not exist")
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = []
        for n in names:
            if n == "ray" or n.startswith("ray.") or n in IO_MODULES:
                bad.append(f"line {node.lineno}: imports {n}")
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called in IO_CALLS:
                bad.append(f"line {node.lineno}: calls {called}()")
    assert not bad, f"{rel}: " + "; ".join(bad)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not (node.level or (node.module or "").split(".")[0] == "ray_cluster_ft"):
                continue
            src = (node.module or "").split(".")[-1]
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                # A package's private module (_packs.py) lends its helpers to the modules beside it.
                if private and not (node.level == 1 and src.startswith("_")):
                    bad.append(f"{MODULES[name].relative_to(PKG.parent)}:{node.lineno} imports {a.name} from "
                               f"{'.' * node.level}{node.module or ''}")
    assert not bad, "\n".join(bad)


def test_no_module_over_600_lines_and_no_function_over_100():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(PKG).as_posix()
        if len(text.splitlines()) > 600:
            long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
