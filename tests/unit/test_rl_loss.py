"""RL loss variants against hand-computed values: ratios, trust-region masks, KL, normalisation, guards."""

import math

import pytest
import torch

from tidal.config.loss import LossConfig
from tidal.trainer.loss import (
    entropy_from_logits,
    k3,
    merge_loss_metrics,
    rl_loss,
    selective_log_softmax,
    sequence_log_ratio,
)

LN2 = math.log(2.0)
NO_MASK = LossConfig(mask_low=None, mask_high=None)
E20 = math.exp(20.0)


def row(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # [1, seq]


def run(delta, adv, config=NO_MASK, mask=None, sample_ids=None, num_tokens=None, num_samples=1, mu=None):
    """Loss with logπ = logμ + delta on one row; returns loss, metrics and d loss / d logπ."""
    num = len(delta)
    mu = row(mu if mu is not None else [-1.0] * num)  # [1, seq]
    logprobs = (mu + row(delta)).requires_grad_()  # [1, seq]
    mask = torch.tensor([mask if mask is not None else [1] * num])  # [1, seq]
    sample_ids = torch.tensor([sample_ids if sample_ids is not None else [0] * num])  # [1, seq]
    num_tokens = num_tokens if num_tokens is not None else int(mask.sum())
    loss, metrics = rl_loss(logprobs, mu, row(adv), mask, sample_ids, config, num_tokens, num_samples)
    loss.backward()
    assert logprobs.grad is not None
    return loss.item(), metrics, logprobs.grad[0].tolist()


def test_token_ratio_by_hand():
    # ratios 2, 1/2, 1; loss = −(2·1 + 0.5·1 + 1·(−1)) / 3; d/dlogπ = −ratio·A / N
    loss, metrics, grad = run([LN2, -LN2, 0.0], [1.0, 1.0, -1.0])
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx([-2 / 3, -1 / 6, 1 / 3])
    assert metrics["ratio_mean"] == pytest.approx(3.5 / 3)
    assert metrics["ratio_max"] == pytest.approx(2.0)
    # k3 = r − log r − 1: (1 − ln2) + (ln2 − 0.5) + 0
    assert metrics["mismatch_kl"] == pytest.approx(0.5 / 3)
    assert metrics["masked_fraction"] == 0.0
    assert metrics["num_nonfinite"] == 0.0
    assert metrics["num_loss_tokens"] == 3.0


def test_on_policy_gradient_is_minus_advantage_times_grad_logprob_over_n():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)  # [batch, seq, vocab]
    targets = torch.randint(0, 7, (2, 5))  # [batch, seq]
    adv = torch.randn(2, 5)  # [batch, seq]
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 0] = False
    logprobs = selective_log_softmax(logits, targets)  # [batch, seq]
    sample_ids = torch.tensor([[0] * 5, [1] * 5])
    loss, metrics = rl_loss(logprobs, logprobs.detach(), adv, mask, sample_ids, LossConfig(), 9, 2)
    loss.backward()
    # ∇_logits logπ(y) = onehot(y) − softmax(logits); with ratio 1 the loss gradient is −A·∇logπ / N
    grad_logprob = torch.nn.functional.one_hot(targets, 7) - torch.softmax(logits.detach(), -1)
    expected = -(adv * mask)[..., None] * grad_logprob / 9
    assert torch.allclose(logits.grad, expected, atol=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio_shared_by_the_sequence():
    # sample 0: log ratios ln2, ln8 → mean ln4 → ratio 4 on both; sample 1: −ln2 → 1/2; then padding
    config = LossConfig(ratio_type="sequence", mask_low=None, mask_high=None)
    delta = [LN2, 3 * LN2, -LN2, 0.0]
    loss, metrics, grad = run(
        delta, [1.0, 1.0, 2.0, 0.0], config, mask=[1, 1, 1, 0], sample_ids=[0, 0, 1, -1]
    )
    assert loss == pytest.approx(-(4 + 4 + 0.5 * 2) / 3)
    # sample 0: −A·s·(1/2 per token)·2 tokens / N = −4/3 each; sample 1: −2·0.5 / 3
    assert grad == pytest.approx([-4 / 3, -4 / 3, -1 / 3, 0.0])
    assert metrics["ratio_max"] == pytest.approx(4.0)
    assert metrics["ratio_mean"] == pytest.approx(8.5 / 3)
    # mismatch KL stays token-level: (1 − ln2) + (7 − 3 ln2) + (ln2 − 0.5)
    assert metrics["mismatch_kl"] == pytest.approx((7.5 - 3 * LN2) / 3)


def test_sequence_log_ratio_ignores_prompt_tokens_and_is_equal_within_a_sequence():
    token_log_ratio = row([5.0, 1.0, 3.0, -2.0, 7.0])  # [1, seq]
    valid = torch.tensor([[False, True, True, True, False]])
    sample_ids = torch.tensor([[0, 0, 0, 1, -1]])
    got = sequence_log_ratio(token_log_ratio, valid, sample_ids)[0, :4].tolist()
    assert got == [2.0, 2.0, 2.0, -2.0]


def test_trust_region_masks_tokens_outside_low_high():
    # ratios 2, 10, 0.1, 1 with the default [1/8, 8]: the middle two get no loss and no gradient
    delta = [LN2, math.log(10.0), math.log(0.1), 0.0]
    loss, metrics, grad = run(delta, [1.0, 1.0, 1.0, 1.0], LossConfig())
    assert loss == pytest.approx(-(2 + 1) / 4)  # masked tokens stay in the normaliser
    assert grad == pytest.approx([-0.5, 0.0, 0.0, -0.25])
    assert metrics["masked_fraction"] == pytest.approx(0.5)


def test_sequence_trust_region_masks_the_whole_sequence():
    config = LossConfig(ratio_type="sequence")
    delta = [math.log(10.0), math.log(10.0), 0.0]
    loss, metrics, grad = run(delta, [1.0, 1.0, 1.0], config, sample_ids=[0, 0, 1])
    assert loss == pytest.approx(-1 / 3)
    assert grad == pytest.approx([0.0, 0.0, -1 / 3])
    assert metrics["masked_fraction"] == pytest.approx(2 / 3)


def test_max_prob_diff_masks_in_probability_space():
    # π = 0.9 vs μ = 0.5: |Δp| = 0.4 > 0.3, masked; π = 0.5 vs μ = 0.4: ratio 1.25, |Δp| = 0.1, kept
    config = LossConfig(mask_low=None, mask_high=None, max_prob_diff=0.3)
    mu = [math.log(0.5), math.log(0.4)]
    delta = [math.log(0.9) - mu[0], math.log(0.5) - mu[1]]
    loss, metrics, grad = run(delta, [1.0, 1.0], config, mu=mu)
    assert loss == pytest.approx(-1.25 / 2)
    assert grad == pytest.approx([0.0, -1.25 / 2])
    assert metrics["masked_fraction"] == pytest.approx(0.5)


def test_kl_term_k3_against_inference():
    # token 0: ratio 2, k3 = 2 − ln2 − 1; d k3 / d logπ = ratio − 1 = 1
    config = LossConfig(mask_low=None, mask_high=None, kl_coef=0.1)
    loss, _, grad = run([LN2, 0.0], [1.0, 1.0], config)
    assert loss == pytest.approx((-2 + 0.1 * (1 - LN2) - 1) / 2)
    assert grad == pytest.approx([(-2 + 0.1) / 2, -0.5])


def test_sequence_ratio_averages_over_kept_tokens_only_so_a_masked_token_gets_no_gradient():
    # token 0: π = 0.9 vs μ = 0.5, |Δp| = 0.4 > 0.3, masked; tokens 1-3: π = 0.5 vs μ = 0.4, ratio 1.25, kept.
    # The sequence ratio is the exp of the mean over the kept three: 1.25, whatever token 0's ratio is.
    config = LossConfig(ratio_type="sequence", mask_low=None, mask_high=None, max_prob_diff=0.3)
    mu = [math.log(0.5)] + [math.log(0.4)] * 3
    delta = [math.log(0.9 / 0.5)] + [math.log(1.25)] * 3
    loss, metrics, grad = run(delta, [1.0] * 4, config, mu=mu)
    assert grad[0] == 0.0  # exactly: the masked token is outside the mean
    assert loss == pytest.approx(-3 * 1.25 / 4)  # the masked token stays in the normaliser
    # each kept token: −Σ_kept A·s·(1/3) / N = −1.25 / 4
    assert grad[1:] == pytest.approx([-1.25 / 4] * 3)
    assert metrics["masked_fraction"] == pytest.approx(0.25)


def test_kl_term_applies_to_tokens_outside_the_trust_region():
    # ratio 10 is outside [1/8, 8]: no policy-gradient term, but k3 still pulls it back: d k3 / d logπ = r − 1
    config = LossConfig(kl_coef=0.1)
    loss, metrics, grad = run([math.log(10.0), 0.0], [1.0, 1.0], config)
    assert grad == pytest.approx([0.1 * 9 / 2, -1 / 2])
    assert loss == pytest.approx((0.1 * (10 - math.log(10.0) - 1) - 1) / 2)
    assert metrics["masked_fraction"] == pytest.approx(0.5)
    # the documented alternative: KL inside the trust region only
    _, _, grad = run([math.log(10.0), 0.0], [1.0, 1.0], LossConfig(kl_coef=0.1, kl_tokens="trust_region"))
    assert grad == pytest.approx([0.0, -1 / 2])


def test_kl_term_applies_to_tokens_masked_by_max_prob_diff_in_sequence_mode():
    config = LossConfig(ratio_type="sequence", mask_low=None, mask_high=None, max_prob_diff=0.3, kl_coef=0.1)
    mu = [math.log(0.5), math.log(0.4)]
    delta = [math.log(0.9 / 0.5), math.log(1.25)]
    _, _, grad = run(delta, [1.0, 1.0], config, mu=mu)
    assert grad[0] == pytest.approx(0.1 * (1.8 - 1) / 2)  # KL only: the masked token has no ratio term
    assert grad[1] == pytest.approx((-1.25 + 0.1 * 0.25) / 2)


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_log_ratio_of_500_gives_finite_loss_and_gradients(ratio_type):
    # exp(500) overflows float32 (and float64); the clamp to ±20 keeps everything finite
    config = LossConfig(ratio_type=ratio_type, mask_low=None, mask_high=None)
    mu = [-510.0, -510.0, -1.0]
    loss, metrics, grad = run([500.0, 500.0, 0.0], [1.0, 1.0, 1.0], config, mu=mu, sample_ids=[0, 0, 1])
    assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)
    assert loss == pytest.approx(-(2 * E20 + 1) / 3, rel=1e-5)
    assert grad == pytest.approx([0.0, 0.0, -1 / 3])  # no gradient through the clamp
    assert metrics["ratio_max"] == pytest.approx(E20, rel=1e-5)
    assert math.isfinite(metrics["mismatch_kl"])
    # with the default trust region those tokens are simply masked
    config = LossConfig(ratio_type=ratio_type)
    loss, metrics, grad = run([500.0, 500.0, 0.0], [1.0, 1.0, 1.0], config, mu=mu, sample_ids=[0, 0, 1])
    assert loss == pytest.approx(-1 / 3)
    assert metrics["masked_fraction"] == pytest.approx(2 / 3)


