"""Held-out evaluation of an exported HF model: greedy decoding, exact match on the last assistant turn."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.envs.tools import conversation_template_inputs
from tidal.trainer.sources import Conversation


@dataclass
class ExactMatchResult:
    """Fraction of conversations whose greedy answer equals the reference, with a few examples to print."""

    exact_match: float
    num_examples: int
    examples: list[tuple[str, str, str]]  # (prompt's last user message, reference, generated)


def split_prompt(messages: Conversation) -> tuple[Conversation, str]:
    """Everything before the last assistant message is the prompt; that message is the reference."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


@torch.no_grad()
def greedy_exact_match(
    model_dir: Path,
    conversations: list[Conversation],
    max_new_tokens: int,
    batch_size: int,
    device: torch.device,
) -> ExactMatchResult:
    from tidal.envs.chat import message_images

    if any(message_images(c) for c in conversations):
        return _exact_match_with_pictures(model_dir, conversations, max_new_tokens, device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts must end at the same column
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    model = model.to(device).eval()
    correct = 0
    examples: list[tuple[str, str, str]] = []
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start : start + batch_size]
        prompts, references = zip(*(split_prompt(c) for c in chunk), strict=True)
        texts = [prompt_text(tokenizer, p) for p in prompts]
        generated = _generate(model, tokenizer, texts, max_new_tokens, device)
        for prompt, reference, answer in zip(prompts, references, generated, strict=True):
            correct += answer.strip() == reference.strip()
            if len(examples) < 5:
                examples.append((prompt[-1]["content"], reference, answer))
    return ExactMatchResult(correct / max(1, len(conversations)), len(conversations), examples)


def prompt_text(tokenizer: Any, messages: Conversation) -> str:
    """A held-out conversation's prompt as the rollout renders it (the tools a demonstration carries
    included, `tidal.envs.tools.conversation_template_inputs`), with the generation prompt."""
    shown, template_kwargs = conversation_template_inputs(tokenizer, list(messages))
    return str(
        tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **template_kwargs)
    )


def _generate(
    model: Any, tokenizer: Any, texts: list[str], max_new_tokens: int, device: torch.device
) -> list[str]:
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    output = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    new_tokens = output[:, batch["input_ids"].shape[1] :]  # [batch, new]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def _exact_match_with_pictures(
    model_dir: Path, conversations: list[Conversation], max_new_tokens: int, device: torch.device
) -> ExactMatchResult:
    """`greedy_exact_match` for a vision-language model on conversations with pictures, one at a time: the
    prompt's ids as the chat template renders them, each picture placeholder expanded by the model's
    processor (as in training and in vLLM), the pictures' arrays beside them."""
    from transformers import AutoModelForImageTextToText

    from tidal.envs.base import render_prompt
    from tidal.envs.chat import message_images, text_parts
    from tidal.models.vision import QWEN_VL_TYPES, forward_pictures, setup_pictures

    pictures = setup_pictures(str(model_dir))
    tokenizer = pictures.tokenizer
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir)
    model = model.to(device).eval()
    kind = str(model.config.model_type)
    correct = 0
    examples: list[tuple[str, str, str]] = []
    for conversation in conversations:
        prompt, reference = split_prompt(conversation)
        ids, inputs = render_prompt(tokenizer, prompt), {}
        images = message_images(prompt)
        if images:
            ids, arrays = pictures.expand(ids, images)
            inputs = forward_pictures(kind, arrays.tensors(device))
        input_ids = torch.tensor([ids], device=device)
        if kind in QWEN_VL_TYPES:  # what the processor gives: transformers then takes multimodal positions
            inputs["mm_token_type_ids"] = (input_ids == pictures.placeholder_id).int()
        output = model.generate(
            input_ids=input_ids,
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
        correct += answer.strip() == reference.strip()
        if len(examples) < 5:
            examples.append((" ".join(text_parts(prompt[-1]["content"])), reference, answer))
    return ExactMatchResult(correct / max(1, len(conversations)), len(conversations), examples)
