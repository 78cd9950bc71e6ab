"""The floors of DESIGN.md, checked on the source (an AST walk of src/tidal, nothing imported).

Fails listing (a) every import that goes up a floor (`tidal.layers.FLOORS`), (b) every import cycle between
modules (strongly connected components of the module graph), and every cycle between the top-level packages
(two packages of one floor may use each other one way only), (c) every import of `tidal.testing` from
production code. Every import counts: at module level, inside functions, under `try`, and under
`if TYPE_CHECKING:` too (a type-only import still ties the two modules' meanings together, and the rule is
simpler to keep with no exemption). A package's `__init__` is a module like any other: what it re-exports
are its imports.

`from a.b import c` counts as importing `a.b` (its `__init__` runs) and, when `a.b.c` is a module, `a.b.c`;
`import a.b.c` counts as importing `a.b.c`. The parents a dotted import initialises on the way are not
counted: a package `__init__` that re-exports its own submodules would otherwise be in a cycle with each.
"""

import ast
from pathlib import Path

import pytest

from tidal.layers import FLOORS, TESTING, floor_of

SRC = Path(__file__).resolve().parents[2] / "src"


def module_names(src: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under src/tidal (`tidal.x` for `tidal/x/__init__.py`)."""
    names = {}
    for path in sorted((src / "tidal").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a plain module's `.` is its package
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The tidal modules `module` imports anywhere in its file (see the module docstring for what counts)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return (found & known) - {module}


def import_graph(src: Path) -> dict[str, set[str]]:
    names = module_names(src)
    known = set(names)
    return {name: imported(name, path, known) for name, path in names.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def top_level(module: str) -> str:
    """The key of `module` in `tidal.layers.FLOORS`: `tidal.inference.client` -> `inference`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto top-level modules and packages (imports within one package dropped)."""
    folded: dict[str, set[str]] = {top_level(name): set() for name in graph}
    for name, deps in graph.items():
        folded[top_level(name)].update(top_level(dep) for dep in deps if top_level(dep) != top_level(name))
    return folded


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} (floor {floor_of(name)}) -> {dep} (floor {floor_of(dep)})"
        for name, deps in graph.items()
        for dep in deps
        if floor_of(dep) > floor_of(name)
    )


def imports_of_testing(graph: dict[str, set[str]]) -> list[str]:
    def in_testing(name: str) -> bool:
        return name == "tidal.testing" or name.startswith("tidal.testing.")

    return sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if not in_testing(name)
        for dep in deps
        if in_testing(dep)
    )


def test_every_top_level_module_has_a_floor() -> None:
    top = {top_level(name) for name in module_names(SRC)}
    assert not top - set(FLOORS), f"give these a floor in tidal/layers.py: {sorted(top - set(FLOORS))}"
    assert not set(FLOORS) - top, f"floors of modules that no longer exist: {sorted(set(FLOORS) - top)}"
    assert FLOORS["testing"] == TESTING == max(FLOORS.values())


def test_floors() -> None:
    graph = import_graph(SRC)
    problems = [f"up a floor: {line}" for line in upward_imports(graph)]
    problems += [f"cycle: {' <-> '.join(component)}" for component in strongly_connected(graph)]
    problems += [
        f"cycle between packages: {' <-> '.join(component)}"
        for component in strongly_connected(package_graph(graph))
    ]
    problems += [f"production code imports tidal.testing: {line}" for line in imports_of_testing(graph)]
    assert not problems, f"{len(problems)} import violations:\n" + "\n".join(problems)


def test_eval_and_orchestrator_stay_apart() -> None:
    """Same floor, but one way only: the orchestrator's online eval uses eval; both use tidal.rollout."""
    graph = import_graph(SRC)
    wrong = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name.startswith("tidal.eval")
        for dep in deps
        if dep.startswith("tidal.orchestrator")
    )
    assert not wrong, wrong


def _package(tmp_path: Path, sources: dict[str, str]) -> Path:
    package = tmp_path / "tidal"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in sources.items():
        path = package / f"{name.replace('.', '/')}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("sources", "cycles"),
    [
        (
            {"a": "import tidal.b", "b": "from tidal.c import x", "c": "from tidal import a"},
            [["tidal.a", "tidal.b", "tidal.c"]],
        ),
        ({"a": "import tidal.b", "b": "def f():\n    import tidal.a", "c": ""}, [["tidal.a", "tidal.b"]]),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tidal.b",
                "b": "import tidal.a",
            },
            [["tidal.a", "tidal.b"]],
        ),
        (
            {"a": "import tidal.b", "b": "try:\n    import tidal.a\nexcept ImportError:\n    pass"},
            [["tidal.a", "tidal.b"]],
        ),
        (
            {"p/__init__": "from tidal.p.q import x", "p/q": "from . import r", "p/r": "from .. import p"},
            [["tidal.p", "tidal.p.q", "tidal.p.r"]],
        ),
        ({"a": "import tidal.b", "b": "import json", "c": "from tidal import a, b"}, []),
    ],
    ids=["three-modules", "inside-a-function", "type-checking", "under-try", "relative-and-init", "no-cycle"],
)
def test_the_walk_finds_cycles(tmp_path: Path, sources: dict[str, str], cycles: list[list[str]]) -> None:
    assert strongly_connected(import_graph(_package(tmp_path, sources))) == cycles


def test_the_walk_finds_upward_and_imports_of_testing(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "types": "def f():\n    from tidal.config import x",
            "config/__init__": "from ..testing import tiny",
            "testing/__init__": "",
            "testing/tiny": "from tidal.cli import main",
            "cli": "import tidal.types",
        },
    )
    graph = import_graph(src)
    assert upward_imports(graph) == [
        "tidal.config (floor 2) -> tidal.testing (floor 9)",
        "tidal.config (floor 2) -> tidal.testing.tiny (floor 9)",
        "tidal.types (floor 1) -> tidal.config (floor 2)",
    ]
    assert imports_of_testing(graph) == [
        "tidal.config -> tidal.testing",
        "tidal.config -> tidal.testing.tiny",
    ]


def test_the_walk_finds_cycles_between_packages(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "envs/__init__": "",
            "envs/base": "from tidal.rollout.chat import x",
            "rollout/__init__": "",
            "rollout/chat": "import json",
            "rollout/guard": "from tidal.envs import base",
        },
    )
    graph = import_graph(src)
    assert strongly_connected(graph) == []
    assert strongly_connected(package_graph(graph)) == [["envs", "rollout"]]
