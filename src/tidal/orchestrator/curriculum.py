"""A difficulty curriculum: which task a stream position runs, by each task's running pass rate (pure logic).

Without a curriculum, stream position p runs task p mod N. With one, position p looks at a seeded sequence
of candidates (the first is p mod N, the others drawn uniformly) and takes the first whose odds accept
it: tasks near the target pass rate are taken, tasks every group solves or fails are passed over. The
candidates and the coin of each depend only on (seed, position, attempt), so what a position picks
depends only on the state the curriculum had when it was drawn, and the state is saved with the
orchestrator's at every step: a resumed run continues the same curriculum. A position drawn but not yet
finished keeps its pick (`picks`): when its group is cancelled and run again later, it runs the same task
with the same seeds, as without a curriculum.

Every group that ends updates its task's estimate, the ones a step then drops (zero-signal, stale)
included: those are what the curriculum learns from.
"""

import random
from dataclasses import dataclass, field
from typing import Any

from tidal.config.rl import CurriculumConfig


@dataclass
class TaskRecord:
    """What the curriculum knows of one task."""

    pass_rate: float
    """Running estimate of the share of samples that pass."""
    groups: int = 0
    """Groups of this task seen."""
    streak: int = 0
    """Consecutive groups of the same extreme verdict (all passed, or none), signed: + solved, − failed."""


@dataclass
class Curriculum:
    """Picks each stream position's task, and learns from the groups that end."""

    config: CurriculumConfig
    num_tasks: int
    seed: int
    tasks: dict[int, TaskRecord] = field(default_factory=dict)
    picks: dict[int, int] = field(default_factory=dict)
    """Stream position → task index, for positions drawn and not yet ended."""
    _passed_over: int = 0
    _fallbacks: int = 0

    # ---- drawing ------------------------------------------------------------------------------------

    def pick(self, position: int) -> int:
        """The task index stream `position` runs (the same one again while that position has not ended)."""
        if position in self.picks:
            return self.picks[position]
        best, best_odds = position % self.num_tasks, -1.0
        for attempt in range(self.config.max_draws):
            index, coin = self._candidate(position, attempt)
            odds = self.odds(index)
            if coin < odds:
                best = index
                break
            self._passed_over += 1
            if odds > best_odds:
                best, best_odds = index, odds
        else:
            self._fallbacks += 1
        self.picks[position] = best
        return best

    def _candidate(self, position: int, attempt: int) -> tuple[int, float]:
        """(task index, coin in [0, 1)) of one attempt: the in-order task first, then seeded uniform draws."""
        rng = random.Random(
            f"curriculum/{self.seed}/{position}/{attempt}"
        )  # str seeds: stable across processes
        coin = rng.random()
        index = position % self.num_tasks if attempt == 0 else rng.randrange(self.num_tasks)
        return index, coin

    def odds(self, index: int) -> float:
        """Chance that a candidate task is taken: 0 once skipped, 1 unseen or at the target, linear between."""
        record = self.tasks.get(index)
        if record is None:
            return 1.0
        cfg = self.config
        if cfg.skip_after is not None and abs(record.streak) >= cfg.skip_after:
            return 0.0
        span = max(cfg.target_pass_rate, 1.0 - cfg.target_pass_rate)
        distance = abs(record.pass_rate - cfg.target_pass_rate) / span
        return 1.0 - (1.0 - cfg.min_weight) * distance

    # ---- learning -----------------------------------------------------------------------------------

    def observe(self, position: int, rewards: list[float]) -> None:
        """The group of stream `position` ended with these rewards (its finished samples'; none when every
        sample failed, which says nothing of the task's difficulty)."""
        index = self.picks.pop(position, position % self.num_tasks)
        if not rewards:
            return
        share = sum(r >= self.config.pass_reward for r in rewards) / len(rewards)
        record = self.tasks.get(index)
        if record is None:
            record = self.tasks[index] = TaskRecord(pass_rate=share)
        else:
            record.pass_rate += self.config.smoothing * (share - record.pass_rate)
        record.groups += 1
        record.streak = next_streak(record.streak, share)

    # ---- metrics and state --------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        """`curriculum/...` for the step's log; the per-step counts start again at 0."""
        seen = list(self.tasks.values())
        skipped = sum(self.odds(i) == 0.0 for i in self.tasks)
        metrics = {
            "curriculum/tasks_seen": float(len(seen)),
            "curriculum/tasks_skipped": float(skipped),
            "curriculum/pass_rate_mean": sum(r.pass_rate for r in seen) / len(seen) if seen else 0.0,
            "curriculum/passed_over": float(self._passed_over),
            "curriculum/fallbacks": float(self._fallbacks),
        }
        self._passed_over = self._fallbacks = 0
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "tasks": {str(i): [r.pass_rate, r.groups, r.streak] for i, r in self.tasks.items()},
            "picks": {str(p): i for p, i in self.picks.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tasks = {
            int(i): TaskRecord(rate, groups, streak) for i, (rate, groups, streak) in state["tasks"].items()
        }
        self.picks = {int(p): int(i) for p, i in state["picks"].items()}


def next_streak(streak: int, share: float) -> int:
    """The signed run of extreme groups after one with pass share `share`: +n solved, −n failed, 0 mixed."""
    if share >= 1.0:
        return streak + 1 if streak > 0 else 1
    if share <= 0.0:
        return streak - 1 if streak < 0 else -1
    return 0
