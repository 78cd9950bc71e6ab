"""Learning-rate schedule shapes; AdamW with bf16 moments (stochastic rounding) against torch's AdamW."""

import pytest
import torch

from tidal.config.common import SchedulerConfig
from tidal.trainer.optim import lr_factor


def test_warmup_is_linear_to_peak():
    config = SchedulerConfig(type="constant", warmup_steps=4)
    assert [lr_factor(s, 10, config) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_from_peak_to_min_ratio():
    config = SchedulerConfig(type="cosine", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_factor(0, 100, config) == pytest.approx(1.0)
    assert lr_factor(50, 100, config) == pytest.approx(0.55)
    assert lr_factor(100, 100, config) == pytest.approx(0.1)


def test_linear_decay_after_warmup():
    config = SchedulerConfig(type="linear", warmup_steps=10)
    assert lr_factor(10, 110, config) == pytest.approx(1.0)
    assert lr_factor(60, 110, config) == pytest.approx(0.5)
    assert lr_factor(110, 110, config) == pytest.approx(0.0)


# --- AdamW with bf16 moments -------------------------------------------------------------------------


def _quadratic_run(optimizer_cls, steps: int, **kwargs):
    """Minimise ||w − target||² from a fixed start; returns (final weights, optimizer)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4096))
    target = torch.randn(4096)
    opt = optimizer_cls([w], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        loss = ((w - target) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return w.detach(), opt


def test_adamw_with_fp32_moments_matches_torch_adamw():
    from tidal.trainer.optim import AdamW

    ours, _ = _quadratic_run(AdamW, 20, state_dtype=torch.float32)
    ref, _ = _quadratic_run(torch.optim.AdamW, 20)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)  # fp32 op order only


def test_bf16_moments_track_fp32_ones_thanks_to_stochastic_rounding():
    """With β2 = 0.999 round-to-nearest bf16 would freeze exp_avg_sq; stochastic rounding keeps it unbiased."""
    from tidal.trainer.optim import AdamW

    ours, opt = _quadratic_run(AdamW, 200, state_dtype=torch.bfloat16)
    ref, ref_opt = _quadratic_run(torch.optim.AdamW, 200)
    state, ref_state = (
        opt.state[opt.param_groups[0]["params"][0]],
        ref_opt.state[ref_opt.param_groups[0]["params"][0]],
    )
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    # the second moment averages the squared gradients of all 200 steps: its mean must stay within 2%
    mean_v, ref_mean_v = state["exp_avg_sq"].float().mean(), ref_state["exp_avg_sq"].mean()
    assert abs(mean_v / ref_mean_v - 1) < 0.02, (float(mean_v), float(ref_mean_v))
    assert (ours - ref).abs().mean() < 3e-3  # weights differ only by rounding noise


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    from tidal.trainer.optim import stochastic_round_

    torch.manual_seed(0)
    value = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16 (1 + 2^-7)
    out = torch.empty(100_000, dtype=torch.bfloat16)
    stochastic_round_(out, value)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - value[0].item()) < 2e-5  # nearest rounding would give exactly 1.0
    negative = torch.empty_like(out)
    stochastic_round_(negative, -value)
    assert abs(negative.float().mean().item() + value[0].item()) < 2e-5


def test_bf16_moments_survive_a_state_dict_round_trip():
    from tidal.trainer.optim import AdamW

    _, opt = _quadratic_run(AdamW, 3, state_dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.zeros(4096))
    fresh = AdamW([w], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, state_dtype=torch.bfloat16)
    fresh.load_state_dict(opt.state_dict())
    state = fresh.state[w]
    assert state["exp_avg_sq"].dtype == torch.bfloat16  # not cast to the parameter's fp32
    assert torch.equal(state["exp_avg_sq"], opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"])
    assert float(state["step"]) == 3
