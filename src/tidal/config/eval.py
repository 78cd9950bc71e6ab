"""Schema of `tidal eval`: environments, samples per task, and the model (a server to start, or one running)."""

from pathlib import Path

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem, shadowed_key
from tidal.config.common import ModelConfig
from tidal.config.envs import EnvSpec, check_distinct
from tidal.config.inference import InferenceConfig, check_disaggregated_replicas


class EvalEnvSpec(EnvSpec):
    """One environment to evaluate (`weight` is ignored: every environment is evaluated on its own)."""

    num_tasks: int | None = Field(default=None, gt=0)
    """Evaluate the first N tasks of the environment (default: eval.num_tasks)."""


class EvalSamplingConfig(Config):
    """How the k samples per task are drawn."""

    temperature: float = Field(default=1.0, ge=0)
    """0 = greedy (then k > 1 repeats the same answer; use k = 1)."""
    max_tokens: int = Field(default=256, gt=0)
    """Tokens per model turn."""


class EvalConfig(Config):
    """`tidal eval`: run environments against a model, k samples per task; report avg@k and pass@k per env."""

    SET_ELSEWHERE = {
        ("inference", "model"): "model",
        ("inference", "disaggregation", "role"): "inference.disaggregation.num_prefill_replicas",
    }
    HELP_MAIN = (
        "output_dir",
        "seed",
        "model.name",
        "server_url",
        "env",
        "num_tasks",
        "k",
        "sampling",
        "inference.vllm.max_model_len",
    )

    output_dir: Path = Path("outputs/eval")
    """Where eval.json, eval.md and rollouts.jsonl go."""
    seed: int = 0
    """Sampling seeds derive from it (same seed, same samples)."""
    model: ModelConfig = ModelConfig()
    """The model: served by the [inference] server started here, and its tokenizer renders the prompts."""
    server_url: str | None = None
    """Base URL of a running vLLM server (OpenAI-compatible, token-in completions); no server is started."""
    inference: InferenceConfig = InferenceConfig()
    """The server to start when server_url is not set (its model is the top-level model)."""
    num_replicas: int = Field(default=1, gt=0)
    """Servers to start, each a copy of [inference] on the next port (vllm-cpu: each on its share of the
    cores unless inference.cpu.omp_threads_bind is set); requests go to the least loaded. With
    [inference.disaggregation] the first `num_prefill_replicas` prefill and the others decode."""
    env: list[EvalEnvSpec] = Field(default_factory=lambda: [EvalEnvSpec(name="reverse_text")], min_length=1)
    """Environments, as [[env]] tables."""
    num_tasks: int = Field(default=100, gt=0)
    """Tasks per environment (each env's num_tasks overrides)."""
    k: int = Field(default=1, gt=0)
    """Samples per task."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is ≥ this (pass@k); for reward-1-is-exact envs, exact match."""
    confidence: float = Field(default=0.95, gt=0, lt=1)
    """Confidence level of the reported intervals (normal approximation over tasks)."""
    sampling: EvalSamplingConfig = EvalSamplingConfig()
    max_concurrency: int = Field(default=32, gt=0)
    """Rollouts in flight at once."""
    timeout: float = Field(default=300.0, gt=0)
    """Seconds one rollout may take before it counts as failed."""
    reward_workers: int | None = Field(default=None, ge=0)
    """Processes that compute rewards off the event loop, as `orchestrator.reward_workers` (unset: one per
    CPU core, at most 4; 0: on the event loop)."""
    save_rollouts: bool = True
    """Write every rollout (messages, reward, metrics) to rollouts.jsonl."""
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for the started server to become healthy."""

    @model_validator(mode="after")
    def _check_combinations(self) -> "EvalConfig":
        shadowed = shadowed_key(self, self.SET_ELSEWHERE)
        if shadowed is not None and shadowed[0] == "inference.model":
            raise ConfigProblem(
                "inference.model", "`tidal eval` serves the top-level [model]; set that instead"
            )
        if shadowed is not None:
            raise ConfigProblem(shadowed[0], f"`tidal eval` sets this from `{shadowed[1]}`; set that instead")
        problem = check_distinct(list(self.env))
        if problem is not None:
            raise ConfigProblem("env", problem)
        disagg = self.inference.disaggregation
        if disagg is not None and self.server_url is not None:
            raise ConfigProblem(
                "inference.disaggregation",
                "needs the prefill and decode servers `tidal eval` starts; server_url names one running server",
                also=("server_url",),
            )
        if disagg is not None:
            check_disaggregated_replicas(disagg, self.num_replicas, "num_replicas")
        if self.sampling.temperature == 0 and self.k > 1:
            raise ConfigProblem(
                "k",
                "greedy sampling (temperature 0) gives the same answer k times; use k = 1",
                also=("sampling.temperature",),
            )
        return self

    def inference_config(self) -> InferenceConfig:
        """The server to start: [inference] with the top-level model."""
        return self.inference.model_copy(update={"model": self.model})
