"""Checks of a weight update's files against the served checkpoint: headers, names, shapes, dtypes, values."""

import json
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.transport.weight_checks import (
    WEIGHTS_BROKEN,
    Reference,
    TensorInfo,
    WeightsProblem,
    compare_to_reference,
    load_or_restore,
    parse_header,
    read_header,
    update_problem,
)

EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def tensors() -> dict[str, torch.Tensor]:
    return {
        EMBED: torch.randn(10, 4),
        NORM: torch.ones(4),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4),
    }


def checkpoint(directory: Path, state: dict[str, torch.Tensor], tied: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return directory


def infos(**shapes: tuple[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(dtype, shape) for name, (dtype, shape) in shapes.items()}


def test_a_good_update_passes_and_float_dtypes_may_differ(tmp_path: Path) -> None:
    reference = Reference.from_dir(checkpoint(tmp_path / "ref", tensors()))
    bf16 = {k: v.to(torch.bfloat16) for k, v in tensors().items()}
    assert update_problem(checkpoint(tmp_path / "new", bf16), reference, check_finite=True) is None


def test_truncated_and_garbage_files_are_named(tmp_path: Path) -> None:
    good = checkpoint(tmp_path / "good", tensors()) / "model.safetensors"
    data = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    with pytest.raises(WeightsProblem, match="cut.safetensors is truncated"):
        read_header(cut)
    garbage = tmp_path / "garbage.safetensors"
    for content in (b"abc", bytes(range(256)) * 4, struct.pack("<Q", 5) + b"nojsn" + b"\0" * 10):
        garbage.write_bytes(content)
        with pytest.raises(WeightsProblem, match="not a safetensors file"):
            read_header(garbage)


def test_header_entries_must_describe_their_bytes() -> None:
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}
    with pytest.raises(WeightsProblem, match="12 bytes for F32"):
        parse_header("m.safetensors", {"w": entry}, 100)
    with pytest.raises(WeightsProblem, match="unsupported dtype"):
        parse_header("m.safetensors", {"w": {**entry, "dtype": "Q4"}}, 100)
    assert parse_header("m.safetensors", {"w": {**entry, "data_offsets": [0, 16]}}, 16) == {
        "w": TensorInfo("F32", (2, 2))
    }


def test_names_shapes_and_dtypes_are_compared_with_the_reference() -> None:
    ref = infos(a=("BF16", (4, 2)), b=("F32", (2,)), ids=("I64", (3,)))
    assert compare_to_reference(ref, ref, tied=False) is None
    missing = compare_to_reference({k: v for k, v in ref.items() if k != "b"}, ref, tied=False)
    assert missing is not None and "tensor b is missing" in missing
    unknown = compare_to_reference({**ref, "c": TensorInfo("F32", (1,))}, ref, tied=False)
    assert unknown is not None and "tensor c is not a weight" in unknown
    shape = compare_to_reference({**ref, "a": TensorInfo("BF16", (2, 4))}, ref, tied=False)
    assert shape == "tensor a has shape [2, 4], the served model has [4, 2]"
    dtype = compare_to_reference({**ref, "ids": TensorInfo("F32", (3,))}, ref, tied=False)
    assert dtype == "tensor ids has dtype F32, the served model has I64"
    assert compare_to_reference({**ref, "a": TensorInfo("F16", (4, 2))}, ref, tied=False) is None


def test_a_tied_head_may_be_present_or_absent() -> None:
    ref = infos(**{EMBED: ("F32", (10, 4))})
    with_head = {**ref, HEAD: TensorInfo("F32", (10, 4))}
    assert compare_to_reference(with_head, ref, tied=True) is None
    assert compare_to_reference(ref, with_head, tied=True) is None
    assert compare_to_reference(with_head, ref, tied=False) is not None


def test_non_finite_values_are_found_and_named(tmp_path: Path) -> None:
    reference = Reference.from_dir(checkpoint(tmp_path / "ref", tensors()))
    state = tensors()
    state[NORM][2] = float("nan")
    state[EMBED][0, 0] = float("inf")
    directory = checkpoint(tmp_path / "nan", state)
    problem = update_problem(directory, reference, check_finite=True)
    assert (
        problem is not None
        and "non-finite" in problem
        and ("model.norm.weight" in problem or EMBED in problem)
    )
    assert update_problem(directory, reference, check_finite=False) is None  # the check can be turned off


def test_cost_of_a_full_check_on_a_bf16_file(tmp_path: Path) -> None:
    """Not an assertion of speed: prints what a full check costs (per GB, from page cache) on this CPU."""
    state = {f"layer.{i}.weight": torch.randn(1024, 4096).to(torch.bfloat16) for i in range(16)}  # 128 MiB
    directory = checkpoint(tmp_path / "big", state)
    reference = Reference.from_dir(directory)
    start = time.perf_counter()
    assert update_problem(directory, reference, check_finite=False) is None
    headers = time.perf_counter() - start
    start = time.perf_counter()
    assert update_problem(directory, reference, check_finite=True) is None
    full = time.perf_counter() - start
    gib = sum(t.numel() * 2 for t in state.values()) / 2**30
    print(
        f"headers {headers * 1e3:.1f} ms; full check {full:.3f} s for {gib:.3f} GiB = {full / gib:.2f} s/GiB"
    )


def test_a_load_that_fails_midway_reloads_the_previous_weights() -> None:
    loaded: list[str] = []

    def load(path: Path) -> None:
        loaded.append(path.name)
        if path.name in ("bad", "gone"):
            raise OSError(f"cannot read {path.name}")

    load_or_restore(load, Path("good"), Path("old"))
    assert loaded == ["good"]
    with pytest.raises(
        RuntimeError, match=r"failed midway \(cannot read bad\); the previous weights"
    ) as restored:
        load_or_restore(load, Path("bad"), Path("old"))
    assert WEIGHTS_BROKEN not in str(restored.value) and loaded[-2:] == ["bad", "old"]
    with pytest.raises(RuntimeError, match=WEIGHTS_BROKEN):
        load_or_restore(load, Path("bad"), Path("gone"))
    with pytest.raises(RuntimeError, match=WEIGHTS_BROKEN):
        load_or_restore(load, Path("bad"), None)
