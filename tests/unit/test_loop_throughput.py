"""The loop-throughput benchmark's arithmetic: binned generation rates, medians, thinning, start-up, goal verdicts.

Its runs need vLLM (and TRL and a GPU for the real numbers); nothing here starts a process."""

import math
import sys
import time
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports

from benchmarks.loop_throughput import (  # noqa: E402
    GOALS,
    REPO,
    comparison_config,
    engine_rates,
    generation_rates,
    goals,
    median_or_none,
    parse_args,
    rate_bins,
    rl_flags,
    server_phases,
    startup,
    startup_profile,
    thin,
    time_to_gain,
    trl_task,
    verdict,
    window_medians,
)


def test_rate_bins_chain_each_bin_to_the_previous_ones_last_sample() -> None:
    # counter sampled every 0.5 s from t=100: +50 tokens a sample while running, nothing while idle
    counter = [(100.0, 0.0), (100.5, 50.0), (101.0, 100.0), (101.5, 150.0), (102.0, 150.0), (102.5, 150.0)]
    running = [(100.5, 4.0), (101.0, 4.0), (101.5, 2.0), (102.0, 0.0), (102.5, 0.0)]
    rows = rate_bins(counter, running, origin=100.0, bin_s=1.0)
    # bins: [0,1) last (100.5, 50); [1,2) last (101.5, 150); [2,3) last (102.5, 150)
    assert [r["t"] for r in rows] == [1.5, 2.5]
    assert rows[0]["tokens_per_s"] == pytest.approx(100.0)  # 100 tokens from 100.5 to 101.5
    assert (rows[0]["running_min"], rows[0]["running_max"]) == (2.0, 4.0)
    assert rows[1]["tokens_per_s"] == 0.0
    assert (rows[1]["running_min"], rows[1]["running_max"]) == (0.0, 0.0)
    assert rate_bins([(0.0, 1.0)], [], origin=0.0, bin_s=1.0) == []  # one sample: no rate


def test_rate_bins_leave_running_unknown_where_the_server_did_not_answer() -> None:
    rows = rate_bins([(0.0, 0.0), (1.0, 10.0)], [(1.0, None)], origin=0.0, bin_s=1.0)
    assert rows == [{"t": 1.0, "tokens_per_s": 10.0, "running_min": None, "running_max": None}]


def test_generation_rates_median_over_generating_bins_and_mean_over_the_window() -> None:
    rows = [
        {"t": 1.0, "tokens_per_s": 500.0, "running_min": 8, "running_max": 8},  # before the window
        {"t": 2.0, "tokens_per_s": 1000.0, "running_min": 8, "running_max": 8},
        {"t": 3.0, "tokens_per_s": 900.0, "running_min": 3, "running_max": 8},
        {"t": 4.0, "tokens_per_s": 100.0, "running_min": 0, "running_max": 2},  # idle part of the time
        {"t": 5.0, "tokens_per_s": 1100.0, "running_min": 8, "running_max": 8},
        {"t": 6.0, "tokens_per_s": 0.0, "running_min": None, "running_max": None},  # unanswered
    ]
    rates = generation_rates(rows, 2.0, 6.0)
    assert rates["median_generating"] == 1000.0  # of 1000, 900, 1100
    assert rates["median_all_bins"] == 900.0  # of 1000, 900, 100, 1100, 0
    # tokens after t=2: 900 + 100 + 1100 + 0 over 4 s
    assert rates["window_mean"] == pytest.approx(525.0)
    assert (rates["bins_generating"], rates["bins"]) == (3, 5)
    empty = generation_rates(rows, 10.0, 20.0)
    assert empty["median_generating"] is None and empty["window_mean"] is None


def test_engine_rates_split_generation_into_steps_per_second_and_tokens_per_step() -> None:
    # (t, engine steps, their tokens, prompt tokens): 100 steps of 200 tokens a second while running, then idle
    engine = [
        (100.0, 0, 0, 0),
        (101.0, 100, 20000, 500),
        (102.0, 200, 40000, 1000),
        (103.0, 200, 40000, 1000),
    ]
    running = [(100.0, 250.0), (101.0, 250.0), (102.0, 10.0), (103.0, 0.0)]
    rates = engine_rates(engine, running, origin=100.0, start=0.0, end=3.0)
    assert rates == {
        "busy_seconds": 2.0, "steps_per_s": 100.0, "tokens_per_step": 200.0, "prompt_tokens_per_s": 500.0,
    }  # fmt: skip
    assert engine_rates(engine, running, origin=100.0, start=2.5, end=3.0)["steps_per_s"] is None