def test_overflowing_ratio_through_real_logits_backpropagates_finite_gradients():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 5, requires_grad=True)  # [batch, seq, vocab]
    targets = torch.randint(0, 5, (1, 4))
    logprobs = selective_log_softmax(logits, targets)  # [batch, seq]
    mu = logprobs.detach() - 500.0
    ones = torch.ones(1, 4)
    loss, _ = rl_loss(logprobs, mu, ones, ones.bool(), torch.zeros(1, 4, dtype=torch.long), NO_MASK, 4, 1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_nonfinite_inference_logprobs_are_masked_and_counted():
    mu = [float("nan"), float("-inf"), -1.0, -1.0, float("nan")]
    loss, metrics, grad = run(
        [0.0] * 5, [1.0, 1.0, 1.0, 2.0, 1.0], LossConfig(), mu=mu, mask=[1, 1, 1, 1, 0], num_tokens=4
    )
    assert loss == pytest.approx(-(1 + 2) / 4)
    assert grad == pytest.approx([0.0, 0.0, -0.25, -0.5, 0.0])
    assert metrics["num_nonfinite"] == 2.0  # the NaN off the loss mask is not counted
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["masked_fraction"] == 0.0


def test_nan_trainer_logprob_gets_no_gradient():
    mu = row([-1.0, -1.0])
    logprobs = torch.tensor([[float("nan"), -1.0]], requires_grad=True)
    ids = torch.zeros(1, 2, dtype=torch.long)
    loss, metrics = rl_loss(logprobs, mu, row([1.0, 1.0]), torch.ones(1, 2), ids, LossConfig(), 2, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert logprobs.grad is not None and logprobs.grad[0].tolist() == [0.0, -0.5]
    assert metrics["num_nonfinite"] == 1.0


def test_sequence_norm_means_within_each_sequence():
    # ratio 1 everywhere; sample 0 has a prompt token and two loss tokens (A = 1), sample 1 one (A = 3)
    config = LossConfig(norm="sequence")
    kwargs = dict(mask=[0, 1, 1, 1, 0], sample_ids=[0, 0, 0, 1, -1], num_samples=4)
    loss, _, grad = run([0.0] * 5, [1.0, 1.0, 1.0, 3.0, 0.0], config, **kwargs)
    assert loss == pytest.approx((-1 + -3) / 4)
    assert grad == pytest.approx([0.0, -1 / 8, -1 / 8, -3 / 4, 0.0])


def test_token_and_constant_norms():
    adv = [1.0, 1.0, 1.0, 3.0, 5.0]
    kwargs = dict(mask=[0, 1, 1, 1, 0], sample_ids=[0, 0, 0, 1, -1], num_tokens=10)
    loss, _, grad = run([0.0] * 5, adv, LossConfig(norm="token"), **kwargs)
    assert loss == pytest.approx(-5 / 10)
    assert grad == pytest.approx([0.0, -0.1, -0.1, -0.3, 0.0])
    loss, _, _ = run([0.0] * 5, adv, LossConfig(norm="constant", norm_constant=20.0), **kwargs)
    assert loss == pytest.approx(-5 / 20)


def test_micro_batch_losses_with_global_normaliser_add_up_to_the_whole():
    torch.manual_seed(1)
    mu = -torch.rand(2, 6)  # [batch, seq]
    logprobs = mu + 0.3 * torch.randn(2, 6)
    adv, mask = torch.randn(2, 6), torch.rand(2, 6) > 0.3
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 3, 3]])
    for config in [LossConfig(), LossConfig(norm="sequence", ratio_type="sequence")]:
        whole, whole_metrics = rl_loss(logprobs, mu, adv, mask, ids, config, int(mask.sum()), 4)
        # one row per micro-batch; sample ids are local to a micro-batch
        rows = [
            (logprobs[i : i + 1], mu[i : i + 1], adv[i : i + 1], mask[i : i + 1], ids[i : i + 1] % 2)
            for i in range(2)
        ]
        parts = [rl_loss(*r, config, int(mask.sum()), 4) for r in rows]
        assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-5)
        merged = merge_loss_metrics([p[1] for p in parts])
        assert merged == pytest.approx(whole_metrics, rel=1e-5)


