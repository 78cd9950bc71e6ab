"""code: the model writes a Python function; the reward runs hidden unit tests on it in the sandbox.

The building block of SWE-style environments, kept small: single-turn, tasks from a JSON file (the
package's `data/code_tasks.json` by default: short function-writing tasks, each with its reference
solution and its tests). A test is a call and its expected result, `{"args": [...], "expected": ...}`.

Scoring, off the event loop (in a reward worker, `call_off_loop`): the code is the last fenced code block
(```python, ```py or ```) that defines the requested function, else the last fenced block, else the whole
answer (`extract_code`: real models follow the solution with a usage example in a block of its own, which
scored 0 when the last block was taken). It is run with a harness in `PythonSandbox` (bubblewrap where it
works): the harness loads it, calls the function on each test's arguments and reports each result as a JSON line on a file
descriptor of its own (what the code prints goes nowhere). The expected values never enter the sandbox:
the results are compared outside it, so code that forges reports gains nothing it did not compute. Tests
that had not reported when the timeout killed the run count as failed.

Splits (`split`): a task is held out when its id hashes into the held-out bucket (`tidal.envs.splits`): 3 of
the 18 shipped tasks (`fibonacci`, `gcd`, `to_binary`), the other 15 are trained on. Three tasks are too
few for a held-out score that means much (one task is a third of it): for one, give a larger `tasks_file`.

Reward: the fraction of the tests passed (`all_or_nothing = true`: 1 only when all pass). Metrics:
`code/fenced` (the code came from a fenced block), `code/compiled` (it loaded and defined the function),
`code/timed_out`, and `reward/tests_passed`.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.envs.base import Episode, SingleTurnEnv, Task, completion_text
from tidal.envs.code_gen import check_families, generate_task
from tidal.envs.reward_pool import call_off_loop
from tidal.envs.sandbox import PythonSandbox, announce, resolve_mode
from tidal.envs.splits import SplitTasks, check_split, in_split

TASKS_FILE = Path(__file__).with_name("data") / "code_tasks.json"
SYSTEM_PROMPT = "Write the requested Python function. Reply with its code in one ```python block."
REPORT_MARK = "@@tidal-test@@"
_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the sandbox; CODE, FUNCTION and CASES are prepended as literals. Reports go to a duplicate of the
# original stdout; the solution's own stdout and stderr are sent to /dev/null. Code that raises after defining
# the function is still tested: real models end a right function with a self-check of their own
# (Qwen2.5-Coder-0.5B: `check_run_length()`, whose assertion failed), which is not the answer.
_HARNESS = """
import json as _json, os as _os
_reports = _os.fdopen(_os.dup(1), "w")
_null = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_null, 1)
_os.dup2(_null, 2)


def _report(fields):
    _reports.write(MARK + _json.dumps(fields) + "\\n")
    _reports.flush()


def _why(exc):
    return (type(exc).__name__ + ": " + str(exc))[:200]


_solution = {"__name__": "solution"}
_failed = None
try:
    exec(compile(CODE, "solution.py", "exec"), _solution)
except BaseException as _exc:
    _failed = _why(_exc)
_function = _solution.get(FUNCTION)
if not callable(_function):
    _report({"loaded": False, "error": _failed or FUNCTION + " is not a function"})
    raise SystemExit(1)
_report({"loaded": True, "error": _failed})
for _case, _args in enumerate(CASES):
    try:
        _line = _json.dumps({"case": _case, "value": _function(*_args)})
    except BaseException as _exc:
        _line = _json.dumps({"case": _case, "error": _why(_exc)})
    _reports.write(MARK + _line + "\\n")
    _reports.flush()
