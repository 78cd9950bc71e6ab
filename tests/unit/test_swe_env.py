"""The `swe` environment: generated repositories whose seeded bug the hidden tests catch and the fix passes,
tools confined to the episode's repository, the bubblewrap sandbox `bash` runs in (no network, nothing
writable outside the repository, fork bombs and runaway loops end at their limits and fail only their
call), the demonstration, the turn budget, and a user's repositories."""

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tidal.envs import bwrap
from tidal.envs.base import Turn, run_episode
from tidal.envs.repo_sandbox import RepoSandbox
from tidal.envs.swe import SweEnv, _read, _replace, _write, changed_files, run_hidden_tests
from tidal.envs.swe_repos import TEST_COMMAND, generate_repo, read_user_repos
from tidal.envs.tools import tool_call_text
from tidal.models.tiny import build_tokenizer

needs_bwrap = pytest.mark.skipif(bwrap.probe() is not None, reason=f"bubblewrap: {bwrap.probe()}")


class Agent:
    """Replies with the next scripted text each turn (EOS appended); then calls bash forever."""

    def __init__(self, replies: list[str]):
        self.tokenizer, self.replies = build_tokenizer(), list(replies)

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        text = self.replies.pop(0) if self.replies else tool_call_text("bash", {"command": "ls"})
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Turn(list(prompt_ids), ids, [-0.1] * len(ids), text, "stop")


@pytest.fixture(scope="module")
def box() -> RepoSandbox:
    return RepoSandbox(timeout=5, mode="auto")


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_seeded_bug_fails_hidden_tests_that_the_fix_passes_while_the_visible_tests_pass(tmp_path, box):
    kinds = set()
    for index in range(6):
        repo = generate_repo(index, seed=3)
        assert repo == generate_repo(index, seed=3)  # a pure function of (index, seed)
        passed, total = run_hidden_tests(repo, {}, box)
        assert 0 < passed < total, (repo.repo_id, passed, total)
        assert run_hidden_tests(repo, repo.fix, box) == (total, total)
        visible = box.run_sync(write(tmp_path / str(index), repo.files), TEST_COMMAND)
        assert visible.returncode == 0 and "OK" in visible.output, visible.output
        # the report names the function and the symptom, not the fix
        (path,) = repo.fix
        assert path in repo.statement and "submit" in repo.statement
        kinds.add(path)
    assert len(kinds) > 1


def test_file_tools_stay_inside_the_repository(tmp_path):
    repo = write(tmp_path / "repo", {"pkg/a.py": "x = 1\n"})
    (tmp_path / "secret.txt").write_text("secret")
    (repo / "link").symlink_to(tmp_path / "secret.txt")
    assert _read(repo, "pkg/a.py") == "x = 1\n"
    for bad in ("../secret.txt", "/etc/passwd", "link"):
        with pytest.raises(ValueError):
            _read(repo, bad)
    with pytest.raises(ValueError):
        _write(repo, "../escape.py", "boom")
    assert not (tmp_path / "escape.py").exists()
    assert _write(repo, "pkg/b.py", "y = 2\n").startswith("wrote")
    assert _replace(repo, "pkg/b.py", "y = 2", "y = 3") == "replaced in pkg/b.py"
    assert "occurs 0 times" in _replace(repo, "pkg/b.py", "nothing", "z")
    assert changed_files(repo, {"pkg/a.py": "x = 1\n"}) == {"pkg/b.py": "y = 3\n"}


@needs_bwrap
def test_bash_reaches_no_network_not_even_the_hosts_loopback(tmp_path):
    box = RepoSandbox(timeout=5, mode="bwrap")
    with socket.socket() as server:  # a server on the host's loopback, reachable from the host itself
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        threading.Thread(target=lambda: server.accept()[0].close(), daemon=True).start()
        code = (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
        )
        result = box.run_sync(tmp_path, f'python -c "{code}"')
        assert "CONNECTED" not in result.output and result.returncode != 0, result.output
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the host could: the sandbox's loopback is its own
    name = box.run_sync(tmp_path, "python -c \"import socket; socket.getaddrinfo('pypi.org', 443)\"")
    assert name.returncode != 0


@needs_bwrap
def test_bash_writes_only_inside_its_repository(tmp_path):
    box = RepoSandbox(timeout=5, mode="bwrap")
    repo = write(tmp_path / "repo", {"a.py": "print('hi')\n"})
    outside = tmp_path / "outside.txt"
    command = f"echo x > {outside}; echo y > /tmp/t.txt; echo z > made.txt; python a.py; pwd"
    result = box.run_sync(repo, command)
    assert not outside.exists() and not Path("/tmp/t.txt").exists()  # /tmp there is its own, and gone
    assert (repo / "made.txt").read_text() == "z\n"
    assert "hi" in result.output and "/repo" in result.output


