"""swe: fix a bug in a small Python repository with a shell and file tools; reward: the hidden tests.

Each episode gets its own copy of a repository (`tidal.envs.swe_repos`: generated with a seeded bug, or a
user's JSONL) in a temporary directory. The tools act on that copy:
- `bash(command)`: runs in `RepoSandbox` (bubblewrap where it works: no network, the repository the only
  writable directory besides a private /tmp, CPU, memory, process and time limits);
- `read_file(path)`, `write_file(path, content)`, `str_replace(path, old, new)`: paths inside the repository
  only (no absolute paths, no `..`, no symlink out of it);
- `submit()`: ends the episode.

When the episode ends (submit, an answer without a tool call, or the turn budget), the files the agent
changed are kept in `episode.info["changes"]` and the copy is deleted. The reward copies the original
repository afresh, applies those changes, adds the hidden tests and runs them in a new sandbox (a reward
worker): the share that pass. Rollouts that never submit are scored the same way (`swe/submitted` says
which did), unless `require_submit` pays them 0.
"""

import contextvars
import functools
import logging
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from tidal.envs.base import Episode, Sampler, Task
from tidal.envs.code_tests import tests_reward
from tidal.envs.multiturn import Message
from tidal.envs.repo_sandbox import RepoSandbox
from tidal.envs.repo_sandbox import workspace as repo_workspace
from tidal.envs.reward_pool import call_off_loop
from tidal.envs.sandbox import Execution
from tidal.envs.splits import SplitTasks, check_split
from tidal.envs.swe_repos import (
    HIDDEN_FILE,
    Repo,
    check_relative,
    generate_repo,
    hidden_runner,
    read_result,
    read_user_repos,
)
from tidal.envs.tools import (
    Tool,
    ToolCall,
    ToolEnv,
    call_tool,
    tool_call_text,
    truncate,
    with_tools,
)

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You fix bugs in a Python repository. Use the tools to look at the code and run the tests, change the "
    "code, and call submit when the tests pass."
)
MAX_FILE_CHARS = 20_000
"""read_file shows at most this much of a file; write_file refuses more."""
_WORKSPACE: contextvars.ContextVar[Path] = contextvars.ContextVar("swe_workspace")
"""The repository copy of the episode the running rollout task plays (rollouts run concurrently)."""


def _schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _string(description: str, example: str | None = None) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "string", "description": description}
    if example is not None:
        prop["examples"] = [example]
    return prop


def inside(repo: Path, name: str) -> Path:
    """`name` resolved inside `repo`; ValueError for a path that leaves it (absolute, `..`, a symlink out)."""
    check_relative(str(name), "tool")
    path = (repo / name).resolve()
    if path != repo.resolve() and repo.resolve() not in path.parents:
        raise ValueError(f"path {name!r} leaves the repository")
    return path