def test_median_or_none_skips_missing_and_nan() -> None:
    assert median_or_none([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert median_or_none([]) is None
    assert median_or_none([math.nan]) is None


def test_thin_keeps_first_last_and_at_most_the_limit() -> None:
    series = list(range(1001))
    kept = thin(series, 11)
    assert kept == list(range(0, 1001, 100))
    assert thin([1, 2, 3], 10) == [1, 2, 3]
    assert len(thin(list(range(7)), 4)) <= 4 and thin(list(range(7)), 4)[-1] == 6
    with pytest.raises(ValueError):
        thin(series, 1)


def test_startup_is_from_launch_to_the_first_records() -> None:
    assert startup(10.0, {0: 75.5, 1: 80.0}, {0: 40.25}) == {
        "launch_to_step0_trained_s": 65.5,
        "launch_to_first_orchestrator_step_s": 30.25,
    }
    assert startup(10.0, {}, {}) == {
        "launch_to_step0_trained_s": None,
        "launch_to_first_orchestrator_step_s": None,
    }


def test_window_medians_publish_and_load_over_the_window_steps() -> None:
    trainer = [{"step": s, "time/publish": p} for s, p in enumerate([5.0, 0.1, 0.2, 0.3, 9.0])]
    # the orchestrator's running totals: one update a step, 2 s at the start, then 0.05 s each
    orchestrator = [
        {"step": s, "weights/updates_total": s, "time/weight_updates_total": t}
        for s, t in enumerate([0.0, 2.0, 2.05, 2.10, 2.15])
    ]
    out = window_medians(trainer, orchestrator, first_step=1, last_step=3)
    assert out["trainer_publish_s_median"] == pytest.approx(0.2)
    assert out["load_s"] == pytest.approx([2.0, 0.05, 0.05])  # updates landing in steps 1..3
    assert out["orchestrator_load_s_median"] == pytest.approx(0.05)
    assert out["publish_plus_load_s"] == pytest.approx(0.25)
    assert window_medians([], [], 1, 3)["publish_plus_load_s"] is None


def test_time_to_gain_is_the_first_eval_that_reaches_the_gain_over_step_0() -> None:
    evals = [(30.0, 0, 0.40), (60.0, 5, 0.42), (90.0, 10, 0.47), (120.0, 15, 0.50)]
    assert time_to_gain(evals, 0.07) == (90.0, 10)
    assert time_to_gain(evals, 0.2) is None
    assert time_to_gain([], 0.1) is None


def test_verdicts_pass_fail_and_none() -> None:
    assert verdict(0.85, ">=", 0.8)["pass"] is True
    assert verdict(0.15, "<=", 0.2) == {"value": 0.15, "goal": "<= 0.2", "pass": True}
    assert verdict(95.0, "<=", 90.0)["pass"] is False
    assert verdict(None, "<=", 90.0)["pass"] is None
    assert verdict(math.nan, "<=", 90.0)["pass"] is None
    assert verdict(0.1, "<=", 0.2, applies=False)["pass"] is None  # a smoke run: no verdict
    table = goals({"trainer_idle": 0.3, "launch_to_step0_s": 60.0}, applies=True)
    assert set(table) == set(GOALS)
    assert table["trainer_idle"]["pass"] is False and table["launch_to_step0_s"]["pass"] is True
    assert table["generation_vs_offline"]["pass"] is None


def test_defaults_are_the_issues_setup_and_smoke_uses_the_cpu_config() -> None:
    args = parse_args(["--out", "r.json"])
    assert args.config == "examples/alphabet_sort/rl_one_gpu.toml"
    assert rl_flags(args) == [
        "--model.name", "HuggingFaceTB/SmolLM2-135M-Instruct", "--trainer.optim.lr", "5e-06",
        "--orchestrator.sampling.max-tokens", "128", "--inference.vllm.gpu-memory-utilization", "0.3",
        "--inference.vllm.max-model-len", "2048", "--orchestrator.batch.seq-len", "2048",
    ]  # fmt: skip
    smoke = parse_args(["--smoke", "--out", "r.json"])
    assert smoke.config == "configs/bench/async_overlap_smoke.toml" and smoke.parts == ["offline", "tidal"]
    assert rl_flags(smoke) == [
        "--model.name",
        "tidal-testing/tiny-qwen3",
        "--orchestrator.sampling.max-tokens",
        "16",
    ]
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--parts", "trl", "--out", "r.json"])


def test_trl_comparison_shares_the_tidal_settings_single_turn() -> None:
    args = parse_args(["--out", "r.json", "--trl-steps", "30"])
    orchestrator = {"env": [{"name": "alphabet_sort", "weight": 1.0, "kwargs": {"seed": 1}}]}
    config = comparison_config(args, orchestrator, Path("/tmp/x"), 18999)
    assert config["orchestrator"]["env"] == [
        {"name": "alphabet_sort", "kwargs": {"seed": 1, "min_turns": 1, "max_turns": 1}}
    ]
    assert config["orchestrator"]["batch"]["zero_signal"] == "keep"
    assert config["trainer"]["optim"]["lr"] == 5e-6 and config["max_steps"] == 30
    task = trl_task(config, orchestrator)
    assert (task["num_prompts"], task["group_size"], task["steps"]) == (32, 8, 30)
    assert (task["lr"], task["max_tokens"], task["max_model_len"]) == (5e-6, 128, 2048)
    base = tomllib.loads((REPO / args.config).read_text())
    assert task["warmup_steps"] == base["trainer"]["scheduler"]["warmup_steps"]
    assert task["temperature"] == base["orchestrator"]["sampling"]["temperature"]


def test_summarise_tidal_reads_a_run_end_to_end() -> None:
    """The tidal part's entry from what the sampler saw (no process): window, rates, idle, updates, start-up."""
    import json
    from types import SimpleNamespace

    from benchmarks.async_overlap import Samples
    from benchmarks.loop_throughput import summarise_tidal

    launch = 1000.0
    trainer_done = {s: launch + 60.0 + 10.0 * s for s in range(8)}  # step 0 at 60 s, then every 10 s
    samples = Samples()
    for i in range(0, 1400):  # 10 Hz from launch to 140 s: 800 tokens/s while running, from 50 s on
        t = launch + i / 10
        running = 16.0 if t >= launch + 50 else 0.0
        samples.running.append((t, running))
        samples.generated.append((t, max(0.0, (t - launch - 50) * 800.0)))
    sampler = SimpleNamespace(
        samples=samples,
        trainer=SimpleNamespace(done_at=trainer_done),
        orchestrator=SimpleNamespace(done_at={s: t - 5.0 for s, t in trainer_done.items()}),
    )
    trainer = [{"step": s, "time/wait_for_data": 1.0, "time/publish": 0.1} for s in range(8)]
    orchestrator = [
        {"step": s, "weights/updates_total": s, "time/weight_updates_total": 0.05 * s, "tokens_per_s": 700.0}
        for s in range(8)
    ]
    run = {"command": "tidal rl", "exit_code": 0, "wall_s": 150.0, "launch": launch, "sampler": sampler}
    out = summarise_tidal({**run, "trainer": trainer, "orchestrator": orchestrator}, 1, 2, 1.0, 50)
    assert out["startup"] == {
        "launch_to_step0_trained_s": 60.0,
        "launch_to_first_orchestrator_step_s": 55.0,
        "vllm_marks_s": {},  # no inference log read
    }
    assert out["window"] == {"steps": [2, 6], "start_s": 70.0, "end_s": 120.0}  # level 1: step 7 left out
    assert out["generation_tokens_per_s"]["median_generating"] == pytest.approx(800.0)
    assert out["trainer_idle"] == pytest.approx(5 * 1.0 / 50.0)
    assert out["weight_update"]["publish_plus_load_s"] == pytest.approx(0.15)
    assert len(out["generation_tokens_per_s_series"]) <= 50 and len(out["num_requests_running_series"]) <= 50
    json.dumps(out)  # the results file takes it as is


def test_startup_profile_reads_vllms_marks_as_seconds_from_launch() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) INFO 12-05 18:39:15 [api_utils.py:273] non-default args: {'host': '127.0.0.1'}",
            "(EngineCore pid=2) INFO 12-05 18:39:38 [core.py:116] Initializing a V1 LLM engine (v0.26.0) with",
            "(EngineCore pid=2) INFO 12-05 18:39:41 [model_runner.py:305] Model loading took 0.26 GiB",
            "(EngineCore pid=2) INFO 12-05 18:39:55 [model_runner.py:747] Graph capturing finished in 6 secs",
            "(EngineCore pid=2) INFO 12-05 18:39:56 [model_runner.py:747] Graph capturing finished in 1 secs",
            "(EngineCore pid=2) INFO 12-05 18:40:13 [jit_monitor.py:79] Kernel JIT monitor activated; mode=warn.",
            "(APIServer pid=1) INFO 12-05 18:40:15 [api_server.py:677] Starting vLLM server on http://x",
        ]
    )
    launched = time.mktime((2026, 12, 5, 18, 38, 53, 0, 0, -1))
    marks = startup_profile(log, launched)
    assert marks == {
        "server_process": 22.0,
        "engine_process": 45.0,
        "model_loaded": 48.0,
        "compiled": None,  # no line for it: not guessed
        "graphs_captured": 62.0,  # the first line of a mark
        "kernels_warmed": 80.0,
        "serving": 82.0,
    }


def test_server_phases_are_medians_per_update_of_the_running_totals() -> None:
    rows = [
        {"step": 0, "weights/updates_total": 1, "time/weight_update_pause_total": 0.5},
        {"step": 1, "weights/updates_total": 2, "time/weight_update_pause_total": 0.6},
        {"step": 2, "weights/updates_total": 4, "time/weight_update_pause_total": 0.9},
        {"step": 3, "weights/updates_total": 4, "time/weight_update_pause_total": 0.9},
        {"step": 4, "weights/updates_total": 5, "time/weight_update_pause_total": 1.3},
    ]
    phases = server_phases(rows, skip=1)
    assert phases["pause"] == pytest.approx(0.275)  # steps 2 and 4: 0.15 per update, then 0.4
    assert phases["update"] is None  # a server without the one-request route reports no phases
