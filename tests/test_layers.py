"""The layers point one way: mpcache_jax (eviction core) <- models <- runtime <- experiments.
Every import in a package's files, at module or function level, is read from the source, and
so is every module a file names to start as a process (`python -m pkg.mod`); inside runtime/
no two modules import each other, directly or through others."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("mpcache_jax", "models", "runtime", "experiments")
# A module a string names to start: "-m pkg.mod ..." or "python -m pkg.mod ...", or the whole
# string "pkg.mod" (as in [sys.executable, "-m", "pkg.mod"]); prose that mentions a command
# ("make one with `python -m pkg.mod`") is not a start.
STARTED = re.compile(r"^(?:\S+\s+)?-m\s+([A-Za-z_]\w*)\.|^([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+$")


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file, nested ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def started_packages(path: pathlib.Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every module a file's strings name to start as a process
    ("-m pkg.mod", or "pkg.mod" alone); docstrings are left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {(m.group(1) or m.group(2), node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings for m in STARTED.finditer(node.value)}


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_layer_imports_a_higher_one(layer):
    higher = set(LAYERS[LAYERS.index(layer) + 1:])
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}/"
    upward = [f"{path.relative_to(ROOT)}:{line} imports {package}"
              for path in files for package, line in sorted(imported_packages(path))
              if package in higher]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_layer_starts_a_module_of_a_higher_one(layer):
    higher = set(LAYERS[LAYERS.index(layer) + 1:])
    upward = [f"{path.relative_to(ROOT)}:{line} starts a module of {package}"
              for path in sorted((ROOT / layer).rglob("*.py"))
              for package, line in sorted(started_packages(path)) if package in higher]
    assert not upward, "\n".join(upward)


def test_no_import_circle_inside_runtime():
    """Every module of runtime/ -> the modules of runtime/ it imports (at any level); no path
    leads from a module back to itself."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "runtime").rglob("*.py")}

    def home(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None
    graph = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = {home(n) for n in names} - {None, module}
    state: dict[str, str] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_scan_sees_nested_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import os\n\ndef f():\n    from runtime.mpc import secure\n"
                      "    import models.registry as r\n")
    assert imported_packages(source) == {("os", 1), ("runtime", 4), ("models", 5)}


def test_the_scan_sees_modules_started_as_processes(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('"""Run `python -m experiments.party`."""\nimport sys\n'
                      'CMD = [sys.executable, "-m", "experiments.party"]\n'
                      'LINE = "python -m experiments.run --flagfile=x"\n'
                      'PATH = "experiments/nodes/3pc_aby3.json"\n'
                      'HINT = "make one with `python -m experiments.prefixkv_calibrate`"\n'
                      'def f():\n    """-m experiments.party"""\n    return "results.jsonl"\n')
    assert started_packages(source) == {("experiments", 3), ("experiments", 4),
                                        ("results", 9)}