"""


@dataclass(frozen=True)
class CodeTask:
    """A function to write and its hidden tests (`(args, expected)` pairs)."""

    id: str
    function: str
    prompt: str
    tests: list[tuple[list[Any], Any]]
    reference: str | None = None
    """A solution that passes the tests (optional: only demonstrations need it)."""


def load_tasks(path: Path) -> list[CodeTask]:
    """The tasks of a JSON file; a malformed one is a ValueError naming the file and the task."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read code tasks from {path}: {exc}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path} must hold a non-empty JSON list of tasks")
    tasks = []
    for index, item in enumerate(raw):
        try:
            tests = [(list(t["args"]), t["expected"]) for t in item["tests"]]
            reference = item.get("reference")
            tasks.append(
                CodeTask(
                    str(item["id"]),
                    str(item["function"]),
                    str(item["prompt"]),
                    tests,
                    None if reference is None else str(reference),
                )
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: task {index} lacks {exc} (id, function, prompt, tests)") from None
        if not tests:
            raise ValueError(f"{path}: task {item['id']!r} has no tests")
    return tasks


def extract_code(text: str, function: str | None = None) -> tuple[str, bool]:
    """(code, whether it was fenced): the last fenced block of a reply (```python, ```py or a bare ```) that
    defines `function`, else the last fenced block, else the whole reply (models often answer with bare
    code; prose then fails to compile)."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return text.strip(), False
    if function is not None:
        defines = re.compile(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(function)}[ \t]*\(", re.MULTILINE)
        defining = [block for block in blocks if defines.search(block)]
        if defining:
            return defining[-1], True
    return blocks[-1], True


def harness_script(code: str, function: str, cases: list[list[Any]]) -> str:
    """The program the sandbox runs: the harness with the solution, the function's name and the arguments."""
    header = (
        f"CODE = {code!r}\nFUNCTION = {function!r}\nMARK = {REPORT_MARK!r}\n"
        f"CASES = __import__('json').loads({json.dumps(cases)!r})\n"
    )
    return header + _HARNESS


def tests_reward(passed: int, total: int, all_or_nothing: bool) -> float:
    """The reward of `passed` of `total` hidden tests: their share, or with `all_or_nothing` 1 when all pass
    and 0 otherwise (the `code` and `swe` environments' rule)."""
    if all_or_nothing:
        return float(passed == total)
    return passed / total


@dataclass(frozen=True)
class TestReport:
    """What the hidden tests found: whether the code was fenced, whether it loaded, how many tests passed."""

    fenced: bool
    compiled: bool
    passed: int
    total: int
    timed_out: bool = False

    def reward(self, all_or_nothing: bool) -> float:
        return tests_reward(self.passed, self.total, all_or_nothing)

    def metrics(self) -> dict[str, float]:
        return {
            "code/fenced": float(self.fenced),
            "code/compiled": float(self.compiled),
            "code/timed_out": float(self.timed_out),
            "reward/tests_passed": self.passed / self.total,
        }


def read_reports(output: str) -> tuple[bool, dict[int, dict[str, Any]]]:
    """(whether the solution loaded, the first report of each test case) from the harness's output."""
    loaded = False
    cases: dict[int, dict[str, Any]] = {}
    for line in output.splitlines():
        if not line.startswith(REPORT_MARK):
            continue
        try:
            fields = json.loads(line[len(REPORT_MARK) :])
        except json.JSONDecodeError:
            continue  # a line cut by the output cap or the timeout
        if not isinstance(fields, dict):
            continue
        if "loaded" in fields:
            loaded = loaded or fields["loaded"] is True
        elif isinstance(fields.get("case"), int):
            cases.setdefault(fields["case"], fields)
    return loaded, cases


def same_value(value: Any, expected: Any) -> bool:
    """Equality after JSON: numbers within 1e-9 when either is a float, bools never equal to numbers,
    lists and objects compared element by element."""
    if isinstance(expected, bool) or isinstance(value, bool):
        return type(value) is type(expected) and value == expected
    if isinstance(expected, int | float) and isinstance(value, int | float):
        if isinstance(expected, float) or isinstance(value, float):
            return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-9)
        return value == expected
    if isinstance(expected, list) and isinstance(value, list):
        return len(value) == len(expected) and all(map(same_value, value, expected))
    if isinstance(expected, dict) and isinstance(value, dict):
        return value.keys() == expected.keys() and all(same_value(value[k], expected[k]) for k in expected)
    return type(value) is type(expected) and value == expected


def grade(
    output: str, tests: list[tuple[list[Any], Any]], timed_out: bool, fenced: bool = True
) -> TestReport:
    """The report of one harness run from its output (pure)."""
    loaded, cases = read_reports(output)
    passed = sum(
        1
        for index, (_, expected) in enumerate(tests)
        if index in cases and "value" in cases[index] and same_value(cases[index]["value"], expected)
    )
    return TestReport(fenced=fenced, compiled=loaded, passed=passed, total=len(tests), timed_out=timed_out)


