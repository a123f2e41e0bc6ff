"""Chat templates: OpenAI ``messages`` rendered into the prompt text a chat-tuned checkpoint was trained on.

The template is the checkpoint config's ``data.chat_template`` or, when that is empty, the tokenizer's own (a
converted Hugging Face checkpoint's ``tokenizer_config.json``; :func:`chat_template_of`): a Jinja2 template in
Hugging Face's format, run in Jinja's ``ImmutableSandboxedEnvironment`` as ``transformers`` does (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception``
and ``strftime_now`` globals). It sees
``messages`` (a list of ``{"role", "content"}`` dicts, content as a string), ``tools`` and
``add_generation_prompt=True``, and renders the text that ``python -m mercury_jax.prepare`` stored as an SFT
example's ``prompt``. As in ``transformers``, ``tools`` is the request's list of ``{"type": "function", "function":
{"name", "description", "parameters"}}`` dicts, or None without tools; an assistant message that called tools has
``tool_calls`` (``[{"id", "type", "function": {"name", "arguments"}}]``, arguments as a dict when they are a JSON
object) and a ``tool`` message has ``tool_call_id``. A template that ignores ``tools`` still renders.

Special tokens: a sentencepiece checkpoint's are ids, not text, so ``bos_token`` and ``eos_token`` render as "", and
the server puts the BOS id in front of the encoded text itself, as SFT records do (``[BOS] + prompt``). A Hugging
Face checkpoint's render as their texts (``tokenizer.template_tokens``, the variables ``transformers`` passes), which
encode to their ids; :func:`prompt_ids` then adds BOS only when the tokenizer wants one (``add_bos``) and the
template did not write it, so a prompt never starts with two.

Example template (turns separated by role headers, the answer after the last ``<|assistant|>``)::

  {% for m in messages %}<|{{ m.role }}|>
  {{ m.content }}
  {% endfor %}{% if add_generation_prompt %}<|assistant|>
  {% endif %}
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
  """A chat template that does not compile, or that refuses the messages (its ``raise_exception``)."""


def _raise_exception(message: str):
  raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


class ChatTemplate:
  """A compiled chat template.

  Args:
    source: The Jinja2 template text.
    special_tokens: The texts of the special-token variables (``bos_token``, ``eos_token``, ...); those not given
      render as "".
    origin: Where ``source`` came from, for the error message.

  Raises:
    TemplateError: ``source`` is not a valid Jinja2 template.
  """

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "data.chat_template"):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    self._tokens = {"bos_token": "", "eos_token": "", **(special_tokens or {})}
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise TemplateError(f"{origin} does not compile: {e.message} (line {e.lineno})") from None

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
        **self._tokens,
      )
    except TemplateError:
      raise
    except (jinja2.TemplateError, TypeError) as e:
      raise TemplateError(f"the chat template cannot render these messages: {e}") from None


def chat_template_of(source: str, tokenizer) -> ChatTemplate | None:
  """The template a server renders chats with: ``source`` (the config's ``data.chat_template``) when set, else the
  tokenizer's own (``tokenizer.chat_template``); None when neither has one. Either sees the tokenizer's
  special-token texts (``tokenizer.template_tokens``). A tokenizer without these attributes counts as having none.

  Raises:
    TemplateError: The template does not compile.
  """
  tokens = getattr(tokenizer, "template_tokens", {})
  if source:
    return ChatTemplate(source, tokens)
  own = getattr(tokenizer, "chat_template", None)
  return ChatTemplate(own, tokens, origin="the tokenizer's chat_template") if own else None


def prompt_ids(tokenizer, ids: Sequence[int]) -> list[int]:
  """A rendered chat prompt's ids with BOS in front exactly once: added when the tokenizer wants BOS (``add_bos``)
  and the template did not write it (a tokenizer without ``add_bos`` wants it, as sentencepiece's); an empty prompt
  gets BOS alone (the decoder needs a known first token)."""
  ids = list(ids)
  if (getattr(tokenizer, "add_bos", True) and ids[:1] != [tokenizer.bos_id]) or not ids:
    return [tokenizer.bos_id, *ids]
  return ids
