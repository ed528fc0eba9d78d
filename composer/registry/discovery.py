"""Find `EntryClass = X` (or `EntryClass = [X, Y]`) in a package's source files without importing them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EntryPoint:
    """A class a module exports through `EntryClass`, importable on demand."""

    class_name: str
    module: str
    source: str = field(default="", compare=False, repr=False)  # the .py file, read without importing

    def load(self) -> type:
        cls = getattr(importlib.import_module(self.module), self.class_name, None)
        if cls is None:
            raise ImportError(f"{self.module} declares EntryClass {self.class_name} but does not define it")
        return cls


def _entry_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if not any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in targets):
            continue
        value = node.value
        items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
        names += [item.id for item in items if isinstance(item, ast.Name)]
    return names


def declared_class_names(entry: EntryPoint) -> tuple[str, ...]:
    """The names a class answers to: its `class_names = (...)` attribute, read from source without importing,
    or its own name."""
    tree = ast.parse(Path(entry.source).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == entry.class_name:
            for stmt in node.body:
                targets = (
                    stmt.targets if isinstance(stmt, ast.Assign)
                    else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                )
                if any(isinstance(t, ast.Name) and t.id == "class_names" for t in targets):
                    return tuple(ast.literal_eval(stmt.value))
    return (entry.class_name,)


def discover_by_served_name(package: str) -> dict[str, EntryPoint]:
    """Map every name a discovered class serves (see `declared_class_names`) -> its entry point."""
    served: dict[str, EntryPoint] = {}
    for entry in discover_entry_classes(package).values():
        for name in declared_class_names(entry):
            if name in served and served[name] != entry:
                raise ImportError(f"class name {name} is served twice: {served[name]} and {entry}")
            served[name] = entry
    return served


def discover_entry_classes(package: str) -> dict[str, EntryPoint]:
    """Map class name -> EntryPoint for every `EntryClass` under `package` (e.g. "composer.models")."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package} is not a package")
    found: dict[str, EntryPoint] = {}
    for root in spec.submodule_search_locations:
        root_path = Path(root)
        for path in sorted(root_path.rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if "EntryClass" not in source:
                continue
            rel = path.relative_to(root_path).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            module = ".".join([package, *parts])
            for name in _entry_names(ast.parse(source, filename=str(path))):
                if name in found and found[name].module != module:
                    raise ImportError(f"EntryClass {name} is declared twice: {found[name].module} and {module}")
                found[name] = EntryPoint(name, module, str(path))
    return found
