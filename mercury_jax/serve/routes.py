"""The HTTP routes of ``python -m mercury_jax.serve``: an OpenAI-compatible API over a :class:`Scheduler`.

Endpoints: ``POST /v1/completions`` (``prompt``, optionally ``suffix`` to fill in the middle),
``POST /v1/chat/completions`` (``messages``, rendered by the checkpoint's ``data.chat_template``; see
:mod:`mercury_jax.serve.chat`), ``POST /v1/fim/completions`` (``prompt`` and ``suffix``, answered like completions),
``GET /v1/models``, ``GET /health`` (503 while draining) and ``GET /metrics`` (Prometheus text).

Prompts are tokenised here, and every update's tokens are decoded here, never on the engine thread. A chat prompt
starts with BOS, as SFT records do; an empty completion prompt is BOS alone (a document's start).

``max_tokens``: when omitted, 16 for ``/v1/completions`` (OpenAI's default) and ``min(256, room)`` for chat and
FIM, where room is the context minus the prompt (and suffix) tokens; a completion prompt with less room than 16 gets
what room there is. Chat also reads ``max_completion_tokens``. A prompt (plus suffix) and ``max_tokens`` that do not
fit the context together answer 400 naming both lengths.

``n`` choices are ``n`` engine requests with the same seed and random streams 0..n-1. Without ``seed`` the server
draws one. ``stop`` ends a choice at the first occurrence of any stop string (the text before it is the answer,
``finish_reason`` "stop"), wherever the blocks that produced it end; the choice's slot is freed at once.

Streaming (``stream: true``) answers Server-Sent Events, one ``data: {json}`` per event and ``data: [DONE]`` last:

* ``text_completion`` (completions, FIM) or ``chat.completion.chunk`` (chat) objects, each choice carrying the text
  committed since its previous event (``choices[i].text``, chat ``choices[i].delta.content``) to append. A chat
  choice's first event has ``delta: {"role": "assistant"}``; each choice's last event has its ``finish_reason``.
  Text that might be the start of a stop string is held back until the next tokens show whether it is.
* With ``diffusing: true``, also one event per refinement step whose choice carries
  ``"diffusing": {"replace": true, "text": DRAFT}`` (chat: inside ``delta``, without ``content``): DRAFT is the whole
  current draft of that choice (committed text, the step's proposals, ``░`` for undecided positions) and replaces
  the previous draft; it is a preview, not text to append. The appended text is still the answer.
* With ``stream_options: {"include_usage": true}``, a last event with ``choices: []`` and ``usage``.
* Choices of an ``n > 1`` request interleave, told apart by ``index``. An engine error ends the stream with
  ``data: {"error": {...}}`` then ``data: [DONE]``.

Structured output (``response_format``, ``tools``, ``tool_choice``): :mod:`mercury_jax.serve.structured` reads and
checks the request and compiles its constraint (off the event loop, cached); every choice's engine request carries
the same automaton, so ``n``, ``diffusing``, ``suffix`` and FIM work as without one. The answers:

* ``response_format`` ``json_object`` or ``json_schema`` (both endpoints): the answer is compact JSON.
  ``finish_reason`` is "stop" when the text is complete and "length" when ``max_tokens`` ran out first (the text is
  then a valid prefix, not valid JSON).
* A reply that is a tool call (``tool_choice`` ``"required"``, a named function, or ``"auto"`` when the reply starts
  with ``{``) is answered as OpenAI does: ``message: {"role": "assistant", "content": null, "tool_calls": [{"id":
  "call_...", "type": "function", "function": {"name", "arguments": JSON text}}]}`` and ``finish_reason``
  "tool_calls". A call cut short by ``max_tokens`` is answered as its text in ``content`` with ``finish_reason``
  "length" and no ``tool_calls``. ``stop`` strings apply to a text reply only.
* With any ``tool_choice`` the template sees ``tools`` (see :mod:`mercury_jax.serve.chat`), and input messages may
  carry ``tool_calls`` (assistant) and ``tool_call_id`` (``role: "tool"``). A reply makes at most one call, whatever
  ``parallel_tool_calls`` says.
* Streaming: a call is never streamed as ``content``. Once complete it is one chunk whose ``delta`` is
  ``{"tool_calls": [{"index": 0, "id", "type": "function", "function": {"name", "arguments"}}]}`` (the whole
  arguments text), then a chunk with an empty ``delta`` and ``finish_reason`` "tool_calls". A call cut short ends
  with one chunk carrying its text as ``content`` and ``finish_reason`` "length". Drafts (``diffusing``) still come.

A client that goes away (streaming or not) cancels its requests, freeing their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from mercury_jax.sampling import healing
from mercury_jax.sampling.sampler import MASK_TEXT
from mercury_jax.sampling.settings import SettingError
from mercury_jax.serve import protocol as api, structured
from mercury_jax.serve.chat import ChatTemplate, TemplateError
from mercury_jax.serve.metrics import Metrics
from mercury_jax.serve.scheduler import Knobs, QueueFull, Request as EngineRequest, ShuttingDown

COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default).
CHAT_MAX_TOKENS = 256  # Chat and FIM without max_tokens: at most this, and no more than the context leaves.
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/fim/completions")  # Counted in mercury_requests_total.
DISCONNECTED = 499  # The status counted for a request whose client went away (nginx's convention).
# A stream still running at shutdown is ended this many seconds before the server's graceful-shutdown deadline, so it
# closes cleanly instead of being killed with the server's tasks.
STREAM_SHUTDOWN_MARGIN = 1.0


def objective_name(scheduler) -> str:
  """``autoregressive``, ``block_diffusion`` or ``masked_diffusion``: how the served model decodes."""
  if scheduler.autoregressive:
    return "autoregressive"
  return "block_diffusion" if scheduler.cfg.objective.block_size else "masked_diffusion"


class _Choice:
  """One choice of a request: its handle, and its text as the updates come (decoded, cut at a stop string).

  ``calls`` is the request's :attr:`Structure.calls <mercury_jax.serve.structured.Structure.calls>`: a reply that is
  a tool call is held back whole, and becomes :attr:`tool_call` when it finishes complete.
  """

  def __init__(
    self,
    index: int,
    handle,
    tokenizer,
    stops: tuple[str, ...],
    metrics: Metrics,
    calls: str = "none",
    healed: str = "",
  ):
    self.index, self.handle, self.tokenizer, self.stops, self.metrics = index, handle, tokenizer, stops, metrics
    self.healed = healed  # the prompt's characters its first token(s) re-generate (token healing); not released
    self.text = ""  # final so far (released, unless the reply is a call)
    self.tokens = 0
    self.nfe = 0
    self.finish_reason: str | None = None
    # Whether the reply is a call: None until the first character of an "auto" reply says ("{" opens one).
    self.calling: bool | None = {"none": False, "required": True}.get(calls)
    self.tool_call: api.ToolCall | None = None

  def advance(self, update) -> tuple[str, str | None]:
    """Takes an update; returns the text released by it and the choice's new draft (None without one)."""
    if update.finish_reason == "error":
      raise api.APIError(500, f"the engine failed on this request: {update.error}", code="engine_error")
    if update.finish_reason == "cancelled":
      raise api.APIError(503, "the server cancelled this request (it is shutting down)", code="cancelled")
    if len(update.tokens) > self.tokens:
      if not self.tokens:
        self.metrics.first_token(update.time - self.handle.submitted)
      self.metrics.add_tokens(len(update.tokens) - self.tokens, update.time)
    self.tokens, self.nfe = len(update.tokens), update.nfe
    text = healing.strip(self.tokenizer.decode(update.tokens), self.healed)
    if not update.done and text.endswith("\ufffd"):  # A character split between blocks waits for its bytes.
      text = text[:-1]
    if not text.startswith(self.text):  # Earlier text never changes; wait for the decoding to agree again.
      text = self.text
    if self.calling is None and text:
      self.calling = text.startswith("{")
      if self.calling:  # Stop strings apply to text replies only: a cut call would be invalid.
        self.stops = ()
    cut = api.find_stop(text, self.stops, start=len(self.text))
    if cut is not None:
      text, self.finish_reason = text[:cut], "stop"
      self.handle.cancel()
    elif update.done:
      self.finish_reason = update.finish_reason
    else:
      text = text[: len(text) - api.held_back(text, self.stops)]
    released, self.text = text[len(self.text) :], text
    if self.calling:
      released = ""  # A call is answered whole once it finishes.
    if self.finish_reason is not None:
      self.metrics.choice_done(self.tokens, self.nfe)
      if self.calling:
        self.tool_call = structured.parse_tool_call(text) if self.finish_reason == "stop" else None
        if self.tool_call is not None:
          self.finish_reason = "tool_calls"
        else:  # Cut short by max_tokens (or not a call after all): the text, as content.
          released = text
      return released, None
    draft = None
    if update.draft is not None:
      draft = self.tokenizer.decode(update.draft, mask_text=MASK_TEXT)
      draft = draft[: api.find_stop(draft, self.stops)]
    return released, draft

  def message(self) -> api.ChatMessageOut:
    """The finished choice as a chat message: its call, or its text."""
    if self.tool_call is not None:
      return api.ChatMessageOut(content=None, tool_calls=[self.tool_call])
    return api.ChatMessageOut(content=self.text)


