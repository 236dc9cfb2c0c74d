"""The package's layers only point down, and no modules import each other in a circle.

The layers, lowest first (docs/architecture.md draws them): a module imports modules of its own
layer or of lower ones, never of a higher one, at module level or inside a function; imports only
for type checking (``if TYPE_CHECKING:``) are left out. Importing ``a.b.c`` imports ``a.b`` first,
so a package's ``__init__`` counts as imported too.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_canzona"

#: Top-level modules and subpackages of the package, by layer, lowest first.
LAYERS: list[set[str]] = [
    {"geometry"},  # how a matrix is cut into slices
    {"rules"},  # the per-matrix math and its cost
    {"planning"},  # pure planning
    {"simulation"},  # the device model and projections
    {"distributed"},  # the engine
    {"optim"},  # the optimizers users construct
    {  # the strategy's parts
        "checkpoint",
        "composition",
        "export",
        "huggingface",
        "launcher",
        "mesh",
        "metrics",
        "precision",
        "telemetry",
        "warning_filters",
    },
    {"strategy"},
    {""},  # lightning_canzona/__init__.py
    {"bench", "cli", "commands", "data", "models"},  # the tools and the bundled model
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement but those under ``if TYPE_CHECKING:``."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if not (node.module or "").startswith("lightning_canzona"):
                    continue
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets = [name if name in modules else node.module for name in names]
            else:
                targets = [a.name for a in node.names if a.name.startswith("lightning_canzona")]
            for target in targets:
                parts = target.split(".")
                for end in range(1, len(parts) + 1):  # the packages above it are imported first
                    imported = ".".join(parts[:end])
                    if imported in modules and imported != module and not module.startswith(imported + "."):
                        graph[module].add(imported)
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    (index,) = [i for i, layer in enumerate(LAYERS) if top in layer]
    return index


def test_every_module_has_a_layer() -> None:
    tops = {module.split(".")[1] if "." in module else "" for module in _modules()}
    assert tops == set().union(*LAYERS)


def test_layers_only_point_down() -> None:
    upward = [
        f"{module} imports {imported}"
        for module, imports in _import_graph().items()
        for imported in imports
        if _layer(imported) > _layer(module)
    ]
    assert not upward, upward


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _import_graph()
    done: set[str] = set()

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            found = circle_from(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(_modules()):
        circle = circle_from(module, [])
        assert circle is None, " -> ".join(circle)
