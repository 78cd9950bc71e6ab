"""`tidal rl` with a multi-turn environment on the tiny model with a Qwen3-style chat template (CPU).

Qwen3's template renders the last assistant reply differently from earlier ones, which once failed every
multi-turn rollout with TemplateMismatch; here every rollout must run both of its turns and be trained on.
"""

import json

import pytest

from tests.conftest import run_tidal
from tidal.monitor.metrics import read_metrics
from tidal.testing import TINY_CHAT_MODEL_NAME, resolve_model_name

pytestmark = pytest.mark.slow
STEPS = 2
ENV = '[{name = "alphabet_sort", kwargs = {num_examples = 20, min_turns = 2, max_turns = 2, min_names = 2, max_names = 2}}]'  # noqa: E501


def model_turns(loss_mask: list[int]) -> int:
    """Runs of trained tokens in one sample: one per model turn (environment tokens separate them)."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def samples(batch: dict) -> list[tuple[list[int], list[int]]]:
    """(input ids, loss mask) of every sample packed in a trainer batch file."""
    out = []
    for micro in batch["micro_batches"]:
        for ids, mask, sample_ids in zip(
            micro["input_ids"], micro["loss_mask"], micro["sample_ids"], strict=True
        ):
            for sample in sorted(set(sample_ids) - {-1}):
                keep = [i for i, s in enumerate(sample_ids) if s == sample]
                out.append(([ids[i] for i in keep], [mask[i] for i in keep]))
    return out


def test_alphabet_sort_on_the_qwen3_template_trains_two_turn_rollouts(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "qwen3_chat"
    result = run_tidal(
        "rl", "@", "configs/ci/rl_tiny.toml", "--output-dir", str(out), "--max-steps", str(STEPS),
        "--model.name", TINY_CHAT_MODEL_NAME, "--orchestrator.env", ENV,
        "--orchestrator.batch.num-prompts", "2", "--orchestrator.batch.group-size", "2",
        "--orchestrator.batch.seq-len", "512", "--inference.vllm.max-model-len", "512",
        "--orchestrator.batch.zero-signal", "keep", "--inference.server.port", "18540",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = read_metrics(out / "orchestrator" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["rollouts/failed"] == 0 and r["env/alphabet_sort/failed"] == 0 for r in records), records
    assert "TemplateMismatch" not in (out / "logs" / "orchestrator.log").read_text()

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(TINY_CHAT_MODEL_NAME))
    trained = [
        s for step in range(STEPS) for s in samples(json.loads((out / "rollouts" / f"step_{step}" / "rank_0.json").read_text()))
    ]  # fmt: skip
    assert len(trained) == STEPS * 2 * 2
    for ids, mask in trained:
        assert model_turns(mask) == 2, tokenizer.decode(ids)
        text = tokenizer.decode(ids)
        # the environment's second turn as the Qwen3-style template renders it, after the model's first reply
        assert "<|im_start|>user\nAdd: " in text and text.count("<|im_start|>assistant\n") == 2, text
