"""An HTTP request made ready for the engine: its text tokenised (token healing decided), its knobs and step budget
read and checked against the served model, and the token-level rows (:class:`~mercury_jax.sampling.text.Row`, the
library's own) of its choices; and the waits of a handler that end when the client leaves, the deadline passes or
the server's grace period ends."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from fastapi import Request

from mercury_jax.data.chat_template import TemplateError, prompt_ids
from mercury_jax.sampling import healing
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.settings import Budget, SettingError, hole_loads, steps_per_block
from mercury_jax.sampling.text import Row
from mercury_jax.serve import protocol as api, structured
from mercury_jax.serve.draining import Drain

if TYPE_CHECKING:
  from mercury_jax.serve.routes import Served

CHAT_MAX_TOKENS = 256  # Chat and FIM without max_tokens: at most this, and no more than the context leaves.
INLINE_CHARS = 4096  # Texts up to this long are tokenised on the event loop; longer ones on a thread.


@dataclasses.dataclass(frozen=True)
class Text:
  """A request's tokenised text.

  Attributes:
    prompt: The prompt's ids (with token healing: without the backed-off last token).
    suffix: The suffix's ids (fill in the middle), or none.
    max_tokens: The hole's positions (with token healing: one more, the backed-off token's).
    healed: With token healing: the backed-off token's characters, which the reply writes first; "" otherwise.
    tokenised: With token healing: the prompt as tokenised (what is sent when healing cannot be compiled).
  """

  prompt: list[int]
  suffix: list[int]
  max_tokens: int
  healed: str = ""
  tokenised: list[int] | None = None


class ClientGone(Exception):
  """The client went away before its answer started."""


async def disconnected(request: Request) -> None:
  """Returns once the client has gone away (the body is read, so the next message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def unless_gone(request: Request, awaitable, deadline: float, timeout: api.APIError, drain: Drain):
  """``await awaitable``, cancelled when the client goes away (:class:`ClientGone`), ``deadline`` passes (the
  ``timeout`` error) or the server's grace period ends (its 503)."""
  work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected(request))
  closing = asyncio.ensure_future(drain.closing.wait())
  try:
    remaining = deadline - asyncio.get_running_loop().time()
    await asyncio.wait((work, gone, closing), timeout=max(remaining, 0.0), return_when=asyncio.FIRST_COMPLETED)
  except BaseException:
    work.cancel()
    raise
  finally:
    left, closed = gone.done(), closing.done()
    gone.cancel()
    closing.cancel()
  if not work.done():
    work.cancel()
    if left:
      raise ClientGone()
    raise drain.ended(api.new_id("req")) if closed else timeout
  return work.result()


