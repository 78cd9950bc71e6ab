"""The trainer benchmark's model shapes and its FLOP count for MoE models (its runs need a GPU to mean much)."""

import math

import pytest
import torch

from benchmarks.trainer_mfu import (
    CONFIGS,
    active_params,
    build_model,
    model_config,
    model_flops_per_token,
    param_count,
)


def test_a_shape_can_keep_its_first_layers_only():
    assert model_config("qwen3-30b-a3b")["num_hidden_layers"] == 48
    cut = model_config("qwen3-30b-a3b:16")
    assert cut["num_hidden_layers"] == 16 and cut["num_experts"] == 128
    assert CONFIGS["qwen3-30b-a3b"]["num_hidden_layers"] == 48  # the table is not changed
    with pytest.raises(SystemExit):
        model_config("qwen3-31b")


def test_active_parameters_are_counted_by_hand_on_the_tiny_moe():
    """Everything a token's forward multiplies by: attention, norms, router, k of the E experts and the head,
    not the input embedding (tiny-moe's head is untied)."""
    config = model_config("tiny-moe")
    model = build_model("tiny-moe", torch.float32, torch.device("cpu"), seed=0)
    total = sum(p.numel() for p in model.parameters())
    assert param_count(config) == total
    hidden, inter, experts, k = 64, 32, 8, 2
    by_hand = 0
    for name, param in model.named_parameters():
        if name == "model.embed_tokens.weight":
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert param.shape[0] == experts
            by_hand += param.numel() // experts * k  # k experts' gate and up [2·inter, hidden], down
        else:
            by_hand += param.numel()
    assert active_params(config, total) == by_hand
    assert by_hand == total - 1000 * hidden - 2 * (experts - k) * 3 * hidden * inter
    flops = model_flops_per_token(config, total, span=100.0)
    assert flops == 6 * by_hand + 6 * 2 * 100.0 * 4 * 16


def test_qwen3_30b_a3b_is_thirty_billion_parameters_with_three_billion_active():
    config = model_config("qwen3-30b-a3b")
    total = param_count(config)
    assert 30.4e9 < total < 30.6e9  # the model card: 30.5B
    # the card's 3.3B activated count the input embedding too (0.31B)
    assert 3.2e9 < active_params(config, total) + 151936 * 2048 < 3.4e9


def test_dense_models_count_every_parameter():
    config = model_config("tiny")
    assert model_flops_per_token(config, 1000, span=10.0) == 6 * 1000 + 6 * 2 * 10.0 * 4 * 16


@pytest.mark.parametrize("docs", ["single", "rl"])
def test_every_layout_runs_one_step_on_the_tiny_model(docs):
    """The benchmark's step functions run against today's trainer (its RL case once broke unseen on the GPU:
    rl_step had come to read a config field its stand-in config lacked): one CPU step each, a finite loss
    (512 tokens: RL samples are up to 448 long)."""
    from benchmarks.trainer_mfu import main

    results = []
    main(
        ["--device", "cpu", "--models", "tiny", "--seq", "512", "--steps", "1", "--warmup", "1", "--docs", docs,
         "--impls", "tidal:default"],
        record=results.append,
    )  # fmt: skip
    assert len(results) == 1 and "error" not in results[0], results
    assert results[0]["tokens_per_s"] > 0 and math.isfinite(results[0]["last_loss"])
