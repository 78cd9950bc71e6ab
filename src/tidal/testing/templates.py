"""A second chat-template family for tests, written from the behaviour its model card documents.

`HARMONY_STYLE_TEMPLATE` stands for gpt-oss's harmony format: the final assistant message ends with
`<|return|>` (the model's stop token, its EOS), earlier ones with `<|end|>`, and the reasoning of earlier
turns is dropped. Its markers are special tokens that `harmony_style_tokenizer` adds. (The Qwen3-style
template, which a built-in test model ships, is tidal.models.templates.)
"""

from typing import Any

from tidal.models.tiny import build_tokenizer

HARMONY_STYLE_TEMPLATE = """\
{%- for m in messages -%}
  {%- set text = m.content -%}
  {%- if m.role == 'assistant' and not loop.last -%}{%- set text = text.split('</think>')[-1] -%}{%- endif -%}
  {{- '<|start|>' + m.role + '<|message|>' + text -}}
  {{- '<|return|>' if m.role == 'assistant' and loop.last else '<|end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant<|message|>' -}}{%- endif -%}"""

HARMONY_SPECIAL_TOKENS = ["<|start|>", "<|message|>", "<|end|>", "<|return|>"]


def harmony_style_tokenizer() -> Any:
    """The tiny char tokenizer with the harmony markers as special tokens, `<|return|>` as EOS."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(HARMONY_SPECIAL_TOKENS, special_tokens=True)
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = HARMONY_STYLE_TEMPLATE
    return tokenizer
