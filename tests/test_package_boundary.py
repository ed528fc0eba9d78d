"""The installed package is the engine: it never imports the checkout's demo/ (the demo models' training and
scoring code), that code is not shipped, and the shipped demo model folders are whole package data."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_MODULES = {p.stem for p in (REPO / "demo").glob("*.py")} - {"__init__"}


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an `import`, a `from ... import` or an `importlib.import_module("...")` literal names."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append((node.lineno, node.args[0].value))
    return names


@pytest.fixture(scope="module")
def shipped() -> tuple[list[str], dict[str, list[str]]]:
    """The packages and package data setuptools builds the wheel from, read by setuptools itself."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    return sorted(dist.packages), dist.package_data


def test_no_engine_module_imports_the_demo_package():
    """`composer.demo` (the packaged models' lookup) is the engine's; the top-level `demo` is not."""
    offenders = []
    for source in sorted((REPO / "composer").rglob("*.py")):
        for line, name in _imported_names(ast.parse(source.read_text(), str(source))):
            if name == "demo" or name.startswith("demo."):
                offenders.append(f"{source.relative_to(REPO)}:{line} imports {name}")
    assert not offenders, "the engine must not import the checkout's demo/:\n" + "\n".join(offenders)


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_engine_works_when_the_demo_package_cannot_be_imported(tmp_path):
    """Import every composer module, build the CLI and resolve the embedded models by name with `demo` made
    unimportable, as it is for a user of the installed wheel: the engine needs nothing from it at run time."""
    script = """
import importlib, importlib.abc, pkgutil, sys

class NoDemo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "demo" or name.startswith("demo."):
            raise ImportError(f"the engine imported {name}")

sys.meta_path.insert(0, NoDemo())
import composer
for module in pkgutil.walk_packages(composer.__path__, "composer."):
    importlib.import_module(module.name)
from composer.cli.main import build_parser
from composer.default_model import default_model_path
from composer.loader.resolve import resolve_model_path

build_parser()
assert resolve_model_path("shapes-causal").name == "shapes-causal"
assert resolve_model_path("composer/shapes-t2v") == default_model_path()
assert not [m for m in sys.modules if m == "demo" or m.startswith("demo.")]
print("engine ok")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "engine ok" in run.stdout, run.stderr[-3000:]


def test_wheel_ships_the_engine_and_no_training_code(shipped):
    packages, _ = shipped
    assert "composer" in packages and "composer.demo" in packages
    assert all(p == "composer" or p.startswith("composer.") for p in packages), packages
    modules = [path for p in packages for path in (REPO / p.replace(".", "/")).glob("*.py")]
    assert modules and not [m for m in modules if m.stem in DEMO_MODULES], "a demo/ module is shipped"
    # Training code, wherever it hides: nothing shipped steps an optimiser or calls backward().
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("backward", "optim"), f"{module.relative_to(REPO)}:{node.lineno}: {node.attr}"


def test_wheel_ships_every_file_of_the_embedded_models(shipped):
    """The folders `--model-path shapes-t2v` and the default model resolve to are whole package data."""
    _, package_data = shipped
    base = REPO / "composer" / "demo"
    packed = {f for pattern in package_data["composer.demo"] for f in base.glob(pattern)}  # as setuptools globs
    for name in ("shapes-t2v", "shapes-causal"):
        files = {f for f in (base / "models" / name).rglob("*") if f.is_file()}
        assert base / "models" / name / "model_index.json" in files
        missed = sorted(str(f.relative_to(base)) for f in files - packed)
        assert not missed, f"not in the wheel's package data: {missed}"
