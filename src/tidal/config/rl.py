"""Schemas of the RL commands: `tidal orchestrator`, `tidal trainer`, and `tidal rl` which runs both plus inference."""

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Tag, model_validator

from tidal.config.base import Config, ConfigProblem, shadowed_key, type_or
from tidal.config.common import (
    CheckpointConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SchedulerConfig,
    TrainerRunConfig,
    WandbConfig,
)
from tidal.config.deployment import DeploymentConfig, check_table_used
from tidal.config.envs import EnvSpec, check_distinct
from tidal.config.eval import EvalEnvSpec, EvalSamplingConfig
from tidal.config.inference import (
    PER_REQUEST_CONNECTORS,
    SHARED_STORAGE_CONNECTOR,
    InferenceConfig,
    check_disaggregated_replicas,
)
from tidal.config.kubernetes import KubernetesConfig, check_pods
from tidal.config.lora import LoraConfig
from tidal.config.loss import LossConfig
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig, check_cp, check_ep, check_fsdp
from tidal.config.restarts import RestartsConfig
from tidal.config.slurm import SlurmConfig
from tidal.types import PAD_MULTIPLE


class FilesystemTransport(Config):
    """Batches as files under `<output_dir>/rollouts/step_<n>/rank_<r>.json` (written atomically)."""

    type: Literal["filesystem"] = "filesystem"
    poll_interval: float = Field(default=0.05, gt=0)
    """Seconds between checks for the next batch."""
    keep_last: int | None = Field(default=4, gt=0)
    """Rollout steps kept on disk (None: all, for inspection). Must exceed max_async_level: the trainer may
    still wait for step n − max_async_level when step n is written (unset: raised to max_async_level + 1).
    The orchestrator also keeps every step from the trainer's latest checkpoint on: a restarted trainer
    trains them again."""


class ZMQTransport(Config):
    """Batches over ZeroMQ: the orchestrator binds, trainer ranks connect and ask for their shard."""

    type: Literal["zmq"] = "zmq"
    host: str = "127.0.0.1"
    """Address the orchestrator binds and trainer ranks connect to."""
    port: int = Field(default=5557, ge=1, le=65535)
    """TCP port."""


RolloutTransport = Annotated[
    Annotated[FilesystemTransport, Tag("filesystem")] | Annotated[ZMQTransport, Tag("zmq")],
    type_or("filesystem", "zmq"),
]


class RLRunConfig(RunConfig):
    """The keys the processes of one RL run share, declared once: `tidal rl` takes them at the top of its
    file and copies them into the orchestrator's and the trainer's configs (`launcher/split.py`), and
    `tidal orchestrator` and `tidal trainer` take them at the top of theirs."""

    output_dir: Path = Path("outputs/rl")
    """Run directory: logs/, configs/, rollouts/, weights/, checkpoints, metrics, plots/ (the orchestrator and
    the trainer write below the same one)."""
    model: ModelConfig = ModelConfig()
    transport: RolloutTransport = FilesystemTransport()
    """How the orchestrator's batches reach the trainer: `filesystem` (rollouts/step_<n>/) or `zmq`."""


