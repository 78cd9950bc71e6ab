"""Vision-language models: whether a model sees pictures (its config has a vision tower, `vision_config`, as
every vision-language model transformers and vLLM know declares), and its processor turning a prompt's
pictures into the image tokens and arrays the trainer feeds it (`setup_pictures`)."""

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.types import PackedArray, Pictures


def sees_images(model_path: str) -> bool:
    """True when the config.json of the model at `model_path` (a local directory or a hub id) has a vision
    tower. Asked before every server start, so it reads the one file: a hub id's from the local cache, else
    downloaded (vLLM fetches it next anyway), never through transformers (seconds of imports). An unreadable
    one is taken as a text model, which the command's own loading then reports."""
    config = _config_file(model_path)
    if config is None:
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def _config_file(model_path: str) -> Path | None:
    local = Path(model_path) / "config.json"
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_path, "config.json")
        return Path(cached) if isinstance(cached, str) else Path(hf_hub_download(model_path, "config.json"))
    except Exception:  # noqa: BLE001 - no network, no such repo, not a repo id: not ours to report
        return None


IDEFICS3_TYPES = ("idefics3", "smolvlm")
"""Idefics3's architecture (SmolVLM): picture features fill `<image>` tokens, positions are the text's."""
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Qwen-VL models: a picture's merged patches fill `<|image_pad|>` tokens, and every token takes multimodal
RoPE positions (temporal, height, width) from the model's own `get_rope_index` (`rope_positions`)."""
TRAINED_TYPES = IDEFICS3_TYPES + QWEN_VL_TYPES
"""Model types whose pictures tidal trains on."""


VISION_TOWERS = ("vision_model", "visual", "vision_tower")
"""Where vision-language models keep their vision encoder, under the causal LM's base model (Idefics3 and
SmolVLM: vision_model; Qwen-VL: visual; LLaVA-style: vision_tower)."""


PICTURE_TOKENS = ("<image>", "<|image_pad|>", "<|video_pad|>")
"""The tokens a vision-language model's inputs put picture features at (Idefics3 / SmolVLM, Qwen-VL)."""


def picture_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the PICTURE_TOKENS `tokenizer` has (none for a text model's)."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[t] for t in PICTURE_TOKENS if t in vocab)


def check_reply(completion_ids: Sequence[int], picture_ids: frozenset[int]) -> None:
    """A ValueError when a model's reply holds a picture token: the model would take it for a picture's place
    (in training, and in vLLM's next turn), and no picture comes with it."""
    wrote = next((t for t in completion_ids if t in picture_ids), None)
    if wrote is not None:
        raise ValueError(f"the reply holds picture token id {wrote}, which only a picture may fill")


def model_type(model_path: str) -> str:
    """The `model_type` of the config.json at `model_path` (a directory or hub id); "" when unreadable."""
    config = _config_file(model_path)
    try:
        return str(json.loads(config.read_text()).get("model_type", "")) if config else ""
    except (OSError, ValueError):
        return ""


class PictureInputs:
    """A vision-language model's processor, used the way vLLM uses it: each picture placeholder the chat
    template wrote into a prompt's ids becomes the picture's image tokens, and the picture becomes the arrays
    the vision tower takes (`Pictures`). Idefics3 / SmolVLM: the processor's text for one `<image>`
    (`<fake_token_around_image><global-img><image>…<fake_token_around_image>`, tiles included)."""

    placeholder = "<image>"

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder_id = int(self.tokenizer.convert_tokens_to_ids(self.placeholder))

    def expand(self, prompt_ids: Sequence[int], images: Sequence[str]) -> tuple[list[int], Pictures]:
        """The prompt's ids with every placeholder expanded, and its pictures' arrays in order. A ValueError
        when the placeholders and pictures differ in number or a picture is not a data URL."""
        ids, _, pictures = self.expand_masked(prompt_ids, None, images)
        return ids, pictures

    def expand_masked(
        self, ids: Sequence[int], mask: Sequence[int] | None, images: Sequence[str]
    ) -> tuple[list[int], list[int], Pictures]:
        """`expand`, carrying a per-token `mask` along (0 on every image token; [] when `mask` is None)."""
        slots = [i for i, token in enumerate(ids) if token == self.placeholder_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} picture placeholder(s) ({self.placeholder}) for {len(images)} "
                "picture(s)"
            )
        out: list[int] = []
        out_mask: list[int] = []
        parts: list[Pictures] = []
        start = 0
        for number, (slot, url) in enumerate(zip(slots, images, strict=True), start=1):
            tokens, pictures = self.one_picture(decode_picture(url, number))
            out += list(ids[start:slot]) + tokens
            if mask is not None:
                out_mask += list(mask[start:slot]) + [0] * len(tokens)
            parts.append(pictures)
            start = slot + 1
        out += ids[start:]
        if mask is not None:
            out_mask += mask[start:]
        joined = Pictures.concat(parts)
        if joined is None:
            raise ValueError("no pictures to expand")
        return out, out_mask, joined

    def one_picture(self, image: Any) -> tuple[list[int], Pictures]:
        out = self.processor(
            text=[self.placeholder], images=[[image]], return_tensors="np", add_special_tokens=False
        )
        values = out["pixel_values"][0].astype("float32")  # [tiles, 3, H, W]
        mask = out.get("pixel_attention_mask")
        return [int(t) for t in out["input_ids"][0]], Pictures(
            count=1,
            pixel_values=PackedArray.from_numpy(values),
            pixel_attention_mask=None if mask is None else PackedArray.from_numpy(mask[0].astype(bool)),
        )


