"""A chat template that re-renders history, written from the behaviour its model card documents: the one
`tidal-testing/tiny-qwen3-chat` ships (tidal.models.tiny).

`QWEN3_STYLE_TEMPLATE` behaves like Qwen3's chat template (ChatML turns, written here from its documented
behaviour, not copied):

- an assistant turn's reasoning (`<think>...</think>` at the start of its content, or `reasoning_content`)
  is rendered only for turns after the last real user query; earlier turns keep just the answer;
- the final assistant turn after that query always gets a `<think>` block, an empty one
  (`<think>\\n\\n</think>\\n\\n`) when it has no reasoning, so a reply renders differently once another
  message follows it;
- tool results (`role: tool`) go into a user turn, each wrapped in `<tool_response>` tags, consecutive
  ones sharing the turn; a user message that is only such a wrapper does not count as a query;
- `tools=` are described in the system turn; `enable_thinking=False` prefills an empty `<think>` block
  in the generation prompt (left undefined, the model thinks).
"""

QWEN3_STYLE_TEMPLATE = """\
{%- set ns = namespace(query=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' and not (m.content.startswith('<tool_response>')
        and m.content.endswith('</tool_response>')) -%}
    {%- set ns.query = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools or messages[0].role == 'system' -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
  {%- if tools -%}
    {%- if messages[0].role == 'system' -%}{{- '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nCall one with <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>' -}}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set answer = m.content -%}
    {%- set thought = m.reasoning_content.strip('\\n') if m.reasoning_content is string else '' -%}
    {%- if m.reasoning_content is not string and '</think>' in answer -%}
      {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if loop.index0 > ns.query and (loop.last or thought) -%}
      {{- '<think>\\n' + thought + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- answer + '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""