def run_hidden_tests(
    code: str,
    function: str,
    tests: list[tuple[list[Any], Any]],
    timeout: float,
    memory_mb: int,
    mode: str,
    fenced: bool = True,
) -> TestReport:
    """Run the tests on `code` in the sandbox and grade them (synchronous: a reward worker calls it)."""
    box = PythonSandbox(timeout=timeout, memory_mb=memory_mb, max_output=256 * 1024, mode=mode)
    result = box.execute_sync(harness_script(code, function, [args for args, _ in tests]))
    return grade(result.output, tests, result.timed_out, fenced)


class CodeTestsEnv(SingleTurnEnv):
    """Write the function the prompt names; reward: hidden tests passed, run in the sandbox.

    `generated = true` draws the tasks from `tidal.envs.code_gen` (of `families`, default all; `seed`
    picks the draws) instead of `tasks_file`: thousands of small functions, so a held-out split of hundreds
    of tasks exists. `num_examples` then sets how many tasks the split counts (default 10,000; a split
    with fewer distinct tasks starts over)."""

    name = "code"

    def __init__(
        self,
        num_examples: int | None = None,
        tasks_file: str | None = None,
        timeout: float = 10.0,
        memory_mb: int = 512,
        sandbox: str = "auto",
        all_or_nothing: bool = False,
        split: str = "train",
        generated: bool = False,
        families: list[str] | None = None,
        seed: int | None = None,
    ):
        super().__init__([])
        self.split = check_split(split, "code")
        self.generated: SplitTasks[CodeTask] | None = None
        if generated:
            if tasks_file is not None:
                raise ValueError("code: tasks_file and generated = true both name the tasks; keep one")
            kinds = check_families(families)
            draws = seed or 0
            self.generated = SplitTasks(
                lambda i: CodeTask(*generate_task(i, draws, kinds)), lambda spec: spec.id, split
            )
            self.tasks: list[CodeTask] = []
            self.size = num_examples or 10_000
        else:
            if families is not None or seed is not None:
                what = "families choose" if families is not None else "seed picks"
                raise ValueError(
                    f"code: {what} generated tasks (the shipped file is a fixed list); set generated = true"
                )
            self.tasks = self._file_tasks(tasks_file, split, num_examples)
            self.size = len(self.tasks)
        if timeout <= 0 or memory_mb <= 0:
            raise ValueError("timeout and memory_mb must be positive")
        self.timeout, self.memory_mb, self.all_or_nothing = timeout, memory_mb, all_or_nothing
        self.sandbox = resolve_mode(sandbox)
        announce(self.sandbox)

    @staticmethod
    def _file_tasks(tasks_file: str | None, split: str, num_examples: int | None) -> list[CodeTask]:
        every = load_tasks(Path(tasks_file) if tasks_file else TASKS_FILE)
        tasks = [spec for spec in every if in_split(spec.id, split)]
        if not tasks:
            raise ValueError(f"the {split} split holds none of the {len(every)} tasks (tidal.envs.splits)")
        if num_examples is not None:
            if not 0 < num_examples <= len(tasks):
                raise ValueError(
                    f"num_examples = {num_examples}, but there are {len(tasks)} tasks in the {split} split"
                )
            tasks = tasks[:num_examples]
        return tasks

    def _spec(self, index: int) -> CodeTask:
        return self.generated[index] if self.generated is not None else self.tasks[index]

    def num_tasks(self) -> int:
        return self.size

    def task(self, index: int) -> Task:
        spec = self._spec(index)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": spec.prompt}]
        return Task(task_id=f"code/{spec.id}", messages=messages, info={"index": index})

    def demonstration(self, task: Task) -> list[dict[str, Any]] | None:
        """The task's reference solution in a ```python block (None for a task without one)."""
        reference = self._spec(task.info["index"]).reference
        if reference is None:
            return None
        code = reference if reference.endswith("\n") else reference + "\n"
        return [*task.messages, {"role": "assistant", "content": f"```python\n{code}```"}]

    async def score(self, task: Task, episode: Episode) -> None:
        """Runs the hidden tests off the event loop; a reward worker returns the whole report."""
        spec = self._spec(task.info["index"])
        code, fenced = extract_code(completion_text(episode), spec.function)
        if not code:
            report = TestReport(fenced=False, compiled=False, passed=0, total=len(spec.tests))
        else:
            report = await call_off_loop(
                run_hidden_tests,
                *(code, spec.function, spec.tests, self.timeout, self.memory_mb, self.sandbox, fenced),
            )
        episode.metrics.update(report.metrics())
        episode.reward = report.reward(self.all_or_nothing)
