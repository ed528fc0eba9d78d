"""The layering of composer/ holds: pyproject.toml's import-linter contracts (the layers, and who may import the
generator, the server, the web stack), at most 5 imports from a lower layer to a higher one and at most 3 cycles
between packages (benchmarks/imports.py measures both with grimp), and the rules of the house the contracts cannot
state (models never import torch.distributed; optional heavy dependencies are imported inside the code that needs
them)."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "composer"

pytest.importorskip("importlinter", reason="import-linter is a dev dependency: pip install -e '.[dev]'")


def _imports_script():
    spec = importlib.util.spec_from_file_location("composer_bench_imports", REPO / "benchmarks" / "imports.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _pending_imports() -> set[tuple[str, str]]:
    """The imports the contracts still ignore (each names the edit that removes it), composer's own only."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    pending = set()
    for contract in config["contracts"]:
        for entry in contract.get("ignore_imports", []):
            importer, imported = (part.strip() for part in entry.split("->"))
            if imported.startswith("composer"):
                pending.add((importer, imported))
    return pending


def test_the_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")  # the venv's, beside its python
    run = subprocess.run([str(lint) if lint.exists() else shutil.which("lint-imports") or "lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_at_most_5_up_imports_and_3_cycles_between_packages():
    imports = _imports_script()
    layers = imports.read_layers()
    graph = imports.build_graph()
    report = imports.measure(graph, layers)
    listed = "\n".join(f"{u['importer']} -> {u['imported']} (l.{u['lines']})" for u in report.up_imports)
    assert not report.up_imports, f"{len(report.up_imports)} imports go up a layer:\n{listed}"
    # every up-import is one the layers contract names (with the edit that removes it)
    assert {(u["importer"], u["imported"]) for u in report.up_imports} <= _pending_imports(), listed
    # cycles: without the imports the contracts name as pending edits, at most 3 between units (packages and the
    # modules pyproject.toml lists: self-registering configs, the num_gpus workers' generator, TextPipeline on
    # ComposedPipeline), and none between the modules of one package
    for importer, imported in _pending_imports():
        if graph.direct_import_exists(importer=importer, imported=imported):
            graph.remove_import(importer=importer, imported=imported)
    after = imports.measure(graph, layers)
    cycles = "\n".join(f"{c['downstream']} -> {c['upstream']}: {c['imports']}" for c in after.unit_cycles)
    assert len(after.unit_cycles) <= 3, f"{len(after.unit_cycles)} cycles between packages:\n{cycles}"
    inside = "\n".join(f"{c['downstream']} -> {c['upstream']}" for c in after.package_cycles)
    assert not after.package_cycles, f"{len(after.package_cycles)} cycles inside packages:\n{inside}"


def test_the_measure_sees_lazy_imports_and_layers():
    """benchmarks/imports.py counts an import inside a function as one at module level, by the layer table."""
    import grimp

    imports = _imports_script()
    graph = grimp.ImportGraph()
    for name in ("composer", "composer.low", "composer.high", "composer.mid"):
        graph.add_module(name)
    graph.add_import(importer="composer.low", imported="composer.high", line_number=12, line_contents="import x")
    graph.add_import(importer="composer.high", imported="composer.low", line_number=3, line_contents="import y")
    graph.add_import(importer="composer.mid", imported="composer.low", line_number=5, line_contents="import z")
    report = imports.measure(graph, [["composer.low"], ["composer.mid"], ["composer.high"]])
    assert [(u["importer"], u["imported"], u["lines"]) for u in report.up_imports] == [
        ("composer.low", "composer.high", [12])]
    assert len(report.unit_cycles) == 1


def _module_files(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def test_models_never_import_torch_distributed():
    """Parallel strategies wrap the models' Attention and linears (composer/parallel/, applied by the parallel
    hook); the models themselves never import torch.distributed, at module level or inside a function."""
    found = [f"{path.relative_to(REPO)}:{node.lineno}"
             for path, tree in _module_files(PACKAGE / "models") for node in ast.walk(tree)
             if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in _imported(node))]
    assert not found, found


@pytest.mark.parametrize("dependency", ["flash_attn", "flash_attn_interface", "torchao"])
def test_optional_heavy_dependencies_are_imported_inside_the_code_that_needs_them(dependency):
    at_module_level = []
    for path, tree in _module_files(PACKAGE):
        stack = list(tree.body)  # what runs at import: module level, class bodies, an `if` / `try` there
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if any(name.split(".")[0] == dependency for name in _imported(node)):
                at_module_level.append(f"{path.relative_to(REPO)}:{node.lineno}")
            stack.extend(ast.iter_child_nodes(node))
    assert not at_module_level, at_module_level


def test_the_quantize_modes_are_one_list():
    """loader/folder_settings.py holds the modes a quantized folder may state (the loader sits below runtime.py);
    RuntimeArgs' quantize knob offers the same."""
    from composer.loader.folder_settings import QUANTIZE_MODES
    from composer.runtime import QUANTIZE_MODES as RUNTIME_MODES

    assert QUANTIZE_MODES == RUNTIME_MODES
