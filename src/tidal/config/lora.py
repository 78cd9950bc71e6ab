"""LoRA settings shared by `tidal sft` (`[lora]`) and the RL trainer (`[trainer.lora]`)."""

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The trainer scores tokens straight from the head weight (chunked head) and vLLM serves no LoRA on them.
UNSUPPORTED_TARGETS = ("lm_head", "embed_tokens")
# vLLM (0.26 and 0.32) accepts only these values for --max-lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Config):
    """LoRA: train low-rank adapters beside the target linear layers while the base weights stay frozen.

    Each target layer computes W·x + (alpha / rank)·B·A·x with A [rank, in] random and B [out, rank] zero at
    the start, so step 0 is exactly the base model. Parameter names of the base model do not change. SFT
    writes the adapter (`final_adapter/`, PEFT format) and the merged model (`final/`); RL publishes only the
    adapter per step and inference hot-loads it. LoRA usually wants a ~10x higher learning rate than full
    fine-tuning.
    """

    rank: int | None = Field(default=None, ge=0, le=max(VLLM_LORA_RANKS))
    """Adapter rank; None or 0 turns LoRA off (full fine-tuning)."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale of the update: B·A is multiplied by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (RL: keep 0, it perturbs the importance ratio)."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES), min_length=1)
    """nn.Linear modules to adapt, by name or dotted suffix of the module path (as PEFT matches them);
    default: the attention and MLP projections."""

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @model_validator(mode="after")
    def _supported_targets(self) -> "LoraConfig":
        for name in self.target_modules:
            if name.rsplit(".", 1)[-1] in UNSUPPORTED_TARGETS:
                raise ConfigProblem(
                    "target_modules", f"{name!r}: LoRA on the embedding or the output head is not supported"
                )
        return self


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)
