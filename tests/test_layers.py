"""The folders are the layers, and imports point one way (a failure names the offending import)."""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Which layers a layer's modules may import (besides itself). The scheduler core and the
# simulation know nothing of models or caches; the engine drives a model but never a front end.
ALLOWED = {
    "core": set(),
    "cache": {"core"},
    "sim": {"core"},
    "models": {"core", "cache"},
    "engine": {"core", "cache", "models"},
    "entrypoints": {"core", "cache", "models", "engine", "sim"},
}
# The one import across: the planner turns gpu_memory_utilization / swap_space into block
# counts with the engine's own sizing arithmetic (lazily, only for a sweep in memory units).
EXCEPTIONS = {("jaxsched/sim/sweep.py", "jaxsched.engine")}
# Besides the standard library, what the core and the simulation may import.
CORE_THIRD_PARTY = {"jax", "jaxlib", "numpy", "flax"}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if rel[0] == "models" else rel[1]


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "jaxsched":
                for alias in node.names:       # `from jaxsched import core` is a layer import
                    yield node.lineno, f"jaxsched.{alias.name}"
            else:
                yield node.lineno, node.module


MODULES = sorted(p for p in list((ROOT / "jaxsched").glob("*/*.py")) + list((ROOT / "models").glob("*.py")))


def test_every_module_sits_in_a_layer():
    top = sorted(p.name for p in (ROOT / "jaxsched").glob("*.py"))
    assert top == ["__init__.py"], f"modules outside the layer folders: {top}"
    assert {_layer(p) for p in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    layer = _layer(path)
    stdlib = sys.stdlib_module_names
    for line, name in _imports(path):
        parts = name.split(".")
        if parts[0] == "jaxsched":
            target = parts[1] if len(parts) > 1 else "jaxsched"
            if (str(path.relative_to(ROOT)), f"jaxsched.{target}") in EXCEPTIONS:
                continue
            assert target == layer or target in ALLOWED[layer], \
                f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name}"
        elif parts[0] == "models":
            assert layer == "models" or "models" in ALLOWED[layer], \
                f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name}"
        elif layer in ("core", "sim") and parts[0] not in stdlib and parts[0] != "__future__":
            if layer == "sim" and parts[0] == "tqdm":     # the sweep's progress bar
                continue
            assert parts[0] in CORE_THIRD_PARTY, f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name}"
