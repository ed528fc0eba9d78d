"""composer's import graph against its layers: the imports that go up a layer, and the import cycles.

The layers are the `layers` contract in pyproject.toml's [tool.importlinter] (high to low; `lint-imports` checks
them, docs/architecture.md draws them). A *unit* is an entry of that list (a package, or a module where a
package holds modules of several layers); a module that no entry covers belongs to its top-level package.
The graph is grimp's: every `import` statement in composer/, those at module level and those inside functions
(lazy imports) alike, and those under `if TYPE_CHECKING:` too.

- An up-import is an (importer, imported) pair of modules whose importer sits in a lower layer than what it
  imports. Both raw counts are printed: the contract's `ignore_imports` (the known ones, each with why) do not
  hide anything here.
- A cycle is one dependency that has to go for the graph to be acyclic, as grimp nominates them (import-linter's
  `acyclic_siblings` reports the same): first between units (packages and listed modules), then between the
  modules of one package, for each package inside a unit.

    python benchmarks/imports.py                 # the counts, each up-import and cycle listed
    python benchmarks/imports.py --json          # the same as JSON
    python benchmarks/imports.py --source /tmp/old   # another checkout's composer/ (e.g. `git archive`d), measured
                                                     # against this checkout's layers
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
ROOT = "composer"


@dataclass
class Report:
    up_imports: list[dict] = field(default_factory=list)  # importer, imported, lines, layers
    unit_cycles: list[dict] = field(default_factory=list)  # downstream, upstream (units), imports
    package_cycles: list[dict] = field(default_factory=list)  # package, downstream, upstream (modules), imports

    @property
    def cycles(self) -> list[dict]:
        return self.unit_cycles + self.package_cycles

    def as_dict(self) -> dict:
        return {"up_imports": len(self.up_imports), "cycles": len(self.cycles), "up_import_list": self.up_imports,
                "unit_cycles": self.unit_cycles, "package_cycles": self.package_cycles}


def read_layers(pyproject: Path = REPO / "pyproject.toml") -> list[list[str]]:
    """The layers contract's layers, low to high, each a list of its units."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    layers = []
    for entry in contract["layers"]:
        sep = ":" if ":" in entry else "|"
        layers.append([name.strip() for name in entry.split(sep)])
    return layers[::-1]


def build_graph(source: Path | None = None) -> grimp.ImportGraph:
    if source is not None:
        sys.path.insert(0, str(source))
    try:
        return grimp.build_graph(ROOT, cache_dir=None)
    finally:
        if source is not None:
            sys.path.remove(str(source))


class Units:
    """Module -> its unit and that unit's layer (low = 0)."""

    def __init__(self, layers: list[list[str]]):
        self.layer_of = {unit: i for i, layer in enumerate(layers) for unit in layer}

    def unit(self, module: str) -> str:
        parts = module.split(".")
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in self.layer_of:
                return name
        return ".".join(parts[:2])

    def layer(self, module: str) -> int | None:
        return self.layer_of.get(self.unit(module))


def _lines(graph: grimp.ImportGraph, importer: str, imported: str) -> list[int]:
    return sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})


def _components(edges) -> list[set[str]]:
    """The strongly connected components of a directed graph given by its edges, those of two names or more."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)

    for name in sorted(succ):
        if name not in index:
            visit(name)
    return found


def _breakers(edges: dict[tuple[str, str], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """The edges of a small graph of names whose removal leaves it acyclic, as grimp nominates them, one strongly
    connected component at a time (so that only edges on a cycle are named)."""
    chosen = []
    for component in _components(edges):
        inside = sorted(edge for edge in edges if edge[0] in component and edge[1] in component)
        names = sorted(component)
        index = {name: f"g.n{i}" for i, name in enumerate(names)}
        back = {v: k for k, v in index.items()}
        graph = grimp.ImportGraph()
        graph.add_module("g")
        for name in names:
            graph.add_module(index[name])
        for a, b in inside:
            graph.add_import(importer=index[a], imported=index[b])
        chosen += [(back[a], back[b]) for a, b in graph.nominate_cycle_breakers("g")]
    return sorted(chosen)


def measure(graph: grimp.ImportGraph, layers: list[list[str]]) -> Report:
    units = Units(layers)
    report = Report()
    unit_edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for importer in sorted(graph.modules):
        if not importer.startswith(ROOT):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if not imported.startswith(ROOT):
                continue
            low, high = units.layer(importer), units.layer(imported)
            if low is not None and high is not None and low < high:
                report.up_imports.append({"importer": importer, "imported": imported,
                                          "lines": _lines(graph, importer, imported),
                                          "from_unit": units.unit(importer), "to_unit": units.unit(imported)})
            a, b = units.unit(importer), units.unit(imported)
            if a != b and ROOT not in (a, b):  # (the root package's lazy re-exports are the public API)
                unit_edges.setdefault((a, b), []).append((importer, imported))
    for a, b in _breakers(unit_edges):
        report.unit_cycles.append({"downstream": a, "upstream": b, "imports": [
            f"{i} -> {j} (l.{', '.join(map(str, _lines(graph, i, j)))})" for i, j in unit_edges[(a, b)]]})
    # the modules of each package inside one unit
    for package in sorted(m for m in graph.modules if m.startswith(ROOT) and len(graph.find_children(m)) >= 2):
        if package == ROOT:
            continue  # its children are units, counted above
        if any(units.unit(child) != units.unit(package) for child in graph.find_children(package)):
            continue  # a package split across units (its modules are units themselves)
        depth = package.count(".") + 2
        edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for importer in graph.find_descendants(package):
            for imported in graph.find_modules_directly_imported_by(importer):
                if not imported.startswith(package + "."):
                    continue
                a, b = (".".join(m.split(".")[:depth]) for m in (importer, imported))
                if a != b:
                    edges.setdefault((a, b), []).append((importer, imported))
        for a, b in _breakers(edges):
            report.package_cycles.append({"package": package, "downstream": a, "upstream": b, "imports": [
                f"{i} -> {j} (l.{', '.join(map(str, _lines(graph, i, j)))})" for i, j in sorted(edges[(a, b)])]})
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--source", type=Path, help="a folder holding another composer/ to measure")
    args = parser.parse_args(argv)
    report = measure(build_graph(args.source), read_layers())
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    print(f"{len(report.up_imports)} up-imports (module pairs, lower layer -> higher; module-level and lazy imports)")
    for up in report.up_imports:
        print(f"  {up['importer']} -> {up['imported']} (l.{', '.join(map(str, up['lines']))})"
              f"   [{up['from_unit']} below {up['to_unit']}]")
    print(f"{len(report.cycles)} cycles ({len(report.unit_cycles)} between units, "
          f"{len(report.package_cycles)} between the modules of a package): the dependencies to remove")
    for cycle in report.unit_cycles:
        print(f"  {cycle['downstream']} -> {cycle['upstream']}: {'; '.join(cycle['imports'])}")
    for cycle in report.package_cycles:
        print(f"  in {cycle['package']}: {cycle['downstream']} -> {cycle['upstream']}: {'; '.join(cycle['imports'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
