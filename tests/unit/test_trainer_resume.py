"""Resuming a trainer drops exactly the metrics records of the steps it redoes (SFT 1-based, RL 0-based)."""

from pathlib import Path

import pytest
import torch

from tests.unit.models import tiny_lm
from tidal.monitor.metrics import MetricsLogger, read_metrics
from tidal.trainer import ckpt
from tidal.trainer.parallel import DistInfo
from tidal.trainer.session import TrainState, maybe_resume

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _state() -> TrainState:
    model = tiny_lm(layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return TrainState(model, optimizer, scheduler, dict)


@pytest.mark.parametrize("first_record_step", [0, 1], ids=["rl-0-based", "sft-1-based"])
def test_resume_keeps_one_record_per_completed_step(tmp_path: Path, first_record_step: int) -> None:
    """The run logged 5 steps and checkpointed after 3: the resumed run redoes steps 4 and 5, so exactly
    the records of the first 3 steps stay (a fourth would be written a second time by the redo)."""
    state = _state()
    extra = {"scheduler": state.scheduler.state_dict(), "data": {}}
    ckpt.save_checkpoint(tmp_path / "ckpt", 3, state.model, state.optimizer, extra, CPU, keep_last=2)
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    for index in range(5):
        logger.log(first_record_step + index, {"loss": float(index)})

    step, _ = maybe_resume(
        tmp_path / "ckpt", _state(), CPU, logger, lambda *_: None, True, first_record_step=first_record_step
    )
    assert step == 3
    kept = [r["step"] for r in read_metrics(logger.path)]
    assert kept == [first_record_step + i for i in range(3)]
    for index in range(3, 5):  # the redo
        logger.log(first_record_step + index, {"loss": float(index)})
    assert [r["step"] for r in read_metrics(logger.path)] == [first_record_step + i for i in range(5)]