@needs_bwrap
def test_a_fork_bomb_and_a_runaway_loop_end_at_their_limits(tmp_path):
    box = RepoSandbox(timeout=3, mode="bwrap", max_processes=32)
    started = time.perf_counter()
    bomb = box.run_sync(tmp_path, "bomb() { bomb | bomb & }; bomb; sleep 60")
    assert bomb.timed_out and time.perf_counter() - started < 20
    loop = box.run_sync(tmp_path, "python -c 'while True: pass'")
    assert loop.timed_out and loop.returncode is not None and loop.returncode < 0
    assert box.run_sync(tmp_path, "echo alive").output.strip() == "alive"  # the next call runs as usual


def test_the_demonstration_fixes_the_bug_and_an_agent_replaying_it_earns_the_full_reward():
    env = SweEnv(timeout=5)
    task = env.task(1)
    demo = env.demonstration(task)
    assert demo is not None and demo[-1]["content"] == tool_call_text("submit", {})
    tool_results = [m["content"] for m in demo if m["role"] == "tool"]
    assert tool_results[-1] == "OK\n"  # the visible tests' verdict after the fix
    replies = [m["content"] for m in demo if m["role"] == "assistant"]
    episode = asyncio.run(run_episode(env, task, Agent(replies)))
    assert episode.reward == 1.0 and episode.info["submitted"]
    assert episode.num_turns == len(replies)  # submit ended it
    assert episode.metrics["swe/files_changed"] == 1.0 and episode.metrics["tools/num_tool_calls"] == 4


def test_an_agent_that_never_submits_ends_at_the_turn_budget_and_is_scored_on_the_unchanged_repo():
    env = SweEnv(timeout=2, max_turns=3)
    task = env.task(0)
    runaway = tool_call_text("bash", {"command": "python -c 'while True: pass'"})
    episode = asyncio.run(run_episode(env, task, Agent([runaway])))
    assert episode.num_turns == 3 and not episode.info["submitted"]
    assert episode.messages[3]["content"].startswith("error: timed out after 2 s")  # only that call failed
    assert episode.messages[5]["role"] == "tool" and "README.md" in episode.messages[5]["content"]
    passed, total = run_hidden_tests(env.repo(task), {}, env.box)
    assert episode.reward == passed / total < 1.0
    assert episode.metrics["swe/submitted"] == 0.0


def test_require_submit_pays_nothing_for_a_fix_left_unsubmitted():
    """RL from Qwen2.5-Coder-0.5B's 6-step warm-up stopped calling submit (the turn budget ended its episodes
    and they were scored all the same); `require_submit` makes the call part of the reward."""
    for require_submit, paid in ((False, 1.0), (True, 0.0)):
        env = SweEnv(timeout=5, max_turns=4, all_or_nothing=True, require_submit=require_submit)
        task = env.task(2)
        demo = env.demonstration(task)
        assert demo is not None
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        assert "submit" in replies[-1]
        unsubmitted = asyncio.run(run_episode(env, task, Agent(replies[:-1])))  # the fix, then `ls`
        assert not unsubmitted.info["submitted"] and unsubmitted.num_turns == 4
        assert unsubmitted.reward == paid
        assert unsubmitted.metrics["swe/hidden_passed"] == unsubmitted.metrics["swe/hidden_total"]  # fixed
        submitted = asyncio.run(run_episode(env, task, Agent(replies)))
        assert submitted.info["submitted"] and submitted.reward == 1.0


def test_a_users_repositories_load_and_bad_lines_are_named(tmp_path):
    repo = {
        "id": "calc",
        "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
        "statement": "add(2, 2) returns 0.",
        "hidden_tests": {
            "tests/test_calc.py": "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
            "    def test_add(self):\n        self.assertEqual(add(2, 2), 4)\n"
            "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n"
        },
    }
    path = tmp_path / "repos.jsonl"
    path.write_text(json.dumps(repo) + "\n")
    env = SweEnv(repos=str(path), timeout=5)
    task = env.task(0)
    assert task.messages[1]["content"] == "add(2, 2) returns 0." and env.demonstration(task) is None
    assert run_hidden_tests(env.repo(task), {}, env.box) == (1, 2)
    fixed = {"calc.py": "def add(a, b):\n    return a + b\n"}
    assert run_hidden_tests(env.repo(task), fixed, env.box) == (2, 2)
    for bad, said in (
        ("{not json", "repos.jsonl:1: not JSON"),
        (json.dumps({"id": "x", "files": {}}), "missing statement, hidden_tests"),
        (json.dumps({**repo, "files": {"../x.py": ""}}), "must be relative"),
    ):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=said):
            read_user_repos(str(path))


