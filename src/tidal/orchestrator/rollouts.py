"""Run one group: render the task's prompt to token ids, sample `group_size` completions, score each one."""

import hashlib
from typing import Any

from tidal.config.rl import SamplingConfig
from tidal.envs.base import Environment, Task
from tidal.inference.client import InferenceClient
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.types import Group, Rollout


def prompt_ids(tokenizer: Any, task: Task) -> list[int]:
    """Token ids of the task's chat prompt, rendered once here so inference samples from exactly these."""
    text = tokenizer.apply_chat_template(task.messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def group_seed(run_seed: int, position: int) -> int:
    """A per-task sampling seed: a rerun (or a resumed run) samples the same completions for the same task."""
    digest = hashlib.sha256(f"{run_seed}/{position}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


async def run_group(
    client: InferenceClient,
    env: Environment,
    tokenizer: Any,
    task: Task,
    position: int,
    group_size: int,
    sampling: SamplingConfig,
    run_seed: int,
) -> Group:
    ids = prompt_ids(tokenizer, task)
    request = GenerateRequest(
        prompt_token_ids=tuple(ids),
        n=group_size,
        sampling=SamplingParams(
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            seed=group_seed(run_seed, position),
        ),
    )
    generation = await client.generate(request, session_id=task.task_id)
    rollouts = []
    for completion in generation.completions:
        reward, failed = _score(env, task, completion.text)
        rollouts.append(
            Rollout(
                prompt_ids=list(generation.prompt_token_ids),
                completion_ids=list(completion.token_ids),
                completion_logprobs=list(completion.logprobs),
                completion_mask=[1] * len(completion.token_ids),
                reward=reward,
                policy_version=generation.weight_version,
                policy_version_max=generation.weight_version,
                env=env.name,
                task_id=task.task_id,
                metrics={"completion_len": float(len(completion.token_ids)), "truncated": float(completion.finish_reason == "length")},
                failed=failed,
            )
        )
    return Group(task_id=task.task_id, env=env.name, rollouts=rollouts)


def _score(env: Environment, task: Task, text: str) -> tuple[float, bool]:
    """An exception in a reward function fails that rollout only; the run goes on."""
    try:
        return float(env.score(task, text)), False
    except Exception:  # noqa: BLE001 - user reward code may raise anything
        return 0.0, True
