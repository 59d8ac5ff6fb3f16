"""Every import of a source tree (top-level, function-local and ``TYPE_CHECKING`` alike), checked against layers.

Used by tests/core/test_layers.py on the packages of this repository and on small fixture
trees that show each kind of violation is caught. Reads the source with :mod:`ast`; imports
nothing it checks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import statement: which module imports which, where."""

    importer: str
    imported: str
    file: Path
    line: int

    def where(self) -> str:
        """``path:line``, for messages."""
        return f"{self.file}:{self.line}"


def modules_of(roots: Iterable[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under each root (a ``src`` folder)."""
    found: dict[str, Path] = {}
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = file
    return found


def imports_of(modules: Mapping[str, Path]) -> list[Import]:
    """Every import of every module, resolved to the deepest module of ``modules`` it names (or kept as written).

    ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``; relative imports are resolved.
    """
    found: list[Import] = []
    for name, file in modules.items():
        is_package = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            for target in targets:
                resolved = _deepest(target, modules)
                if resolved != name:
                    found.append(Import(name, resolved, file, node.lineno))
    return found


def _deepest(target: str, modules: Mapping[str, Path]) -> str:
    probe = target
    while probe and probe not in modules:
        probe = probe.rpartition(".")[0]
    return probe or target


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]]) -> int | None:
    """Index of the layer whose prefixes match ``module`` most specifically.

    A prefix matches the module of that name and the modules below it; ``=name`` matches that module only
    (a package's ``__init__``, e.g. ``=epl`` for the facade, without claiming everything under it).
    """
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            exact = prefix.startswith("=")
            prefix = prefix.removeprefix("=")
            if module == prefix or (not exact and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def upward_imports(imports: Iterable[Import], layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """A line for each import from a layer into a higher one (both ends must be in some layer)."""
    problems = []
    for item in imports:
        low, high = layer_of(item.importer, layers), layer_of(item.imported, layers)
        if low is not None and high is not None and high > low:
            problems.append(
                f"{item.where()}: {item.importer} ({layers[low][0]}) imports {item.imported} ({layers[high][0]}), "
                "a higher layer"
            )
    return problems


def unlayered(modules: Iterable[str], prefix: str, layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Modules under ``prefix`` that no layer claims."""
    return sorted(m for m in modules if (m == prefix or m.startswith(prefix + ".")) and layer_of(m, layers) is None)


def cycles(imports: Iterable[Import], within: str) -> list[list[str]]:
    """The import cycles (strongly connected components of two or more modules) among modules under ``within``."""
    inside = lambda module: module == within or module.startswith(within + ".")  # noqa: E731
    graph: dict[str, set[str]] = {}
    for item in imports:
        if inside(item.importer) and inside(item.imported):
            graph.setdefault(item.importer, set()).add(item.imported)
            graph.setdefault(item.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def outside_api(imports: Iterable[Import], plugin_prefix: str, core: str, api: str) -> list[str]:
    """A line for each import by a module under ``plugin_prefix`` of a module of ``core`` other than ``api``.

    ``from epl.plugin_api import _private`` is caught by :func:`private_names` instead.
    """
    return [
        f"{item.where()}: {item.importer} imports {item.imported}; plugins import from {api} only"
        for item in imports
        if (item.importer == plugin_prefix or item.importer.startswith(plugin_prefix + "."))
        and (item.imported == core or item.imported.startswith(core + "."))
        and item.imported != api
    ]


def private_names(modules: Mapping[str, Path], plugin_prefix: str, core: str) -> list[str]:
    """A line for each ``from <core...> import _name`` in a module under ``plugin_prefix``."""
    problems = []
    for name, file in modules.items():
        if not (name == plugin_prefix or name.startswith(plugin_prefix + ".")):
            continue
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == core:
                problems += [
                    f"{file}:{node.lineno}: {name} imports the private name {alias.name} of {node.module}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    return problems
