"""The async-overlap benchmark's arithmetic: Prometheus parsing, the steady-state window, idle fractions."""

import math

import pytest

from benchmarks.async_overlap import (
    GENERATED,
    RUNNING,
    Samples,
    Window,
    breakdown,
    counter_rate,
    idle_fraction,
    parse_prometheus,
    steady_window,
    summarise,
    trainer_idle,
)

METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running_total_bogus{engine="0"} 100.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1.5e+04
"""


def test_parse_prometheus_sums_engines_and_ignores_other_names_and_comments():
    values = parse_prometheus(METRICS_TEXT, (RUNNING, GENERATED, "vllm:num_requests_waiting"))
    assert values == {RUNNING: 5.0, GENERATED: 15000.0}


def test_window_skips_warmup_steps_and_counts_the_rest_when_synchronous():
    done_at = {0: 10.0, 1: 30.0, 2: 40.0, 3: 50.0, 4: 60.0}
    window = steady_window(done_at, level=0, warmup_steps=2)
    assert (window.first_step, window.last_step, window.start, window.end) == (2, 4, 30.0, 60.0)
    assert window.steps_per_min == pytest.approx(6.0)  # 3 steps in 30 s
    with pytest.raises(ValueError):
        steady_window({0: 1.0, 1: 2.0}, level=0, warmup_steps=2)  # nothing after warm-up


def test_window_drops_batches_generated_ahead_and_the_tail_when_asynchronous():
    # level 2: batches 0-2 were ready before the trainer (steps 0-2 fast); steps 8-9 trained after the
    # orchestrator had produced its last batch (fast again): only steps 3..7 show the steady state
    done_at = {0: 0.0, 1: 1.0, 2: 2.0, 3: 12.0, 4: 22.0, 5: 32.0, 6: 42.0, 7: 52.0, 8: 53.0, 9: 54.0}
    window = steady_window(done_at, level=2, warmup_steps=2)
    assert (window.first_step, window.last_step) == (3, 7)
    assert window.steps_per_min == pytest.approx(6.0)  # 5 steps in 50 s, not 9 in 54
    with pytest.raises(ValueError):
        steady_window({s: float(s) for s in range(5)}, level=2, warmup_steps=2)  # 3 > 4 − 2


def test_idle_fraction_counts_zero_running_inside_the_window_only():
    samples = [(0.0, 0.0), (1.0, 4.0), (2.0, 0.0), (3.0, None), (4.0, 2.0), (9.0, 0.0)]
    # inside [1, 4]: 4, 0, (unanswered), 2 -> one idle sample of three answered
    assert idle_fraction(samples, 1.0, 4.0) == pytest.approx(1 / 3)
    assert math.isnan(idle_fraction(samples, 5.0, 8.0))


def test_trainer_idle_is_waiting_over_the_window():
    records = [{"step": s, "time/wait_for_data": w} for s, w in enumerate([9.0, 1.0, 2.0, 3.0, 7.0])]
    window = Window(first_step=2, last_step=3, start=0.0, end=10.0)
    assert trainer_idle(records, window) == pytest.approx(0.5)  # (2 + 3) s of 10 s


def test_counter_rate_uses_first_and_last_sample_in_window():
    assert counter_rate([(0.0, 0.0), (1.0, 100.0), (3.0, 500.0), (9.0, 9999.0)], 1.0, 3.0) == 200.0
    assert math.isnan(counter_rate([(1.0, 5.0)], 0.0, 2.0))


def test_summarise_a_synchronous_run():
    # trainer steps end every 10 s after warm-up; it waited 6 s of each; inference ran 4 of every 10 samples
    done_at = {0: 5.0, 1: 10.0, 2: 20.0, 3: 30.0}
    trainer = [
        {"step": s, "time/wait_for_data": 6.0, "mismatch_kl/mean": 1e-4 * (s + 1), "time/step": 10.0}
        for s in range(4)
    ]
    orchestrator = [
        {"step": s, "reward/mean": 0.1 * s, "time/step": 9.0, "time/wait_for_policy": 4.0} for s in range(4)
    ]
    samples = Samples(
        running=[(10.0 + t / 10, 8.0 if t % 10 < 4 else 0.0) for t in range(201)],
        generated=[(10.0, 0.0), (30.0, 8000.0)],
    )
    result = summarise(0, done_at, trainer, orchestrator, samples, warmup_steps=2)
    assert result["steps_per_min"] == pytest.approx(6.0)
    assert result["trainer_idle"] == pytest.approx(0.6)
    assert result["inference_idle"] == pytest.approx(0.6, abs=0.01)
    assert result["reward_mean"] == pytest.approx(0.25)  # steps 2 and 3
    assert result["mismatch_kl"] == pytest.approx(3.5e-4)
    assert result["breakdown"]["orchestrator/generate_s"] == pytest.approx(5.0)
    # 8000 tokens in 20 s, generated during the 40 % of the time inference was busy
    assert result["breakdown"]["inference/busy_tokens_per_s"] == pytest.approx(1000.0, rel=0.03)


def test_breakdown_weight_update_seconds_per_update():
    orchestrator = [
        {"step": s, "policy_version": v, "time/weight_updates_total": t}
        for s, v, t in [(0, 0, 0.0), (1, 1, 1.0), (2, 2, 2.5), (3, 3, 4.0)]
    ]
    parts = breakdown([], orchestrator, Window(first_step=2, last_step=3, start=0.0, end=1.0))
    assert parts["inference/weight_update_s"] == pytest.approx(1.5)  # (4.0 − 1.0) s over 2 updates
