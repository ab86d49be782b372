"""The machinery under the scripts is a stack: utils/' modules import each other without a cycle, and none imports
another inside a function (the usual way to hide a cycle). Imports under `if TYPE_CHECKING:` do not run, so they do
not count."""

from __future__ import annotations

import ast

from conftest import REPO


def runtime_imports() -> dict[str, dict[str, list[int]]]:
    """module -> {imported utils module: [lines]}, of utils/*.py (`__init__` is utils itself); with a function-level
    import's line negated."""
    graph = {}
    for path in sorted((REPO / "utils").glob("*.py")):
        tree, found = ast.parse(path.read_text()), {}

        def visit(node, in_function: bool, found: dict = found) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "utils":
                name = node.module.split(".")[1] if "." in node.module else "__init__"
                found.setdefault(name, []).append(-node.lineno if in_function else node.lineno)
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for child in ast.iter_child_nodes(node):
                visit(child, inner, found)

        visit(tree, False)
        found.pop(path.stem, None)
        graph[path.stem] = found
    return graph


def cycle(graph: dict[str, dict]) -> list[str] | None:
    """One import cycle of the graph (its modules in order), or None."""
    state = {}

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for nxt in graph.get(module, {}):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt, [*path, nxt])):
                return found
        state[module] = "done"
        return None

    return next((c for m in graph if m not in state and (c := walk(m, [m]))), None)


def test_utils_modules_import_each_other_without_a_cycle():
    assert cycle(runtime_imports()) is None, f"import cycle: {' -> '.join(cycle(runtime_imports()))}"


def test_no_utils_module_imports_another_inside_a_function():
    inside = {(m, name): lines for m, imports in runtime_imports().items() for name, lines in imports.items()
              if any(line < 0 for line in lines)}
    assert not inside, f"function-level imports of utils modules (module, imported): {inside}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b": [1]}, "b": {"c": [1]}, "c": {"a": [1]}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b": [1]}, "b": {}}) is None
