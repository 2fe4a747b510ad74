"""The layers point one way: mpcache_jax (eviction core) <- models <- runtime <- experiments.
Every import in a package's files, at module or function level, is read from the source."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("mpcache_jax", "models", "runtime", "experiments")


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file, nested ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_layer_imports_a_higher_one(layer):
    higher = set(LAYERS[LAYERS.index(layer) + 1:])
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}/"
    upward = [f"{path.relative_to(ROOT)}:{line} imports {package}"
              for path in files for package, line in sorted(imported_packages(path))
              if package in higher]
    assert not upward, "\n".join(upward)


def test_the_scan_sees_nested_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import os\n\ndef f():\n    from runtime.mpc import secure\n"
                      "    import models.registry as r\n")
    assert imported_packages(source) == {("os", 1), ("runtime", 4), ("models", 5)}
