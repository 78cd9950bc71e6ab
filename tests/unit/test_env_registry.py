"""Environments from anywhere: entry points, `module:Class`, factories; one-line errors for every mistake,
before any server starts (`tidal rl` / `tidal eval` exit at once, no vLLM)."""

import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_tidal
from tidal.config.env_names import env_names, installed_envs, unknown_name
from tidal.config.envs import EnvSpec
from tidal.envs.registry import check_env, load_env
from tidal.errors import UserError

ENV_MODULE = """
from tidal.envs.base import SingleTurnEnv, Task


class Hello(SingleTurnEnv):
    name = "hello"

    def __init__(self, num_examples: int = 3):
        super().__init__()
        self.num_examples = num_examples

    def num_tasks(self):
        return self.num_examples

    def task(self, index):
        return Task(task_id=f"hello/{index}", messages=[{"role": "user", "content": "hi"}], answer="hi")


def make_hello(size: int = 2):
    return Hello(num_examples=size)


def make_nothing():
    return 42


class NotAnEnv:
    pass
"""


@pytest.fixture
def modules(tmp_path, monkeypatch) -> Path:
    """Importable modules on sys.path, and a distribution declaring `hello_ep` in `tidal.environments`."""
    (tmp_path / "hello_envs.py").write_text(textwrap.dedent(ENV_MODULE))
    (tmp_path / "needs_dep.py").write_text("import a_dependency_nobody_installed\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('config file missing')\n")
    (tmp_path / "vf_no_all.py").write_text("X = 1\n")
    dist = tmp_path / "hello_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tidal.environments]\nhello_ep = hello_envs:Hello\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hello_envs", "needs_dep", "raises_on_import", "vf_no_all"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_entry_points_classes_and_factories_load(modules):
    assert installed_envs()["hello_ep"] == "hello_envs:Hello"
    assert "hello_ep" in env_names() and "reverse_text" in env_names()
    assert load_env("hello_ep", num_examples=4).num_tasks() == 4
    assert load_env("hello_envs:Hello").num_tasks() == 3
    assert load_env("hello_envs:make_hello", size=5).num_tasks() == 5
    assert load_env("tidal.envs.reverse_text:ReverseTextEnv", num_examples=2).name == "reverse_text"


