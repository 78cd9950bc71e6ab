"""The `swe` environment's repositories: small Python packages generated from function templates, each with
one seeded bug, visible tests that pass despite it, hidden tests that catch it, and a bug report that
describes the symptom, not the fix (pure: no I/O but `read_user_repos`).

A repository is a package `<name>/` with one module of three functions (one of them buggy), its
`__init__.py`, `tests/test_<module>.py` (unittest, standard library only) and a README. The hidden tests
(`hidden_tests`) are one unittest module the reward adds to a fresh copy of the repository after the
agent's changes; `run_hidden.py`'s last line reports how many passed.

A user's repositories come as a JSONL file, one per line: `{"id", "files": {path: text}, "statement",
"hidden_tests": {path: text}}` and optionally `"test_command"` (default `python -m unittest discover -s
tests -t .`); their reward is the share of the hidden tests' unittest cases that pass.
"""

import json
import random
import textwrap
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Bug:
    kind: str
    """off_by_one, wrong_condition or missing_case."""
    old: str
    """Text of the correct source that the bug replaces (once)."""
    new: str
    symptom: str
    """What a user saw: the bug report's body (a call, what it returned, what it should have)."""


@dataclass(frozen=True)
class FunctionTemplate:
    name: str
    source: str
    visible: tuple[str, ...]
    """Assertions the visible tests make (they pass with the bug)."""
    hidden: tuple[str, ...]
    """Assertions the hidden tests make (some fail with the bug)."""
    bugs: tuple[Bug, ...]


