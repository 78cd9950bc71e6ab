"""GGUF model files: checked, then converted once into a Hugging Face model directory that every process loads.

A GGUF file (llama.cpp's format) holds quantised weights, the model's hyper-parameters and its tokenizer,
usually with a chat template. transformers reads it (`gguf_file=`, with the `gguf` package) and dequantises
it into an ordinary float model with a fast tokenizer; tidal writes that out as a plain HF directory
(config.json without a quantisation section, model.safetensors, the tokenizer with its chat template, and a
generation config whose EOS list has the template's end-of-turn token), so vLLM serves it, the trainer
trains it and the orchestrator renders prompts with its tokenizer exactly as for a hub checkpoint.

The model transformers returns keeps its GGUF quantiser attached and refuses `save_pretrained`: its weights
are copied into a model built from the same config instead. Some files store the output layer apart from
the token embeddings although the model ties them (Qwen2.5 0.5B quantised twice keeps a Q8_0 output layer
beside Q5_0 embeddings); where the two are the same matrix up to quantisation noise they are tied again,
keeping the more precise copy, so the directory is the original architecture, not a larger untied one.

The directory lives in tidal's cache, named by the file's stem and its sha256 (`gguf_cache_dir`), and is
written under a lock through a staging directory, so several processes of one run that resolve the same
file convert it once; a later run finds it by path, size and modification time without hashing again.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from tidal.errors import UserError, first_line

CONVERTER_VERSION = 1
"""Bump when the conversion changes, so directories converted before are made again, not silently reused."""
MAGIC = b"GGUF"
INFO_FILE = "tidal_gguf.json"
"""Written last into a converted directory: where it came from. A directory without it is incomplete."""
TIE_TOLERANCE = 0.1
"""Output layer and embeddings whose relative difference (Frobenius) is below this are one matrix
quantised twice (measured: 0.044 for Qwen2.5-Coder-0.5B's Q8_0 output vs its Q5_0 embeddings); two trained
matrices differ by far more (~1.4 for independent ones of the same scale)."""
INSTALL_HINT = "pip install 'tidal[gguf]' (the gguf and accelerate packages)"

Say = Callable[[str], None]


class ConvertRequest(Protocol):
    """What `tidal convert` asks for (tidal.config.convert.ConvertConfig; named here by its fields, since the
    config floor sits above this one)."""

    @property
    def gguf(self) -> Path: ...
    @property
    def output_dir(self) -> Path | None: ...
    @property
    def force(self) -> bool: ...


@dataclass(frozen=True)
class GGUFInfo:
    """What the file's header says, read without loading any tensor."""

    architecture: str
    name: str
    quant_types: tuple[str, ...]
    num_tensors: int
    has_chat_template: bool
    separate_output: bool
    """The file stores `output.weight` apart from the token embeddings."""


def is_gguf_name(name: str) -> bool:
    """Whether a config's model name names a GGUF file (by its suffix, as llama.cpp names them)."""
    return name.lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted models go: `$TIDAL_CACHE_DIR/models/gguf` (default `~/.cache/tidal/models/gguf`)."""
    root = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")
    return Path(root) / "models" / "gguf"


def convert_command(config: ConvertRequest) -> int:
    """`tidal convert`: convert into `output_dir`, or into the cache where `model.name` finds it."""
    try:
        return _convert(config)
    except UserError as exc:  # the same checks as for model.name, but here the file is `gguf`
        raise UserError(str(exc).removeprefix("model.name: "), exc.exit_code) from None


def _convert(config: ConvertRequest) -> int:
    path = config.gguf.expanduser()
    check_file(path)
    if config.output_dir is not None:
        target = config.output_dir.expanduser()
        if (target / "config.json").exists() and not config.force:
            raise UserError(f"output_dir: {target} holds a model already (--force replaces it)")
        convert_gguf(path, target)
    else:
        found = None if config.force else find_converted(path)
        if found is not None:
            print(f"{path} is converted already: {found} (--force converts it again)", flush=True)
            return 0
        target = convert_into_cache(path, force=config.force)
    print(f'use it as model.name = "{path}" or "{target}"', flush=True)
    return 0


def resolve_gguf(name: str, say: Say | None = None) -> Path:
    """The converted directory of the GGUF file `name`, converting it first if no complete one exists."""
    path = Path(name).expanduser()
    check_file(path)
    found = find_converted(path)
    return found if found is not None else convert_into_cache(path, say)


def convert_into_cache(path: Path, say: Say | None = None, force: bool = False) -> Path:
    """The cache's directory for the file's contents (its sha256), converted unless a complete one is there
    (another copy of the same file converted it, or another process while this one waited for the lock);
    this copy is remembered there, so it is found next time without hashing."""
    digest = file_sha256(path)
    target = cache_root() / f"{_safe_stem(path)}-{digest[:16]}"
    with _lock(target):
        if force or not is_complete(target):
            convert_gguf(path, target, digest=digest, say=say)
        else:
            remember_copy(target, path)
    return target


def find_converted(path: Path) -> Path | None:
    """A complete converted directory whose record names this very file (path, size, mtime), or None."""
    root = cache_root()
    if not root.is_dir():
        return None
    this = _identity(path)
    for candidate in sorted(root.glob(f"{_safe_stem(path)}-*")):
        record = read_info(candidate)
        if record is None or record.get("converter_version") != CONVERTER_VERSION:
            continue
        copies = [record.get("source", {}), *record.get("copies", [])]
        if any(_identity_of(copy) == this for copy in copies):
            return candidate
    return None


def remember_copy(target: Path, path: Path) -> None:
    """Add `path` to the copies of the file `target` was converted from (the caller holds the lock)."""
    record = read_info(target)
    if record is None:
        return
    stat = path.stat()
    copy = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    copies = [c for c in record.get("copies", []) if c.get("path") != copy["path"]]
    record["copies"] = [*copies, copy]
    staging = target / (INFO_FILE + ".tmp")
    staging.write_text(json.dumps(record, indent=2) + "\n")
    staging.replace(target / INFO_FILE)


def _identity(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _identity_of(record: dict[str, Any]) -> tuple[Any, Any, Any]:
    return record.get("path"), record.get("size"), record.get("mtime_ns")


def is_complete(target: Path) -> bool:
    record = read_info(target)
    return record is not None and record.get("converter_version") == CONVERTER_VERSION


def read_info(target: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((target / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_file(path: Path) -> None:
    """A one-line UserError unless `path` is a readable file that starts like a GGUF file."""
    if not path.exists():
        raise UserError(f"model.name: {path}: no such file")
    if not path.is_file():
        raise UserError(f"model.name: {path}: not a file (a GGUF model is one .gguf file)")
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise UserError(f"model.name: {path}: cannot read: {exc.strerror}") from None
    if head != MAGIC:
        raise UserError(f"model.name: {path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")


def inspect_gguf(path: Path) -> GGUFInfo:
    """Read the header and tensor table; a one-line UserError for a file tidal cannot convert (truncated,
    damaged, an architecture or quantisation transformers cannot read, no `gguf` package)."""
    check_file(path)
    gguf = _import_gguf(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises bare ValueError/IndexError on a cut file
        raise UserError(f"model.name: {path}: damaged or truncated GGUF file ({first_line(exc)})") from None
    check_tensor_data(path, reader)
    architecture = _field(reader, "general.architecture")
    if not isinstance(architecture, str):
        raise UserError(f"model.name: {path}: GGUF file names no architecture (general.architecture)")
    supported = supported_architectures()
    if supported is not None and architecture not in supported:
        raise UserError(
            f"model.name: {path}: architecture {architecture!r} cannot be converted (transformers reads GGUF "
            f"files of: {', '.join(sorted(supported))})"
        )
    quant_types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    unreadable = [q for q in quant_types if not can_dequantize(gguf, q)]
    if unreadable:
        raise UserError(
            f"model.name: {path}: quantisation {', '.join(unreadable)} cannot be dequantised by the installed "
            f"gguf package {_version('gguf')}"
        )
    names = {t.name for t in reader.tensors}
    return GGUFInfo(
        architecture=architecture,
        name=str(_field(reader, "general.name") or path.stem),
        quant_types=quant_types,
        num_tensors=len(reader.tensors),
        has_chat_template=isinstance(_field(reader, "tokenizer.chat_template"), str),
        separate_output="output.weight" in names and "token_embd.weight" in names,
    )


def check_tensor_data(path: Path, reader: Any) -> None:
    """Every tensor's bytes must lie inside the file: a download cut short fails here, not halfway through
    dequantising (the reader maps the file and only notices when a tensor is read)."""
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise UserError(
                f"model.name: {path}: truncated GGUF file: tensor {tensor.name!r} ends at byte {end}, the file "
                f"has {size}"
            )


def supported_architectures() -> set[str] | None:
    """The GGUF architectures transformers can convert (None where this transformers does not say)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    # transformers lists its own names; llama.cpp writes some without the underscore (qwen2moe, qwen3moe)
    return set(GGUF_SUPPORTED_ARCHITECTURES) | {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES}


def can_dequantize(gguf: Any, quant_type: str) -> bool:
    """Float types are read as they are; quantised ones need a dequantiser in the gguf package."""
    if quant_type in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
        return True
    traits = getattr(getattr(gguf, "quants", None), "_type_traits", None)
    kind = getattr(gguf.GGMLQuantizationType, quant_type, None)
    return traits is None or (kind is not None and kind in traits)


def convert_gguf(
    path: Path, target: Path, digest: str | None = None, dtype: str = "float32", say: Say | None = None
) -> Path:
    """Write the HF directory of the GGUF file `path` to `target` (through a staging directory and one
    rename; an existing `target` is replaced). `dtype`: what the weights are stored in (float32 keeps the
    dequantised values exactly)."""
    info = inspect_gguf(path)
    say = say or (lambda line: print(line, flush=True))
    say(
        f"converting {path} ({info.architecture}, {', '.join(info.quant_types)}) to a Hugging Face "
        f"directory, once: {target}"
    )
    start = time.perf_counter()
    tokenizer, model = load_dequantised(path, dtype)
    tied = retie_output(model, info)
    turn_end = fix_special_tokens(tokenizer, model, path)
    staging = _staging_dir(target)
    try:
        write_directory(staging, model, tokenizer, turn_end)
        record = {
            "converter_version": CONVERTER_VERSION,
            "source": _source(path, digest or file_sha256(path)),
            "gguf": asdict(info),
            "dtype": dtype,
            "retied_output": tied,
            "turn_end_token": turn_end,
            "transformers": _version("transformers"),
            "gguf_package": _version("gguf"),
        }
        (staging / INFO_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _readable_by_all(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except OSError as exc:
        raise UserError(
            f"{target}: cannot write the converted model: {exc.strerror or first_line(exc)}"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    note = "" if info.has_chat_template else " (the file has no chat template: chat environments need one)"
    say(f"converted {path.name} in {time.perf_counter() - start:.0f} s: {target}{note}")
    return target


def load_dequantised(path: Path, dtype: str) -> tuple[Any, Any]:
    """transformers' tokenizer and float model of the file, the model rebuilt without its quantiser."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with _no_tensor_bar():
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    except ImportError as exc:
        raise UserError(f"model.name: {path}: {first_line(exc)} ({INSTALL_HINT})") from None
    except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as exc:
        raise UserError(
            f"model.name: {path}: transformers cannot load this GGUF file: {first_line(exc)}"
        ) from None
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(loaded)(config).to(getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [key for key in missing if key != "lm_head.weight"]:
        raise UserError(
            f"model.name: {path}: the converted weights do not fit {type(loaded).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    model.eval()
    return tokenizer, model


@contextlib.contextmanager
def _no_tensor_bar() -> Iterator[None]:
    """transformers draws a tqdm bar per tensor straight to stderr (its progress-bar switch does not reach
    it): hundreds of carriage-return updates in every log file of a run. tidal says when conversion starts
    and ends instead."""
    try:
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:
        yield
        return
    bar = getattr(loader, "tqdm", None)
    loader.tqdm = lambda items, *args, **kwargs: items  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if bar is not None:
            loader.tqdm = bar  # type: ignore[attr-defined]


def retie_output(model: Any, info: GGUFInfo) -> bool:
    """Tie a separately stored output layer back to the embeddings when they are one matrix quantised twice
    (keeping the copy of higher precision); True if it did."""
    import torch

    if not info.separate_output:
        return False
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embed.weight.shape != head.weight.shape:
        return False
    a, b = embed.weight.detach().float(), head.weight.detach().float()
    difference = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a).clamp_min(1e-12))
    if difference >= TIE_TOLERANCE:
        return False
    # the output layer is the one files keep at higher precision (Q8_0/Q6_K); use it for both
    embed.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = True
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = True
    model.tie_weights()
    return True


def fix_special_tokens(tokenizer: Any, model: Any, path: Path) -> str | None:
    """Make the tokenizer's EOS the chat template's end-of-turn token where the file names another, and give
    the tokenizer a pad token and a length limit. Returns the end-of-turn token (None without a template)."""
    turn_end = template_turn_end(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        tokenizer.model_max_length = limit
    if turn_end is not None and turn_end != tokenizer.eos_token:
        # vLLM stops at the tokenizer's EOS; a chat model must stop where its turn ends
        tokenizer.eos_token = turn_end
    model.config.eos_token_id = tokenizer.eos_token_id
    return turn_end


def template_turn_end(tokenizer: Any) -> str | None:
    """The special token the chat template writes right after an assistant reply (ChatML `<|im_end|>`,
    Llama 3 `<|eot_id|>`, Gemma `<end_of_turn>`), or None without a template or such a token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "tidal-reply-mark"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}]
    try:
        text = str(tokenizer.apply_chat_template(messages, tokenize=False))
    except Exception:  # noqa: BLE001 - a template that cannot render this has no turn end we can learn
        return None
    if mark not in text:
        return None
    after = text.split(mark, 1)[1]
    special = sorted(tokenizer.all_special_tokens + [str(t) for t in tokenizer.added_tokens_decoder.values()])
    for token in sorted(set(special), key=len, reverse=True):
        if token and after.lstrip().startswith(token):
            return token
    return None


def write_directory(target: Path, model: Any, tokenizer: Any, turn_end: str | None) -> None:
    """config.json, model.safetensors, the tokenizer and a generation config stopping at EOS and turn end."""
    from transformers import GenerationConfig

    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    eos = [tokenizer.eos_token_id]
    for token in (turn_end, "<|endoftext|>", "<|end_of_text|>", "<eos>"):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in eos:
            eos.append(token_id)
    GenerationConfig(
        eos_token_id=eos if len(eos) > 1 else eos[0],
        bos_token_id=getattr(model.config, "bos_token_id", None),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(target)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _source(path: Path, digest: str) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an unreadable field is the same as a missing one here
        return None


def _import_gguf(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise UserError(
            f"model.name: {path}: reading a GGUF file needs the gguf package: {INSTALL_HINT}"
        ) from None
    return gguf


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _safe_stem(path: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)


def _readable_by_all(folder: Path) -> None:
    """mkdtemp makes a private directory: a shared cache (a cluster's nodes, other users) must read it."""
    folder.chmod(0o755)
    for item in folder.iterdir():
        item.chmod(0o644)


def _staging_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    """An exclusive lock on `target`'s name: a second process converting the same file waits for the first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
