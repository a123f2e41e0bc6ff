"""How a request's engine updates become its answer: per choice text (:class:`Choice`), then one JSON body or the
event stream (:class:`Shape`, :func:`collect`, :func:`events`). The formats are described in
:mod:`mercury_jax.serve.routes`.

The text is built incrementally, so the work per update is proportional to the update, never to the text so far:

* :class:`~mercury_jax.sampling.text.Detokenizer` (the library's streams use it too) decodes only a small window of
  token ids per update, the way vLLM's incremental detokenizer keeps a prefix and a read offset.
* :class:`Choice` keeps the decoded text that could still begin a stop string (at most the longest stop's length,
  :func:`~mercury_jax.serve.protocol.held_back`) and releases the rest; stop strings are searched in that held-back
  tail plus the new text only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from mercury_jax.sampling.text import MASK_TEXT, Detokenizer
from mercury_jax.serve import protocol as api, structured
from mercury_jax.serve.metrics import Metrics

logger = logging.getLogger("mercury_jax.serve")
DISCONNECTED = 499  # The status counted for a request whose client went away (nginx's convention).


class Choice:
  """One choice of a request: its handle, and its text as the updates come (decoded, cut at a stop string).

  Args:
    index: The choice's index in the answer.
    handle: Its engine handle (``updates()``, ``cancel()``, ``submitted``).
    tokenizer: Decodes its tokens.
    stops: Its stop strings.
    metrics: Where its tokens, first token and end are counted.
    calls: The request's :attr:`Structure.calls <mercury_jax.serve.structured.Structure.calls>`: a reply that is a
      tool call is held back whole, and becomes :attr:`tool_call` when it finishes complete.
    healed: The prompt's characters its first token(s) re-generate (token healing), never released.
    request_id: The answer's id, quoted in a 500 and in the log.
  """

  def __init__(
    self,
    index: int,
    handle,
    tokenizer,
    stops: tuple[str, ...],
    metrics: Metrics,
    *,
    calls: str = "none",
    healed: str = "",
    request_id: str = "",
  ):
    self.index, self.handle, self.tokenizer, self.stops, self.metrics = index, handle, tokenizer, stops, metrics
    self.healed, self.request_id = healed, request_id
    self._detokenizer = Detokenizer(tokenizer)
    self._skip = len(healed)  # healed characters still to come (and drop)
    self._pending = ""  # decoded text not released yet: it could begin a stop string
    self._parts: list[str] = []  # released text
    self.tokens = 0
    self.nfe = 0
    self.finish_reason: str | None = None
    # Whether the reply is a call: None until the first character of an "auto" reply says ("{" opens one).
    self.calling: bool | None = {"none": False, "required": True}.get(calls)
    self.tool_call: api.ToolCall | None = None

  @property
  def text(self) -> str:
    """The text so far (final once :attr:`finish_reason` is set)."""
    if len(self._parts) > 1:
      self._parts = ["".join(self._parts)]
    return self._parts[0] if self._parts else ""

  def advance(self, update) -> tuple[str, str | None]:
    """Takes an update; returns the text released by it and the choice's new draft (None without one). Its time
    counts in ``mercury_answer_seconds_total``.

    Raises:
      APIError: 500 when the engine failed on the request (the details go to the log), 503 when it was cancelled.
    """
    began = time.perf_counter()
    try:
      return self._advance(update)
    finally:
      self.metrics.answer_seconds.inc(time.perf_counter() - began)

  def _advance(self, update) -> tuple[str, str | None]:
    if update.finish_reason == "error":
      logger.error("request %s: the engine failed on choice %d: %s", self.request_id, self.index, update.error)
      raise api.APIError.internal(self.request_id)
    if update.finish_reason == "cancelled":
      raise api.APIError(503, "the server cancelled this request (it is shutting down)", code="cancelled")
    if update.tokens:
      if not self.tokens:
        self.metrics.first_token(update.time - self.handle.submitted)
      self.metrics.add_tokens(len(update.tokens), update.time)
    self.tokens, self.nfe = self.tokens + len(update.tokens), update.nfe
    delta = self._detokenizer.add(update.tokens, final=update.done)
    if self._skip:
      cut = min(self._skip, len(delta))
      delta, self._skip = delta[cut:], self._skip - cut
    pending = self._pending + delta
    if self.calling is None and pending:
      self.calling = pending.startswith("{")
      if self.calling:  # Stop strings apply to text replies only: a cut call would be invalid.
        self.stops = ()
    cut = api.find_stop(pending, self.stops)
    if cut is not None:
      out, self.finish_reason = pending[:cut], "stop"
      self.handle.cancel()
    elif update.done:
      out, self.finish_reason = pending, update.finish_reason
    else:
      out = pending[: len(pending) - api.held_back(pending, self.stops)]
    self._pending = pending[len(out) :]
    self._parts.append(out)
    released = "" if self.calling else out  # A call is answered whole once it finishes.
    if self.finish_reason is not None:
      self.metrics.choice_done(self.tokens, self.nfe)
      if self.calling:
        self.tool_call = structured.parse_tool_call(self.text) if self.finish_reason == "stop" else None
        if self.tool_call is not None:
          self.finish_reason = "tool_calls"
        else:  # Cut short by max_tokens (or not a call after all): the text, as content.
          released = self.text
      return released, None
    draft = None
    if update.draft is not None:
      draft = self.tokenizer.decode(update.draft, mask_text=MASK_TEXT)
      draft = draft[len(self.healed) :] if self.healed and draft.startswith(self.healed) else draft
      draft = draft[: api.find_stop(draft, self.stops)]
    return released, draft

  def message(self) -> api.ChatMessageOut:
    """The finished choice as a chat message: its call, or its text."""
    if self.tool_call is not None:
      return api.ChatMessageOut(content=None, tool_calls=[self.tool_call])
    return api.ChatMessageOut(content=self.text)


class TimedOut(Exception):
  """The request ran past its deadline (the routes answer it; the choices are cancelled)."""


class ShutDown(Exception):
  """The server's grace period ended before the request did (the routes answer it; the choices are cancelled)."""