class SweEnv(ToolEnv):
    """Reward: share of the hidden tests passing after the agent's changes (`all_or_nothing`: 1 when every
    one passes, else 0); tools: bash, read_file, write_file, str_replace, submit.

    The share pays for leaving the repository alone: a seeded bug fails only some hidden tests, so an agent
    that changes nothing scores what the unchanged repository passes, and sampled edits that break the
    module score below it; RL on a real model learnt to change nothing (examples/swe/README.md).
    `all_or_nothing` pays only for a fix, as the RL recipes set it. `require_submit` pays 0 to an episode
    that never called submit (its hidden tests still run, for the metrics): RL on a real model stopped
    submitting and ran every episode to the turn budget when that cost nothing (examples/swe/README.md)."""

    name = "swe"
    max_turns = 12

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        repos: str | None = None,
        split: str = "train",
        max_turns: int = 12,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        sandbox: str = "auto",
        max_output: int = 2000,
        max_context_tokens: int | None = None,
        all_or_nothing: bool = False,
        require_submit: bool = False,
    ):
        if max_turns < 1 or timeout <= 0 or memory_mb <= 0 or max_output < 100:
            raise ValueError("swe: need max_turns ≥ 1, timeout > 0, memory_mb > 0 and max_output ≥ 100")
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError("swe: max_context_tokens must be positive (or left out: the server's context)")
        # the episode's token budget: it ends before a turn whose prompt would be longer
        self.max_context_tokens = max_context_tokens
        self.box = RepoSandbox(timeout=timeout, memory_mb=memory_mb, max_output=max_output, mode=sandbox)
        self.max_turns, self.max_output = max_turns, max_output
        self.all_or_nothing, self.require_submit = all_or_nothing, require_submit
        self.tool_timeout = timeout + 5  # the sandbox's own timeout fires first
        self.split = check_split(split, "swe")
        self.num_examples = num_examples
        if repos is not None:
            listed = read_user_repos(repos)
            self._repos = SplitTasks(lambda i: listed[i % len(listed)], lambda r: r.repo_id, split)
        else:
            self._repos = SplitTasks(functools.partial(generate_repo, seed=seed), lambda r: r.repo_id, split)
        super().__init__(self._tools(), rewards=[])

    def _tools(self) -> list[Tool]:
        return [
            Tool(
                "bash",
                "Run a shell command in the repository (no network); returns its output.",
                _schema({"command": _string("The command.", "python -m unittest discover -s tests -t .")}),
                self._bash,
            ),
            Tool(
                "read_file", "A file of the repository.", _schema({"path": _string("Relative path.")}), _read
            ),
            Tool(
                "write_file",
                "Write a file of the repository (the whole text).",
                _schema({"path": _string("Relative path."), "content": _string("The new text.")}),
                _write,
            ),
            Tool(
                "str_replace",
                "Replace the one occurrence of `old` in a file by `new`.",
                _schema(
                    {
                        "path": _string("Relative path."),
                        "old": _string("Exact text."),
                        "new": _string("Text."),
                    }
                ),
                _replace,
            ),
            Tool("submit", "Finish: your changes are tested.", {"type": "object", "properties": {}}, _submit),
        ]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        repo = self._repos[index]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": repo.statement}]
        return Task(task_id=f"swe/{repo.repo_id}", messages=messages, info={"index": index})

    def repo(self, task: Task) -> Repo:
        return self._repos[task.info["index"]]

    # ---- the episode's repository ----------------------------------------------------------------------

    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        with repo_workspace("tidal-swe-") as workspace:
            write_files(workspace, self.repo(task).files)
            token = _WORKSPACE.set(workspace)
            try:
                episode = await super().rollout(task, sampler)
            finally:
                _WORKSPACE.reset(token)
            episode.info["changes"] = changed_files(workspace, self.repo(task).files)
            return episode

    def setup_episode(self, task: Task, episode: Episode) -> None:
        super().setup_episode(task, episode)
        episode.info.update(submitted=False)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        replies = await super().env_response(task, episode)
        if episode.info.get("submitted"):
            return None  # submit ends the episode; what else the turn called has run
        return replies

    async def run_call(self, call: ToolCall, episode: Episode) -> str:
        """The call on this episode's repository; a `submit` also marks the episode to end after this turn."""
        tool = self.tools.get(call.name)
        if call.error is None and call.name == "submit":
            episode.info["submitted"] = True
        if call.error is not None or tool is None:
            return await super().run_call(call, episode)
        bound = replace(tool, fn=functools.partial(tool.fn, _WORKSPACE.get()))
        return await call_tool(bound, call.arguments, self.tool_timeout)

    async def _bash(self, workspace: Path, command: str) -> str:
        return self._shown(await self.box.run(workspace, str(command)))

    def _shown(self, result: Execution) -> str:
        """What the model sees of a command: its output (truncated with a marker), after its exit status or
        the timeout when it did not succeed."""
        text = truncate(result.output, self.max_output) if result.output.strip() else "(no output)"
        if result.timed_out:
            return f"error: timed out after {self.box.timeout:g} s\n{text}"
        return f"exit status {result.returncode}\n{text}" if result.returncode else text

    # ---- reward --------------------------------------------------------------------------------------------

    async def score(self, task: Task, episode: Episode) -> None:
        await super().score(task, episode)
        repo = self.repo(task)
        passed, total = await call_off_loop(run_hidden_tests, repo, episode.info.get("changes", {}), self.box)
        submitted = bool(episode.info.get("submitted"))
        episode.reward = tests_reward(passed, total, self.all_or_nothing)  # total ≥ 1 (`_count_hidden`)
        if self.require_submit and not submitted:
            episode.reward = 0.0
        episode.metrics.update(
            {
                "swe/hidden_passed": float(passed),
                "swe/hidden_total": float(total),
                "swe/submitted": float(submitted),
                "swe/files_changed": float(len(episode.info.get("changes", {}))),
            }
        )

    def demonstration(self, task: Task) -> list[Message] | None:
        """Read the module, write the fixed file, run the tests (their last line), submit (generated
        repositories; None for a user's, whose fix is not known). The tool results are the real ones."""
        repo = self.repo(task)
        if not repo.fix:
            return None
        schemas = [tool.schema() for tool in self.tools.values()]
        messages: list[Message] = with_tools(task.messages, schemas)  # rendered as the rollout renders them
        ((path, fixed),) = repo.fix.items()
        check = f"{repo.test_command} 2>&1 | tail -n 1"  # "OK": a result that does not vary with timing
        with repo_workspace("tidal-swe-demo-") as workspace:
            write_files(workspace, repo.files)
            steps = [
                ("read_file", {"path": path}, _read(workspace, path)),
                ("write_file", {"path": path, "content": fixed}, _write(workspace, path, fixed)),
                ("bash", {"command": check}, self._shown(self.box.run_sync(workspace, check))),
            ]
        for name, arguments, result in steps:
            messages += [
                {"role": "assistant", "content": tool_call_text(name, arguments)},
                {"role": "tool", "content": result},
            ]
        return [*messages, {"role": "assistant", "content": tool_call_text("submit", {})}]