class QwenPictureInputs(PictureInputs):
    """Qwen-VL's pictures, expanded as its processor (and vLLM) does: the chat template's one `<|image_pad|>`
    per picture becomes (t·h·w patches) / merge² of them, and the picture becomes its patches
    (`pixel_values` [patches, C·T·P·P]) and their grid (`image_grid_thw` [1, 3]), from the model's image
    processor. The processor itself is not needed: it would also load a video processor, which needs
    torchvision."""

    placeholder = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any):
        self.processor = image_processor
        self.tokenizer = tokenizer
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.placeholder))
        self.merge = int(getattr(image_processor, "merge_size", 2))

    def one_picture(self, image: Any) -> tuple[list[int], Pictures]:
        out = self.processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"].astype("int64")  # [1, 3]
        tokens = int(grid.prod()) // (self.merge * self.merge)
        return [self.placeholder_id] * tokens, Pictures(
            count=1,
            pixel_values=PackedArray.from_numpy(out["pixel_values"].astype("float32")),
            image_grid_thw=PackedArray.from_numpy(grid),
        )


def rope_positions(
    decoder: Any, input_ids: Any, position_ids: Any, image_grid_thw: Any | None, image_token_id: int
) -> Any:
    """Packed rows' positions for a Qwen-VL model, [4, rows, seq]: the text positions (which mark where each
    sample starts, for the attention's document bounds), then the model's own multimodal RoPE positions
    (`decoder.get_rope_index`) of each sample alone, as vLLM gives that sample. `image_grid_thw` holds the
    rows' pictures in token order (a sample's image tokens are one run per picture); padding after a row's
    last sample counts on as text after it."""
    import torch

    rows, seq = input_ids.shape
    mrope = position_ids.unsqueeze(0).repeat(3, 1, 1)  # text positions in all three: samples without pictures
    grids = list(image_grid_thw) if image_grid_thw is not None else []
    used = 0
    for row in range(rows):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist() + [seq]
        for begin, end in zip(starts, starts[1:], strict=False):
            ids = input_ids[row, begin:end]
            is_image = ids == image_token_id
            pictures = int((is_image[1:] & ~is_image[:-1]).sum()) + int(bool(is_image[:1].any()))
            if not pictures:
                continue
            if used + pictures > len(grids):
                raise ValueError(f"{len(grids)} pictures for more runs of image tokens in the rows")
            mine = torch.stack(grids[used : used + pictures])
            used += pictures
            found, _ = decoder.get_rope_index(
                ids.unsqueeze(0), mm_token_type_ids=is_image.int().unsqueeze(0), image_grid_thw=mine
            )
            # (a row's padding is in its last sample's span: text positions after it)
            mrope[:, row, begin:end] = found[:, 0].to(mrope.dtype)
    if used != len(grids):
        raise ValueError(f"{len(grids)} pictures for {used} runs of image tokens in the rows")
    return torch.cat([position_ids.unsqueeze(0), mrope], dim=0)


def training_problem(model_name: str) -> str | None:
    """Why the model `model_name` cannot train on pictures (no vision tower, or a type tidal does not train
    on yet), in words; None when it can."""
    from tidal.models.names import resolve_model_name

    path = resolve_model_name(model_name)
    if not sees_images(path):
        return f"model {model_name!r} has no vision tower (no vision_config in its config)"
    kind = model_type(path)
    if kind not in TRAINED_TYPES:
        return (
            f"model {model_name!r} is a {kind or 'unknown'} vision-language model: tidal trains on pictures "
            f"with {', '.join(TRAINED_TYPES)} models so far (docs/vlm.md)"
        )
    return None


