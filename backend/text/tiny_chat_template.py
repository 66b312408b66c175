"""A compact chat template in the MiniMax-M3 prompt layout (formats.md 5.2), for the tiny tokenizer."""

TINY_M3_CHAT_TEMPLATE = r"""
{#- m3serve test template: MiniMax-M3 layout, own wording. -#}
{%- set NS = ']<]minimax[>[' -%}
{%- set BOD = ']~!b[' -%}
{%- set BOT = ']~b]' -%}
{%- set EOT = '[e~[' -%}
{%- set THINK_OPEN = '<mm:think>' -%}
{%- set THINK_CLOSE = '</mm:think>' -%}
{%- macro text_of(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c is none -%}
{%- elif c is mapping -%}{{ c.text if c.text is defined else '' }}
{%- elif c is iterable -%}
{%- for part in c -%}
{%- if part is string -%}{{ part }}
{%- elif part.type == 'text' -%}{{ part.text }}
{%- elif part.type == 'image' -%}{{ ']<]image[>[' }}
{%- elif part.type == 'video' -%}{{ ']<]video[>[' }}
{%- elif part.output is defined -%}{{ part.output }}
{%- endif -%}
{%- endfor -%}
{%- else -%}{{ c }}
{%- endif -%}
{%- endmacro -%}
{%- macro xml(v) -%}
{%- if v is mapping -%}
{%- for k, x in v.items() if x is not none -%}{{ NS }}<{{ k }}>{{ xml(x) }}{{ NS }}</{{ k }}>{%- endfor -%}
{%- elif v is string -%}{{ v }}
{%- elif v is boolean -%}{{ v | tojson }}
{%- elif v is iterable -%}
{%- for x in v -%}{{ NS }}<item>{{ xml(x) }}{{ NS }}</item>{%- endfor -%}
{%- elif v is not none -%}{{ v }}
{%- endif -%}
{%- endmacro -%}
{%- if thinking_mode is defined and thinking_mode in ['enabled', 'disabled', 'adaptive'] -%}
{%- set mode = thinking_mode -%}
{%- else -%}
{%- set mode = 'adaptive' -%}
{%- endif -%}
{%- set root_msg = none -%}
{%- set dev_msg = none -%}
{%- set convo = messages -%}
{%- if convo and convo[0].role == 'root' -%}
{%- set root_msg = convo[0] -%}
{%- set convo = convo[1:] -%}
{%- endif -%}
{%- if convo and convo[0].role in ['system', 'developer'] -%}
{%- set dev_msg = convo[0] -%}
{%- set convo = convo[1:] -%}
{%- endif -%}
{{- BOD ~ BOT ~ 'system\n' -}}
{%- if root_msg and root_msg.content -%}{{- text_of(root_msg.content) -}}
{%- else -%}{{- 'You are MiniMax-M3, an AI model built by MiniMax.' -}}
{%- endif -%}
{{- '\n\n<thinking_instructions>\n' -}}
{{- 'Reasoning goes inside ' ~ THINK_OPEN ~ THINK_CLOSE ~ ' before the answer. With thinking disabled, answer right after the ' ~ THINK_CLOSE ~ ' prefix; with adaptive thinking, choose per turn.\n' -}}
{{- 'Current thinking mode: ' ~ mode ~ '.\n' -}}
{{- '</thinking_instructions>' ~ EOT ~ '\n' -}}
{{- BOT ~ 'developer\n' -}}
{%- if dev_msg and dev_msg.content -%}{{- text_of(dev_msg.content) -}}
{%- else -%}{{- 'You are a helpful assistant.' -}}
{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\nThe tools below are described in JSONSchema.\n\n<tools>\n' -}}
{%- for t in tools -%}
{{- '<tool>' ~ ((t.function if t.function is defined else t) | tojson(ensure_ascii=False)) ~ '</tool>\n' -}}
{%- endfor -%}
{{- '</tools>\n\nCall tools inside one ' ~ NS ~ '<tool_call>' ~ NS ~ '</tool_call> block; nested values become child tags and list entries become ' ~ NS ~ '<item> tags. Example:\n\n' -}}
{{- NS ~ '<tool_call>\n' ~ NS ~ '<invoke name="f">' ~ NS ~ '<a>1' ~ NS ~ '</a>' ~ NS ~ '</invoke>\n' ~ NS ~ '</tool_call>' -}}
{%- endif -%}
{{- EOT ~ '\n' -}}
{%- set state = namespace(last_call=none) -%}
{%- for m in convo -%}
{%- if m.role == 'user' -%}
{{- BOT ~ 'user\n' ~ text_of(m.content) ~ EOT ~ '\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set body = text_of(m.content) -%}
{%- if m.reasoning_content is string -%}
{%- set thought = m.reasoning_content -%}
{%- elif m.reasoning is string -%}
{%- set thought = m.reasoning -%}
{%- elif THINK_CLOSE in body -%}
{%- set thought = body.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip('\n') -%}
{%- set body = body.split(THINK_CLOSE)[-1].strip('\n') -%}
{%- else -%}
{%- set thought = '' -%}
{%- endif -%}
{{- BOT ~ 'ai\n' -}}
{%- if thought -%}{{- THINK_OPEN ~ thought ~ THINK_CLOSE -}}
{%- else -%}{{- THINK_CLOSE -}}
{%- endif -%}
{{- body -}}
{%- if m.tool_calls -%}
{{- NS ~ '<tool_call>\n' -}}
{%- for tc in m.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if fn.arguments is not mapping -%}
{{- raise_exception('tool call arguments must be a JSON object') -}}
{%- endif -%}
{{- NS ~ '<invoke name="' ~ fn.name ~ '">' ~ xml(fn.arguments) ~ NS ~ '</invoke>\n' -}}
{%- set state.last_call = fn.name -%}
{%- endfor -%}
{{- NS ~ '</tool_call>' -}}
{%- else -%}
{%- set state.last_call = none -%}
{%- endif -%}
{{- EOT ~ '\n' -}}
{%- elif m.role == 'tool' -%}
{%- if state.last_call is none -%}
{{- raise_exception('a tool message must follow an assistant message with tool calls') -}}
{%- endif -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- BOT ~ 'tool' -}}{%- endif -%}
{{- '\n<response>' ~ text_of(m.content) ~ '</response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- EOT ~ '\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- BOT ~ 'ai\n' -}}
{%- if mode == 'disabled' -%}{{- THINK_CLOSE -}}
{%- elif mode == 'enabled' -%}{{- THINK_OPEN -}}
{%- endif -%}
{%- endif -%}
"""