def _read(workspace: Path, path: str) -> str:
    target = inside(workspace, str(path))
    if not target.is_file():
        return f"error: no file {path!r}"
    return truncate(target.read_text(errors="replace"), MAX_FILE_CHARS)


def _write(workspace: Path, path: str, content: str) -> str:
    if len(str(content)) > MAX_FILE_CHARS:
        return f"error: content longer than {MAX_FILE_CHARS} characters"
    target = inside(workspace, str(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(str(content))
    return f"wrote {path} ({len(str(content))} characters)"


def _replace(workspace: Path, path: str, old: str, new: str) -> str:
    target = inside(workspace, str(path))
    if not target.is_file():
        return f"error: no file {path!r}"
    text = target.read_text(errors="replace")
    count = text.count(str(old)) if old else 0
    if count != 1:
        return f"error: `old` occurs {count} times in {path}; it must occur exactly once"
    target.write_text(text.replace(str(old), str(new), 1))
    return f"replaced in {path}"


def _submit(workspace: Path) -> str:
    return "submitted: your changes go to the hidden tests"  # `SweEnv.run_call` has marked the episode to end


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def changed_files(workspace: Path, original: dict[str, str]) -> dict[str, str]:
    """The text files the agent added or changed, by relative path (a deleted file is not a change the
    hidden tests see: they start from the original files); caches, symlinks and the hidden tests' path
    are left out."""
    changes = {}
    for path in sorted(workspace.rglob("*")):
        if path.is_symlink() or not path.is_file() or "__pycache__" in path.parts:
            continue
        name = path.relative_to(workspace).as_posix()
        if name == HIDDEN_FILE:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if original.get(name) != text and len(text) <= MAX_FILE_CHARS:
            changes[name] = text
    return changes


def run_hidden_tests(repo: Repo, changes: dict[str, str], box: RepoSandbox) -> tuple[int, int]:
    """(passed, total) of the hidden tests on a fresh copy of `repo` with `changes` applied (a reward worker
    calls it: synchronous). A run that crashes or times out passes none of them."""
    nonce = secrets.token_hex(8)
    with repo_workspace("tidal-swe-tests-") as workspace:
        write_files(workspace, {**repo.files, **changes, **repo.hidden_tests})
        runner = workspace / f".tidal_hidden_{nonce}.py"
        runner.write_text(hidden_runner(nonce, sorted(repo.hidden_tests)))
        result = box.run_sync(workspace, f"python {runner.name}")
    counted = read_result(result.output, nonce)
    total = _count_hidden(repo)
    if counted is None:
        if not result.timed_out:  # the agent's code can crash the runner; so can a broken sandbox: show it
            _crashed(repo.repo_id, result.returncode, result.output)
        return 0, total
    passed, seen = counted
    return min(passed, total), max(total, seen) if seen else total


_CRASHES_SHOWN = [0]
"""Crashed hidden-test runs logged by this process: the first few, each with the end of its output."""


def _crashed(repo_id: str, returncode: int | None, output: str) -> None:
    if _CRASHES_SHOWN[0] >= 3:
        return
    _CRASHES_SHOWN[0] += 1
    tail = " | ".join(output.strip().splitlines()[-3:])[:400]
    logger.warning(
        "swe: the hidden tests of %s ended without a result (exit %s): %s", repo_id, returncode, tail
    )


def _count_hidden(repo: Repo) -> int:
    """How many test methods the hidden modules define (what a crashed run is out of)."""
    return sum(text.count("\n    def test") for text in repo.hidden_tests.values()) or 1
