"""Config loading: merging, overrides, help, dry-run, and one-line errors (exit 2) for bad configs."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO, run_tidal
from tidal.config.loader import load_config, load_raw, parse_args, parse_value
from tidal.config.sft import SFTConfig
from tidal.errors import UserError

BASE = """
output_dir = "out"
max_steps = 20
[data.train]
type = "builtin"
[optim]
lr = 1e-3
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_parse_value_reads_toml_literals_and_falls_back_to_strings():
    assert parse_value("3e-4") == pytest.approx(3e-4)
    assert parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value("/tmp/out") == "/tmp/out"
    assert parse_value("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_files_merge_left_to_right_then_cli_overrides(tmp_path):
    base = write(tmp_path, "base.toml", BASE)
    over = write(tmp_path, "over.toml", "[optim]\nweight_decay = 0.1\n[data]\nbatch_size = 8\n")
    args = parse_args(
        [
            "@",
            base,
            f"@{over}",
            "--optim.lr",
            "5e-4",
            "--max-steps",
            "7",
            "--output-dir",
            "/tmp/x",
            "--no-data.shuffle",
        ]
    )
    config = load_config(SFTConfig, args.files, args.overrides)
    assert config.optim.lr == pytest.approx(5e-4)  # CLI beats files
    assert config.optim.weight_decay == pytest.approx(0.1)  # second file merged into first's table
    assert config.data.batch_size == 8 and config.data.shuffle is False
    assert config.max_steps == 7 and str(config.output_dir) == "/tmp/x"


def test_lists_replace_instead_of_merging(tmp_path):
    base = write(tmp_path, "base.toml", BASE + "betas = [0.9, 0.99]\n")
    over = write(tmp_path, "over.toml", "[optim]\nbetas = [0.8, 0.95]\n")
    raw = load_raw([base, over], [])
    assert raw.data["optim"]["betas"] == [0.8, 0.95]
    assert raw.sources[("optim", "betas")] == over


def test_dry_run_prints_resolved_config_that_round_trips(tmp_path):
    base = write(tmp_path, "base.toml", BASE)
    result = run_tidal("sft", "@", base, "--optim.lr", "7e-4", "--dry-run")
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["optim"]["lr"] == pytest.approx(7e-4)
    assert printed["data"]["train"]["type"] == "builtin"
    assert SFTConfig.model_validate(printed).optim.lr == pytest.approx(7e-4)


def test_help_lists_fields_with_docs_and_does_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from tidal.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n        main(['sft', '--help'])\n    except SystemExit as e:\n        assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'help imported torch'\n"
        "print(buf.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "--optim.lr FLOAT" in result.stdout and "Peak learning rate" in result.stdout
    assert "--max-steps" in result.stdout and "--output-dir" in result.stdout


def test_unknown_command_and_top_level_help():
    assert run_tidal("frobnicate").returncode == 2
    result = run_tidal("--help")
    assert result.returncode == 0 and "sft" in result.stdout


BAD_CONFIGS = [
    # (name, file text, extra CLI args, expected fragments of the one-line error)
    ("unknown_key", BASE + "lrr = 1\n", [], ["bad.toml", "optim.lrr", "unknown key", "optim.lr"]),
    ("unknown_table", BASE + "[optimizer]\nlr = 1\n", [], ["bad.toml", "optimizer", "unknown key"]),
    (
        "wrong_type",
        BASE.replace("max_steps = 20", 'max_steps = "many"'),
        [],
        ["bad.toml", "max_steps", "integer"],
    ),
    ("negative_lr", BASE.replace("lr = 1e-3", "lr = -1e-3"), [], ["bad.toml", "optim.lr", "greater than 0"]),
    ("zero_batch", BASE + "[data]\nbatch_size = 0\n", [], ["bad.toml", "data.batch_size", "greater than 0"]),
    ("toml_syntax", BASE + "[optim\n", [], ["bad.toml", "invalid TOML"]),
    ("bad_literal", BASE.replace("lr = 1e-3", "lr = "), [], ["bad.toml", "invalid TOML"]),
    ("missing_required", 'output_dir = "out"\n', [], ["bad.toml", "data", "missing required key"]),
    ("bad_variant", BASE.replace('type = "builtin"', 'type = "s3"'), [], ["bad.toml", "data.train"]),
    (
        "missing_variant_field",
        BASE.replace('type = "builtin"', 'type = "file"'),
        [],
        ["bad.toml", "data.train.path", "missing"],
    ),
    ("bad_literal_choice", BASE + '[scheduler]\ntype = "exponential"\n', [], ["bad.toml", "scheduler.type"]),
    (
        "warmup_too_long",
        BASE + "[scheduler]\nwarmup_steps = 50\n",
        [],
        ["bad.toml", "scheduler.warmup_steps", "longer than max_steps"],
    ),
    ("bad_betas", BASE + "betas = [0.9, 1.5]\n", [], ["bad.toml", "optim.betas", "[0, 1)"]),
    ("cli_unknown_key", BASE, ["--optim.lrr", "1"], ["command line", "optim.lrr", "unknown key"]),
    ("cli_wrong_type", BASE, ["--max-steps", "abc"], ["command line", "max_steps"]),
    ("cli_combination", BASE, ["--scheduler.warmup-steps", "99"], ["command line", "scheduler.warmup_steps"]),
    ("stray_argument", BASE, ["oops"], ["unexpected argument"]),
    (
        # the file's warmup is fine; the flag made it too long: blame the flag, name the file's key
        "flag_breaks_file_key",
        BASE.replace("max_steps = 20", "max_steps = 100") + "[scheduler]\nwarmup_steps = 50\n",
        ["--max-steps", "40"],
        ["command line: max_steps:", "longer than max_steps (40)", "scheduler.warmup_steps from", "bad.toml"],
    ),
    (
        "ep_does_not_divide_ranks",
        BASE + "[deployment]\nnum_trainer_ranks = 3\n",
        ["--perf.ep", "2"],
        ["command line: perf.ep:", "do not divide the 3 trainer rank(s)"],
    ),
    ("negative_aux_loss", BASE + "[moe]\naux_loss_coef = -1\n", [], ["bad.toml", "moe.aux_loss_coef"]),
    (
        "cp_does_not_divide_ranks",
        BASE + "[deployment]\nnum_trainer_ranks = 3\n",
        ["--perf.cp", "2"],
        ["command line: perf.cp:", "do not divide the 3 trainer rank(s)"],
    ),
    (
        "cp_does_not_divide_a_replica",
        BASE + "[deployment]\nnum_trainer_ranks = 4\n[perf]\nreplicate = 2\n",
        ["--perf.cp", "4"],
        ["command line: perf.cp:", "do not divide the 2 ranks of each replica"],
    ),
    (
        "fsdp_off_with_several_ranks",
        BASE + "[deployment]\nnum_trainer_ranks = 2\n",
        ["--perf.fsdp", "false"],
        ["command line: perf.fsdp:", "2 trainer ranks shard the model with FSDP2"],
    ),
    (
        "fsdp_off_with_cpu_offload",
        BASE + "[perf]\ncpu_offload = true\n",
        ["--perf.fsdp", "false"],
        ["perf.fsdp:", "cpu_offload is FSDP2's offload policy"],
    ),
    (
        "save_mlp_layers_with_matmuls",
        BASE + '[perf]\nactivation_checkpointing = "matmuls"\n',
        ["--perf.save-mlp-layers", "3"],
        ["perf.save_mlp_layers:", "keeps gate and up in every layer already"],
    ),
    (
        "cp_with_hf_attention",
        BASE + '[deployment]\nnum_trainer_ranks = 2\n[perf]\nattention = "hf"\n',
        ["--perf.cp", "2"],
        ["perf.cp:", "attention = 'hf'", "'auto' or 'varlen'"],
    ),
]


def test_a_checkpoint_interval_longer_than_the_run_is_accepted():
    """The trainers checkpoint the end of a run too, so an interval past max_steps means "at the end"."""
    assert load_config(SFTConfig, [], [("data.train.type", "builtin")]).ckpt.interval == 50
    short = load_config(SFTConfig, [], [("data.train.type", "builtin"), ("max_steps", 3)])
    assert short.ckpt.interval == 50
    given = load_config(
        SFTConfig, [], [("data.train.type", "builtin"), ("max_steps", 3), ("ckpt.interval", 100)]
    )
    assert given.ckpt.interval == 100


@pytest.mark.parametrize("name,text,extra,fragments", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_gives_one_line_and_exit_2(tmp_path, name, text, extra, fragments):
    path = write(tmp_path, "bad.toml", text)
    result = run_tidal("sft", "@", path, *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (tmp_path / "out").exists()  # nothing started


def test_missing_file_is_named(tmp_path):
    missing = str(tmp_path / "nope.toml")
    result = run_tidal("sft", "@", missing)
    assert result.returncode == 2
    assert result.stderr.strip() == f"tidal sft: error: {missing}: no such config file"


def test_in_process_errors_are_user_errors(tmp_path):
    path = write(tmp_path, "bad.toml", BASE + "lrr = 1\n")
    with pytest.raises(UserError) as info:
        load_config(SFTConfig, [path], [])
    assert info.value.exit_code == 2


def test_changing_a_variant_type_replaces_the_table(tmp_path):
    base = write(
        tmp_path, "base.toml", BASE.replace('type = "builtin"', 'type = "builtin"\nname = "reverse_text"')
    )
    over = write(tmp_path, "over.toml", '[data.train]\ntype = "file"\npath = "x.jsonl"\n')
    config = load_config(SFTConfig, [base, over], [])
    assert config.data.train.type == "file"
    args = parse_args(["@", base, "--data.train", '{type = "hf", id = "org/data"}'])
    config = load_config(SFTConfig, args.files, args.overrides)
    assert config.data.train.type == "hf" and config.data.train.id == "org/data"


SHADOWED_BY_TOP_LEVEL = [
    # (table text of a `tidal rl` file, key the error names, the top-level key it says to set)
    ("[trainer]\ntemperature = 0.7\n", "trainer.temperature", "orchestrator.sampling.temperature"),
    ("[orchestrator]\nmax_async_level = 3\n", "orchestrator.max_async_level", "max_async_level"),
    ('[orchestrator]\noutput_dir = "elsewhere"\n', "orchestrator.output_dir", "output_dir"),
    ("[orchestrator]\nmax_steps = 999\n", "orchestrator.max_steps", "max_steps"),
    ("[trainer]\nseed = 5\n", "trainer.seed", "seed"),
    ("[trainer]\nresume = true\n", "trainer.resume", "resume"),
    ('[trainer.model]\nname = "other/model"\n', "trainer.model", "model"),
    ('[orchestrator.model]\ndtype = "float32"\n', "orchestrator.model", "model"),
    ('[inference.model]\nname = "other/model"\n', "inference.model", "model"),
    ('[trainer.transport]\ntype = "zmq"\n', "trainer.transport", "transport"),
    ('[orchestrator.transport]\ntype = "filesystem"\nkeep_last = 9\n', "orchestrator.transport", "transport"),
    ('[orchestrator.client]\nurls = ["http://x:1"]\n', "orchestrator.client.urls", "inference.server"),
    ("[orchestrator.batch]\nnum_trainer_ranks = 2\n", "orchestrator.batch.num_trainer_ranks", "deployment"),
    ("[orchestrator.batch]\ncp = 1\n", "orchestrator.batch.cp", "trainer.perf.cp"),
    ("[inference.vllm]\nseed = 3\n", "inference.vllm.seed", "seed"),
    (
        '[inference.cpu]\nomp_threads_bind = "1"\n',
        "inference.cpu.omp_threads_bind",
        "deployment.inference_cpus",
    ),
]


@pytest.mark.parametrize("text,key,top", SHADOWED_BY_TOP_LEVEL, ids=[c[1] for c in SHADOWED_BY_TOP_LEVEL])
def test_rl_rejects_a_sub_table_key_that_tidal_rl_sets_from_the_top(tmp_path, text, key, top):
    """Before: `tidal rl` overwrote the sub-table's value with the top-level one without a word."""
    from tidal.config.rl import RLConfig

    path = write(tmp_path, "rl.toml", "max_steps = 5\n" + text)
    with pytest.raises(UserError) as info:
        load_config(RLConfig, [path], [])
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: ") and "\n" not in message, message
    assert f"`{top}" in message, message
    assert info.value.exit_code == 2


def test_rl_sub_table_keys_tidal_rl_does_not_set_are_kept(tmp_path):
    from tidal.config.rl import RLConfig
    from tidal.launcher.split import run_admin_token, split_config

    text = "[orchestrator.sampling]\ntemperature = 0.7\n[orchestrator.batch]\nnum_prompts = 4\n"
    text += '[orchestrator.client]\nadmin_token = "t"\n[trainer]\nnum_threads = 1\n'
    config = load_config(RLConfig, [write(tmp_path, "rl.toml", text)], [("trainer.optim.lr", 1e-6)])
    roles = split_config(config, on_gpu=False, num_cpus=4)
    assert roles.trainer.temperature == 0.7 and roles.orchestrator.batch.num_prompts == 4
    assert roles.trainer.num_threads == 1
    # the token is kept too, but travels in the environment only (tidal.launcher.split.run_admin_token)
    assert run_admin_token(config, {}, shared=True) == "t" and roles.orchestrator.client.admin_token is None


SHIPPED_CONFIGS = sorted(
    p
    for p in (REPO / "examples").glob("*/*.toml")
    if p.name != "pyproject.toml"  # a package's, not a run's
) + sorted((REPO / "configs").glob("*/*.toml"))


SFT_OVERLAY_BASE = str(REPO / "configs/ci/sft_tiny.toml")
"""SFT overlays (`*_sft_*`) validate on top of this run config: alone they have no data."""


def _schema_for(path: Path) -> str:
    stem = path.stem
    if "_sft_" in stem:
        return "tidal.config.sft:SFTConfig"
    for prefix, schema in [
        ("rl", "tidal.config.rl:RLConfig"),
        ("async_overlap", "tidal.config.rl:RLConfig"),
        ("async_node", "tidal.config.rl:RLConfig"),
        ("slurm", "tidal.config.rl:RLConfig"),  # overlays on an rl config; each also validates alone
        ("k8s_", "tidal.config.rl:RLConfig"),  # overlays on a run config (examples/cluster/)
        ("sft", "tidal.config.sft:SFTConfig"),
        ("eval", "tidal.config.eval:EvalConfig"),
        ("infer", "tidal.config.inference:InferenceConfig"),
        ("orchestrator", "tidal.config.rl:OrchestratorConfig"),
        ("trainer", "tidal.config.rl:RLTrainerConfig"),
    ]:
        if stem.startswith(prefix):
            return schema
    raise AssertionError(f"{path}: which command is this config for?")


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[str(p.relative_to(REPO)) for p in SHIPPED_CONFIGS])
def test_every_shipped_config_validates(path, tmp_path, monkeypatch):
    import importlib

    if path.parent.name == "custom_env":  # names the example package's entry points: as if it were installed
        installed_example_metadata(tmp_path, monkeypatch)
    module, name = _schema_for(path).split(":")
    base = [SFT_OVERLAY_BASE] if "_sft_" in path.stem else []
    load_config(getattr(importlib.import_module(module), name), [*base, str(path)], [])


def installed_example_metadata(tmp_path, monkeypatch) -> None:
    """What `pip install examples/custom_env` leaves for importlib.metadata: its dist-info, entry points."""
    import tomllib

    project = tomllib.loads((REPO / "examples" / "custom_env" / "pyproject.toml").read_text())["project"]
    dist = tmp_path / "tidal_acronym-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0.1.0\n")
    entries = project["entry-points"]["tidal.environments"]
    lines = [f"{name} = {value}" for name, value in entries.items()]
    (dist / "entry_points.txt").write_text("[tidal.environments]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_eval_rejects_an_inference_model_it_would_replace_by_the_top_level_one(tmp_path):
    """Before: `tidal eval` served the top-level [model] and dropped [inference.model] without a word."""
    from tidal.config.eval import EvalConfig

    path = write(tmp_path, "eval.toml", '[inference.model]\nname = "other"\n')
    with pytest.raises(UserError) as info:
        load_config(EvalConfig, [path], [])
    assert str(info.value).startswith(f"{path}: inference.model: ") and "top-level [model]" in str(info.value)
    assert load_config(EvalConfig, [], [("model.name", "m")]).inference_config().model.name == "m"


def test_log_interval_picks_the_first_every_nth_and_last_step_and_rl_roles_have_no_progress_bar_key() -> None:
    """`log.interval` is what the RL trainer and orchestrator print by (it was read by `tidal sft` alone);
    `progress_bar` exists only where a bar is drawn, so setting it elsewhere is an error, not ignored."""
    from tidal.config.common import LogConfig
    from tidal.config.rl import OrchestratorConfig, RLTrainerConfig

    log = LogConfig(interval=4)
    assert [s for s in range(10) if log.prints(s, 10)] == [0, 3, 7, 9]
    assert [s for s in range(3) if LogConfig(interval=1).prints(s, 3)] == [0, 1, 2]
    for cls in (OrchestratorConfig, RLTrainerConfig):
        with pytest.raises(ValueError, match="progress_bar"):
            cls.model_validate({"log": {"progress_bar": False}})
