"""Imports run one way, kernels <- model <- draft / decode <- io, train <- api <- serve, cli,
and no module imports itself back through others. Read from the source (no import), so a
function-level import counts as much as a top-level one."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what each part may import, beside itself and the JAX-free option tables (options.py)
MAY_IMPORT = {
    "kernels": set(),
    "model": {"kernels"},
    "draft": {"kernels", "model", "decode"},
    "decode": {"kernels", "model", "draft"},
    "io": {"model", "draft"},
    "train": {"model", "draft", "decode", "io"},
    "results": {"decode"},
    "costs": {"model", "decode"},
    "api": {"model", "draft", "decode", "io", "results", "costs"},
    "serve": {"api", "decode", "io"},
    "cli": {"api", "model", "decode", "io", "train", "serve"},
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


def test_no_module_imports_itself_back():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod, path):
        state[mod] = 1
        for dep in sorted(g[mod]):
            # a package's __init__ re-exporting its modules is not a loop through them
            if dep.startswith(mod + "."):
                continue
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(g):
        if mod not in state:
            visit(mod, [mod])


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