@dataclasses.dataclass(frozen=True)
class Ends:
  """How a stream ends early, and what it says then.

  Attributes:
    deadline: The request's deadline on the loop's clock (None: none).
    timeout: The :class:`~mercury_jax.serve.protocol.APIError` sent when ``deadline`` passes.
    closing: Set when the server's grace period ends (None: never).
    shutdown: The :class:`~mercury_jax.serve.protocol.APIError` sent when ``closing`` is set.
  """

  deadline: float | None = None
  timeout: api.APIError | None = None
  closing: asyncio.Event | None = None
  shutdown: api.APIError | None = None


async def run(
  choices: list[Choice], deadline: float | None = None, closing: asyncio.Event | None = None
) -> AsyncIterator[tuple[Choice, str, str | None]]:
  """``(choice, released text, draft)`` as the choices' updates arrive, until every choice has finished.

  However it ends (finished, failed, timed out at ``deadline`` on the loop's clock, stopped by ``closing``, or closed
  because the client left), the choices still running are cancelled, which frees their slots.

  Raises:
    TimedOut: ``deadline`` passed first.
    ShutDown: ``closing`` was set first.
  """
  queue: asyncio.Queue = asyncio.Queue()
  loop = asyncio.get_running_loop()

  async def pump(choice: Choice):
    try:
      async for update in choice.handle.updates():
        queue.put_nowait((choice, update))
    except Exception as error:  # noqa: BLE001  Handed to the consumer, which answers 500.
      queue.put_nowait((choice, error))

  async def close():
    await closing.wait()
    queue.put_nowait((None, ShutDown()))

  tasks = [asyncio.create_task(pump(choice)) for choice in choices]
  if closing is not None:
    tasks.append(asyncio.create_task(close()))
  timer = loop.call_at(deadline, queue.put_nowait, (None, TimedOut())) if deadline is not None else None
  try:
    while any(choice.finish_reason is None for choice in choices):
      choice, update = await queue.get()
      if isinstance(update, TimedOut | ShutDown):
        raise update
      if isinstance(update, Exception):
        request_id = choice.request_id
        logger.error("request %s: reading the engine's updates failed: %r", request_id, update)
        raise api.APIError.internal(request_id)
      if choice.finish_reason is None:
        released, draft = choice.advance(update)
        yield choice, released, draft
  finally:
    if timer is not None:
      timer.cancel()
    for choice in choices:
      if choice.finish_reason is None:
        choice.handle.cancel()
    for task in tasks:
      task.cancel()


