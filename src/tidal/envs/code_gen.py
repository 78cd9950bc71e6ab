"""Generated function-writing tasks for the `code` environment (`generated = true`): thousands of small,
exactly tested functions, so that a held-out split of hundreds of tasks exists (the shipped file has 18).

Each family is a kind of function with parameters (`affine(x)`: a·x + b; `clamp(x)`: x limited to
[lo, hi]; ...); a task is one family with drawn parameters, five hidden tests and a reference solution
(the demonstration). Its id names the family and the parameters (`gen/clamp/lo=-3,hi=17`), and the split
rule (`tidal.envs.splits`) reads that id: a task is in one split whatever the seed or its draw number.
Pure: nothing here runs code; the environment's sandbox does.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

NUM_TESTS = 5


class GeneratedTask(NamedTuple):
    """A generated task, field for field a `tidal.envs.code_tests.CodeTask` (which is built from it)."""

    id: str
    function: str
    prompt: str
    tests: list[tuple[list[Any], Any]]
    reference: str


@dataclass(frozen=True)
class Family:
    """One kind of function: its name, how to draw parameters and arguments, and what it must return."""

    function: str
    params: Callable[[random.Random], dict[str, Any]]
    prompt: Callable[[dict[str, Any]], str]
    args: Callable[[random.Random], list[Any]]
    value: Callable[[dict[str, Any], list[Any]], Any]
    reference: Callable[[dict[str, Any]], str]


def _int_list(rng: random.Random) -> list[Any]:
    return [[rng.randint(-60, 60) for _ in range(rng.randint(0, 7))]]


def _signed(value: int) -> str:
    return f"+ {value}" if value >= 0 else f"- {-value}"


def _multiples(function: str, what: str, link: str, term: str, total: Callable[[list[int]], int]) -> Family:
    """`count_multiples(n)` / `sum_multiples(n)`: over the integers 1..n divisible by k."""
    return Family(
        function,
        lambda r: {"k": r.randint(2, 40)},
        lambda p: (
            f"Write a Python function `{function}(n)` that returns {what} from 1 to n (inclusive) {link} "
            f"divisible by {p['k']}."
        ),
        lambda r: [r.randint(0, 500)],
        lambda p, a: total([i for i in range(1, a[0] + 1) if i % p["k"] == 0]),
        lambda p: (
            f"def {function}(n):\n    return sum({term} for i in range(1, n + 1) if i % {p['k']} == 0)\n"
        ),
    )


FAMILIES: dict[str, Family] = {
    "affine": Family(
        "affine",
        lambda r: {"a": r.choice([i for i in range(-9, 10) if i]), "b": r.randint(-20, 20)},
        lambda p: (
            f"Write a Python function `affine(x)` that returns {p['a']} * x {_signed(p['b'])} for an integer x."
        ),
        lambda r: [r.randint(-100, 100)],
        lambda p, a: p["a"] * a[0] + p["b"],
        lambda p: f"def affine(x):\n    return {p['a']} * x {_signed(p['b'])}\n",
    ),
    "quadratic": Family(
        "quadratic",
        lambda r: {"a": r.randint(1, 5), "b": r.randint(-5, 5), "c": r.randint(-5, 5)},
        lambda p: (
            f"Write a Python function `quadratic(x)` that returns {p['a']} * x * x {_signed(p['b'])} * x "
            f"{_signed(p['c'])} for an integer x."
        ),
        lambda r: [r.randint(-30, 30)],
        lambda p, a: p["a"] * a[0] * a[0] + p["b"] * a[0] + p["c"],
        lambda p: f"def quadratic(x):\n    return {p['a']} * x * x {_signed(p['b'])} * x {_signed(p['c'])}\n",
    ),
    "clamp": Family(
        "clamp",
        lambda r: {"lo": r.randint(-20, 0), "hi": r.randint(1, 30)},
        lambda p: (
            f"Write a Python function `clamp(x)` that returns x limited to the range from {p['lo']} to "
            f"{p['hi']}: {p['lo']} if x is smaller, {p['hi']} if x is larger, else x itself."
        ),
        lambda r: [r.randint(-40, 50)],
        lambda p, a: min(max(a[0], p["lo"]), p["hi"]),
        lambda p: f"def clamp(x):\n    return min(max(x, {p['lo']}), {p['hi']})\n",
    ),
    "count_multiples": _multiples("count_multiples", "how many integers", "are", "1", len),
    "sum_multiples": _multiples("sum_multiples", "the sum of the integers", "that are", "i", sum),
    "count_greater": Family(
        "count_greater",
        lambda r: {"t": r.randint(-50, 50)},
        lambda p: (
            f"Write a Python function `count_greater(xs)` that returns how many numbers in the list xs are "
            f"greater than {p['t']}."
        ),
        _int_list,
        lambda p, a: sum(1 for x in a[0] if x > p["t"]),
        lambda p: f"def count_greater(xs):\n    return sum(1 for x in xs if x > {p['t']})\n",
    ),
    "sum_greater": Family(
        "sum_greater",
        lambda r: {"t": r.randint(-50, 50)},
        lambda p: (
            f"Write a Python function `sum_greater(xs)` that returns the sum of the numbers in the list xs "
            f"that are greater than {p['t']} (0 when there are none)."
        ),
        _int_list,
        lambda p, a: sum(x for x in a[0] if x > p["t"]),
        lambda p: f"def sum_greater(xs):\n    return sum(x for x in xs if x > {p['t']})\n",
    ),
    "scale_list": Family(
        "scale_list",
        lambda r: {"k": r.choice([i for i in range(-5, 6) if i]), "c": r.randint(-10, 10)},
        lambda p: (
            f"Write a Python function `scale_list(xs)` that returns a new list with each number x of the "
            f"list xs replaced by {p['k']} * x {_signed(p['c'])}, in the same order."
        ),
        _int_list,
        lambda p, a: [p["k"] * x + p["c"] for x in a[0]],
        lambda p: f"def scale_list(xs):\n    return [{p['k']} * x {_signed(p['c'])} for x in xs]\n",
    ),
    "power_mod": Family(
        "power_mod",
        lambda r: {"e": r.randint(2, 5), "m": r.randint(3, 60)},
        lambda p: (
            f"Write a Python function `power_mod(x)` that returns x to the power {p['e']}, modulo {p['m']} "
            "(the remainder Python's % gives), for an integer x."
        ),
        lambda r: [r.randint(-50, 200)],
        lambda p, a: a[0] ** p["e"] % p["m"],
        lambda p: f"def power_mod(x):\n    return x ** {p['e']} % {p['m']}\n",
    ),
    "digit_sum_times": Family(
        "digit_sum_times",
        lambda r: {"k": r.randint(1, 30)},
        lambda p: (
            f"Write a Python function `digit_sum_times(n)` that returns the sum of the decimal digits of the "
            f"non-negative integer n, multiplied by {p['k']}."
        ),
        lambda r: [r.randint(0, 10**6)],
        lambda p, a: sum(int(d) for d in str(a[0])) * p["k"],
        lambda p: f"def digit_sum_times(n):\n    return sum(int(d) for d in str(n)) * {p['k']}\n",
    ),
    "repeat_join": Family(
        "repeat_join",
        lambda r: {"k": r.randint(2, 6), "sep": r.choice(["-", ",", " ", "|", "+", "::"])},
        lambda p: (
            f"Write a Python function `repeat_join(s)` that returns the string s repeated {p['k']} times, "
            f"with {p['sep']!r} between the copies."
        ),
        lambda r: ["".join(r.choice("abcxyz") for _ in range(r.randint(0, 4)))],
        lambda p, a: p["sep"].join([a[0]] * p["k"]),
        lambda p: f"def repeat_join(s):\n    return {p['sep']!r}.join([s] * {p['k']})\n",
    ),
}


def task_id(family: str, params: dict[str, Any]) -> str:
    """`gen/<family>/<name>=<value>,...`: what makes the task that task (the split key)."""
    return f"gen/{family}/" + ",".join(f"{name}={value!r}" for name, value in params.items())


def generate_task(index: int, seed: int, families: list[str] | None = None) -> GeneratedTask:
    """Task number `index` of the generator under `seed`: a family (of `families`, default all), its
    parameters, five tests (distinct arguments where the family allows) and the reference solution."""
    rng = random.Random(f"code/gen/{seed}/{index}")
    name = rng.choice(sorted(families or FAMILIES))
    family = FAMILIES[name]
    params = family.params(rng)
    cases: list[list[Any]] = []
    for _ in range(NUM_TESTS * 4):
        args = family.args(rng)
        if args not in cases:
            cases.append(args)
        if len(cases) == NUM_TESTS:
            break
    tests = [(args, family.value(params, args)) for args in cases]
    return GeneratedTask(
        task_id(name, params), family.function, family.prompt(params), tests, family.reference(params)
    )


def check_families(families: list[str] | None) -> list[str] | None:
    unknown = [name for name in families or [] if name not in FAMILIES]
    if unknown or families == []:
        raise ValueError(
            f"code: families must be a non-empty list of {', '.join(FAMILIES)}, got {families!r}"
        )
    return families
