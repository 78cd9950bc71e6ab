"""Publishing weights as `<output_dir>/weights/step_<n>/` for inference servers to load."""

from pathlib import Path

import pytest
import torch

from tidal.models.tiny import build_tokenizer
from tidal.trainer.parallel import DistInfo
from tidal.trainer.publish import FilesystemPublisher
from tidal.transport.weights import check_weights_dir, latest_published, list_published

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


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
    publisher = FilesystemPublisher(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        path = publisher.publish(step, model, tokenizer, CPU)
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
        FilesystemPublisher(tmp_path, keep_last=1)


def test_publish_model_writes_the_served_dtype_and_leaves_the_trainer_config_alone(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    from tidal.trainer.parallel import DistInfo

    model, tokenizer = small_model()  # fp32 master weights
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    path = FilesystemPublisher(tmp_path, dtype=torch.bfloat16).publish(1, model, tokenizer, info)
    saved = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    expected = model.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(saved["model.embed_tokens.weight"], expected)  # the same rounding vLLM would apply
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32 and model.config.dtype != torch.bfloat16


def test_served_dtype_explicit_then_model_dtype_then_the_checkpoint_s_own(tmp_path: Path) -> None:
    from tidal.config.common import ModelConfig
    from tidal.trainer.model import served_dtype

    model, _ = small_model()
    model.config.dtype = torch.bfloat16
    model.config.save_pretrained(tmp_path)  # a checkpoint stored in bf16, like the Qwen releases
    stored = ModelConfig(name=str(tmp_path))
    assert served_dtype(stored) == torch.bfloat16  # vLLM serves what the checkpoint stores
    assert served_dtype(stored, "float16") == torch.float16
    assert served_dtype(ModelConfig(name=str(tmp_path), dtype="float32")) == torch.float32


def test_non_finite_weights_are_refused_naming_the_tensor_and_step(tmp_path: Path) -> None:
    from tidal.errors import UserError
    from tidal.trainer.parallel import DistInfo

    model, tokenizer = small_model()
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 1] = float("nan")
    publisher = FilesystemPublisher(tmp_path)
    with pytest.raises(UserError, match=r"step_7: tensor model\.layers\.0\.mlp\.up_proj\.weight has NaN/inf"):
        publisher.publish(7, model, tokenizer, info)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("inf"))
    with pytest.raises(UserError, match=r"step_8: tensor model\.\S+ \(and 1 more\) has NaN/inf"):
        publisher.publish(8, model, tokenizer, info)
    assert list_published(tmp_path) == [] and not (tmp_path / "weights").exists()