class Shape:
  """How one request's answer looks: completions or chat, its id and model name."""

  def __init__(self, response_id: str, model: str, chat: bool):
    self.id, self.model, self.chat = response_id, model, chat

  def chunk(self, choices: list, usage: api.Usage | None = None) -> str:
    cls = api.ChatCompletionChunk if self.chat else api.Completion
    return cls(id=self.id, model=self.model, choices=choices, usage=usage).model_dump_json()

  def delta(
    self, index: int, text: str | None, finish_reason: str | None = None, draft: str | None = None, role=None, call=None
  ):
    diffusing = api.Diffusing(text=draft) if draft is not None else None
    if self.chat:
      calls = [api.ToolCallDelta(index=0, id=call.id, function=call.function)] if call is not None else None
      delta = api.ChatDelta(role=role, content=text, tool_calls=calls, diffusing=diffusing)
      return api.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
    return api.CompletionChoice(index=index, text=text or "", finish_reason=finish_reason, diffusing=diffusing)

  def whole(self, choices: list[Choice], usage: api.Usage):
    if self.chat:
      items = [api.ChatChoice(index=c.index, message=c.message(), finish_reason=c.finish_reason) for c in choices]
      return api.ChatCompletion(id=self.id, model=self.model, choices=items, usage=usage)
    items = [api.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason) for c in choices]
    return api.Completion(id=self.id, model=self.model, choices=items, usage=usage)


async def collect(choices: list[Choice], deadline: float | None = None, closing: asyncio.Event | None = None) -> None:
  """Runs the choices to their end (:func:`run`), for a whole answer."""
  async with contextlib.aclosing(run(choices, deadline, closing)) as updates:
    async for _ in updates:
      pass


async def events(
  choices: list[Choice], shape: Shape, usage, metrics: Metrics, path: str, ends: Ends = Ends()
) -> AsyncIterator[dict]:
  """The SSE events of a streamed answer (:mod:`~mercury_jax.serve.routes`' docstring).

  Args:
    usage: A callable for the usage event, or None.
    ends: The request's deadline and the server's grace limit: past either the stream ends with the error's body as
      an event, then ``[DONE]``.
  """
  status = DISCONNECTED

  def chunk(choices: list, usage_: api.Usage | None = None) -> dict:
    began = time.perf_counter()
    data = shape.chunk(choices, usage_)
    metrics.answer_seconds.inc(time.perf_counter() - began)
    return {"data": data}

  try:
    if shape.chat:
      for choice in choices:
        yield chunk([shape.delta(choice.index, None, role="assistant")])
    try:
      async with contextlib.aclosing(run(choices, ends.deadline, ends.closing)) as updates:
        async for choice, released, draft in updates:
          if choice.tool_call is not None:
            yield chunk([shape.delta(choice.index, None, call=choice.tool_call)])
            yield chunk([shape.delta(choice.index, None, choice.finish_reason)])
          elif released or choice.finish_reason is not None:
            yield chunk([shape.delta(choice.index, released or None, choice.finish_reason)])
          if draft is not None:
            yield chunk([shape.delta(choice.index, None, draft=draft)])
      if usage is not None:
        yield chunk([], usage())
      status = 200
    except (TimedOut, ShutDown) as stopped:
      error = ends.timeout if isinstance(stopped, TimedOut) else ends.shutdown
      status = error.status
      yield {"data": json.dumps(error.body())}
    except api.APIError as error:
      status = error.status
      yield {"data": json.dumps(error.body())}
    yield {"data": "[DONE]"}
  finally:
    metrics.request(path, status)
