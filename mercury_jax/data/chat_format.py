"""The bundled models' chat format: one Jinja2 chat template (``data.chat_template``) and the calls it writes.

The template is rendered by :class:`mercury_jax.data.chat_template.ChatTemplate`, the code that renders imported
Hugging Face templates, for training examples (:mod:`mercury_jax.data.instructions`) and for the server alike. A
conversation is a run of turns, each a header line and its text::

  <|system|>
  You write Python.
  <|tools|>
  {"name":"gcd","description":"Greatest common divisor.","parameters":{"type":"object",...}}
  <|user|>
  Call gcd with a=12 and b=18.
  <|assistant|>
  {"name":"gcd","arguments":{"a":12,"b":18}}
  <|tool|>
  6
  <|assistant|>
  gcd returned 6.

* ``<|system|>``: the system message, when the first message is one (a later system message is a turn like the
  others).
* ``<|tools|>``: when the request has tools, after the system message: one compact JSON object per line, the
  function's ``name``, ``description`` (when given) and ``parameters`` (``{"type": "object", "properties": {}}`` when
  absent).
* ``<|user|>``, ``<|assistant|>``, ``<|tool|>``: the turns, in order. An assistant turn that called a tool holds the
  call as compact JSON, ``{"name": NAME, "arguments": {...}}`` (:func:`call_text`), exactly what the server's
  constrained tool calls produce and :func:`mercury_jax.serve.structured.parse_tool_call` reads; a ``tool`` turn holds
  the result's text.
* With ``add_generation_prompt`` the text ends with ``<|assistant|>`` and a newline: the answer follows, and ends with
  the tokenizer's EOS id (no text: a sentencepiece checkpoint's special tokens render as ""). A previous assistant
  turn ends with its newline.

An answer is plain text, or a call: a reply that starts with ``{`` is a tool call, as the server's ``tool_choice``
"auto" constraint reads it (a text answer never starts with ``{``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# The template (Hugging Face's format: ``messages``, ``tools``, ``add_generation_prompt``). trim_blocks and
# lstrip_blocks are on, as in transformers: a block tag's own line leaves no newline behind.
TEMPLATE = """\
{% set ns = namespace(rest=messages) %}
{% if messages and messages[0].role == 'system' %}
<|system|>
{{ messages[0].content }}
{% set ns.rest = messages[1:] %}
{% endif %}
{% if tools %}
<|tools|>
{% for tool in tools %}
{% set f = tool.function %}
{"name":{{ f.name | tojson }}{% if f.description %},"description":{{ f.description | tojson }}{% endif %}\
,"parameters":{{ (f.parameters or {"type": "object", "properties": {}}) | tojson(separators=(',', ':')) }}}
{% endfor %}
{% endif %}
{% for m in ns.rest %}
{% if m.role not in ('system', 'user', 'assistant', 'tool') %}
{{ raise_exception("unknown role " ~ m.role ~ ": use system, user, assistant or tool") }}
{% endif %}
<|{{ m.role }}|>
{% if m.role == 'assistant' and m.tool_calls %}
{% for call in m.tool_calls %}
{"name":{{ call.function.name | tojson }},"arguments":\
{% if call.function.arguments is string %}{{ call.function.arguments }}\
{% else %}{{ call.function.arguments | tojson(separators=(',', ':')) }}{% endif %}}
{% endfor %}
{% else %}
{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

SYSTEM, USER, ASSISTANT, TOOL = "system", "user", "assistant", "tool"


def call_text(name: str, arguments: dict) -> str:
  """A tool call as the model writes it: compact JSON ``{"name": ..., "arguments": {...}}``, keys in order."""
  return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))


def tool(name: str, parameters: dict, description: str = "") -> dict:
  """An OpenAI-style tool: ``{"type": "function", "function": {"name", "description"?, "parameters"}}``."""
  function = {"name": name, **({"description": description} if description else {}), "parameters": parameters}
  return {"type": "function", "function": function}


def assistant_call(name: str, arguments: dict, call_id: str = "call_0") -> dict:
  """An assistant message that called a tool (as a chat request carries it)."""
  return {
    "role": ASSISTANT,
    "content": "",
    "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
  }


def render(messages: Sequence[dict], tools: Sequence[dict] | None = None, *, add_generation_prompt: bool = True) -> str:
  """``messages`` (and ``tools``) in this format, through the server's template code (module docstring)."""
  from mercury_jax.data.chat_template import ChatTemplate  # jinja2: loaded only where chats are rendered

  return _template(ChatTemplate).render(messages, tools=tools, add_generation_prompt=add_generation_prompt)


_COMPILED = {}


def _template(cls):
  if "template" not in _COMPILED:
    _COMPILED["template"] = cls(TEMPLATE, origin="mercury_jax.data.chat_format.TEMPLATE")
  return _COMPILED["template"]