def test_the_config_validator_names_what_exists_and_imports_nothing(modules):
    assert unknown_name("hello_ep") is None and unknown_name("hello_envs:Hello") is None
    assert "hello_envs" not in sys.modules  # naming it imported nothing
    problem = unknown_name("chess")
    assert problem is not None and "built-in: alphabet_sort" in problem and "installed: hello_ep" in problem
    assert "package.module:Class" in problem and "vf:<id>" in problem
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        EnvSpec(name="chess")
    assert EnvSpec(name="hello_ep").name == "hello_ep"


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("no_such_module:Env", {}, "environment 'no_such_module:Env': no module named 'no_such_module'"),
        ("needs_dep:Env", {}, "importing needs_dep failed: ModuleNotFoundError: No module named 'a_dependency"),
        ("raises_on_import:Env", {}, "importing raises_on_import failed: RuntimeError: config file missing"),
        ("hello_envs:Missing", {}, "module 'hello_envs' has no attribute 'Missing'"),
        ("hello_envs:NotAnEnv", {}, "hello_envs:NotAnEnv is not a tidal Environment"),
        ("tidal.envs.base:Environment", {}, "is an abstract Environment"),
        ("hello_envs:make_nothing", {}, "its factory returned int, not a tidal Environment"),
        ("hello_ep", {"colour": 1}, "'hello_ep': got an unexpected keyword argument 'colour' (arguments: num_examples)"),
        ("hello_envs:make_hello", {"sise": 1}, "unexpected keyword argument 'sise' (arguments: size)"),
    ],
)  # fmt: skip
def test_every_mistake_is_one_line(modules, name, kwargs, message):
    with pytest.raises(UserError) as caught:
        load_env(name, **kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_verifiers_mistakes_are_one_line(modules):
    pytest.importorskip("verifiers.v1")
    with pytest.raises(UserError, match="'vf_not_installed' is not installed"):
        load_env("vf:vf_not_installed")
    with pytest.raises(UserError, match="defines no `__all__`"):
        load_env("vf:vf_no_all")
    with pytest.raises(UserError, match="importing it failed: ModuleNotFoundError: No module named 'a_dep"):
        load_env("vf:needs_dep")


def test_check_env_binds_arguments_without_building(modules):
    check_env(EnvSpec(name="hello_ep", kwargs={"num_examples": 2}), "tidal-testing/tiny-qwen3")
    with pytest.raises(UserError, match="unexpected keyword argument 'nope'"):
        check_env(EnvSpec(name="hello_ep", kwargs={"nope": 2}), "tidal-testing/tiny-qwen3")


def test_ambiguous_entry_points_are_errors(modules):
    dist = modules / "hello_envs-1.0.dist-info"
    (dist / "entry_points.txt").write_text(
        "[tidal.environments]\nmath = hello_envs:Hello\nhello_ep = hello_envs:Hello\n"
    )
    other = modules / "other_envs-1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-envs\nVersion: 1.0\n")
    (other / "entry_points.txt").write_text("[tidal.environments]\nhello_ep = hello_envs:make_hello\n")
    with pytest.raises(UserError, match="'math' is built in and also declared by an installed package"):
        load_env("math")
    with pytest.raises(UserError, match="'hello_ep' is declared by several installed packages"):
        load_env("hello_ep")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ('{name = "tidal_nowhere:Env"}', "no module named 'tidal_nowhere'"),
        ('{name = "raises_on_import:Env"}', "importing raises_on_import failed: RuntimeError: config file"),
        ('{name = "reverse_text", kwargs = {colour = 1}}', "unexpected keyword argument 'colour'"),
        ('{name = "hello_envs:NotAnEnv"}', "is not a tidal Environment"),
    ],
)
@pytest.mark.parametrize("command", ["rl", "eval"])
def test_rl_and_eval_stop_with_one_line_before_any_server(modules, tmp_path, command, env, message):
    key = "--orchestrator.env" if command == "rl" else "--env"
    out = tmp_path / "out"
    path = os.pathsep.join(filter(None, [str(modules), os.environ.get("PYTHONPATH")]))
    result = run_tidal(
        command, key, f"[{env}]", "--output-dir", str(out), timeout=120, env={"PYTHONPATH": path}
    )
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (out / "logs").exists()  # no inference server (nor anything else) was started
    if command == "rl":
        assert "tidal rl: error: orchestrator.env.0: environment" in result.stderr


def test_an_unknown_name_is_a_config_error(tmp_path):
    result = run_tidal("eval", "--env", '[{name = "chess"}]', "--output-dir", str(tmp_path))
    assert result.returncode == 2 and "unknown environment 'chess'" in result.stderr
    assert "built-in: alphabet_sort" in result.stderr and "Traceback" not in result.stderr


def test_an_online_eval_env_without_a_seed_argument_is_named_with_a_hint(modules, tmp_path):
    """Online eval's default held-out tasks pass `seed`; a factory without one is caught before any server."""
    path = os.pathsep.join(filter(None, [str(modules), os.environ.get("PYTHONPATH")]))
    result = run_tidal(
        "rl", "--orchestrator.env", '[{name = "hello_envs:make_hello"}]',
        "--orchestrator.online-eval.interval", "1", "--output-dir", str(tmp_path / "out"), env={"PYTHONPATH": path},
    )  # fmt: skip
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "orchestrator.online_eval.env.0: environment 'hello_envs:make_hello'" in result.stderr
    assert "give the environment a `seed` argument" in result.stderr
    assert not (tmp_path / "out" / "logs").exists()
