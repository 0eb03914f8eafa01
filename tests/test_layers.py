"""The package's floors: imports go down only, and no two modules import each other in a cycle.

DESIGN.md, style 12: plan (pure) at the bottom, then io/kernels/models/data, store/optim/ckpt, exec,
dist/node, engine, and cli on top. A module may import from a lower floor only (never sideways into a
sibling package, never upward); function-level imports count too, since they run all the same. As the
planner's purity test does for ``plan/``, this reads the source, so it fails before any import runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import luwu_rt

ROOT = Path(luwu_rt.__file__).parent

FLOORS: dict[str, int] = {
    # standard library only (plan: see tests/plan for its purity), and the native module
    "plan": 0, "config": 0, "fs": 0, "interrupt": 0, "heap": 0, "_C": 0, "__init__": 0,
    "io": 1, "kernels": 1, "models": 1, "data": 1,
    "store": 2, "optim": 2, "ckpt": 2,
    # gradient codecs: Numba kernels that reuse kernels' rounding, below the dist handlers that run them
    "compress": 2,
    "exec": 3,
    "dist": 4, "node": 4,
    # the swap-schedule testing kit: simulates plans (plan) and writes their timelines with exec's trace
    # writer; it imports nothing that runs a step, and nothing imports it but the CLI
    "testing": 4,
    "engine": 5,
    "cli": 6,
    "__main__": 7,
}
"""Top-level package or module of ``luwu_rt`` -> its floor."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(["luwu_rt", *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``luwu_rt`` modules that ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("luwu_rt"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs or [target])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("luwu_rt"))
    return found


def _floor_of(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "__init__"
    assert top in FLOORS, f"{module}: add its package {top!r} to FLOORS in {__file__} (which floor is it on?)"
    return top, FLOORS[top]


def test_imports_go_down_only():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        top, floor = _floor_of(name)
        for target in sorted(_imports(name, path, modules)):
            other, other_floor = _floor_of(target)
            if other != top and other_floor >= floor:
                wrong.append(f"{name} (floor {floor}) imports {target} (floor {other_floor})")
    assert not wrong, "imports that do not go down:\n" + "\n".join(wrong)


def test_no_import_cycles():
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, modules) if t in modules and t != name}
             for name, path in modules.items()}
    # A package's __init__ re-exports its modules; a module importing its own package's public names
    # from it is the usual shape, not a cycle of meaning: look through the __init__ to what it names.
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and t in modules
                                                      and modules[t].name == "__init__.py")}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_package_has_a_floor():
    tops = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert tops <= set(FLOORS), f"packages without a floor: {sorted(tops - set(FLOORS))}"
