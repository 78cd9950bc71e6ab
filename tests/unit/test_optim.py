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
    w.grad = torch.ones_like(w)
    fresh.step()  # state (and the cached views of it) exist before the load replaces them
    fresh.load_state_dict(opt.state_dict())
    state = fresh.state[w]
    assert state["exp_avg_sq"].dtype == torch.bfloat16  # not cast to the parameter's fp32
    assert torch.equal(state["exp_avg_sq"], opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"])
    assert float(state["step"]) == 3
    w.grad = torch.ones_like(w)
    loaded = fresh.state[w]["exp_avg_sq"]
    before = loaded.clone()
    fresh.step()  # updates the loaded moments, not stale views of the ones the load replaced
    assert float(fresh.state[w]["step"]) == 4
    assert not torch.equal(loaded, before)


# --- clipping folded into the update, grouped compiled calls, hash noise ------------------------------


def _many_params_run(optimizer_cls, steps: int, clip, **kwargs):
    """20 same-size tensors (more than one group) and 3 odd sizes, gradients large enough to be clipped."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(20)]
    params += [torch.nn.Parameter(torch.randn(n)) for n in (3, 700, 700)]
    targets = [torch.randn_like(p) for p in params]
    opt = optimizer_cls(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kwargs)
    norms = []
    for _ in range(steps):
        loss = sum(((p - t) ** 2).sum() for p, t in zip(params, targets, strict=True)) * 10
        loss.backward()
        norms.append(float(clip(opt, params)))
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in params], norms


def test_clipping_inside_the_update_matches_torch_clip_then_adamw():
    from tidal.trainer.optim import AdamW, clip_and_step

    def torch_clip(opt, params):
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return norm

    ours, our_norms = _many_params_run(
        AdamW, 5, lambda o, p: clip_and_step(o, p, 1.0), state_dtype=torch.float32
    )
    ref, ref_norms = _many_params_run(torch.optim.AdamW, 5, torch_clip)
    assert min(ref_norms) > 10  # clipping was active on every step
    assert our_norms == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_groups_split_into_power_of_two_tails():
    from tidal.trainer.optim import split_group

    assert [len(c) for c in split_group(list(range(73)), 16)] == [16, 16, 16, 16, 8, 1]
    assert [len(c) for c in split_group(list(range(7)), 16)] == [4, 2, 1]
    assert sum(split_group(list(range(37)), 16), []) == list(range(37))  # order kept, nothing lost


def test_hash_bits_is_murmur3_finaliser_of_a_counter():
    from tidal.trainer.optim import hash_bits

    def reference(index: int, seed: int) -> int:  # unsigned 32-bit arithmetic, written out
        x = (index * 0x9E3779B9 + seed) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
        x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    words = hash_bits(1000, torch.tensor(12345, dtype=torch.int32))
    assert [w & 0xFFFFFFFF for w in words.tolist()] == [reference(i, 12345) for i in range(1000)]
    bits = (
        (hash_bits(1 << 16, torch.tensor(7, dtype=torch.int32)).unsqueeze(1) >> torch.arange(32)) & 1
    ).float()
    assert (bits.mean(0) - 0.5).abs().max() < 0.01  # every bit fair: both 16-bit halves usable as noise


def test_rounding_with_hash_noise_is_unbiased_and_seeds_differ():
    from tidal.trainer.optim import hash_bits, rounding_seed, stochastic_round_

    seeds = {
        rounding_seed(step, pos, rank) for step in range(1, 50) for pos in range(1, 50) for rank in range(4)
    }
    assert len(seeds) == 49 * 49 * 4 and all(-(2**31) <= s < 2**31 for s in seeds)
    value = torch.full((100_000,), 1.0 + 2**-10)
    noise = hash_bits(value.numel(), torch.tensor(rounding_seed(3, 1, 0), dtype=torch.int32))
    for half in (noise & 0xFFFF, (noise >> 16) & 0xFFFF):
        out = torch.empty(value.numel(), dtype=torch.bfloat16)
        stochastic_round_(out, value, half)
        assert abs(out.float().mean().item() - value[0].item()) < 2e-5


def _norm_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tidal.trainer.optim import global_norm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same full tensors on both ranks
        full = [torch.randn(6, 4), torch.randn(5), torch.randn(3, 3)]
        sharded = init_device_mesh("cpu", (2,))
        hybrid = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        results[f"shard-{rank}"] = global_norm(
            [distribute_tensor(t, sharded, [Shard(0)]) for t in full]
        ).item()
        hsdp = [distribute_tensor(t, hybrid, [Replicate(), Shard(0)]) for t in full]
        results[f"hsdp-{rank}"] = global_norm(hsdp).item()
    finally:
        dist.destroy_process_group()


def test_global_norm_sums_shards_but_not_replicas():
    """Two gloo ranks: FSDP-style Shard(0) gradients and HSDP's (Replicate, Shard) ones both give the norm
    of the full tensors (summing over the replicate dimension too would give √2 times it)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_norm_worker, args=(port, results), nprocs=2)
    torch.manual_seed(0)
    want = (
        torch.cat([t.flatten() for t in (torch.randn(6, 4), torch.randn(5), torch.randn(3, 3))]).norm().item()
    )
    assert dict(results) == pytest.approx({f"{kind}-{r}": want for kind in ("shard", "hsdp") for r in (0, 1)})
