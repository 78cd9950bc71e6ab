"""Is a directory of HF safetensors fit to replace the weights a server is serving? Checked before loading.

vLLM's layer-wise reload tears the model down before it reads a file, so a truncated, garbage or
wrong-shape file left a half-built model behind (the next request killed the engine), a file with a
tensor missing was half-loaded (garbage outputs) and NaNs were served. The checks, cheapest first:

1. every file has a readable safetensors header whose tensors fit inside the file (truncation, garbage);
2. the tensor names, shapes and dtypes match the HF checkpoint the server started from (its own
   safetensors headers: HF-named like published weights, so vLLM's packed/fused parameters do not
   matter); a floating tensor may be any float dtype (the loader casts it to the serving dtype);
3. every floating value is finite (reads the whole file; see `non_finite_problem` for the cost).

Each problem is one line naming the file or tensor. The header checks are pure functions of parsed
headers; only `read_header` and `first_non_finite` touch files.
"""

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are read: the server's CLI imports this module
    import torch

ITEM_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
# Floats the loader can cast into any serving dtype; 8-bit floats need scales, so they must match exactly.
CASTABLE_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
# Far above any real header (a 70B checkpoint's is ~100 KB); a bigger length means the bytes are not one.
MAX_HEADER_BYTES = 100 * 2**20
# Checkpoints of older models carry buffers that loaders skip; a published state dict need not have them.
OPTIONAL_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_HEAD = "lm_head.weight"
# In a worker's error when a failed load left weights that are neither the old nor the new ones (the
# server's guard then reports the server unhealthy).
WEIGHTS_BROKEN = "serving weights are broken"


class WeightsProblem(ValueError):
    """Why an update's files cannot be loaded (one line, naming the file or tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors one safetensors file declares; raises WeightsProblem if the header or sizes are wrong."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise WeightsProblem(f"{file.name}: not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise WeightsProblem(
                f"{file.name}: not a safetensors file or truncated (header of {length} bytes)"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise WeightsProblem(f"{file.name}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise WeightsProblem(f"{file.name}: not a safetensors file (header is not a JSON object)")
    return parse_header(file.name, header, size - 8 - length)


def parse_header(file_name: str, header: Mapping[str, object], data_bytes: int) -> dict[str, TensorInfo]:
    """Validate a parsed header against the `data_bytes` that follow it in the file (pure)."""
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, span = _entry(file_name, name, entry)
        begin, end = span
        if end - begin != math.prod(info.shape) * ITEM_SIZE[info.dtype]:
            raise WeightsProblem(
                f"{file_name}: {name} has {end - begin} bytes for {info.dtype} {list(info.shape)}"
            )
        if end > data_bytes:
            raise WeightsProblem(
                f"{file_name} is truncated: {name} ends at byte {end} of the data, the file has {data_bytes}"
            )
        tensors[name] = info
    return tensors


def _entry(file_name: str, name: str, entry: object) -> tuple[TensorInfo, tuple[int, int]]:
    bad = WeightsProblem(f"{file_name}: malformed header entry for {name}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_SIZE:
        raise WeightsProblem(f"{file_name}: {name} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise bad
    if not 0 <= offsets[0] <= offsets[1]:
        raise bad
    return TensorInfo(str(dtype), tuple(shape)), (offsets[0], offsets[1])


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsProblem(f"no *.safetensors files in {directory}")
    return files


def read_headers(directory: Path) -> dict[str, TensorInfo]:
    """The tensors of every shard in `directory`; a tensor in two shards is a problem."""
    found: dict[str, TensorInfo] = {}
    owner: dict[str, str] = {}
    for file in safetensors_files(directory):
        for name, info in read_header(file).items():
            if name in found:
                raise WeightsProblem(f"{name} is in both {owner[name]} and {file.name}")
            found[name], owner[name] = info, file.name
    return found


def compare_to_reference(
    found: Mapping[str, TensorInfo], expected: Mapping[str, TensorInfo], tied: bool
) -> str | None:
    """The first difference that would make the update load wrongly, or None (pure)."""

    def optional(name: str) -> bool:
        return name.endswith(OPTIONAL_SUFFIXES) or (tied and name == TIED_HEAD)

    missing = [n for n in expected if n not in found and not optional(n)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"tensor {missing[0]} is missing{more}: the update must carry every weight of the model"
    unknown = [n for n in found if n not in expected and not optional(n)]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        return f"tensor {unknown[0]} is not a weight of the served model{more}"
    for name, info in found.items():
        want = expected.get(name)
        if want is None:
            continue
        if info.shape != want.shape:
            return f"tensor {name} has shape {list(info.shape)}, the served model has {list(want.shape)}"
        castable = info.dtype in CASTABLE_FLOATS and want.dtype in CASTABLE_FLOATS
        if info.dtype != want.dtype and not castable:
            return f"tensor {name} has dtype {info.dtype}, the served model has {want.dtype}"
    return None


def non_finite_problem(name: str, tensor: "torch.Tensor") -> str | None:
    """A one-line description if `tensor` (floating) holds NaN or inf, else None."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    # NaN and inf survive a sum, so a finite sum means finite values; on CPU the sum runs ~25x faster than
    # isfinite (0.5 s/GiB of bf16 against 12-20). Only a non-finite sum (or an overflowing one) pays for
    # the exact count.
    if bool(torch.isfinite(tensor.sum())):
        return None
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return None
    bad = int(finite.numel() - finite.sum())
    return f"tensor {name} has {bad} non-finite (NaN/inf) values of {tensor.numel()}"