def setup_pictures(model_name: str, trust_remote_code: bool = False) -> PictureInputs:
    """The picture inputs of the model `model_name` trains with; a UserError when it cannot train on
    pictures (`training_problem`) or its processor does not load."""
    from tidal.errors import UserError, first_line
    from tidal.models.names import resolve_model_name

    problem = training_problem(model_name)
    if problem is not None:
        raise UserError(problem)
    path = resolve_model_name(model_name)
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        if model_type(path) in QWEN_VL_TYPES:
            return QwenPictureInputs(
                AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code),
                AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
            )
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise UserError(f"model {model_name!r}: cannot load its processor: {first_line(exc)}") from None
    return PictureInputs(processor)


def decode_picture(url: str, number: int) -> Any:
    """The RGB image of a data URL; a ValueError naming picture `number` for anything else (training needs
    the picture itself: an http(s) picture would be fetched twice, by vLLM and here, and could differ)."""
    if not url.startswith("data:"):
        raise ValueError(
            f"picture {number}: training needs the picture itself (a data URL or a PIL image), not {url[:40]!r}"
        )
    try:
        raw = base64.b64decode(url.partition(",")[2])
    except ValueError as exc:
        raise ValueError(f"picture {number}: cannot be read as an image ({exc})") from None
    return picture_from_bytes(raw, number)


def picture_from_bytes(raw: bytes, number: int) -> Any:
    """The RGB image in `raw` (a file's bytes); a ValueError naming picture `number` when it is none (a
    decompression bomb included)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"picture {number}: cannot be read as an image ({exc})") from None


def split_repeats(kind: str, tensors: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """A micro-batch's picture tensors joined once per shared picture (`picture_tensors(once=True)`) as
    (the model's inputs, the index that repeats the vision tower's output per tile, or None).

    Idefics3 runs its tower on the distinct tiles and `repeated_tower` spreads the output back: a group's
    samples share their prompt's picture, so the tower runs once where it ran once per sample. Other models
    get their inputs repeated back (their towers are not split here), as without `once`."""
    from tidal.types import REPEAT

    repeats = {k.removeprefix(REPEAT): v for k, v in tensors.items() if k.startswith(REPEAT)}
    inputs = {k: v for k, v in tensors.items() if not k.startswith(REPEAT)}
    if not repeats:
        return inputs, None
    if kind in IDEFICS3_TYPES and set(repeats) <= {"pixel_values", "pixel_attention_mask"}:
        return inputs, repeats["pixel_values"]
    return {k: v.index_select(0, repeats[k]) if k in repeats else v for k, v in inputs.items()}, None


class repeated_tower:
    """While entered: `decoder`'s Idefics3 vision tower, given the `distinct` tiles, returns its output for
    every tile of the micro-batch (`index` from `split_repeats`); autograd adds the repeated tiles'
    gradients into the one computation. No index: nothing changes."""

    def __init__(self, decoder: Any, index: Any, distinct: int):
        self.tower = getattr(decoder, "vision_model", None) if index is not None else None
        self.index = index
        self.distinct = distinct  # from the inputs' shape: the index's maximum would wait for the GPU

    def __enter__(self) -> None:
        if self.tower is None:
            return
        forward, index, distinct = self.tower.forward, self.index, self.distinct

        def spread(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if out.last_hidden_state.shape[0] != distinct:  # the model dropped tiles (all-zero padding)
                raise ValueError(
                    f"the vision tower returned {out.last_hidden_state.shape[0]} tiles for {distinct} distinct"
                )
            out.last_hidden_state = out.last_hidden_state.index_select(0, index)
            return out

        self.tower.forward = spread

    def __exit__(self, *exc: object) -> None:
        if self.tower is not None:
            del self.tower.forward  # the class's forward again


def forward_pictures(kind: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch's picture tensors (`MicroBatch.picture_tensors`) as the forward of a model of type
    `kind` takes them: Idefics3 wants [batch, images, …], and all of a micro-batch's pictures go in one
    batch entry (the model fills image tokens in flattened row order)."""
    if kind in IDEFICS3_TYPES:
        return {name: t.unsqueeze(0) for name, t in tensors.items()}
    return tensors