def test_an_episode_ends_cleanly_at_its_token_budget():
    env = SweEnv(timeout=2, max_turns=10, max_context_tokens=1400)
    task = env.task(2)
    episode = asyncio.run(run_episode(env, task, Agent([])))  # `ls` every turn: each turn adds its output
    assert episode.info["truncated"] and 1 <= episode.num_turns < 10
    assert len(episode.context_ids) <= 1400
    assert 0.0 < episode.reward < 1.0  # scored on the unchanged repository


def test_the_fallback_refuses_an_interpreter_its_own_user_cannot_reach(tmp_path, monkeypatch):
    from tidal.envs import repo_sandbox

    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    python = closed / "bin" / "python3"
    python.write_text("")
    python.chmod(0o755)
    closed.chmod(0o700)
    assert not repo_sandbox.open_to_others(str(python))
    closed.chmod(0o755)
    tmp_path.chmod(0o755)
    assert repo_sandbox.open_to_others(str(python)) == repo_sandbox.open_to_others(str(tmp_path))
    closed.chmod(0o700)
    monkeypatch.setattr(repo_sandbox.sys, "executable", str(python))
    monkeypatch.setattr(repo_sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(closed / "bin"))  # no python3 open to others on PATH either
    with pytest.raises(ValueError, match="cannot reach the interpreter .* and no python3 on PATH"):
        RepoSandbox(mode="process")
    with repo_sandbox.workspace("tidal-test-") as open_root:  # pytest's own tmp root is closed to others
        open_bin = open_root / "bin"
        open_bin.mkdir(parents=True)
        open_root.chmod(0o755)
        (open_bin / "python3").write_text("")
        (open_bin / "python3").chmod(0o755)
        monkeypatch.setenv("PATH", f"{closed / 'bin'}{os.pathsep}{open_bin}")
        assert RepoSandbox(mode="process").python == str(open_bin / "python3")


def test_the_fallback_as_root_runs_the_bash_tool_and_the_hidden_tests_in_a_workspace_its_user_reaches():
    """Without bubblewrap, as root (a container; the GPU machines): the commands run as a user of their own,
    who must reach both an interpreter (tidal's may sit under a closed /root) and the repository (mkdtemp
    makes 0700 directories). Found on an H100 where every hidden test "failed" and every episode scored 0."""
    box = RepoSandbox(timeout=5, mode="process")
    repo = generate_repo(0)
    passed, total = run_hidden_tests(repo, {}, box)
    assert 0 < passed < total  # the seeded bug fails some hidden tests, not all
    assert run_hidden_tests(repo, repo.fix, box) == (total, total)
    from tidal.envs.repo_sandbox import workspace

    with workspace("tidal-test-") as path:
        path.mkdir()
        (path / "hello.py").write_text("print('hi from', __name__)")
        result = box.run_sync(path, "python hello.py && touch made && ls")
        assert result.returncode == 0, result.output
        assert "hi from __main__" in result.output and "made" in result.output
        # what the child's prelude set before bash took over: its own user, the limits, its own network
        # namespace (only loopback), and no way to write outside the repository
        result = box.run_sync(
            path, "id -u; ulimit -v; ulimit -t; tail -n +3 /proc/self/net/dev; touch /etc/tidal-x"
        )
        uid, memory_kib, cpu_s, *interfaces = result.output.strip().splitlines()[:-1]
        assert int(uid) != 0 and int(memory_kib) == 1024 * 1024 and int(cpu_s) == 6, result.output
        assert [line.split(":")[0].strip() for line in interfaces] == ["lo"], result.output
        assert result.returncode != 0 and "Permission denied" in result.output
        assert not Path("/etc/tidal-x").exists()


def test_all_or_nothing_pays_for_the_fix_and_nothing_for_leaving_the_repository_alone():
    """The share of hidden tests pays a do-nothing agent what the unchanged repository passes; RL on a real
    model learnt exactly that (benchmarks/results/swe_rl_smollm2_h100.json). `all_or_nothing` pays 0 for it."""
    submit_only = [tool_call_text("submit", {})]
    for all_or_nothing, unchanged in ((False, "share"), (True, 0.0)):
        env = SweEnv(timeout=5, all_or_nothing=all_or_nothing)
        task = env.task(1)
        idle = asyncio.run(run_episode(env, task, Agent(submit_only)))
        passed, total = run_hidden_tests(env.repo(task), {}, env.box)
        assert idle.reward == (passed / total if unchanged == "share" else 0.0)
        assert 0 < passed < total
        demo = env.demonstration(task)
        assert demo is not None
        fixed = asyncio.run(
            run_episode(env, task, Agent([m["content"] for m in demo if m["role"] == "assistant"]))
        )
        assert fixed.reward == 1.0