def test_no_loss_tokens_gives_zero_loss_that_still_backpropagates():
    loss, metrics, grad = run([0.3, 0.1], [1.0, 1.0], LossConfig(), mask=[0, 0], num_tokens=0)
    assert loss == 0.0 and grad == [0.0, 0.0]
    assert metrics["masked_fraction"] == 0.0 and metrics["ratio_mean"] == 0.0


def test_entropy_metric_is_a_mean_over_loss_tokens():
    mu = row([-1.0, -1.0, -1.0])
    ids = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = rl_loss(
        mu.clone(), mu, row([1.0] * 3), mask, ids, LossConfig(), 2, 1, entropy=row([1, 2, 9])
    )
    assert metrics["entropy"] == pytest.approx(1.5)


def test_merge_loss_metrics_by_hand():
    a = {"num_loss_tokens": 2.0, "num_nonfinite": 0.0, "mismatch_kl": 0.1, "ratio_mean": 1.0}
    a |= {"ratio_max": 2.0, "masked_fraction": 0.5}
    b = {"num_loss_tokens": 4.0, "num_nonfinite": 2.0, "mismatch_kl": 0.4, "ratio_mean": 2.0}
    b |= {"ratio_max": 3.0, "masked_fraction": 0.25}
    merged = merge_loss_metrics([a, b])
    assert merged["num_loss_tokens"] == 6.0 and merged["num_nonfinite"] == 2.0
    assert merged["mismatch_kl"] == pytest.approx((0.1 * 2 + 0.4 * 2) / 4)
    assert merged["ratio_mean"] == pytest.approx((1.0 * 2 + 2.0 * 2) / 4)
    assert merged["ratio_max"] == 3.0
    assert merged["masked_fraction"] == pytest.approx((1 + 1) / 6)
    assert "entropy" not in merged


