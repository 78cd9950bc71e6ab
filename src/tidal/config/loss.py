"""RL loss config: importance ratio, trust-region masks, KL term and normalisation (see trainer/loss.py)."""

from typing import Literal

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem


class LossConfig(Config):
    """Importance-weighted policy gradient against the inference logprobs (README, "Commands", the RL step; the code: trainer/loss.py)."""

    ratio_type: Literal["token", "sequence"] = "token"
    """`token`: ratio exp(logπ − logμ) per token. `sequence` (GSPO): exp of the mean of logπ − logμ over the
    sequence's loss tokens that max_prob_diff keeps, shared by all its tokens (mask_low/high then apply to
    that sequence ratio)."""
    # 1/8 .. 8: far outside the ~0.8..1.25 that bf16 and kernel differences give, so a healthy run masks
    # almost nothing, yet a token the two engines disagree on by nearly an order of magnitude (a tail token
    # sampled by inference that the trainer finds near impossible, or the reverse) cannot dominate the step.
    # IcePop's paper uses the tighter [0.5, 5] for MoE models, whose mismatch is larger.
    mask_low: float | None = Field(default=0.125, gt=0)
    """Tokens whose ratio is below this get zero loss (counted in masked_fraction); None disables."""
    mask_high: float | None = Field(default=8.0, gt=0)
    """Tokens whose ratio is above this get zero loss (counted in masked_fraction); None disables."""
    max_prob_diff: float | None = Field(default=None, gt=0, le=1)
    """DPPO-style mask: tokens with |π − μ| (probabilities, not logs) above this get zero loss; None disables."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a k3 KL(μ‖π) penalty against the inference policy; 0 disables."""
    kl_tokens: Literal["all", "trust_region"] = "all"
    """Where the KL penalty applies. `all`: every loss token with finite inputs, including those the trust
    region (mask_low/high, max_prob_diff) takes the policy-gradient term from — the pull back towards μ is
    what a token far from it needs. `trust_region`: only the tokens the policy-gradient term keeps (the KL
    gradient r − 1 of a token with a large ratio r then cannot dominate the step)."""
    norm: Literal["token", "sequence", "constant"] = "token"
    """`token`: sum over loss tokens / their global count. `sequence`: mean within each sequence, summed, /
    number of sequences. `constant`: sum / norm_constant (no length bias, fixed scale)."""
    norm_constant: float | None = Field(default=None, gt=0)
    """Divisor of the summed loss when norm = `constant` (e.g. batch size × max tokens)."""
    max_abs_log_ratio: float = Field(default=20.0, gt=0)
    """log ratios are clamped to ±this before exp, so the ratio never overflows (e^20 ≈ 4.9e8)."""

    @model_validator(mode="after")
    def _check(self) -> "LossConfig":
        if self.mask_low is not None and self.mask_low >= 1.0:
            raise ConfigProblem(
                "mask_low", f"must be below 1 (else on-policy tokens are masked), got {self.mask_low}"
            )
        if self.mask_high is not None and self.mask_high <= 1.0:
            raise ConfigProblem(
                "mask_high", f"must be above 1 (else on-policy tokens are masked), got {self.mask_high}"
            )
        if self.norm == "constant" and self.norm_constant is None:
            raise ConfigProblem("norm_constant", "norm = 'constant' needs norm_constant")
        return self
