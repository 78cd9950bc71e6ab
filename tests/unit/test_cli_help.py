"""`--help` tells the truth: every default it prints is the value the same command resolves (its dry run), the
short help is short, and the CLI's own flags (--version, a closed pipe) behave."""

import os
import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from tests.conftest import REPO, run_tidal
from tidal.cli import COMMANDS, _load
from tidal.config.loader import load_config, parse_args, parse_value
from tidal.config.rl import RLConfig
from tidal.launcher.rl import as_run

DEFAULT = re.compile(r"^  --(\S+) .*\(default: (.*)\)$")
ROLES = ("inference", "orchestrator", "trainer")


def printed_defaults(text: str) -> dict[str, str]:
    """`dotted.key` -> the default literal of every `--key ... (default: X)` line."""
    found = {}
    for line in text.splitlines():
        match = DEFAULT.match(line)
        if match:
            found[match.group(1).replace("-", "_")] = match.group(2)
    return found


def lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def assert_same(dotted: str, literal: str, resolved: Any) -> None:
    """`literal` as printed (`unset`: absent from the dry run, which leaves out None) equals `resolved`."""
    if literal == "unset":
        assert resolved is KeyError, f"{dotted}: help says unset, the command resolves {resolved!r}"
        return
    assert resolved is not KeyError, f"{dotted}: help says {literal}, the command leaves it unset"
    assert parse_value(literal) == resolved, (
        f"{dotted}: help says {literal}, the command resolves {resolved!r}"
    )


def dry_run(*args: str) -> str:
    result = run_tidal(*args, "--dry-run")
    assert result.returncode == 0, result.stderr
    return result.stdout


def help_text(*args: str) -> str:
    result = run_tidal(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rl_role_configs(text: str) -> dict[str, dict[str, Any]]:
    """The role configs `tidal rl --dry-run` prints, by role (the first inference replica's as `inference`)."""
    parts = re.split(r"^# ---- .*/configs/(\S+)\.toml ----$", text, flags=re.M)
    roles = {name: tomllib.loads(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    inference = next(name for name in roles if name.startswith("inference"))
    return {"inference": roles[inference], "orchestrator": roles["orchestrator"], "trainer": roles["trainer"]}


@pytest.mark.parametrize("flag", ["--help", "--help-all"])
def test_rl_help_defaults_are_the_ones_rl_resolves_and_runs_its_processes_with(flag):
    printed = printed_defaults(help_text("rl", flag))
    top = as_run(RLConfig.model_validate({})).model_dump(mode="json", exclude_none=True)
    roles = rl_role_configs(dry_run("rl"))
    for dotted, literal in printed.items():
        role, _, rest = dotted.partition(".")
        assert_same(dotted, literal, lookup(top, dotted))
        if role in ROLES:  # and the process started for that role gets the same value
            assert_same(dotted, literal, lookup(roles[role], rest))
    # the values the old help printed from the classes instead (the command runs with the right-hand ones)
    assert printed["trainer.scheduler.type"] == '"constant"' and printed["trainer.optim.lr"] == "3e-06"
    if flag == "--help-all":
        assert printed["trainer.log.interval"] == "1"
        assert printed["orchestrator.online_eval.sampling.temperature"] == "0.0"
        assert len(printed) > 150


@pytest.mark.parametrize("flag", ["--help", "--help-all"])
@pytest.mark.parametrize(
    "command,args",
    [
        ("sft", ["--data.train.type", "builtin"]),
        ("sft", []),  # data.train is required: help still shows every other default
        ("eval", []),
        ("inference", []),
        ("trainer", []),
        ("orchestrator", []),
    ],
)
def test_help_defaults_are_the_ones_the_command_resolves(command, args, flag):
    printed = printed_defaults(help_text(command, *args, flag))
    needs = [] if command != "sft" else ["--data.train.type", "builtin"]
    shown = tomllib.loads(dry_run(command, *(args or needs)))
    schema = _load(COMMANDS[command].schema)
    loaded = load_config(schema, [], parse_args(args or needs).overrides)  # type: ignore[arg-type]
    resolved = loaded.model_dump(mode="json", exclude_none=True)
    assert len(printed) > 5
    for dotted, literal in printed.items():
        assert_same(dotted, literal, lookup(resolved, dotted))
        table = dotted.split(".")[0]
        if table in shown:
            assert_same(dotted, literal, lookup(shown, dotted))  # the dry run leaves out unused tables


def test_help_follows_the_given_files_and_flags(tmp_path):
    printed = printed_defaults(help_text("rl", "--trainer.optim.lr", "1e-5", "--max-steps", "7", "--help"))
    assert printed["trainer.optim.lr"] == "1e-05" and printed["max_steps"] == "7"


def test_short_help_is_short_and_all_keys_rl_sets_itself_are_left_out():
    short = help_text("rl", "--help")
    full = help_text("rl", "--help-all")
    assert len(short.splitlines()) < 120 < len(full.splitlines())
    assert "more options: tidal rl --help-all" in short
    for text in (short, full):
        assert "--trainer.model." not in text and "--orchestrator.max-steps" not in text
        assert "--inference.model." not in text and "--trainer.temperature" not in text
        assert text.count("[model]") == 1
    assert "--trainer.perf.compile" in full and "--trainer.perf.compile" not in short


def test_help_names_no_missing_file_and_the_real_rollout_format():
    full = help_text("rl", "--help-all")
    for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", full):
        assert (REPO / name).exists(), f"help points to {name}, which the repository does not have"
    assert ".npz" not in full and "rank_<r>.json" in full


def test_help_all_shows_each_transport_variant_with_its_defaults():
    full = help_text("rl", "--help-all")
    assert "type = 'filesystem' (the default)" in full
    assert "--transport.port INT (default with this type: 5557)" in full


def test_version_flag():
    from tidal import __version__

    result = run_tidal("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"tidal {__version__}"


@pytest.mark.parametrize("args", [["--help"], ["rl", "--help-all"]])
def test_closed_pipe_ends_quietly(args):
    """`tidal --help | head -1`: the reader is gone before tidal writes; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has exited
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tidal", *args],
            cwd=REPO,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)
    err = result.stderr.decode()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_every_debug_config_resolves():
    """configs/debug/: one per part, CPU and GPU (tests/integration/test_debug_configs.py runs the CPU ones)."""
    names = sorted(p.stem for p in (REPO / "configs" / "debug").glob("*.toml"))
    assert {"sft", "trainer", "orchestrator", "inference", "eval", "rl"} <= set(names)
    for name in names:
        command = name.removesuffix("_gpu")
        result = run_tidal(command, "@", f"configs/debug/{name}.toml", "--dry-run")
        assert result.returncode == 0, (name, result.stderr)
