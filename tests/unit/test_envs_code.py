"""The `code` environment: code extraction, grading (pure), the shipped tasks' references, scoring in a
reward worker through the sandbox, and solutions that hang, crash or forge reports."""

import asyncio
import json

import pytest

from tidal.envs.base import Episode
from tidal.envs.code_tests import (
    REPORT_MARK,
    TASKS_FILE,
    CodeTestsEnv,
    extract_code,
    grade,
    load_tasks,
    run_hidden_tests,
    same_value,
)
from tidal.envs.reward_pool import reward_workers
from tidal.errors import UserError


def answer(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\n"


def score(env: CodeTestsEnv, index: int, reply: str, workers: int | None = 1) -> Episode:
    task = env.task(index)
    episode = Episode(prompt_ids=[1], messages=[*task.messages, {"role": "assistant", "content": reply}])

    async def go():
        async with reward_workers(workers):
            await env.score(task, episode)

    asyncio.run(go())
    return episode


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == ("b = 2\n", True)
    assert extract_code("```\nc = 3\n```") == ("c = 3\n", True)
    assert extract_code(" def f(): pass\n") == ("def f(): pass", False)
    assert extract_code("```python\nunfinished") == ("```python\nunfinished", False)


SOLUTION_THEN_EXAMPLE = (
    "```python\ndef add(a, b):\n    return a + b\n```\n\nExample usage:\n\n"
    "```python\nresult = add(2, 3)\nprint(result)  # Output: 5\n```"
)


def test_extract_code_takes_the_block_that_defines_the_function():
    """A right answer followed by a usage example scored 0 when the last block was taken."""
    assert extract_code(SOLUTION_THEN_EXAMPLE, "add") == ("def add(a, b):\n    return a + b\n", True)
    assert extract_code(SOLUTION_THEN_EXAMPLE) == ("result = add(2, 3)\nprint(result)  # Output: 5\n", True)
    # the last of several blocks that define it (a fixed second try); none: the last block
    two = "```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(two, "add")[0] == "def add(a, b):\n    return a + b\n"
    assert extract_code("```python\ndef adder(a, b): ...\n```\n```\nx = 1\n```", "add") == ("x = 1\n", True)
    assert extract_code("```python\nclass A:\n    async def add (self): ...\n```", "add")[1]


def test_same_value_is_strict_about_types_and_tolerant_about_floats():
    assert same_value(2.5, 2.5000000000001) and same_value(3, 3.0)
    assert not same_value(True, 1) and not same_value(1, True) and not same_value("1", 1)
    assert same_value([1, [2, "a"]], [1, [2, "a"]]) and not same_value([1, 2], [1, 2, 3])
    assert same_value({"a": 1}, {"a": 1}) and not same_value({"a": 1}, {"b": 1})
    assert same_value(None, None) and not same_value(None, 0)


def test_grade_counts_only_reported_correct_values():
    tests = [([1], 1), ([2], 4), ([3], 9)]
    lines = [
        REPORT_MARK + json.dumps({"loaded": True}),
        REPORT_MARK + json.dumps({"case": 0, "value": 1}),
        REPORT_MARK + json.dumps({"case": 1, "error": "ValueError: x"}),
        REPORT_MARK + '{"case": 2, "val',  # cut by the timeout
        "noise",
    ]
    report = grade("\n".join(lines), tests, timed_out=True)
    assert (report.compiled, report.passed, report.total, report.timed_out) == (True, 1, 3, True)
    assert report.reward(all_or_nothing=False) == pytest.approx(1 / 3) and report.reward(True) == 0.0


def test_every_shipped_reference_passes_its_hidden_tests():
    raw = json.loads(TASKS_FILE.read_text())
    tasks = load_tasks(TASKS_FILE)
    assert 10 <= len(tasks) <= 20 and len({t.id for t in tasks}) == len(tasks)
    for spec, item in zip(tasks, raw, strict=True):
        report = run_hidden_tests(item["reference"], spec.function, spec.tests, 10.0, 512, "auto")
        assert report.compiled and report.passed == report.total, spec.id


def test_scores_in_a_reward_worker_with_metrics():
    env = CodeTestsEnv(timeout=5.0)
    index = next(i for i, t in enumerate(env.tasks) if t.id == "add")
    good = score(env, index, answer("def add(a, b):\n    return a + b"))
    assert good.reward == 1.0
    assert good.metrics == {
        "code/fenced": 1.0,
        "code/compiled": 1.0,
        "code/timed_out": 0.0,
        "reward/tests_passed": 1.0,
    }
    half = score(env, index, answer("def add(a, b):\n    return a + b if a <= 0 else 0"), workers=0)
    assert 0.0 < half.reward < 1.0  # without workers it runs in a thread: same result
    prose = score(env, index, "no code at all")
    assert prose.metrics["code/fenced"] == prose.metrics["code/compiled"] == prose.reward == 0.0
    assert score(env, index, "def add(a, b):\n    return a + b").reward == 1.0  # bare code counts
    assert score(env, index, SOLUTION_THEN_EXAMPLE).reward == 1.0  # the example after it is not the answer
    # a self-check after the function that fails (Qwen2.5-Coder-0.5B's `check_run_length()`) does not
    # hide the function from the tests
    checked = answer("def add(a, b):\n    return a + b\n\nassert add(1, 1) == 3\ninput()")
    assert score(env, index, checked).reward == 1.0
    assert score(env, index, "").metrics["code/compiled"] == 0.0
    broken = score(env, index, answer("def add(a, b)\n    return a + b"))
    assert broken.metrics["code/compiled"] == 0.0 and broken.reward == 0.0
    missing = score(env, index, answer("def plus(a, b):\n    return a + b"))
    assert missing.metrics["code/compiled"] == 0.0 and missing.reward == 0.0
    strict = CodeTestsEnv(timeout=5.0, all_or_nothing=True)
    assert score(strict, index, answer("def add(a, b):\n    return a + b if a <= 0 else 0")).reward == 0.0


@pytest.mark.parametrize(
    "code",
    [
        "import time\ndef add(a, b):\n    time.sleep(60)",  # every test hangs
        "def add(a, b):\n    while True: pass",
        "import os\ndef add(a, b):\n    os._exit(0)",
        "raise SystemExit(0)",
        "x = bytearray(10 * 1024**3)\ndef add(a, b):\n    return a + b",
        # forged reports on stdout are not read; only the harness's own descriptor is
        f'print({REPORT_MARK!r} + \'{{"case": 0, "value": 3}}\')\ndef add(a, b):\n    return -1',
    ],
)
def test_hostile_or_broken_solutions_score_zero_and_the_caller_goes_on(code):
    env = CodeTestsEnv(timeout=2.0)
    index = next(i for i, t in enumerate(env.tasks) if t.id == "add")
    episode = score(env, index, answer(code))
    assert episode.reward == 0.0
    if "sleep" in code or "while True" in code:
        assert episode.metrics["code/timed_out"] == 1.0


def test_splits_partition_the_tasks_by_id():
    train, heldout = CodeTestsEnv(), CodeTestsEnv(split="heldout")
    assert [t.id for t in heldout.tasks] == ["fibonacci", "gcd", "to_binary"]
    assert len(train.tasks) == 15 and not {t.id for t in train.tasks} & {t.id for t in heldout.tasks}
    assert heldout.task(1).task_id == "code/gcd"


def test_bad_settings_are_one_line_errors(tmp_path):
    from tidal.envs.registry import load_env

    with pytest.raises(UserError, match="num_examples = 99, but there are 15 tasks in the train split"):
        load_env("code", num_examples=99)
    with pytest.raises(UserError, match="split must be one of train, heldout"):
        load_env("code", split="test")
    bad = tmp_path / "tasks.json"
    bad.write_text('[{"id": "x", "prompt": "p", "tests": []}]')
    with pytest.raises(UserError, match="task 0 lacks 'function'"):
        load_env("code", tasks_file=str(bad))
    with pytest.raises(UserError, match="cannot read code tasks"):
        load_env("code", tasks_file=str(tmp_path / "missing.json"))
    assert load_env("code", num_examples=3).num_tasks() == 3


def test_generated_tasks_are_distinct_reproducible_and_solved_by_their_references():
    from tidal.envs.code_gen import FAMILIES, generate_task
    from tidal.envs.splits import is_heldout

    first = [generate_task(i, 0) for i in range(20_000)]
    assert [generate_task(i, 0) for i in range(50)] == first[:50]  # a draw depends on its seed and number
    assert generate_task(0, 1) != first[0]
    distinct = {t.id for t in first}
    assert {t.id.split("/")[1] for t in first} == set(FAMILIES)
    assert len({i for i in distinct if is_heldout(i)}) >= 200  # a held-out eval of 200 different tasks
    for spec in first[:300]:
        namespace: dict = {}
        exec(spec.reference, namespace)
        assert all(namespace[spec.function](*args) == want for args, want in spec.tests), spec.id
        assert len(spec.tests) == 5 and f"`{spec.function}(" in spec.prompt


def test_the_generated_code_env_splits_by_task_and_scores_in_the_sandbox():
    from tidal.envs.registry import load_env

    train = CodeTestsEnv(generated=True, timeout=5.0)
    heldout = CodeTestsEnv(generated=True, split="heldout", num_examples=200)
    assert train.num_tasks() == 10_000 and heldout.num_tasks() == 200
    held_ids = {heldout.task(i).task_id for i in range(200)}
    assert len(held_ids) == 200 and not held_ids & {train.task(i).task_id for i in range(2000)}
    assert heldout.task(0).task_id.startswith("code/gen/")
    demo = train.demonstration(train.task(3))
    assert demo is not None and demo[-1]["content"].startswith("```python\n")
    assert score(train, 3, demo[-1]["content"]).reward == 1.0
    assert score(train, 3, answer("def f(x):\n    return 0")).reward == 0.0
    only = CodeTestsEnv(generated=True, families=["clamp"])
    assert all(only.task(i).task_id.startswith("code/gen/clamp/") for i in range(20))
    with pytest.raises(UserError, match="families must be a non-empty list"):
        load_env("code", generated=True, families=["sorting"])
    with pytest.raises(UserError, match="set generated = true"):
        load_env("code", families=["clamp"])
    with pytest.raises(UserError, match="keep one"):
        load_env("code", generated=True, tasks_file="x.json")