def non_finite_tensors(named: Iterable[tuple[str, "torch.Tensor"]]) -> list[str]:
    """Names of the floating tensors holding NaN/inf, with one device sync for all (a sum per tensor)."""
    import torch

    floats = [(name, tensor) for name, tensor in named if tensor.is_floating_point() and tensor.numel()]
    if not floats:
        return []
    sums = torch.stack([tensor.sum().float().to(floats[0][1].device) for _, tensor in floats])
    bad = (~torch.isfinite(sums)).tolist()
    # a finite tensor whose sum overflowed is not refused: the exact check decides
    return [
        name
        for (name, tensor), b in zip(floats, bad, strict=True)
        if b and not bool(torch.isfinite(tensor).all())
    ]


def first_non_finite(directory: Path, names: Iterable[str] | None = None) -> str | None:
    """Read every floating tensor in `directory` (or only `names`); the first with NaN/inf, or None."""
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if wanted is not None and name not in wanted:
                    continue
                problem = non_finite_problem(name, handle.get_tensor(name))
                if problem is not None:
                    return f"{file.name}: {problem}"
    return None


def is_tied(model_dir: Path) -> bool:
    """Whether the checkpoint in `model_dir` ties lm_head to the embedding (its config.json says)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


@dataclass(frozen=True)
class Reference:
    """What the served model's weights look like: from the HF checkpoint the server started from."""

    tensors: Mapping[str, TensorInfo]
    tied: bool

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Reference":
        return cls(read_headers(model_dir), is_tied(model_dir))


def update_problem(directory: Path, reference: Reference | None, check_finite: bool) -> str | None:
    """Why `directory` must not be loaded (headers, then names/shapes/dtypes, then values), or None."""
    try:
        found = read_headers(directory)
    except (WeightsProblem, OSError) as exc:
        return f"{directory}: {exc}"
    if reference is not None:
        problem = compare_to_reference(found, reference.tensors, reference.tied)
        if problem is not None:
            return f"{directory}: {problem}"
    if check_finite:
        try:
            problem = first_non_finite(directory)
        except Exception as exc:  # safetensors raises its own error types for bad data
            return f"{directory}: cannot read tensors ({exc})"
        if problem is not None:
            return f"{directory}/{problem}"
    return None


def local_checkpoint(name: str) -> Path | None:
    """The directory holding the safetensors of model `name` (a path, or a hub id vLLM downloaded)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(
            name, local_files_only=True, allow_patterns=["*.safetensors", "config.json"]
        )
    except Exception:  # not a hub id, or not in the local cache (e.g. vLLM's --download-dir elsewhere)
        return None
    return Path(found)


def load_reference(name: str) -> Reference | None:
    """The reference for updates of a server started from `name`; None if its checkpoint is not local."""
    directory = local_checkpoint(name)
    if directory is None or not any(directory.glob("*.safetensors")):
        return None
    try:
        return Reference.from_dir(directory)
    except (WeightsProblem, OSError):  # the server loaded it, so this is unlikely; then check without it
        return None


def load_or_restore(load: Callable[[Path], None], new: Path, previous: Path | None) -> None:
    """Load `new`; if that fails midway, load `previous` (the weights served before) again.

    The checks above make a midway failure rare (an I/O error, memory), but vLLM's reload overwrites layers
    as they complete, so after one the model is a mix of old and new weights. Raises in both failure cases;
    the message says `WEIGHTS_BROKEN` only when the old weights could not be restored either.
    """
    try:
        load(new)
    except Exception as exc:
        if previous is None:
            raise RuntimeError(
                f"loading {new} failed midway ({exc}); no previous weights to restore: {WEIGHTS_BROKEN}"
            ) from exc
        try:
            load(previous)
        except Exception as again:
            raise RuntimeError(
                f"loading {new} failed midway ({exc}) and reloading {previous} failed too ({again}): {WEIGHTS_BROKEN}"
            ) from again
        raise RuntimeError(
            f"loading {new} failed midway ({exc}); the previous weights ({previous}) serve again"
        ) from exc