async def _run(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, str, str | None]]:
  """``(choice, released text, draft)`` as the choices' updates arrive, until every choice has finished.

  However it ends (finished, failed, or closed because the client left), the choices still running are cancelled.
  """
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(choice: _Choice):
    try:
      async for update in choice.handle.updates():
        queue.put_nowait((choice, update))
    except Exception as error:  # Handed to the consumer, which answers 500.
      queue.put_nowait((choice, error))

  tasks = [asyncio.create_task(pump(choice)) for choice in choices]
  try:
    while any(choice.finish_reason is None for choice in choices):
      choice, update = await queue.get()
      if isinstance(update, Exception):
        raise api.APIError(500, f"the engine failed on this request: {update}", code="engine_error")
      if choice.finish_reason is None:
        released, draft = choice.advance(update)
        yield choice, released, draft
  finally:
    for choice in choices:
      if choice.finish_reason is None:
        choice.handle.cancel()
    for task in tasks:
      task.cancel()


async def _disconnected(request: Request) -> None:
  """Returns once the client has gone away (the body is read, so the next message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def _max_tokens(given: int | None, default: int, prompt: int, suffix: int, context: int, field: str) -> int:
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
      f"{lengths} and {field}={given}, together {prompt + suffix + given}, but the model's context is {context} "
      f"tokens{hint}"
    )
  raise api.APIError(400, message, param="prompt" if room < 1 else field, code="context_length_exceeded")


def _knobs(body: api.GenerationRequest, scheduler) -> Knobs:
  """The engine knobs of a request: reasoning_effort first, explicit steps and threshold over it."""
  if scheduler.autoregressive:
    for field in api.DIFFUSION_FIELDS:
      value = getattr(body, field)
      if value is not None and value is not False:
        raise api.APIError(
          400,
          f"{field}={value!r} applies to diffusion models only; this model is autoregressive (it decodes one "
          "token per forward pass)",
          param=field,
        )
  if body.block_length is not None and body.block_length != scheduler.block:
    why = "the block it was trained with" if scheduler.block_length_fixed else "set by --block-length at start"
    raise api.APIError(
      400,
      f"block_length={body.block_length} differs from the served model's block length {scheduler.block} ({why}); "
      f"omit it or send {scheduler.block}",
      param="block_length",
    )
  steps, threshold = api.effort_knobs(body.reasoning_effort, scheduler.block) if body.reasoning_effort else (None, None)
  given = {
    "temperature": body.temperature,
    "top_p": body.top_p,
    "top_k": body.top_k,
    "steps": body.steps if body.steps is not None else steps,
    "threshold": body.threshold if body.threshold is not None else threshold,
  }
  return Knobs(**{name: value for name, value in given.items() if value is not None})


def create_app(scheduler, *, model_name: str, grace: float = 30.0, token_healing: bool = True) -> FastAPI:
  """The FastAPI app serving ``scheduler``'s model.

  Args:
    scheduler: A started :class:`~mercury_jax.serve.scheduler.Scheduler` (or an object with its interface).
    model_name: The name ``/v1/models`` lists and every response carries.
    grace: The server's graceful-shutdown timeout: a stream may go on for about this long after shutdown begins.
    token_healing: Re-generate the last token of a plain-text completion's prompt, constrained to start with its
      characters (:mod:`~mercury_jax.sampling.healing`): not for FIM, structured output, or a model with a chat
      template (SFT: its prompts end at a boundary it learned); needs a constraint capacity.

  Raises:
    TemplateError: The checkpoint's ``data.chat_template`` does not compile.

  ``app.state.draining = True`` (set by the command line on SIGTERM) turns ``/health`` to 503 and refuses new work.
  """
  app = FastAPI(title="mercury_jax", docs_url=None, redoc_url=None)
  app.state.draining = False
  tokenizer, context = scheduler.tokenizer, scheduler.max_length
  source = scheduler.cfg.data.chat_template
  template = ChatTemplate(source) if source else None
  metrics = app.state.metrics = Metrics(scheduler)

  def answer(error: api.APIError, path: str) -> JSONResponse:
    if path in PATHS:
      metrics.request(path, error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

  @app.exception_handler(api.APIError)
  async def api_error(request: Request, error: api.APIError):
    return answer(error, request.url.path)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, error: RequestValidationError):
    return answer(api.validation_error(error), request.url.path)

  @app.exception_handler(Exception)
  async def failed(request: Request, error: Exception):
    return answer(api.APIError(500, f"internal error: {type(error).__name__}: {error}"), request.url.path)

  async def generate(
    request: Request,
    body,
    *,
    chat: bool,
    prompt: list[int],
    suffix: list[int],
    max_tokens: int,
    shape: structured.Structure,
    tools: list[dict],
    healed: str = "",
  ):
    """Submits the request's choices and answers: one JSON body, or the event stream. ``healed``: characters backed
    off the prompt (token healing), which the reply writes first and does not show."""
    if app.state.draining:
      raise api.APIError(503, "the server is shutting down; send the request elsewhere", code="draining")
    knobs = _knobs(body, scheduler)
    constraint = await structured.constraint(shape, tools, scheduler.compiler)
    if healed:
      constraint = scheduler.compiler.heal(healed)
    seed = body.seed if body.seed is not None else secrets.randbelow(api.MAX_SEED + 1)
    diffusing = bool(body.diffusing and body.stream)
    requests = [
      EngineRequest(tuple(prompt), max_tokens, tuple(suffix), knobs, seed, i, diffusing, constraint=constraint)
      for i in range(body.n or 1)
    ]
    try:
      scheduler.check(requests[0])
    except SettingError as e:
      raise api.APIError(400, str(e), param=e.field) from None
    except ValueError as e:  # From the HTTP layer, only a constraint the slots cannot hold gets here.
      raise api.APIError(400, str(e), param=shape.field) from None
    choices, loop = [], asyncio.get_running_loop()
    try:
      for i, engine_request in enumerate(requests):
        handle = scheduler.submit(engine_request, loop)
        choices.append(_Choice(i, handle, tokenizer, body.stops, metrics, shape.calls, healed))
    except QueueFull as e:
      for choice in choices:
        choice.handle.cancel()
      retry = str(max(1, math.ceil(e.retry_after)))
      raise api.APIError(429, str(e), code="queue_full", headers={"Retry-After": retry}) from None
    except ShuttingDown as e:
      for choice in choices:
        choice.handle.cancel()
      raise api.APIError(503, str(e), code="draining") from None
    shape = _Shape(api.new_id("chatcmpl" if chat else "cmpl"), model_name, chat)

    backed = 1 if healed else 0  # token healing's backed-off token: the client sent it, as part of the prompt

    def usage() -> api.Usage:
      completion = sum(max(c.tokens - backed, 0) for c in choices)
      return api.Usage.of(len(prompt) + backed + len(suffix), completion, sum(c.nfe for c in choices))

    path = request.url.path
    if body.stream:
      events = _events(choices, shape, usage if body.include_usage else None, metrics, path)
      margin = max(grace - STREAM_SHUTDOWN_MARGIN, 0.0)
      return EventSourceResponse(events, sep="\n", shutdown_grace_period=margin)
    collect = asyncio.ensure_future(_collect(choices))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not collect.done():
      collect.cancel()
      metrics.request(path, DISCONNECTED)
      return Response(status_code=DISCONNECTED)
    collect.result()
    metrics.request(path, 200)
    return JSONResponse(shape.whole(choices, usage()).model_dump(mode="json"))

  async def complete(request: Request, body: api.CompletionRequest, default_max_tokens: int):
    api.check_supported(body)
    shape = structured.structure(body)
    prompt = tokenizer.encode(body.text) or [tokenizer.bos_id]
    suffix = tokenizer.encode(body.suffix) if body.suffix else []
    max_tokens = _max_tokens(body.max_tokens, default_max_tokens, len(prompt), len(suffix), context, "max_tokens")
    healed = ""
    heals = token_healing and (scheduler.autoregressive or scheduler.cfg.objective.block_size > 0)
    if heals and template is None and not suffix and shape.field is None and scheduler.compiler is not None:
      kept, healed = healing.back_off(tokenizer, body.text, prompt)
      max_tokens += len(prompt) - len(kept)  # the same positions, one more of them generated
      prompt = kept
    return await generate(
      request,
      body,
      chat=False,
      prompt=prompt,
      suffix=suffix,
      max_tokens=max_tokens,
      shape=shape,
      tools=[],
      healed=healed,
    )

  @app.post("/v1/completions")
  async def completions(body: api.CompletionRequest, request: Request):
    return await complete(request, body, COMPLETIONS_MAX_TOKENS)

  @app.post("/v1/fim/completions")
  async def fim(body: api.CompletionRequest, request: Request):
    return await complete(request, body, CHAT_MAX_TOKENS)

  @app.post("/v1/chat/completions")
  async def chat(body: api.ChatRequest, request: Request):
    api.check_supported(body)
    shape = structured.structure(body)
    if template is None:
      message = "this model has no chat template (data.chat_template in its config); use /v1/completions"
      raise api.APIError(400, message, param="messages", code="no_chat_template")
    tools = body.tool_dicts()
    try:
      text = template.render([m.as_dict() for m in body.messages], tools=tools)
    except TemplateError as e:
      raise api.APIError(400, str(e), param="messages") from None
    prompt = [tokenizer.bos_id, *tokenizer.encode(text)]
    field, given = "max_tokens", body.max_tokens
    if body.max_completion_tokens is not None:
      if given is not None and given != body.max_completion_tokens:
        message = f"max_tokens={given} and max_completion_tokens={body.max_completion_tokens} disagree; send one"
        raise api.APIError(400, message, param="max_completion_tokens")
      field, given = "max_completion_tokens", body.max_completion_tokens
    max_tokens = _max_tokens(given, CHAT_MAX_TOKENS, len(prompt), 0, context, field)
    return await generate(
      request, body, chat=True, prompt=prompt, suffix=[], max_tokens=max_tokens, shape=shape, tools=tools
    )

  @app.get("/v1/models")
  async def models():
    card = {
      "id": model_name,
      "object": "model",
      "created": 0,
      "owned_by": "mercury_jax",
      "context_length": context,
      "block_length": scheduler.block,
      "objective": objective_name(scheduler),
    }
    return {"object": "list", "data": [card]}

  @app.get("/health")
  async def health():
    if app.state.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)

  return app


class _Shape:
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

  def whole(self, choices: list[_Choice], usage: api.Usage):
    if self.chat:
      items = [api.ChatChoice(index=c.index, message=c.message(), finish_reason=c.finish_reason) for c in choices]
      return api.ChatCompletion(id=self.id, model=self.model, choices=items, usage=usage)
    items = [api.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason) for c in choices]
    return api.Completion(id=self.id, model=self.model, choices=items, usage=usage)


async def _collect(choices: list[_Choice]) -> None:
  async with contextlib.aclosing(_run(choices)) as updates:
    async for _ in updates:
      pass


async def _events(choices: list[_Choice], shape: _Shape, usage, metrics: Metrics, path: str) -> AsyncIterator[dict]:
  """The SSE events of a streamed answer (module docstring); ``usage``: a callable for the usage event, or None."""
  status = DISCONNECTED
  try:
    if shape.chat:
      for choice in choices:
        yield {"data": shape.chunk([shape.delta(choice.index, None, role="assistant")])}
    try:
      async with contextlib.aclosing(_run(choices)) as updates:
        async for choice, released, draft in updates:
          if choice.tool_call is not None:
            yield {"data": shape.chunk([shape.delta(choice.index, None, call=choice.tool_call)])}
            yield {"data": shape.chunk([shape.delta(choice.index, None, choice.finish_reason)])}
          elif released or choice.finish_reason is not None:
            yield {"data": shape.chunk([shape.delta(choice.index, released or None, choice.finish_reason)])}
          if draft is not None:
            yield {"data": shape.chunk([shape.delta(choice.index, None, draft=draft)])}
      if usage is not None:
        yield {"data": shape.chunk([], usage())}
      status = 200
    except api.APIError as error:
      status = error.status
      yield {"data": json.dumps(error.body())}
    yield {"data": "[DONE]"}
  finally:
    metrics.request(path, status)
