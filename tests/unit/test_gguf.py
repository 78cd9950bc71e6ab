"""GGUF model files: what is refused before any conversion (one line, naming the file), the cache's lookup of a
converted directory, and the chat template's turn end. The conversion itself runs on the real SmolLM2 file
in tests/integration/test_real_tokenizer.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tidal.errors import UserError
from tidal.models import gguf as g
from tidal.models.tiny import build_tokenizer
from tidal.testing import build_tiny_model


def write_gguf(path: Path, architecture: str = "llama", tensors: int = 2) -> Path:
    """A small well-formed GGUF file: header, metadata and float32 tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("test model")
    for i in range(tensors):
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.full((8, 8), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_well_formed_file_is_read_without_loading_its_tensors(tmp_path: Path) -> None:
    info = g.inspect_gguf(write_gguf(tmp_path / "m.gguf", tensors=3))
    assert (info.architecture, info.num_tensors, info.quant_types) == ("llama", 3, ("F32",))
    assert not info.has_chat_template and not info.separate_output


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "no such file"),
        (lambda p: (p.mkdir(), p)[1], "not a file"),
        (lambda p: (p.write_text("# not a model\n"), p)[1], "not a GGUF file"),
    ],
    ids=["missing", "directory", "text"],
)
def test_what_is_not_a_gguf_file_is_named_in_one_line(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path / "model.gguf")
    with pytest.raises(UserError) as caught:
        g.inspect_gguf(path)
    assert message in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_truncated_file_is_refused_before_conversion(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", tensors=4).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])  # the last tensor's data is short
    with pytest.raises(UserError, match="truncated") as caught:
        g.inspect_gguf(cut)
    assert str(cut) in str(caught.value)


def test_an_architecture_transformers_cannot_convert_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", architecture="rwkv7")
    with pytest.raises(UserError, match="architecture 'rwkv7' cannot be converted"):
        g.inspect_gguf(path)


def test_without_the_gguf_package_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(UserError, match=r"needs the gguf package: pip install 'tidal\[gguf\]'"):
        g.inspect_gguf(path)


def test_tidal_convert_refuses_bad_files_with_one_line_and_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    result = subprocess.run(
        [sys.executable, "-m", "tidal", "convert", str(bad)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == f"tidal convert: error: {bad}: not a GGUF file (it starts with b'GGML', not b'GGUF')"
    )


def fake_converted(cache: Path, source: Path) -> Path:
    """A converted directory as `convert_gguf` leaves it (only its record matters to the lookup)."""
    target = g.cache_root() / f"{source.stem}-{g.file_sha256(source)[:16]}"
    target.mkdir(parents=True)
    stat = source.stat()
    record = {
        "converter_version": g.CONVERTER_VERSION,
        "source": {"path": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
    }
    (target / g.INFO_FILE).write_text(json.dumps(record))
    return target


def test_a_converted_file_is_found_by_path_and_a_copy_of_it_is_remembered(
    tmp_path: Path, cache: Path
) -> None:
    first = write_gguf(tmp_path / "m.gguf")
    target = fake_converted(cache, first)
    assert g.find_converted(first) == target
    copy = tmp_path / "elsewhere" / "m.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    assert g.find_converted(copy) is None  # another path: found only by hashing it
    assert g.resolve_gguf(str(copy)) == target  # same contents: the same directory, not converted again
    assert g.find_converted(copy) == target and g.find_converted(first) == target
    first.touch()  # modified since: looked up again by its contents
    assert g.find_converted(first) is None


def test_a_record_of_another_converter_version_is_not_reused(tmp_path: Path, cache: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf")
    target = fake_converted(cache, source)
    record = json.loads((target / g.INFO_FILE).read_text())
    (target / g.INFO_FILE).write_text(json.dumps({**record, "converter_version": -1}))
    assert g.find_converted(source) is None and not g.is_complete(target)


def test_the_turn_end_is_the_special_token_the_template_puts_after_a_reply(tmp_path: Path) -> None:
    assert g.template_turn_end(build_tokenizer()) == "<|im_end|>"
    plain = build_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert g.template_turn_end(plain) is None
    no_template = build_tokenizer()
    no_template.chat_template = None
    assert g.template_turn_end(no_template) is None


def test_turn_end_becomes_the_tokenizers_eos_and_the_generation_configs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    tokenizer = build_tokenizer()
    tokenizer.eos_token = "<|endoftext|>"  # as a file whose EOS is not the template's turn end
    turn_end = g.fix_special_tokens(tokenizer, model, tmp_path / "m.gguf")
    assert turn_end == "<|im_end|>" and tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    g.write_directory(tmp_path / "out", model, tokenizer, turn_end)
    eos = json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
