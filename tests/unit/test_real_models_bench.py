"""benchmarks/real_models.py's pure parts: which port each recipe gets and what its held-out eval is told.

Both cost a GPU round when wrong: two lr variants of one recipe on one port (the second never started), and a
held-out `tidal eval` that asked for vLLM's default share of a GPU other runs were using (refused at start).
"""

import json
from pathlib import Path

import pytest

from benchmarks import real_models
from benchmarks.real_models import Recipe, assign_ports, heldout_eval_args, port_of


def _recipes(specs: list[str], tmp_path: Path) -> list[Recipe]:
    return [Recipe(spec, "smollm2", "model.gguf", tmp_path) for spec in specs]


def test_every_recipe_gets_its_own_ports_and_directory(tmp_path: Path) -> None:
    recipes = _recipes(["tool_use@1e-4", "tool_use@3e-5", "alphabet_sort:short", "alphabet_sort"], tmp_path)
    assign_ports(recipes)
    tool_use = port_of(recipes[0].rl_config)
    assert [r.port for r in recipes[:2]] == [tool_use, tool_use + 2]
    assert recipes[2].rl_config.name == "rl_smollm2_short.toml"
    assert recipes[2].port == port_of(recipes[2].rl_config)
    assert recipes[3].port == port_of(recipes[3].rl_config)
    ports = {r.port for r in recipes} | {r.port + 5 for r in recipes}  # servers and their base evals
    assert len(ports) == 2 * len(recipes)
    assert len({r.dir for r in recipes}) == len(recipes)
    assert [r.dir.name for r in recipes[:3]] == ["tool_use_lr1e-4", "tool_use_lr3e-5", "alphabet_sort_short"]


def test_the_held_out_eval_takes_the_runs_gpu_share_unless_the_shared_flags_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = real_models.EXAMPLES / "alphabet_sort" / "rl_smollm2_short.toml"
    alone = heldout_eval_args(config, "model.gguf", tmp_path / "eval", 18785)  # EXTRA empty (--cpu)
    assert alone[alone.index("--inference.vllm.gpu-memory-utilization") + 1] == "0.2"  # the recipe's own
    monkeypatch.setattr(real_models, "EXTRA", list(real_models.SHARED_GPU_FLAGS))
    args = heldout_eval_args(config, "model.gguf", tmp_path / "eval", 18785)
    assert args.count("--inference.vllm.gpu-memory-utilization") == 1  # one value, the shared one
    assert args[args.index("--inference.vllm.gpu-memory-utilization") + 1] == "0.05"
    assert args[args.index("--inference.server.port") + 1] == "18785"
    written = (tmp_path / "heldout_eval.toml").read_text()
    assert 'split = "heldout"' in written
    assert "min_turns = 2" in written and "max_names = 2" in written
    assert json.loads(args[args.index("--inference.vllm.extra-args") + 1])[0] == "--kv-cache-memory-bytes"


def test_a_warm_up_length_per_recipe(tmp_path: Path) -> None:
    recipes = _recipes(["tool_use+12@3e-5", "tool_use+20", "tool_use"], tmp_path)
    assign_ports(recipes)
    assert [r.dir.name for r in recipes] == ["tool_use_w12_lr3e-5", "tool_use_w20", "tool_use"]
    assert recipes[0].sft_args()[-2:] == ["--max-steps", "12"]
    assert recipes[0].lr == "3e-5"
    assert recipes[0].commands == [] and recipes[0].base_eval is None  # __init__ set up what warm_up adds to
    assert "--max-steps" not in recipes[2].sft_args()  # the config's own steps
    assert len({r.port for r in recipes}) == 3
    with pytest.raises(SystemExit, match=r"\+4 names a warm-up"):
        Recipe("alphabet_sort+4", "smollm2", "model.gguf", tmp_path)


def test_a_recipe_that_asks_for_bwrap_runs_its_code_in_process_only_where_bwrap_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidal.config.loader import parse_value
    from tidal.envs import bwrap

    code, math = _recipes(["code", "math"], tmp_path)
    monkeypatch.setattr(bwrap, "probe", lambda: None)
    assert code.sandbox_fallback() == [] and "sandbox" not in code.notes
    monkeypatch.setattr(bwrap, "probe", lambda: "bwrap is not installed")
    assert math.sandbox_fallback() == []  # no environment of it asks for bwrap
    flag, value = code.sandbox_fallback()
    assert flag == "--orchestrator.env"
    envs = parse_value(value)  # what the command line makes of it
    assert envs[0]["name"] == "code" and envs[0]["kwargs"]["sandbox"] == "process"
    assert envs[0]["kwargs"]["generated"] is True  # the rest of the recipe's kwargs kept
    assert "bwrap is not installed" in code.notes["sandbox"]


def test_the_rl_run_gets_its_steps_and_intervals_and_the_config_reads_them(tmp_path: Path) -> None:
    from tidal.config.loader import load_config, parse_args
    from tidal.config.rl import RLConfig

    given = Recipe("swe", "qwen05b", "model.gguf", tmp_path, 10, eval_interval=4, samples_interval=2)
    default = Recipe("swe", "qwen05b", "model.gguf", tmp_path)
    args = given.rl_args("start")
    assert args[args.index("--orchestrator.online-eval.interval") + 1] == "4"
    assert not any("interval" in arg for arg in default.rl_args("start"))  # the recipe's own
    parsed = parse_args(args[1:])  # what `tidal rl` makes of them, sandbox fallback and all
    config = load_config(RLConfig, parsed.files, parsed.overrides)
    assert config.max_steps == 10
    assert config.orchestrator.online_eval.interval == 4 and config.orchestrator.samples.interval == 2
