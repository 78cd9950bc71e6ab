"""benchmarks/carry_model.py: slices join back to the same file, a damaged or missing slice is refused, and
the one-embedding copy keeps every field and tensor but the duplicate embedding."""

from pathlib import Path

import numpy as np
import pytest

from benchmarks.carry_model import join, one_embedding, split


def write_gguf(path: Path, separate_output: bool = True) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_chat_template("{{ messages }}")
    embed = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    writer.add_tensor("token_embd.weight", embed.astype(np.float16))  # the lower-precision copy
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    if separate_output:
        writer.add_tensor("output.weight", embed + 0.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_slices_join_to_the_same_file_and_a_bad_slice_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB
    slices = split(source, tmp_path / "out", [0.5, 1.0])
    assert [path.stat().st_size for path in slices] == [
        1 << 19,
        1 << 20,
        len(source.read_bytes()) - 3 * (1 << 19),
    ]
    parts = tmp_path / "parts"
    parts.mkdir()
    for path in [*slices, slices[-1].parent / "SHA256SUMS"]:
        (parts / path.name).write_bytes(path.read_bytes())
    assert join(parts, tmp_path / "joined.gguf").read_bytes() == source.read_bytes()

    damaged = parts / slices[1].name
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256"):
        join(parts, tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists()
    damaged.unlink()
    with pytest.raises(SystemExit, match="a slice is missing"):
        join(parts, tmp_path / "again.gguf")


def test_one_embedding_keeps_the_output_copy_as_the_embedding(tmp_path: Path) -> None:
    import gguf

    source, out = tmp_path / "two.gguf", tmp_path / "one" / "one.gguf"
    write_gguf(source)
    one_embedding(source, out)
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(out)
    tensors = {tensor.name: tensor for tensor in after.tensors}
    assert sorted(tensors) == ["blk.0.attn_norm.weight", "token_embd.weight"]
    output = next(tensor for tensor in before.tensors if tensor.name == "output.weight")
    assert tensors["token_embd.weight"].tensor_type == output.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(tensors["token_embd.weight"].data, output.data)
    for name in (
        "tokenizer.ggml.tokens",
        "tokenizer.chat_template",
        "llama.block_count",
        "general.architecture",
    ):
        assert after.fields[name].contents() == before.fields[name].contents()


def test_one_embedding_refuses_a_file_with_one_embedding(tmp_path: Path) -> None:
    source = tmp_path / "tied.gguf"
    write_gguf(source, separate_output=False)
    with pytest.raises(SystemExit, match="does not store its embedding twice"):
        one_embedding(source, tmp_path / "out.gguf")
