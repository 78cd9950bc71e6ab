"""The floors rule of DESIGN.md, checked on the source (an AST walk, nothing imported): no import cycle among
the modules of src/tidal at module level, and no two modules that import each other at all (imports for
type checkers only do not count: they never run)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Pairs that import each other inside functions, left as they were (test-support code); do not add to it.
KNOWN_MUTUAL = {
    ("tidal.testing.random_models", "tidal.testing.tiny"),
    ("tidal.testing.templates", "tidal.testing.tiny"),
}


def module_names(src: Path) -> dict[str, Path]:
    names = {}
    for path in sorted((src / "tidal").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported(tree: ast.Module, known: set[str], module_level: bool) -> set[str]:
    """The tidal modules a module imports: at module level only, or anywhere (never under `if TYPE_CHECKING`).

    `from a.b import c` counts as importing `a.b`, and `a.b.c` too when that is a module."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        if module_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):  # never runs
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & known


def import_graph(src: Path, module_level: bool) -> dict[str, set[str]]:
    names = module_names(src)
    known = set(names)
    return {
        name: imported(ast.parse(path.read_text()), known, module_level) - {name}
        for name, path in names.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def mutual_pairs(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ())}


def test_no_module_level_import_cycle() -> None:
    cycle = find_cycle(import_graph(SRC, module_level=True))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_two_modules_import_each_other() -> None:
    pairs = mutual_pairs(import_graph(SRC, module_level=False)) - KNOWN_MUTUAL
    assert not pairs, f"modules that import each other (also inside functions): {sorted(pairs)}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        (
            "tidal.eval",
            "tidal.orchestrator",
        ),  # both use tidal.rollout; the orchestrator's online eval uses eval
        ("tidal.rollout", "tidal.orchestrator"),
        ("tidal.rollout", "tidal.eval"),
        ("tidal.envs", "tidal.orchestrator"),
        ("tidal.envs", "tidal.eval"),
    ],
)
def test_layers_import_downwards_only(package: str, forbidden: str) -> None:
    graph = import_graph(SRC, module_level=False)
    inside = lambda name, prefix: name == prefix or name.startswith(prefix + ".")  # noqa: E731
    wrong = sorted(
        (name, dep)
        for name, deps in graph.items()
        if inside(name, package)
        for dep in deps
        if inside(dep, forbidden)
    )
    assert not wrong, f"{package} must not import {forbidden}: {wrong}"


@pytest.mark.parametrize(
    ("sources", "expect_cycle"),
    [
        ({"a": "import tidal.b", "b": "from tidal.c import x", "c": "from tidal import a"}, True),
        ({"a": "import tidal.b", "b": "def f():\n    import tidal.a", "c": ""}, False),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tidal.b",
                "b": "import tidal.a",
            },
            False,
        ),
        ({"a": "import tidal.b", "b": "try:\n    import tidal.a\nexcept ImportError:\n    pass"}, True),
    ],
    ids=["three-module-cycle", "function-level-only", "type-checking-only", "under-try"],
)
def test_the_walk_finds_cycles(tmp_path: Path, sources: dict[str, str], expect_cycle: bool) -> None:
    package = tmp_path / "tidal"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text + "\n")
    assert (find_cycle(import_graph(tmp_path, module_level=True)) is not None) is expect_cycle


def test_mutual_imports_inside_functions_are_found(tmp_path: Path) -> None:
    package = tmp_path / "tidal"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from tidal.b import x\n")
    (package / "b.py").write_text("def f():\n    from tidal.a import y\n")
    assert mutual_pairs(import_graph(tmp_path, module_level=False)) == {("tidal.a", "tidal.b")}
