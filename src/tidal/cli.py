"""`tidal <command> @ a.toml @ b.toml --dotted.key value`: parse, validate, then hand over to the command.

Only config modules are imported before a command runs, so `--help`, `--dry-run` and config errors are fast
(no torch import on those paths).
"""

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from tidal import __version__
from tidal.config.help import render_help
from tidal.config.loader import ParsedArgs, load_config, parse_args
from tidal.errors import USER_ERRNOS, UserError, first_line


@dataclass(frozen=True)
class Command:
    """A CLI command: its config schema and its entry point, both as lazy `module:attr` references."""

    schema: str
    entry: str
    summary: str
    dry_run: str | None = None
    """`module:function(config) -> str` printing what --dry-run shows (default: the resolved config)."""
    positional: str | None = None
    """The key a first bare argument sets (`tidal plot outputs/rl` = `tidal plot --output-dir outputs/rl`)."""
    as_run: str | None = None
    """`module:function(config) -> config`: the config as the command runs it, where it derives values
    beyond validation (--help shows those as the defaults)."""


COMMANDS: dict[str, Command] = {
    "rl": Command(
        "tidal.config.rl:RLConfig",
        "tidal.deploy.run:rl_main",
        "Asynchronous RL: starts vLLM inference, the orchestrator and the trainer from one config.",
        dry_run="tidal.deploy.run:rl_dry_run",
        as_run="tidal.launcher.rl:as_run",
    ),
    "node": Command(
        "tidal.config.node:NodeConfig",
        "tidal.deploy.node:main",
        "One node's share of a cluster `tidal rl` (the Slurm job starts it on every node).",
    ),
    "sft": Command(
        "tidal.config.sft:SFTConfig",
        "tidal.deploy.run:sft_main",
        "Supervised fine-tuning on chat conversations (loss on assistant tokens; FSDP2 under torchrun, which "
        "it starts itself for several ranks, here or on Slurm or Kubernetes).",
        dry_run="tidal.deploy.run:sft_dry_run",
    ),
    "sft-node": Command(
        "tidal.config.node:SFTNodeConfig",
        "tidal.deploy.node:sft_main",
        "One node's share of a cluster `tidal sft` (the Slurm job or each pod starts it on every node).",
    ),
    "inference": Command(
        "tidal.config.inference:InferenceConfig",
        "tidal.inference.server:main",
        "Serve a model with vLLM (OpenAI API + pause, weight updates, LoRA) for RL.",
    ),
    "orchestrator": Command(
        "tidal.config.rl:OrchestratorConfig",
        "tidal.orchestrator.loop:main",
        "Roll out tasks against inference, score, build batches and ship them to the trainer.",
    ),
    "eval": Command(
        "tidal.config.eval:EvalConfig",
        "tidal.eval.runner:main",
        "Evaluate a model on environments: k samples per task, avg@k and pass@k with confidence intervals.",
        dry_run="tidal.eval.runner:dry_run",
    ),
    "trainer": Command(
        "tidal.config.rl:RLTrainerConfig",
        "tidal.trainer.rl:main",
        "RL trainer: one optimizer step per batch, then publish weights (FSDP2 under torchrun).",
    ),
    "convert": Command(
        "tidal.config.convert:ConvertConfig",
        "tidal.models.gguf:convert_command",
        "Convert a GGUF model file into a Hugging Face directory (what model.name = 'x.gguf' does on first "
        "use): `tidal convert model.gguf [--output-dir DIR]`.",
        positional="gguf",
    ),
    "plot": Command(
        "tidal.config.plot:PlotConfig",
        "tidal.monitor.plot:main",
        "Draw an RL run (finished, running or crashed) as <output_dir>/plots/rl.png: `tidal plot <output_dir>`.",
        positional="output_dir",
    ),
}


def _load(ref: str) -> object:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _as_toml(config: BaseModel) -> str:
    import tomli_w  # only here: the GPU machines run tidal without it

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: tidal <command> [@ config.toml ...] [--key.path value ...] [--dry-run] [--help | --help-all]",
        "       tidal --version",
        "",
        "tidal: asynchronous RL post-training for LLMs (real vLLM inference, FSDP2 trainer, orchestrator).",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += [
        "",
        "Run `tidal <command> --help` for that command's main options, `--help-all` for all of them.",
        'configs/debug/ holds the smallest config that starts each command alone (README, "Debug configs").',
    ]
    return "\n".join(lines)


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def version() -> str:
    """The installed distribution's version (the source tree's when tidal runs uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tidal")
    except PackageNotFoundError:
        return __version__


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader went away (`tidal rl --help | head`): nothing left to say, and Python's flush at exit
        # would raise again on the closed pipe, so stdout is pointed at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


def _main(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help", "--help-all"):
        print(_usage())
        sys.stdout.flush()
        sys.exit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        print(f"tidal {version()}")
        sys.exit(0)
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"tidal: error: unknown command {name!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_command(name, command, rest))


def _resolved(command: Command, schema: type[BaseModel], parsed: ParsedArgs) -> BaseModel | None:
    """The config the command would run with, for --help's defaults; None while it does not validate."""
    try:
        config = load_config(schema, parsed.files, parsed.overrides)
        derive = _load(command.as_run) if command.as_run else None
        return derive(config) if callable(derive) else config
    except UserError:
        return None


def os_error_line(exc: OSError, config: BaseModel | None) -> str:
    """`<path>: <reason>`: the file the error names, else the run's output directory (a failed write()
    names no file)."""
    path = exc.filename or getattr(config, "output_dir", None)
    reason = exc.strerror or first_line(exc)
    return f"{path}: {reason}" if path is not None else reason


def run_command(name: str, command: Command, argv: Sequence[str]) -> int:
    schema = _load(command.schema)
    assert isinstance(schema, type) and issubclass(schema, BaseModel)
    if command.positional and argv and not argv[0].startswith(("-", "@")):
        argv = [f"--{command.positional.replace('_', '-')}", *argv]
    config: BaseModel | None = None
    try:
        parsed = parse_args(argv)
        if parsed.help:
            print(
                render_help(
                    name, command.summary, schema, _resolved(command, schema, parsed), parsed.help_all
                )
            )
            sys.stdout.flush()
            return 0
        config = load_config(schema, parsed.files, parsed.overrides)
        if parsed.dry_run:
            show = _load(command.dry_run) if command.dry_run else None
            print(show(config) if callable(show) else _as_toml(config), end="")
            return 0
        entry = _load(command.entry)
        assert callable(entry)
        result = entry(config)
        return int(result or 0)
    except UserError as exc:
        if _is_main_rank():
            print(f"tidal {name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in USER_ERRNOS:
            raise
        # a full disk, a read-only or missing directory: the user's to fix, so one line naming the path
        if _is_main_rank():
            print(f"tidal {name}: error: {os_error_line(exc, config)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if _is_main_rank():
            print(f"tidal {name}: interrupted", file=sys.stderr)
        return 130
