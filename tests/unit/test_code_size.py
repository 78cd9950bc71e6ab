"""The size limits of issue 35, checked on the source (an AST walk of src/tidal, nothing imported).

Fails listing every class with more than `MAX_METHODS` methods and every function (or method) longer than
`MAX_LINES` lines. A class that outgrows the limit mixes jobs that want classes of their own; a function
that does, steps that want names. Methods are the `def`s directly in a class body (properties and static
methods included, a nested class's not); a function's length is `end_lineno - lineno + 1` of its `def`
node (its decorators not counted, its docstring and comments counted), nested functions counted on their
own and as part of the function around them.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"
MAX_METHODS = 25
MAX_LINES = 60

Function = ast.FunctionDef | ast.AsyncFunctionDef


def oversized(src: Path) -> list[str]:
    """`path:line Class has N methods` and `path:line function is N lines`, for every file under `src`."""
    problems = []
    for path in sorted(src.rglob("*.py")):
        where = path.relative_to(src.parent)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, Function) for item in node.body)
                if methods > MAX_METHODS:
                    problems.append(f"{where}:{node.lineno} class {node.name} has {methods} methods")
            elif isinstance(node, Function):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    problems.append(f"{where}:{node.lineno} {node.name} is {lines} lines")
    return problems


def test_no_class_or_function_is_too_large() -> None:
    problems = oversized(SRC)
    assert not problems, (
        f"{len(problems)} over the limits ({MAX_METHODS} methods a class, {MAX_LINES} lines a function):\n"
        + "\n".join(problems)
    )


def test_the_walk_counts_methods_and_lines(tmp_path: Path) -> None:
    package = tmp_path / "tidal"
    package.mkdir()
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_METHODS + 1))
    body = "".join("    x = 1\n" for _ in range(MAX_LINES - 1))  # with the `def` line: at the limit
    (package / "a.py").write_text(
        f"class Big:\n{methods}\nclass Fine:\n    def m(self):\n        pass\n\n"
        f"def at_limit():\n{body}\ndef over():\n{body}    x = 2\n"
    )
    assert oversized(package) == [
        f"tidal/a.py:1 class Big has {MAX_METHODS + 1} methods",
        f"tidal/a.py:{2 * MAX_METHODS + 10 + MAX_LINES} over is {MAX_LINES + 1} lines",
    ]