TEMPLATES: tuple[FunctionTemplate, ...] = (
    FunctionTemplate(
        "chunk",
        '''def chunk(items, size):
    """Split items into lists of `size` items; the last one may be shorter."""
    return [items[i : i + size] for i in range(0, len(items), size)]
''',
        ("chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]",),
        (
            "chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]",
            "chunk([], 3) == []",
            "chunk([1, 2, 3], 3) == [[1, 2, 3]]",
            "chunk([1, 2, 3, 4], 3) == [[1, 2, 3], [4]]",
        ),
        (
            Bug(
                "off_by_one",
                "range(0, len(items), size)",
                "range(0, len(items) - size + 1, size)",
                "chunk([1, 2, 3, 4, 5], 2) returns [[1, 2], [3, 4]]: the last, shorter chunk [5] is missing.",
            ),
        ),
    ),
    FunctionTemplate(
        "is_leap",
        '''def is_leap(year):
    """Whether `year` is a leap year of the Gregorian calendar."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''',
        ("is_leap(2024) is True", "is_leap(2023) is False"),
        (
            "is_leap(2000) is True",
            "is_leap(1900) is False",
            "is_leap(2024) is True",
            "is_leap(2023) is False",
            "is_leap(2400) is True",
        ),
        (
            Bug(
                "missing_case",
                "(year % 100 != 0 or year % 400 == 0)",
                "year % 100 != 0",
                "is_leap(2000) returns False, but 2000 was a leap year (so will 2400 be).",
            ),
        ),
    ),
    FunctionTemplate(
        "median",
        '''def median(values):
    """The median of a non-empty list of numbers."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
        ("median([3, 1, 2]) == 2",),
        (
            "median([1, 2, 3, 4]) == 2.5",
            "median([5, 1]) == 3",
            "median([3, 1, 2]) == 2",
            "median([7]) == 7",
            "median([4, 1, 3, 2, 6, 5]) == 3.5",
        ),
        (
            Bug(
                "off_by_one",
                "(ordered[middle - 1] + ordered[middle]) / 2",
                "(ordered[middle] + ordered[middle + 1]) / 2",
                "median([1, 2, 3, 4]) returns 3.5 instead of 2.5, and median([5, 1]) raises IndexError.",
            ),
        ),
    ),
    FunctionTemplate(
        "count_vowels",
        '''def count_vowels(text):
    """How many vowels (a, e, i, o, u) `text` holds, in either case."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''',
        ("count_vowels('banana') == 3",),
        (
            "count_vowels('ApplE') == 2",
            "count_vowels('AEIOU') == 5",
            "count_vowels('rhythm') == 0",
            "count_vowels('banana') == 3",
            "count_vowels('') == 0",
        ),
        (
            Bug(
                "missing_case",
                "text.lower()",
                "text",
                "count_vowels('ApplE') returns 0; it should count the capital A and E too (2).",
            ),
        ),
    ),
    FunctionTemplate(
        "clamp",
        '''def clamp(value, low, high):
    """`value` limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''',
        ("clamp(-5, 0, 10) == 0", "clamp(5, 0, 10) == 5"),
        (
            "clamp(15, 0, 10) == 10",
            "clamp(-5, 0, 10) == 0",
            "clamp(5, 0, 10) == 5",
            "clamp(10, 0, 10) == 10",
            "clamp(11, 0, 10) == 10",
        ),
        (
            Bug(
                "wrong_condition",
                "    if value > high:\n        return high",
                "    if value > high:\n        return low",
                "clamp(15, 0, 10) returns 0; a value above the range should come back as 10.",
            ),
        ),
    ),
    FunctionTemplate(
        "last_items",
        '''def last_items(items, n):
    """The last `n` items of a list (none for n = 0)."""
    if n <= 0:
        return []
    return items[-n:]
''',
        ("last_items([1, 2, 3], 2) == [2, 3]",),
        (
            "last_items([1, 2, 3], 0) == []",
            "last_items([1, 2, 3], 2) == [2, 3]",
            "last_items([1, 2], 5) == [1, 2]",
            "last_items([], 1) == []",
        ),
        (
            Bug(
                "missing_case",
                "    if n <= 0:\n        return []\n",
                "",
                "last_items([1, 2, 3], 0) returns [1, 2, 3]; asking for no items should give [].",
            ),
        ),
    ),
    FunctionTemplate(
        "running_total",
        '''def running_total(values):
    """Cumulative sums: running_total([1, 2, 3]) == [1, 3, 6]."""
    totals, total = [], 0
    for value in values:
        total += value
        totals.append(total)
    return totals
''',
        ("running_total([]) == []",),
        (
            "running_total([1, 2, 3]) == [1, 3, 6]",
            "running_total([]) == []",
            "running_total([5]) == [5]",
            "running_total([2, -2, 2]) == [2, 0, 2]",
        ),
        (
            Bug(
                "off_by_one",
                "for value in values:",
                "for value in values[1:]:",
                "running_total([1, 2, 3]) returns [2, 5]: the first value is left out of every total.",
            ),
        ),
    ),
    FunctionTemplate(
        "find_sorted",
        '''def find_sorted(items, target):
    """The index of `target` in the sorted list `items`, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
''',
        ("find_sorted([1, 3, 5], 3) == 1",),
        (
            "find_sorted([1, 3, 5], 5) == 2",
            "find_sorted([1, 3, 5], 1) == 0",
            "find_sorted([1, 3, 5], 4) == -1",
            "find_sorted([7], 7) == 0",
            "find_sorted([], 1) == -1",
        ),
        (
            Bug(
                "off_by_one",
                "while low <= high:",
                "while low < high:",
                "find_sorted([1, 3, 5], 5) returns -1 although 5 is at index 2.",
            ),
        ),
    ),
)
MODULES = ("utils", "helpers", "core", "tools", "basics")
PACKAGE_STEMS = (
    "acorn", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "indigo", "juniper",
    "kestrel", "lumen", "maple", "nimbus", "onyx", "pylon", "quartz", "ridge", "summit", "tundra",
)  # fmt: skip
PACKAGE_SUFFIXES = ("lib", "kit", "tools")
FUNCTIONS_PER_REPO = 3
HIDDEN_FILE = "tests/test_hidden.py"
RESULT_MARK = "TIDAL-HIDDEN-TESTS"
"""The hidden-test runner's last line: `<mark> <nonce> <passed> <total>`."""
TEST_COMMAND = "python -m unittest discover -s tests -t ."


@dataclass(frozen=True)
class Repo:
    repo_id: str
    files: dict[str, str]
    """Path (relative, '/'-separated) → text: what the agent starts from."""
    statement: str
    hidden_tests: dict[str, str]
    """Added to a fresh copy of the repository, after the agent's changes, to compute the reward."""
    fix: dict[str, str] = field(default_factory=dict)
    """The files a correct fix changes, as they should read (generated repositories: the demonstration)."""
    test_command: str = TEST_COMMAND


def generate_repo(index: int, seed: int = 0) -> Repo:
    """Repository `index` of the stream that `seed` draws (the same repository for the same pair)."""
    rng = random.Random(f"swe/{seed}/{index}")
    chosen = rng.sample(TEMPLATES, FUNCTIONS_PER_REPO)
    buggy = chosen[0]
    bug = rng.choice(buggy.bugs)
    rng.shuffle(chosen)
    package = rng.choice(PACKAGE_STEMS) + rng.choice(PACKAGE_SUFFIXES)
    module = rng.choice(MODULES)
    path = f"{package}/{module}.py"
    correct = _module_text(chosen)
    broken = correct.replace(buggy.source, buggy.source.replace(bug.old, bug.new, 1), 1)
    assert broken != correct, f"bug of {buggy.name} does not apply"
    names = [t.name for t in chosen]
    files = {
        f"{package}/__init__.py": f'"""{package}: small helpers."""\n',
        path: broken,
        "tests/__init__.py": "",
        f"tests/test_{module}.py": _test_module(
            package, module, names, [a for t in chosen for a in t.visible]
        ),
        "README.md": f"# {package}\n\nRun the tests with `{TEST_COMMAND}`.\n",
    }
    first_call = '<tool_call>{"name": "read_file", "arguments": {"path": "' + path + '"}}</tool_call>'
    statement = (
        f"Bug report for the repository in the current directory: {bug.symptom} Use the tools to fix the "
        f"code in {path}: first read it with {first_call}, then change it with write_file or str_replace, "
        f"run the tests with bash ({TEST_COMMAND}), and call submit."
    )
    hidden = [a for t in chosen for a in (t.hidden if t is buggy else t.hidden[:2])]
    others = sorted(t.name for t in chosen if t is not buggy)
    return Repo(
        repo_id=f"{package}.{module}:{buggy.name}:{bug.kind}+{'+'.join(others)}",  # what makes it this task
        files=files,
        statement=statement,
        hidden_tests={HIDDEN_FILE: _test_module(package, module, names, hidden)},
        fix={path: correct},
    )


def _module_text(templates: list[FunctionTemplate]) -> str:
    return '"""Helpers."""\n\n\n' + "\n\n".join(t.source for t in templates)


def _test_module(package: str, module: str, names: list[str], assertions: list[str]) -> str:
    methods = "\n".join(
        f"    def test_{number}(self):\n        self.assertTrue({assertion}, {assertion!r})\n"
        for number, assertion in enumerate(assertions)
    )
    return (
        f"import unittest\n\nfrom {package}.{module} import {', '.join(names)}\n\n\n"
        f"class Test{module.title()}(unittest.TestCase):\n{methods}\n\nif __name__ == '__main__':\n"
        "    unittest.main()\n"
    )


def hidden_runner(nonce: str, test_files: list[str]) -> str:
    """A script that runs the hidden test modules' unittest cases and prints, last, `RESULT_MARK nonce passed
    total` (a case whose module does not import counts as failed)."""
    modules = [path.removesuffix(".py").replace("/", ".") for path in test_files]
    return textwrap.dedent(
        f"""\
        import sys, unittest
        sys.path.insert(0, ".")
        loader, total, passed = unittest.TestLoader(), 0, 0
        for name in {modules!r}:
            suite = loader.loadTestsFromName(name)
            result = unittest.TestResult()
            suite.run(result)
            total += result.testsRun
            passed += result.testsRun - len(result.failures) - len(result.errors) - len(result.unexpectedSuccesses)
        print()
        print({RESULT_MARK!r}, {nonce!r}, passed, total)
        """
    )


def read_result(output: str, nonce: str) -> tuple[int, int] | None:
    """(passed, total) from the runner's output; None when its last line is missing (a crash, the timeout)."""
    lines = output.strip().splitlines()
    if not lines:
        return None
    parts = lines[-1].split()
    if len(parts) != 4 or parts[0] != RESULT_MARK or parts[1] != nonce:
        return None
    return int(parts[2]), int(parts[3])


def read_user_repos(path: str) -> list[Repo]:
    """A user's repositories (JSONL, see the module docstring); one-line errors name the file and line."""
    repos = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"swe: {where}: not JSON ({exc.msg})") from None
        missing = [k for k in ("id", "files", "statement", "hidden_tests") if k not in data]
        if missing:
            raise ValueError(f"swe: {where}: missing {', '.join(missing)}")
        for key in ("files", "hidden_tests"):
            if not isinstance(data[key], dict) or not all(isinstance(v, str) for v in data[key].values()):
                raise ValueError(f"swe: {where}: {key} must map paths to file texts")
            for name in data[key]:
                check_relative(name, where)
        repos.append(
            Repo(
                repo_id=str(data["id"]),
                files=dict(data["files"]),
                statement=str(data["statement"]),
                hidden_tests=dict(data["hidden_tests"]),
                test_command=str(data.get("test_command", TEST_COMMAND)),
            )
        )
    if not repos:
        raise ValueError(f"swe: {path} holds no repository")
    return repos


def check_relative(name: str, where: str) -> None:
    """A repository path must stay inside it: relative, no `..`."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"swe: {where}: path {name!r} must be relative and inside the repository")