def test_selective_log_softmax_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # [1, 2, vocab 2]: p = 1/4, 3/4
    got = selective_log_softmax(logits, torch.tensor([[1, 0]]))
    assert got.tolist()[0] == pytest.approx([math.log(0.75), math.log(0.25)])
    # temperature 2 halves the logits: p(1) = √3 / (1 + √3)
    got = selective_log_softmax(logits, torch.tensor([[1, 1]]), temperature=2.0)
    assert got[0, 0].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_selective_log_softmax_chunks_match_a_plain_log_softmax_with_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16, requires_grad=True)  # [batch, seq, vocab]
    targets = torch.randint(0, 11, (3, 5))
    got = selective_log_softmax(logits, targets, temperature=0.7, chunk_size=4)  # 15 tokens: 4 chunks
    (got * torch.arange(15.0).view(3, 5)).sum().backward()
    grad, logits.grad = logits.grad, None
    plain = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    (plain * torch.arange(15.0).view(3, 5)).sum().backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, plain, atol=1e-6)
    assert torch.allclose(grad.float(), logits.grad.float(), atol=1e-2)


def test_entropy_from_logits_by_hand():
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)]]])  # at temperature 2: p = 1/4, 3/4
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits, temperature=2.0, chunk_size=1).item() == pytest.approx(expected)


def test_loss_config_defaults_and_problems():
    config = LossConfig()
    assert (config.ratio_type, config.norm, config.kl_coef) == ("token", "token", 0.0)
    assert (config.mask_low, config.mask_high, config.max_prob_diff) == (0.125, 8.0, None)
    with pytest.raises(ValueError, match="below 1"):
        LossConfig(mask_low=1.5)
    with pytest.raises(ValueError, match="above 1"):
        LossConfig(mask_high=0.9)
    with pytest.raises(ValueError, match="norm_constant"):
        LossConfig(norm="constant")
    with pytest.raises(ValueError):
        LossConfig(max_prob_diff=1.5)


def test_k3_is_never_negative_and_keeps_second_order_for_tiny_log_ratios():
    x = torch.tensor([-1e-3, -1e-6, -1e-9, 0.0, 1e-9, 1e-6, 1e-3], dtype=torch.float32)
    value = k3(x)
    assert (value >= 0).all()
    assert value[0].item() == pytest.approx(1e-6 / 2, rel=1e-2)  # r − log r − 1 ≈ x²/2
    assert value[3].item() == 0.0
