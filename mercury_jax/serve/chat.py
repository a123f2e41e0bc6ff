"""Chat templates: OpenAI ``messages`` rendered into the prompt text a chat-tuned checkpoint was trained on.

The template is the checkpoint config's ``data.chat_template``, a Jinja2 template in Hugging Face's format, run in
Jinja's ``ImmutableSandboxedEnvironment`` as ``transformers`` does (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, a ``raise_exception`` global). It sees
``messages`` (a list of ``{"role", "content"}`` dicts, content as a string), ``tools`` and
``add_generation_prompt=True``, and renders the text that ``python -m mercury_jax.prepare`` stored as an SFT
example's ``prompt``. As in ``transformers``, ``tools`` is the request's list of ``{"type": "function", "function":
{"name", "description", "parameters"}}`` dicts, or None without tools; an assistant message that called tools has
``tool_calls`` (``[{"id", "type", "function": {"name", "arguments"}}]``, arguments as a dict when they are a JSON
object) and a ``tool`` message has ``tool_call_id``. A template that ignores ``tools`` still renders. The special
tokens are ids, not text, so ``bos_token`` and ``eos_token`` render as "": the server puts the BOS id in front of
the encoded text itself, as SFT records do (``[BOS] + prompt``), and the model ends its answer with EOS.

Example template (turns separated by role headers, the answer after the last ``<|assistant|>``)::

  {% for m in messages %}<|{{ m.role }}|>
  {{ m.content }}
  {% endfor %}{% if add_generation_prompt %}<|assistant|>
  {% endif %}
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
  """A chat template that does not compile, or that refuses the messages (its ``raise_exception``)."""


def _raise_exception(message: str):
  raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
  """A compiled chat template.

  Args:
    source: The Jinja2 template text (``data.chat_template``).

  Raises:
    TemplateError: ``source`` is not a valid Jinja2 template.
  """

  def __init__(self, source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise TemplateError(f"data.chat_template does not compile: {e.message} (line {e.lineno})") from None

  def render(
    self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
  ) -> str:
    """The prompt text of ``messages``.

    Args:
      messages: ``{"role": str, "content": str}`` dicts, oldest first (other keys, like ``name``, ``tool_calls`` and
        ``tool_call_id``, pass through).
      tools: The tools the model may call (the template's ``tools``); None: no tools.
      add_generation_prompt: End with the header that opens the assistant's turn.

    Raises:
      TemplateError: The template refused the messages or failed while rendering them.
    """
    try:
      return self._template.render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        bos_token="",
        eos_token="",
      )
    except TemplateError:
      raise
    except (jinja2.TemplateError, TypeError) as e:
      raise TemplateError(f"the chat template cannot render these messages: {e}") from None