def encode(tokenizer, text: str, field: str) -> list[int]:
  """Token ids of a request's text; 400 naming ``field`` for text that is not valid Unicode."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    message = f"{field} holds {text[e.start : e.end]!r}, which is not valid Unicode text (a lone surrogate)"
    raise api.APIError(400, message, param=field) from None
  return tokenizer.encode(text)


async def off_loop(fn, *args, size: int):
  """``fn(*args)``, on a thread when ``size`` (characters) is large, so the event loop never waits long."""
  return await asyncio.to_thread(fn, *args) if size > INLINE_CHARS else fn(*args)


def max_tokens_of(given: int | None, default: int, prompt: int, suffix: int, context: int, field: str) -> int:
  """The positions to generate: ``given`` (the request's ``field``) or ``default``, checked against the context."""
  room = context - prompt - suffix
  if given is None and room >= 1:
    return min(default, room)
  if given is not None and given <= room:
    return given
  lengths = f"prompt has {prompt} tokens" + (f", suffix has {suffix} tokens" if suffix else "")
  if given is None:
    message = f"{lengths} but the model's context is {context} tokens, which leaves no room to generate"
  else:
    hint = f"; lower {field} to at most {room}" if room >= 1 else "; shorten the prompt"
    message = (
      f"{lengths} and {field}={api.shown(given)}, together {prompt + suffix + given}, but the model's context is "
      f"{context} tokens{hint}"
    )
  raise api.APIError(400, message, param="prompt" if room < 1 else field, code="context_length_exceeded")


def knobs_of(body: api.GenerationRequest, scheduler, first: int, generated: int) -> tuple[Knobs, Budget | None]:
  """``(knobs, steps per block)`` of a request whose hole of ``generated`` positions starts at canvas position
  ``first``: reasoning_effort first, explicit steps (or steps_per_block) and threshold over it; the engine's defaults
  for what is not given (steps per block None)."""
  if scheduler.autoregressive:
    if scheduler.draft:
      how = (
        f"this server decodes by verified decoding (each forward pass drafts up to {scheduler.draft} tokens by "
        "diffusion and keeps those its next-token head accepts; no diffusion step knobs apply)"
      )
    else:
      how = "this model is autoregressive (it decodes one token per forward pass)"
    for field in api.DIFFUSION_FIELDS:
      value = getattr(body, field)
      if value is not None and value is not False:
        raise api.APIError(400, f"{field}={api.shown(value)} applies to diffusion decoding only; {how}", param=field)
  if body.decode not in (None, "auto", scheduler.decode):
    raise api.APIError(
      400,
      f"decode={api.shown(body.decode)} differs from the served mode {scheduler.decode!r} (set by --decode at start); "
      f"omit it or send {scheduler.decode!r}",
      param="decode",
    )
  if body.draft_length is not None and body.draft_length != scheduler.draft:
    served = f"{scheduler.draft} (set by --draft-length at start)" if scheduler.draft else "none: it is not verified"
    raise api.APIError(
      400,
      f"draft_length={api.shown(body.draft_length)} differs from the served draft length {served}",
      param="draft_length",
    )
  block = scheduler.block
  if body.block_length is not None and body.block_length != block:
    why = "the block it was trained with" if scheduler.block_length_fixed else "set by --block-length at start"
    raise api.APIError(
      400,
      f"block_length={api.shown(body.block_length)} differs from the served model's block length {block} ({why}); "
      f"omit it or send {block}",
      param="block_length",
    )
  per_block, threshold = api.effort_knobs(body.reasoning_effort, block) if body.reasoning_effort else (None, None)
  per_block = None if per_block is None else Budget(per_block)
  if body.steps_per_block is not None:
    per_block = Budget(body.steps_per_block)
  if body.steps is not None:
    try:
      per_block = steps_per_block(body.steps, hole_loads(first, generated, block))
    except SettingError as e:
      raise api.APIError(400, e.named("steps"), param="steps") from None
  default = scheduler.default_knobs
  given = (body.temperature, body.top_k, body.top_p, body.threshold if body.threshold is not None else threshold)
  knobs = Knobs(*(d if g is None else g for g, d in zip(given, default, strict=True)))
  return knobs, per_block


async def healable(tokenizer, healed: str) -> bool:
  """Whether some token starts with a prompt's backed-off end (token healing's one-position mask,
  :func:`~mercury_jax.sampling.healing.allowed_tokens`; cached, off the event loop); if not, the prompt is sent as
  tokenised."""
  return await asyncio.to_thread(healing.healable, tokenizer, healed)


def tokenise_completion(served: Served, body: api.CompletionRequest, shape: structured.Structure, default: int) -> Text:
  """A completion's :class:`Text` (token healing is decided here); ``default``: its ``max_tokens`` when it gives
  none."""
  tokenizer, scheduler, context = served.tokenizer, served.scheduler, served.context
  prompt = encode(tokenizer, body.text, "prompt") or [tokenizer.bos_id]
  suffix = encode(tokenizer, body.suffix, "suffix") if body.suffix else []
  max_tokens = max_tokens_of(body.max_tokens, default, len(prompt), len(suffix), context, "max_tokens")
  heals = served.options.token_healing and (scheduler.autoregressive or scheduler.cfg.objective.block_size > 0)
  if heals and served.template is None and not suffix and shape.field is None:
    kept, healed = healing.back_off(tokenizer, body.text, prompt)
    if healed:  # The same positions, one more of them generated.
      return Text(kept, suffix, max_tokens + len(prompt) - len(kept), healed, prompt)
  return Text(prompt, suffix, max_tokens)


def tokenise_chat(served: Served, body: api.ChatRequest, tools: list[dict]) -> Text:
  """A chat request's :class:`Text`: the rendered template's ids, BOS in front once (:func:`chat.prompt_ids`)."""
  tokenizer = served.tokenizer
  try:
    rendered = served.template.render([m.as_dict() for m in body.messages], tools=tools)
  except TemplateError as e:
    raise api.APIError(400, str(e), param="messages") from None
  prompt = prompt_ids(tokenizer, encode(tokenizer, rendered, "messages"))
  field, given = "max_tokens", body.max_tokens
  if body.max_completion_tokens is not None:
    if given is not None and given != body.max_completion_tokens:
      message = (
        f"max_tokens={api.shown(given)} and max_completion_tokens={api.shown(body.max_completion_tokens)} "
        "disagree; send one"
      )
      raise api.APIError(400, message, param="max_completion_tokens")
    field, given = "max_completion_tokens", body.max_completion_tokens
  return Text(prompt, [], max_tokens_of(given, CHAT_MAX_TOKENS, len(prompt), 0, served.context, field))


def rows_of(body, text: Text, knobs: Knobs, budget: Budget | None, constraint, seed: int) -> list[Row]:
  """The engine rows of a request's ``n`` choices: the same canvas, knobs, budget, constraint and seed, random
  streams 0..n-1."""
  fields = dict(seed=seed, constraint=constraint, heal=text.healed)
  if budget is not None:
    fields |= dict(steps_per_block=budget.per_block, extra_steps=budget.extra)
  return [
    Row.completion(text.prompt, text.max_tokens, text.suffix, knobs, stream=i, **fields) for i in range(body.n or 1)
  ]