class SamplingConfig(Config):
    """Sampling for rollouts. top_p = 1 and top_k off keep the inference logprobs those of softmax(logits / T)."""

    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value."""
    max_tokens: int = Field(default=64, gt=0)
    """Completion budget per rollout."""


class ClientConfig(Config):
    """How the orchestrator reaches inference."""

    urls: list[str] = ["http://127.0.0.1:8000"]
    """Base URLs of the inference servers (several: data parallel)."""
    admin_token: str | None = None
    """Token for pause/update routes (default: TIDAL_ADMIN_TOKEN)."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds per request."""
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds the orchestrator waits, when it starts, for the servers to answer /health. `tidal rl` sets it
    to its own startup_timeout: it starts the orchestrator while vLLM loads."""
    max_in_flight: int | None = Field(default=None, gt=0)
    """Most groups generated concurrently, whichever step they are for: with max_async_level > 0, groups for
    the next steps start while the current step's are still running (tidal.orchestrator.inflight). Unset: as
    many as the async bound lets start: (max_async_level + 1) × num_prompts divided by the recent share of
    groups kept, within each step's draw budget (batch.max_tasks_factor). A cap below that holds back the next step's groups: the former default of 64
    did at 32 prompts, level 1 and a keep rate of 0.8 (80 wanted), while vLLM ran below half its batch (issue
    34, README Performance). Set it to bound the requests one server gets."""
    recovery_timeout: float = Field(default=0.0, ge=0)
    """Seconds a request, or a weight update, waits for an inference server to come back while every one
    is out of rotation (0: it fails at once, and with it the run). `tidal rl` sets it to startup_timeout
    when it restarts lost replicas (`restarts.max_restarts` > 0): a restarted replica is back after its
    startup."""
    http_workers: int = Field(default=0, ge=0)
    """Processes that send the generation requests and parse their answers, beside the orchestrator's
    event loop (a server's requests always from the same one); 0: the loop does it. Worth it at hundreds
    of servers or thousands of requests in flight, where that work would hold the loop (README,
    "Orchestrator at cluster scale")."""
    prefill_urls: list[str] = []
    """Prefill servers of disaggregated serving (`tidal rl` sets them from `inference.disaggregation`):
    each generation is prefilled on one of these and decoded on one of `urls`."""
    kv_store: str | None = None
    """A KV store every server reads by prompt content (ExampleConnector's directory), emptied while every
    server is paused for a weight update (`tidal rl` sets it from `inference.disaggregation`)."""
    weight_update_pause: Literal["auto", "wait", "keep"] = "auto"
    """What a full-weight update does with requests in flight. `wait`: stop admitting requests, let the
    running ones finish, load, resume — every completion comes from one policy, but with max_async_level > 0
    generation stalls for the drain at every update (2×H200, Qwen3-0.6B shape, 256×256 tokens: 6.5 s per
    update; SmolLM2-135M on one H100, multi-turn alphabet_sort: vLLM ran no request in half of the
    seconds between steps; README, Performance). `keep`: freeze running requests, load, resume them under
    the new weights — no drain (2×H200: 0.5 s per update; with CUDA graphs level 2 ran 1.79x level 0); a
    completion may then span two policies, as a multi-turn episode's turns may under either. Training
    stays correct: the loss corrects with each token's own sampling logprob, and a rollout counts as the
    (older) version it started with for the staleness bound. `auto`: `keep` when max_async_level > 0,
    except with a shared KV store (`kv_store`, which needs `wait`); `wait` otherwise (with
    max_async_level = 0 nothing runs during an update)."""

    def pause_mode(self, max_async_level: int) -> Literal["wait", "keep"]:
        """The resolved `weight_update_pause` for an orchestrator whose bound is `max_async_level`."""
        if self.weight_update_pause != "auto":
            return self.weight_update_pause
        return "keep" if max_async_level > 0 and self.kv_store is None else "wait"


class BatchConfig(Config):
    """What one training step consumes and how it is laid out for the trainer ranks."""

    num_prompts: int = Field(default=32, gt=0)
    """Tasks (groups) per step."""
    group_size: int = Field(default=8, gt=1)
    """Rollouts per task; advantages are computed within a group."""
    advantage: Literal["mean", "std", "rloo"] = "mean"
    """`mean`: r − mean(r); `std`: divided by the group's std too; `rloo`: leave-one-out baseline."""
    zero_signal: Literal["drop", "keep"] = "drop"
    """Groups whose advantages are all zero teach nothing: `drop` refills them with new tasks."""
    max_tasks_factor: float = Field(default=4.0, ge=1)
    """A step draws at most this × num_prompts new tasks to replace dropped groups (zero-signal, failed,
    stale). At the limit it trains on the groups it has (a warning says how many), or stops with the reason
    when it has none: a run whose rewards never differ, or whose rollouts all fail, must not hang."""
    seq_len: int = Field(default=2048, gt=1)
    """Packed row length for the trainer; must hold the longest prompt + completion."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Packed rows per forward pass."""
    pad_multiple: int = Field(default=PAD_MULTIPLE, gt=0)
    """A micro-batch's rows are padded to its longest row rounded up to a multiple of this many tokens (at
    most seq_len), so the trainer's compute follows the real tokens; seq_len: every micro-batch is
    [rows, seq_len] (fixed shapes for compiled kernels, at the cost of computing the padding)."""
    num_trainer_ranks: int = Field(default=1, gt=0)
    """Trainer processes to shard each batch over (set by `tidal rl`)."""
    cp: int = Field(default=1, gt=0)
    """Trainer ranks per context-parallel group (set by `tidal rl` from trainer.perf.cp): each group of this
    many consecutive ranks gets the same rows, so a step is split num_trainer_ranks / cp ways."""

    @model_validator(mode="after")
    def _check_cp(self) -> "BatchConfig":
        if self.num_trainer_ranks % self.cp:
            raise ConfigProblem(
                "cp", f"{self.cp} ranks per context-parallel group do not divide the {self.num_trainer_ranks} "
                "trainer rank(s)", also=("num_trainer_ranks",),
            )  # fmt: skip
        return self


class OnlineEvalConfig(Config):
    """Evaluate the current policy every `interval` steps during RL (logged as eval/<env>/... metrics)."""

    interval: int | None = Field(default=None, gt=0)
    """Run the eval every N steps (and before step 0); None disables it."""
    env: list[EvalEnvSpec] | None = Field(default=None, min_length=1)
    """Environments to evaluate, as [[orchestrator.online_eval.env]] tables. Default: the run's own
    environments on tasks it does not train on (see `heldout_spec`)."""
    num_tasks: int = Field(default=50, gt=0)
    """Tasks per environment."""
    k: int = Field(default=1, gt=0)
    """Samples per task (avg@k, pass@k)."""
    sampling: EvalSamplingConfig | None = None
    """Default: greedy, so the number moves only when the policy does, with the run's max_tokens."""
    final: bool = True
    """With `interval` set: evaluate once more after the last step, on the policy the last step trained
    (printed, and in orchestrator/online_eval.jsonl with every other online eval)."""
    save_rollouts: Literal["none", "first_and_final", "all"] = "first_and_final"
    """Which evals also write their rollouts (the answers, rewards and metrics, as `tidal eval`'s
    rollouts.jsonl) to orchestrator/online_eval_rollouts/step_<n>[_final].jsonl: `first_and_final` the one
    at step 0 and the final one, so what training changed can be read answer by answer."""


HELDOUT_SEED_OFFSET = 1_000_003
"""Added to a generated environment's seed for its held-out tasks (any other seed draws other instances)."""


def heldout_spec(spec: EnvSpec, num_tasks: int) -> EvalEnvSpec:
    """The eval spec of a training environment, on tasks the run does not train on.

    Built-in environments: their other split (`split = "heldout"` unless training is on it; the split rule,
    `tidal.envs.splits`, puts each task in one split by a hash of what makes it that task, so these are the
    tasks of SFT's held-out demonstrations too), `num_tasks` of them for the generated ones. math on a hub
    dataset: its `test` split when training uses `train`. code: its held-out tasks (3 of the shipped 18;
    generated: `num_tasks` of them).
    vf: environments: the same tasks (set [[orchestrator.online_eval.env]] to choose another split). Other
    environments: another seed (new instances of the same generator; a small task space may repeat some).
    """
    from tidal.config.env_names import BUILTIN_ENVS  # imports no environment (nor torch)

    kwargs = dict(spec.kwargs)
    if spec.name == "math" and kwargs.get("dataset", "local") != "local":
        if kwargs.get("split", "train") == "train":
            kwargs["split"] = "test"
    elif spec.name in BUILTIN_ENVS:
        kwargs["split"] = "train" if kwargs.get("split") == "heldout" else "heldout"
        if spec.name != "code" or kwargs.get("generated"):  # code's fixed list: its whole held-out split
            kwargs["num_examples"] = num_tasks
    elif not spec.name.startswith("vf:"):
        kwargs["seed"] = int(kwargs.get("seed", 0)) + HELDOUT_SEED_OFFSET
    return EvalEnvSpec(name=spec.name, label=spec.label, kwargs=kwargs)


def check_off_policy_steps(max_off_policy_steps: int | None, max_async_level: int, prefix: str = "") -> int:
    """The staleness bound the orchestrator drops groups by: `max_off_policy_steps`, unset
    `max_async_level`; ConfigProblem when it is below `max_async_level`."""
    if max_off_policy_steps is None:
        return max_async_level
    if max_off_policy_steps < max_async_level:
        raise ConfigProblem(
            f"{prefix}max_off_policy_steps",
            f"{max_off_policy_steps} is below max_async_level ({max_async_level}): groups started at the "
            "run-ahead limit would all be dropped",
            also=("max_async_level",),
        )
    return max_off_policy_steps


def fit_keep_last(
    transport: "FilesystemTransport | ZMQTransport", max_async_level: int
) -> "FilesystemTransport | ZMQTransport":
    """The transport with enough rollout steps on disk for the async bound: an unset keep_last is raised to
    max_async_level + 1, one set too low is a ConfigProblem (the trainer would wait forever for a deleted step)."""
    if not isinstance(transport, FilesystemTransport) or transport.keep_last is None:
        return transport
    if transport.keep_last > max_async_level:
        return transport
    if "keep_last" in transport.model_fields_set:
        raise ConfigProblem(
            "transport.keep_last",
            f"keeps {transport.keep_last} rollout steps on disk but max_async_level = {max_async_level} lets "
            "the orchestrator write that many steps past the one the trainer reads next, which would be "
            f"deleted unread; set keep_last ≥ {max_async_level + 1} (or leave it unset)",
            also=("max_async_level",),
        )
    return transport.model_copy(update={"keep_last": max_async_level + 1})


class SamplesConfig(Config):
    """Rollouts kept as text for people to read: <output_dir>/samples.jsonl (and the W&B `samples` table)."""

    interval: int | None = Field(default=10, gt=0)
    """Keep samples of every Nth step (step 0 included); None: none."""
    num: int = Field(default=8, gt=0)
    """Rollouts kept per such step, taken across the step's groups (one per group first)."""


class CurriculumConfig(Config):
    """Which tasks a run draws, by how often the policy solves them (`[orchestrator.curriculum]`; absent:
    the environment's tasks in order). A group teaches nothing when every sample or none passes, and a
    step drops it after paying for its generation; the curriculum draws fewer of those.

    Each task keeps a pass rate, a running estimate from its groups: the share of a group's finished
    samples whose reward is at least `pass_reward`, blended into the estimate with weight `smoothing`. A
    task a group fully solved, or fully failed, `skip_after` times in a row is no longer drawn. Another is
    drawn with odds that are 1 at `target_pass_rate` and fall linearly to `min_weight` at 0 and 1; a task
    never seen has odds 1. The state is saved with the orchestrator's (`--resume` continues it)."""

    target_pass_rate: float = Field(default=0.5, gt=0, lt=1)
    """The pass rate a drawn task is weighted toward."""
    min_weight: float = Field(default=0.1, ge=0, le=1)
    """Odds of drawing a task whose pass rate is 0 or 1 (and not yet skipped): between them, linear."""
    skip_after: int | None = Field(default=2, gt=0)
    """Skip a task once this many of its groups in a row were all solved, or all failed; None: never skip."""
    pass_reward: float = 1.0
    """A sample passes when its reward is at least this (partial-credit rewards: the share that counts)."""
    smoothing: float = Field(default=0.5, gt=0, le=1)
    """Weight of a task's newest group in its pass-rate estimate (1: that group alone)."""
    max_draws: int = Field(default=16, gt=0)
    """Candidates tried for one task slot; when none is accepted, the one with the best odds is taken."""


class TeacherConfig(Config):
    """On-policy distillation (`[orchestrator.teacher]`): a teacher model scores the student's own samples.

    For every finished rollout the orchestrator asks the teacher's server(s) for the logprob of each
    completion token (a prompt-logprobs request with the exact token ids, nothing sampled), and each token's
    advantage becomes `reward_weight` × the group's advantage + `kl_weight` × (teacher − student logprob):
    the policy gradient then lowers the reverse KL to the teacher on the student's own distribution. The
    teacher is served by `tidal inference` (its own GPUs, or a share of one) and must use the student's
    tokenizer: `tidal rl` and `tidal orchestrator` refuse another in one line before anything starts."""

    model: str
    """The teacher's model (hub id, directory or .gguf), as its server was started with: its tokenizer is
    checked against the student's."""
    urls: list[str] = Field(min_length=1)
    """Base URLs of the servers serving it, e.g. ["http://127.0.0.1:18900"]; requests rotate over them."""
    kl_weight: float = Field(default=1.0, gt=0)
    """Weight of (teacher − student logprob) in each token's advantage."""
    reward_weight: float = Field(default=0.0, ge=0)
    """Weight of the task's group advantage; 0: distillation alone (groups are kept whatever their rewards,
    no verifier is needed)."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds one scoring request may take; a rollout the teacher did not score fails (counted)."""


class TeacherServerConfig(Config):
    """`[teacher_server]`: `tidal rl` serves the distillation teacher itself, as one more `tidal inference` child of
    the run (its own log, started with the replicas, restarted on its port if it dies, stopped with them),
    and points `[orchestrator.teacher]` at it. One machine only (`deployment.type = "local"`); on a cluster,
    serve it yourself and name it in `[orchestrator.teacher]`."""

    model: str
    """The teacher's model (hub id, directory or .gguf); its tokenizer must be the student's."""
    port: int = Field(default=18950, gt=0, lt=65536)
    """Its server's port (loopback)."""
    gpus: list[int] | None = None
    """Its GPU ids (GPU runs): its own, or one the student's replicas use too (then give both a small
    `gpu_memory_utilization`). Unset: the first inference replica's."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Its vLLM's share of the GPU (unset: `inference.vllm`'s)."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Its context (unset: `inference.vllm`'s); it must hold prompt + completion."""
    kl_weight: float = Field(default=1.0, gt=0)
    """As `orchestrator.teacher.kl_weight`."""
    reward_weight: float = Field(default=0.0, ge=0)
    """As `orchestrator.teacher.reward_weight` (0: distillation alone)."""


class OrchestratorConfig(RLRunConfig):
    """`tidal orchestrator`: sample tasks, roll out against inference, score, build and ship batches."""

    HELP_MAIN = (
        "output_dir",
        "max_steps",
        "seed",
        "max_async_level",
        "model.name",
        "env",
        "sampling",
        "batch.num_prompts",
        "batch.group_size",
        "batch.seq_len",
        "client.urls",
        "transport.type",
    )

    max_async_level: int = Field(default=1, ge=0)
    """Rollouts from policy version v may train step n only if n − v ≤ this (0: fully synchronous)."""
    max_off_policy_steps: int | None = Field(default=None, ge=0)
    """Drop a group (counted: rollouts/dropped_stale) when the oldest token of its rollouts comes from a policy
    more than this many versions before the step it would train. Unset: `max_async_level`, the exact bound.
    `max_async_level` says how far generation runs ahead of training; this says how old a group may be when
    its step trains. Larger than `max_async_level`, groups that waited (carried across steps, or episodes
    whose turns span several versions) still train, further off-policy. Never smaller: a group started at
    the run-ahead limit would be dropped."""
    env: list[EnvSpec] = Field(default_factory=lambda: [EnvSpec(name="reverse_text")], min_length=1)
    """Environments to draw tasks from, as [[orchestrator.env]] tables; several are mixed by weight."""
    online_eval: OnlineEvalConfig = OnlineEvalConfig()
    teacher: TeacherConfig | None = None
    """On-policy distillation from a teacher model (`[orchestrator.teacher]`, README "On-policy
    distillation"); unset: none."""
    curriculum: CurriculumConfig | None = None
    """Draw tasks by their running pass rate: skip those solved or failed `skip_after` groups in a row, weight
    the rest toward `target_pass_rate` (README, "Difficulty curriculum"). Unset: the tasks in order."""
    resume_from: Literal["trainer", "latest"] = "trainer"
    """Where `resume` continues. `trainer`: the state saved with the trainer's latest checkpoint step, the
    batches after it made again (with the trainer resumed from that checkpoint: `tidal rl --resume`).
    `latest`: its own newest state, every batch sent before kept (the trainer runs on: `tidal rl`
    restarting a lost orchestrator)."""
    rollout_timeout: float = Field(default=300.0, gt=0)
    """Seconds one rollout (all its turns and its reward) may take before it counts as failed."""
    loop_lag_warn: float = Field(default=0.5, gt=0)
    """Warn, naming the step, when the event loop was held this many seconds at once: every request in
    flight waited that long (logged every step as event_loop/lag_p50_s, _p99_s, _max_s)."""
    reward_workers: int | None = Field(default=None, ge=0)
    """Processes that compute rewards, so that a slow reward (math-verify, a rubric, running tests) does not
    hold the event loop and every request in flight. Plain reward functions defined at module level run
    there, one call at a time per process, on a copy of the task and episode; a call still running when its
    rollout times out kills its process (a new one starts). `async def` rewards, and lambdas, closures or
    bound methods (warned once), run on the event loop. Unset: one per CPU core, at most 4; 0: every
    reward on the event loop."""
    sampling: SamplingConfig = SamplingConfig()
    routing_replay: bool = False
    """Record the experts inference routed each rollout's tokens to and send them with its samples (routing
    replay; the servers must return them: `inference.vllm.return_routed_experts`). A completion without
    them stops the run. `tidal rl` sets it from `trainer.moe.routing_replay`."""
    batch: BatchConfig = BatchConfig()
    client: ClientConfig = ClientConfig()
    log: LogConfig = LogConfig(interval=1)
    samples: SamplesConfig = SamplesConfig()

    @model_validator(mode="after")
    def _check_envs(self) -> "OrchestratorConfig":
        problem = check_distinct(self.env)
        if problem is not None:
            raise ConfigProblem("env", problem)
        transport = fit_keep_last(self.transport, self.max_async_level)
        if transport is not self.transport:
            self.transport = transport
        if self.resume_from == "latest" and isinstance(self.transport, ZMQTransport):
            raise ConfigProblem(
                "resume_from",
                "'latest' keeps the batches sent before, which zmq holds in the process that is gone; "
                "use 'trainer' (and resume the trainer from its checkpoint) or the filesystem transport",
            )
        return self

    @model_validator(mode="after")
    def _fill_online_eval(self) -> "OrchestratorConfig":
        """Unset online-eval environments and sampling follow the run's (shown resolved by --dry-run)."""
        spec, fill = self.online_eval, dict[str, Any]()
        if spec.env is None:
            fill["env"] = [heldout_spec(s, spec.num_tasks) for s in self.env]
        if spec.sampling is None:
            fill["sampling"] = EvalSamplingConfig(temperature=0.0, max_tokens=self.sampling.max_tokens)
        if fill:
            self.online_eval = spec.model_copy(update=fill)
        return self

    def environments(self) -> list[tuple[str, EnvSpec]]:
        """Every environment the run will build, with its key: those it trains on, those it evaluates online."""
        named = [(f"env.{i}", spec) for i, spec in enumerate(self.env)]
        if self.online_eval.interval is not None:
            named += [(f"online_eval.env.{i}", spec) for i, spec in enumerate(self.online_eval.env or [])]
        return named


PublishDtype = Literal["auto", "float32", "bfloat16", "float16"]


class FilesystemPublish(Config):
    """Weights as files: HF safetensors under <output_dir>/weights/step_<n>/ (with LoRA: a PEFT adapter),
    loaded by every server from there. Works across nodes when they share the run directory."""

    type: Literal["filesystem"] = "filesystem"
    keep_last: int = Field(default=3, ge=2)
    """Published steps kept on disk (a server may still be loading the previous one)."""
    dtype: PublishDtype = "auto"
    """Dtype of the published weights. `auto`: the dtype inference serves — model.dtype when set, else the
    checkpoint's own (config.json); fp32 master weights are then cast once here instead of written in fp32."""


class NcclPublish(Config):
    """Weights by NCCL broadcast from trainer rank 0 to every inference worker of every replica (GPUs only,
    across nodes too). Each step, rank 0 announces `weights/step_<n>/` (a small `nccl.json`, no weights) and
    broadcasts; the orchestrator tells every server to receive it, as it would to load a filesystem step.
    The trainer waits in each publish until every server has received the step. Full weights only (no LoRA)."""

    type: Literal["nccl"] = "nccl"
    keep_last: int = Field(default=3, ge=2)
    """Step announcements kept on disk (they hold no weights)."""
    dtype: PublishDtype = "auto"
    """Dtype the weights are broadcast in (as for `filesystem`): fp32 master weights are cast first, so the
    broadcast carries what inference serves."""
    host: str = "127.0.0.1"
    """Address of trainer rank 0 that inference workers reach for the NCCL rendezvous (`tidal rl` sets it:
    loopback on one node, the first trainer node's address on a cluster)."""
    port: int = Field(default=29555, ge=1, le=65535)
    """TCP port of that rendezvous (rank 0 listens; the workers connect)."""
    inference_world_size: int = Field(default=1, gt=0)
    """Inference workers that receive the broadcast, all replicas together (`tidal rl` sets it)."""


class CudaIpcPublish(Config):
    """Weights through GPU memory when inference and trainer rank 0 share one GPU (one machine, every
    inference replica on trainer rank 0's GPU, one GPU each). Rank 0 keeps one copy of the weights in the
    served dtype on the GPU, casts its master weights into it in place each step, and shares it once with
    vLLM's workers (CUDA IPC); each step announces `weights/step_<n>/` (a small `cuda_ipc.json`, no weights)
    and every server loads from that copy. Full weights only (no LoRA)."""

    type: Literal["cuda_ipc"] = "cuda_ipc"
    keep_last: int = Field(default=3, ge=2)
    """Step announcements kept on disk (they hold no weights)."""
    dtype: PublishDtype = "auto"
    """Dtype of the shared copy (as for `filesystem`): what inference serves."""


PublishConfig = Annotated[
    Annotated[FilesystemPublish, Tag("filesystem")]
    | Annotated[NcclPublish, Tag("nccl")]
    | Annotated[CudaIpcPublish, Tag("cuda_ipc")],
    type_or("filesystem", "nccl", "cuda_ipc"),
]
"""How the trainer hands new weights to inference: `filesystem` (default), `nccl` or `cuda_ipc`; under `tidal rl`
this is the one setting, and every server's `inference.weights` is derived from it."""


class RLTrainerConfig(TrainerRunConfig, RLRunConfig):
    """`tidal trainer`: consume batches, take one optimizer step per batch, publish weights."""

    HELP_MAIN = (
        "output_dir",
        "max_steps",
        "seed",
        "resume",
        "device",
        "model.name",
        "optim.lr",
        "scheduler",
        "lora.rank",
        "ckpt.interval",
        "transport.type",
        "publish.type",
    )

    optim: OptimConfig = OptimConfig(lr=3e-6)
    perf: PerfConfig = PerfConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoraConfig = LoraConfig()
    """Train LoRA adapters only; each step publishes a PEFT adapter (`weights/step_<n>/`) instead of the
    full weights, and inference samples with it (`tidal rl` enables LoRA in vLLM to match)."""
    scheduler: SchedulerConfig = SchedulerConfig(type="constant")
    loss: LossConfig = LossConfig()
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts (logits are divided by it); `tidal rl` copies it from sampling."""
    publish: PublishConfig = FilesystemPublish()
    ckpt: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig(interval=1)
    wandb: WandbConfig = WandbConfig()


# Keys `tidal rl` sets in its processes' configs from elsewhere in its own file (launcher/split.py), and
# where the user sets them instead: a value written in the sub-table would be overwritten without a word.
# Every key a role's schema shares by name with RLConfig (the RLRunConfig block, and `model`,
# `max_async_level`, `wandb`) is added below RLConfig, read off the schemas (`_shared_by_name`); here are the
# keys derived from other keys of the run.
SET_FROM_THE_TOP: dict[tuple[str, ...], str] = {
    ("trainer", "temperature"): "orchestrator.sampling.temperature",
    ("orchestrator", "client", "urls"): "inference.server.host` / `port` and `deployment.num_replicas",
    ("orchestrator", "batch", "num_trainer_ranks"): "deployment.num_trainer_ranks",
    ("orchestrator", "batch", "cp"): "trainer.perf.cp",
    ("orchestrator", "client", "recovery_timeout"): "startup_timeout` and `restarts",
    ("orchestrator", "client", "prefill_urls"): "inference.disaggregation",
    ("inference", "disaggregation", "role"): "inference.disaggregation.num_prefill_replicas",
    ("orchestrator", "client", "kv_store"): "inference.disaggregation",
    ("orchestrator", "client", "startup_timeout"): "startup_timeout",
    ("orchestrator", "resume_from"): "resume` and `restarts",
    ("inference", "vllm", "seed"): "seed",
    ("inference", "cpu", "omp_threads_bind"): "deployment.inference_cpus",
    ("inference", "vllm", "return_routed_experts"): "trainer.moe.routing_replay",
    ("orchestrator", "routing_replay"): "trainer.moe.routing_replay",
    ("inference", "weights", "backend"): "trainer.publish.type",
    ("inference", "weights", "nccl"): "trainer.publish",
    ("trainer", "publish", "host"): "deployment",
    ("trainer", "publish", "inference_world_size"): "deployment` and `inference.vllm",
}


class MonitorConfig(Config):
    """What `tidal rl` shows while it runs: the console's step lines and the plot it redraws."""

    progress: Literal["auto", "bar", "lines"] = "auto"
    """`bar`: a progress bar with step time and ETA; `lines`: one timestamped line per step; `auto`: the bar
    when stdout is a terminal, lines otherwise (a log file, a batch job)."""
    plot_interval: int | None = Field(default=5, gt=0)
    """Redraw <output_dir>/plots/rl.png every N trained steps (by `tidal plot`, beside the run) and at the
    end; None: only at the end."""


class RLConfig(RLRunConfig):
    """`tidal rl`: one file for inference, orchestrator and trainer; shared keys are set once at the top."""

    SET_ELSEWHERE = SET_FROM_THE_TOP
    HELP_MAIN = (
        "output_dir",
        "max_steps",
        "seed",
        "resume",
        "max_async_level",
        "model.name",
        "model.dtype",
        "deployment.type",
        "deployment.num_replicas",
        "deployment.num_trainer_ranks",
        "deployment.trainer_gpus",
        "deployment.inference_gpus",
        "inference.vllm.max_model_len",
        "inference.vllm.gpu_memory_utilization",
        "orchestrator.env",
        "orchestrator.online_eval.interval",
        "orchestrator.sampling",
        "orchestrator.batch.num_prompts",
        "orchestrator.batch.group_size",
        "orchestrator.batch.seq_len",
        "trainer.optim.lr",
        "trainer.scheduler",
        "trainer.lora.rank",
        "trainer.ckpt.interval",
        "trainer.wandb.enabled",
        "restarts.max_restarts",
    )

    resume: bool = False
    """Resume trainer and orchestrator and reload the latest weights into inference."""
    max_async_level: int = Field(default=1, ge=0)
    """Off-policy bound: rollouts from version v train step n only if n − v ≤ this."""
    deployment: DeploymentConfig = DeploymentConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    """Manifests of a Kubernetes run (deployment.type = "kubernetes" only)."""
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: RLTrainerConfig = RLTrainerConfig()
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for inference to become healthy (at the start, and for a restarted replica)."""
    restarts: RestartsConfig = RestartsConfig()
    wandb: WandbConfig = WandbConfig()
    """One W&B run for the whole `tidal rl`: trainer and orchestrator metrics, online eval and the rollout
    samples table, logged by the launcher (README, "Monitoring")."""
    monitor: MonitorConfig = MonitorConfig()
    slurm: SlurmConfig = SlurmConfig()
    """The batch job of `deployment.type = "slurm"` (partition, account, time, setup commands, …)."""
    teacher_server: TeacherServerConfig | None = None
    """On-policy distillation from a teacher that `tidal rl` serves (README, "On-policy distillation");
    unset: none, or one served elsewhere (`[orchestrator.teacher]`)."""

    @model_validator(mode="after")
    def _check_teacher(self) -> "RLConfig":
        if self.teacher_server is None:
            return self
        if self.orchestrator.teacher is not None:
            raise ConfigProblem(
                "teacher_server", "and [orchestrator.teacher] both name a teacher: set [teacher_server] for one "
                "`tidal rl` serves, or [orchestrator.teacher] for one served elsewhere", also=("orchestrator.teacher",),
            )  # fmt: skip
        if self.deployment.type != "local":
            raise ConfigProblem(
                "teacher_server", f"tidal rl serves a teacher on one machine only, not with deployment.type = "
                f"{self.deployment.type!r}: serve it with `tidal inference` and name it in [orchestrator.teacher]",
                also=("deployment.type",),
            )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _check_slurm(self) -> "RLConfig":
        check_table_used(self, "slurm", self.deployment.type)
        return self

    @model_validator(mode="after")
    def _check_keys_set_from_the_top(self) -> "RLConfig":
        shadowed = shadowed_key(self, SET_FROM_THE_TOP)
        if shadowed is not None:
            key, top = shadowed
            raise ConfigProblem(key, f"`tidal rl` sets this from `{top}`; set that instead")
        return self

    @model_validator(mode="after")
    def _check_kubernetes(self) -> "RLConfig":
        check_table_used(self, "kubernetes", self.deployment.type)
        if self.deployment.type == "kubernetes":
            check_kubernetes_run(self)
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> "RLConfig":
        check_ep(self.trainer.perf, self.deployment.total_trainer_ranks, "trainer.perf.ep")
        check_routing_replay(self.trainer.moe, "trainer.moe")
        check_cp(self.trainer.perf, self.deployment.total_trainer_ranks, "trainer.perf.cp")
        check_fsdp(self.trainer.perf, self.deployment.total_trainer_ranks, "trainer.perf.fsdp")
        transport = fit_keep_last(self.transport, self.max_async_level)
        if transport is not self.transport:
            self.transport = transport
        if self.trainer.scheduler.warmup_steps > self.max_steps:
            raise ConfigProblem(
                "trainer.scheduler.warmup_steps",
                f"warmup is longer than max_steps ({self.max_steps})",
                also=("max_steps",),
            )
        check_publish_combinations(self)
        check_off_policy_steps(self.orchestrator.max_off_policy_steps, self.max_async_level, "orchestrator.")
        if self.inference.disaggregation is not None:
            check_disaggregated_rl(self)
        check_max_model_len(self)
        return self


ROLE_TABLES = ("inference", "orchestrator", "trainer")


def _shared_by_name() -> dict[tuple[str, ...], str]:
    """(role, key) for every key a role's schema declares under the same name as one of RLConfig's: the
    launcher copies each of them from the top (`launcher/split.py`), so none is listed by hand."""
    shared: dict[tuple[str, ...], str] = {}
    for role in ROLE_TABLES:
        schema = RLConfig.model_fields[role].annotation
        assert isinstance(schema, type) and issubclass(schema, Config)
        for key in schema.model_fields:
            if key in RLConfig.model_fields and key not in ROLE_TABLES:
                shared[(role, key)] = key
    return shared


SET_FROM_THE_TOP.update(_shared_by_name())


def check_publish_combinations(rl: RLConfig) -> None:
    """What the weight publish method (`trainer.publish.type`) rules out: LoRA adapters, restarts and
    weight-file checks outside the filesystem, and the layerwise load setting outside cuda_ipc."""
    publish_type = rl.trainer.publish.type
    if rl.trainer.lora.enabled and publish_type != "filesystem":
        raise ConfigProblem(
            "trainer.publish.type",
            f"LoRA runs publish adapters through the filesystem; {publish_type} carries full weights only",
            also=("trainer.lora.rank",),
        )
    restarts = rl.restarts
    if publish_type != "filesystem" and restarts.max_restarts and "max_restarts" in restarts.model_fields_set:
        why = {
            "nccl": "cannot take a restarted process back into its broadcast group",
            "cuda_ipc": "cannot hand a restarted trainer's new GPU buffer to the running servers",
        }[publish_type]
        raise ConfigProblem(
            "restarts.max_restarts",
            f"a run that publishes weights by {publish_type} {why}; set 0 "
            "(or trainer.publish.type = 'filesystem')",
        )
    if publish_type != "filesystem" and rl.inference.weights.check_finite is True:
        raise ConfigProblem(
            "inference.weights.check_finite",
            f"checks weight files; {publish_type} updates have none "
            "(the trainer refuses NaN/inf before it publishes)",
        )
    if publish_type == "cuda_ipc":
        check_one_gpu(rl)
    elif rl.inference.weights.load != "layerwise":
        raise ConfigProblem(
            "inference.weights.load",
            "chooses how cuda_ipc updates load; set trainer.publish.type = 'cuda_ipc'",
            also=("trainer.publish.type",),
        )


def check_max_model_len(rl: RLConfig) -> None:
    """A rollout as long as inference allows must fit a packed training row."""
    longest = rl.orchestrator.batch.seq_len
    if rl.inference.vllm.max_model_len is not None and rl.inference.vllm.max_model_len > longest:
        raise ConfigProblem(
            "orchestrator.batch.seq_len",
            f"packed rows ({longest} tokens) are shorter than inference.vllm.max_model_len "
            f"({rl.inference.vllm.max_model_len}): a long rollout could not be trained on",
            also=("inference.vllm.max_model_len",),
        )


def check_disaggregated_rl(rl: RLConfig) -> None:
    """What `tidal rl` cannot keep correct across weight updates with prefill/decode disaggregation."""
    disagg = rl.inference.disaggregation
    assert disagg is not None
    key = "inference.disaggregation.connector"
    if rl.deployment.type != "local":
        raise ConfigProblem(
            "inference.disaggregation", f"runs on one machine for now; deployment.type is {rl.deployment.type!r}",
            also=("deployment.type",),
        )  # fmt: skip
    check_disaggregated_replicas(disagg, rl.deployment.num_replicas, "deployment.num_replicas")
    known = (SHARED_STORAGE_CONNECTOR, *PER_REQUEST_CONNECTORS)
    if disagg.connector not in known:
        raise ConfigProblem(
            key,
            f"{disagg.connector!r} may keep KV across a weight update, which would decode new weights on KV of "
            f"old ones; `tidal rl` supports {' and '.join(known)}",
        )
    if not disagg.shared_storage:
        return
    if rl.trainer.lora.enabled:
        raise ConfigProblem(
            key,
            f"{SHARED_STORAGE_CONNECTOR} finds KV by the prompt's tokens alone, and LoRA policy updates load "
            "without a pause: KV of one step's adapter would serve the next; use NixlConnector",
            also=("trainer.lora.rank",),
        )
    if rl.orchestrator.client.weight_update_pause == "keep":  # `auto` resolves to wait with the store
        raise ConfigProblem(
            "orchestrator.client.weight_update_pause",
            "'keep' carries requests across a weight update: one on a replica that failed it could write KV of "
            f"the old weights to {SHARED_STORAGE_CONNECTOR}'s store after it was emptied; use 'wait'",
            also=(key,),
        )


def check_routing_replay(moe: MoEConfig, where: str) -> None:
    """`replay_compare_interval` compares with replay: without it, it would do nothing."""
    if moe.replay_compare_interval is not None and not moe.routing_replay:
        raise ConfigProblem(
            f"{where}.replay_compare_interval",
            f"compares routing replay with the trainer's own routing; set {where}.routing_replay = true",
        )


def check_one_gpu(rl: RLConfig) -> None:
    """`cuda_ipc` maps trainer rank 0's GPU memory into the vLLM workers: only where each of them runs on
    that very GPU, on the same machine."""
    deploy, vllm = rl.deployment, rl.inference.vllm
    fix = "(use 'nccl' between GPUs or nodes, 'filesystem' anywhere)"
    if deploy.type != "local":
        raise ConfigProblem(
            "trainer.publish.type",
            f"cuda_ipc needs inference and trainer on one machine; deployment.type = {deploy.type!r} puts them on "
            f"separate nodes {fix}",
            also=("deployment.type",),
        )
    for key, device in (("inference.device", rl.inference.device), ("trainer.device", rl.trainer.device)):
        if device == "cpu":
            raise ConfigProblem(
                "trainer.publish.type", f"cuda_ipc shares GPU memory; {key} is 'cpu'", also=(key,)
            )
    if vllm.tensor_parallel_size * vllm.data_parallel_size != 1:
        raise ConfigProblem(
            "trainer.publish.type",
            "cuda_ipc needs each inference replica on one GPU (tensor_parallel_size × data_parallel_size = 1) "
            f"{fix}",
            also=("inference.vllm.tensor_parallel_size", "inference.vllm.data_parallel_size"),
        )
    trainer_gpu = deploy.trainer_gpus[0]
    others = sorted({gpu for gpu in deploy.inference_gpus if gpu != trainer_gpu})
    if others:
        raise ConfigProblem(
            "trainer.publish.type",
            f"cuda_ipc needs inference on trainer rank 0's GPU {trainer_gpu}, but deployment.inference_gpus "
            f"lists {others} {fix}",
            also=("deployment.inference_gpus", "deployment.trainer_gpus"),
        )


def check_kubernetes_run(rl: RLConfig) -> None:
    """Raise a ConfigProblem (key relative to the run config) for what a Kubernetes RL run cannot do."""
    deploy = rl.deployment
    check_pods(
        rl.kubernetes,
        rl.output_dir,
        {"inference_gpus": deploy.inference_gpus, "trainer_gpus": deploy.trainer_gpus},
    )
    for key, value in (
        ("inference.server.admin_token", rl.inference.server.admin_token),
        ("orchestrator.client.admin_token", rl.orchestrator.client.admin_token),
    ):
        if value is not None:
            raise ConfigProblem(
                key, "pods take the token from a Secret (kubernetes.admin_token_secret, or one generated)"
            )
    if rl.inference.server.host not in ("127.0.0.1", "localhost", "0.0.0.0"):
        raise ConfigProblem(
            "inference.server.host",
            "Kubernetes assigns pod addresses; leave it unset (replicas bind 0.0.0.0)",
        )
