"""The house's import rules, read off the source with ``ast`` (no module is imported here).

Imports flow one way, kernels -> ops -> models -> generation -> serving; ``pallas_kernels``
imports nothing from ``spark_jax``; no import cycle anywhere; no module imports another
module's underscore names. Function-level (lazy) imports count like top-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "spark_jax", "conversion")

# Lower layers never import higher ones. Modules not listed take their package's rank.
LAYERS = {
    "pallas_kernels": 0,
    "spark_jax.config": 1,
    "spark_jax.tokenizer": 1,
    "spark_jax.ops": 2,
    "spark_jax.models": 3,
    "spark_jax.checkpoint": 3,
    "conversion": 4,
    "spark_jax.model": 4,
    "spark_jax.protocol": 4,
    "spark_jax.generation": 5,
    "spark_jax.serving": 6,
    "spark_jax": 7,  # the public API (__init__) and the CLI
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in a module (absolute or relative)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [alias.name for alias in node.names], node.lineno))
    return out


def _targets(module: str, names: list[str]) -> list[str]:
    """The project modules an import reaches: a submodule named in ``from pkg import mod``."""
    if module not in MODULES:
        return []
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return subs or [module]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(name, path):
            graph[name].update(t for t in _targets(module, names) if t != name)
    return graph


def _rank(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def test_the_import_walk_sees_the_package():
    assert {"spark_jax.generation.step", "spark_jax.serving.engine", "pallas_kernels"} <= set(
        MODULES
    )
    assert "spark_jax.ops.sampling" in _graph()["spark_jax.generation.step"]


def test_pallas_kernels_import_nothing_from_spark_jax():
    bad = [
        f"{name}:{line} imports {module}"
        for name, path in MODULES.items()
        if name.startswith("pallas_kernels")
        for module, _, line in _imports(name, path)
        if module == "spark_jax" or module.startswith("spark_jax.")
    ]
    assert not bad, "\n".join(bad)


def test_imports_flow_one_way_through_the_layers():
    bad = [
        f"{name} (layer {_rank(name)}) imports {target} (layer {_rank(target)})"
        for name, targets in _graph().items()
        for target in targets
        if _rank(target) > _rank(name)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_underscore_names():
    bad = []
    for name, path in MODULES.items():
        for module, names, line in _imports(name, path):
            if module not in MODULES and not any(module.startswith(p + ".") for p in PACKAGES):
                continue
            private = [n for n in names if n.startswith("_")]
            # A package's private module (pallas_kernels._mosaic) holds helpers its siblings
            # share under public names; importing the module's names is not reaching in.
            if private:
                bad.append(f"{name}:{line} imports {private} from {module}")
    assert not bad, "\n".join(bad)


def test_no_test_module_imports_another_test_module():
    """Tests share code through ``tests/helpers.py`` (and fixtures through conftest.py)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0].startswith("test_") or n.split(".")[0] == "conftest"
            ]
    assert not bad, "\n".join(bad)
