"""On-policy distillation's training signal: per-token advantages from a teacher's logprobs (pure logic), and
the checks a teacher must pass before a run starts.

The student samples; a teacher scores the student's own tokens. At completion token t, with s_t the
student's logprob (what inference sampled it with) and q_t the teacher's, q_t − s_t is minus the
single-sample estimate of the reverse KL's term there, KL(student ‖ teacher) = E_student[s − q]. Using it
as token t's advantage in the policy-gradient loss lowers the reverse KL: tokens the teacher likes more
than the student are pushed up, the others down. It is added to the task's group advantage with weights:

    A_t = reward_weight · A_group + kl_weight · (q_t − s_t)

`reward_weight = 0` is distillation alone (no verifier needed: a group's rewards may all be equal).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tidal.config.envs import EnvSpec
from tidal.errors import UserError
from tidal.types import Rollout


@dataclass(frozen=True)
class DistillWeights:
    kl_weight: float
    """Weight of the teacher − student logprob difference per token."""
    reward_weight: float
    """Weight of the task's group advantage (0: distillation alone)."""


def completion_advantages(rollout: Rollout, advantage: float, weights: DistillWeights) -> list[float]:
    """Each completion token's advantage: the weighted group advantage plus the weighted teacher − student
    difference on the tokens the model wrote (an environment's tokens in a multi-turn completion, which
    carry no loss, get the group part only)."""
    if len(rollout.teacher_logprobs) != len(rollout.completion_ids):
        raise ValueError(f"rollout {rollout.rollout_id or rollout.task_id!r} has no teacher logprobs")
    base = weights.reward_weight * advantage
    return [
        base + (weights.kl_weight * (teacher - student) if trained else 0.0)
        for teacher, student, trained in zip(
            rollout.teacher_logprobs, rollout.completion_logprobs, rollout.completion_mask, strict=True
        )
    ]


class ReverseKL(NamedTuple):
    """The sampled KL(student ‖ teacher) of a step's rollouts, over their model-written completion tokens
    (student − teacher logprob; an environment's tokens in a multi-turn completion have none)."""

    per_token: float
    """The mean over all those tokens (0.0 with none)."""
    tokens: int
    """How many tokens that mean is over."""
    per_sequence: float
    """The mean over rollouts of each one's sum: the KL of whole completions. When distillation changes how
    long the student writes, the per-token mean alone misleads (shorter replies made of the hardest tokens
    raise it while the KL of the replies falls); 0.0 with no rollouts."""


def reverse_kl(rollouts: Sequence[Rollout]) -> ReverseKL:
    """`ReverseKL` of `rollouts`, in one pass over their tokens."""
    tokens, sequence_sums = 0, []
    for rollout in rollouts:
        terms = [
            student - teacher
            for teacher, student, trained in zip(
                rollout.teacher_logprobs, rollout.completion_logprobs, rollout.completion_mask, strict=False
            )
            if trained
        ]
        tokens += len(terms)
        sequence_sums.append(sum(terms))
    return ReverseKL(
        per_token=sum(sequence_sums) / tokens if tokens else 0.0,
        tokens=tokens,
        per_sequence=sum(sequence_sums) / len(sequence_sums) if sequence_sums else 0.0,
    )


def check_teacher(
    envs: Sequence[EnvSpec], student_tokenizer: Any, teacher: str, trust_remote_code: bool, key: str
) -> None:
    """What `tidal rl` checks before anything starts and `tidal orchestrator` when it starts: no environment
    with pictures, and the teacher's tokenizer the student's (one-line UserErrors naming config `key`)."""
    from tidal.inference.tokenizer import check_same_tokenizer

    refuse_distilled_pictures(envs)
    check_same_tokenizer(student_tokenizer, teacher, trust_remote_code, key)


def refuse_distilled_pictures(envs: Sequence[EnvSpec]) -> None:
    """A one-line UserError for an environment with pictures in a distilled run: the teacher's scoring
    request carries token ids only, so the teacher would not see them."""
    from tidal.envs.registry import gives_images

    for env in envs:
        if gives_images(env.name):
            raise UserError(
                f"orchestrator.teacher: environment {env.name!r} gives images, which are not distilled yet"
            )
