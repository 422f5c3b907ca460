"""Imports run one way, kernels <- model <- draft <- decode <- io, train <- api <- serve, cli:
no package imports one above it, no two packages import each other (through others either),
no module imports itself back, and the core never imports the lab. Read from the source (no
import), so a function-level import counts as much as a top-level one."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what each part may import, beside itself and the JAX-free option tables (options.py)
MAY_IMPORT = {
    "kernels": set(),
    "model": {"kernels"},
    "draft": {"kernels", "model"},
    "decode": {"kernels", "model", "draft"},
    "io": {"model", "draft"},
    "train": {"model", "draft", "decode", "io"},
    "results": {"decode"},
    "costs": {"model", "decode"},
    "api": {"model", "draft", "decode", "io", "results", "costs"},
    "serve": {"api", "model", "decode", "io"},  # model: the engine pages the KV caches
    "cli": {"api", "model", "draft", "decode", "io", "train", "serve"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str | None:
    pieces = module.split(".")
    if pieces[0] == "pallas_kernels":
        return "kernels"
    return pieces[1] if pieces[0] == "jetspec_jax" and len(pieces) > 1 else None


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules that path imports (`from pkg import mod` counts as pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found & modules


def graph() -> dict[str, set[str]]:
    files = [p for pkg in ("jetspec_jax", "pallas_kernels") for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) - {module_name(p)} for p in files}


def test_every_part_imports_only_the_parts_below_it():
    wrong = []
    for mod, deps in graph().items():
        if part(mod) not in MAY_IMPORT:
            continue
        allowed = MAY_IMPORT[part(mod)] | {part(mod), "options", None}
        wrong += [f"{mod} -> {d}" for d in sorted(deps) if part(d) not in allowed]
    assert not wrong, wrong


def find_cycle(g: dict[str, set[str]], skip=lambda mod, dep: False) -> list[str] | None:
    """A loop of edges in g (as the nodes on it, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if skip(node, dep):
                continue
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (loop := visit(dep, path + [dep])):
                return loop
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (loop := visit(node, [node])):
            return loop
    return None


def test_no_module_imports_itself_back():
    # a package's __init__ re-exporting its modules is not a loop through them
    loop = find_cycle(graph(), skip=lambda mod, dep: dep.startswith(mod + "."))
    assert loop is None, " -> ".join(loop)


def test_no_two_packages_import_each_other():
    """The package-level graph (an edge where any module of one imports one of the other) has
    no loop, so the parts stack in one order."""
    packages: dict[str, set[str]] = {}
    for mod, deps in graph().items():
        if part(mod) is None:  # jetspec_jax/__init__.py
            continue
        packages.setdefault(part(mod), set()).update(
            part(d) for d in deps if part(d) not in (part(mod), None, "options"))
    loop = find_cycle(packages)
    assert loop is None, " -> ".join(map(str, loop))


def test_the_core_never_imports_the_lab():
    """The lab's heads plug in by registration (`lab/__init__.py`); nothing in jetspec_jax or
    pallas_kernels names `lab`."""
    wrong = []
    for pkg in ("jetspec_jax", "pallas_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                wrong += [f"{path.relative_to(ROOT)} -> {n}" for n in names
                          if n == "lab" or n.startswith("lab.")]
    assert not wrong, wrong
