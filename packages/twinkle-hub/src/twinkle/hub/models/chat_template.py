"""The Jinja2 chat template shipped with ``builtin://qwen3-tiny``.

It renders ChatML the way Qwen3 models are trained, so that what is learned on
the tiny model carries over to real Qwen3 checkpoints:

- an optional leading system message, merged with a description of ``tools``
  (inside ``<tools></tools>``) when tools are given;
- reasoning (``reasoning_content``, or a ``<think>...</think>`` prefix of the
  content) is kept only for assistant turns after the last real user query, and
  the final assistant turn always carries a think block, even an empty one;
  earlier turns drop it, as Qwen3 does not see old reasoning;
- tool results (role ``tool``) travel in a user turn, consecutive ones grouped;
- ``add_generation_prompt`` opens an assistant turn, pre-filled with an empty
  think block when ``enable_thinking=False``.

Literal text is emitted only through ``{{ '...' }}`` expressions and every tag
trims whitespace, so the layout of the template source never leaks into prompts.
"""

QWEN3_CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {{- content if content is string else '' -}}
{%- endmacro -%}

{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call the functions described below to help with the request.\n\n' -}}
    {{- 'Their signatures are listed inside <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments ' -}}
    {{- 'inside <tool_call></tool_call> XML tags:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}

{#- The last user message that is a real query, not tool output relayed by the user. -#}
{%- set state = namespace(last_query=-1) -%}
{%- for message in messages -%}
    {%- set content = text(message.content) -%}
    {%- if message.role == 'user'
          and not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) -%}
        {%- set state.last_query = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}

{%- for message in messages -%}
    {%- set content = text(message.content) -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- else -%}
            {%- set reasoning = '' -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {{- call.arguments if call.arguments is string else call.arguments | tojson -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

_TEXT_MACRO = r"""{%- macro text(content) -%}
    {{- content if content is string else '' -}}
{%- endmacro -%}"""

# ``builtin://qwen3-vl-tiny``: the same ChatML, where a message's content may also be a list of parts, as
# Qwen3-VL's template takes them: ``{"type": "text", "text": ...}`` renders its text and ``{"type": "image"}``
# (or a part holding ``image`` / ``image_url``) the image's placeholder, which the processor then expands to
# one ``<|image_pad|>`` per vision token.
QWEN3_VL_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    _TEXT_MACRO,
    r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}""",
)
if QWEN3_VL_CHAT_TEMPLATE == QWEN3_CHAT_TEMPLATE:  # pragma: no cover - guards an edit of the macro above
    raise RuntimeError("QWEN3_VL_CHAT_TEMPLATE: the text macro of QWEN3_CHAT_TEMPLATE was not found")
