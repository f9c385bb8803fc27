"""The product's import graph has no cycle: not inside a package, not between them.

import-linter (``make lint``) keeps the layers (serve above gateway and worker,
shared below both); this test keeps each module's imports a DAG, so a module
can be read after the ones it imports. Module-level imports only, read from
the source (``TYPE_CHECKING`` blocks included; imports inside functions are
deliberate lazy imports and left out).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serve", "gateway", "worker", "shared")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports at module level."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # if TYPE_CHECKING: ...
            statements = node.body
        else:
            statements = [node]
        for statement in statements:
            if isinstance(statement, ast.Import):
                found |= {alias.name for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                found.add(statement.module)
                found |= {f"{statement.module}.{alias.name}" for alias in statement.names}
    return {name for name in found if name in modules}


def import_graph() -> networkx.DiGraph:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = networkx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        for imported in imports_of(path, set(files)):
            # A package's __init__ is not a dependency of its own modules' reading.
            if imported != name and not name.startswith(imported + "."):
                graph.add_edge(name, imported)
    return graph


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert graph.number_of_edges() > 100  # the graph was read, not empty
    cycles = list(networkx.simple_cycles(graph))
    assert cycles == [], cycles[:5]


def test_a_planted_cycle_is_found() -> None:
    graph = import_graph()
    graph.add_edge(
        "shared.protocol", "gateway.dispatch.pool"
    )  # gateway.dispatch.pool imports shared.protocol
    assert list(networkx.simple_cycles(graph))
