"""The package's layers only point down, and no modules import each other in a circle.

The layers, lowest first (`layers.LAYERS`; docs/architecture.md draws them): a module imports
modules of its own layer or of lower ones, never of a higher one, at module level, inside a
function or only for type checking (``if TYPE_CHECKING:``: an annotation names what the module
needs all the same). Importing ``a.b.c`` imports ``a.b`` first, so a package's ``__init__`` counts
as imported too.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from layers import LAYERS

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_canzona"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement, those under ``if TYPE_CHECKING:`` and inside functions too."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text())):
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


#: Private names of other libraries that a module may use outside `compat`: public in fact.
PUBLIC_IN_FACT = {"_exit"}  # os._exit


def _own_private_names(tree: ast.AST) -> set[str]:
    """The ``_`` names that a module defines: functions, classes, and attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_private_names_of_other_modules_and_libraries_are_reached_through_compat_only() -> None:
    """No module reads another module's ``_`` names, nor a library's outside `compat`: a
    subclass's own (``self._x``, ``super()._x``) and the module's own definitions excepted."""
    found = []
    for module, path in _modules().items():
        if module == "lightning_canzona.compat":
            continue
        tree = ast.parse(path.read_text())
        own = _own_private_names(tree) | PUBLIC_IN_FACT
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(alias.name for alias in node.names)]
                if any(_private(part) for name in names for part in name.split(".")):
                    found.append(f"{module}:{node.lineno} imports from {node.module}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue  # a subclass's own surface (Lightning's strategy and launcher hooks)
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                    continue
                found.append(f"{module}:{node.lineno} reads .{node.attr}")
    assert not found, found
