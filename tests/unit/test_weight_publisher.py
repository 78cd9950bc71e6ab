"""Publishing weights as `<output_dir>/weights/step_<n>/` for inference servers to load."""

from pathlib import Path

import pytest
import torch

from tidal.testing.tiny import build_tokenizer
from tidal.transport.weights import WeightPublisher, check_weights_dir, latest_published, list_published


def small_model():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config), tokenizer


def test_publish_keeps_the_last_steps_complete_and_loadable(tmp_path: Path) -> None:
    model, tokenizer = small_model()
    publisher = WeightPublisher(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        path = publisher.publish_state_dict(step, model.state_dict(), model.config, tokenizer)
        assert path == tmp_path / "weights" / f"step_{step}" and check_weights_dir(path) is None
    assert [step for step, _ in list_published(tmp_path)] == [2, 3]
    assert latest_published(tmp_path) == (3, tmp_path / "weights" / "step_3")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "weights" / "step_3" / "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])


def test_half_written_directories_are_ignored_and_refused(tmp_path: Path) -> None:
    partial = tmp_path / "weights" / "step_5"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"")
    (tmp_path / "weights" / "step_6.tmp").mkdir()
    assert list_published(tmp_path) == [] and latest_published(tmp_path) is None
    assert "partial" in (check_weights_dir(partial) or "")
    assert "no *.safetensors" in (check_weights_dir(tmp_path / "weights" / "step_6.tmp") or "")
    assert "does not exist" in (check_weights_dir(tmp_path / "nope") or "")


def test_keep_last_below_two_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        WeightPublisher(tmp_path, keep_last=1)
