"""The HTTP routes of ``python -m mercury_jax.serve``: an OpenAI-compatible API over a :class:`Scheduler`.

Endpoints: ``POST /v1/completions`` (``prompt``, optionally ``suffix`` to fill in the middle),
``POST /v1/chat/completions`` (``messages``, rendered by the checkpoint's ``data.chat_template``; see
:mod:`mercury_jax.serve.chat`), ``POST /v1/fim/completions`` (``prompt`` and ``suffix``, answered like completions),
``GET /v1/models``, ``GET /health`` (503 while draining or when the engine has failed for good) and ``GET /metrics``
(Prometheus text).

Every request passes :class:`~mercury_jax.serve.guard.Guard` first: with an API key (``--api-key``), ``/v1/...`` needs
``Authorization: Bearer KEY`` (401 otherwise); a body above ``--max-body-bytes`` answers 413. Every field is bounded
(:mod:`mercury_jax.serve.protocol`; 400 naming the field). A request that has not finished ``--request-timeout``
seconds after it arrived ends with 504 (a stream: an error event, then ``[DONE]``), and its slots are freed. A
failure inside the server answers 500 with a fixed message and a request id; the details go to the server's log only.

Prompts are tokenised here (long ones off the event loop), and every update's tokens are decoded here,
incrementally (:mod:`mercury_jax.serve.answers`), never on the engine thread. A chat prompt starts with BOS, as SFT
records do; an empty completion prompt is BOS alone (a document's start).

``max_tokens``: when omitted, 16 for ``/v1/completions`` (OpenAI's default) and ``min(256, room)`` for chat and
FIM, where room is the context minus the prompt (and suffix) tokens; a completion prompt with less room than 16 gets
what room there is. Chat also reads ``max_completion_tokens``. A prompt (plus suffix) and ``max_tokens`` that do not
fit the context together answer 400 naming both lengths.

Step budgets (:mod:`mercury_jax.serve.protocol`): ``steps`` is the total refinement budget for the ``max_tokens``
generated positions, as on the command line and in ``Sampler.generate``; the server converts it into steps per block
with :func:`~mercury_jax.sampling.settings.steps_per_block`, never spending more than ``steps`` (a budget below the
blocks the hole spans answers 400 naming ``steps``; one above a step per token is spent as a step per token).
``steps_per_block`` gives the steps per block directly. Without either (or ``reasoning_effort``), every block takes
one step per token under the threshold rule (tau 0.9, ``threshold``), the command line's default too.

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
checks the request and compiles its constraint in the compile pool (:mod:`mercury_jax.serve.compiling`: worker
processes with a time and a memory limit per job, cached; a refusal, a timeout or a limit answers 400, code
``invalid_schema``, and a client that leaves stops the job); every choice's engine request carries
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

A client that goes away (streaming or not, also while its prompt is tokenised or its constraint compiled) cancels
its requests, freeing their slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from mercury_jax.sampling import healing
from mercury_jax.sampling.settings import Budget, SettingError, hole_loads, steps_per_block
from mercury_jax.serve import answers, protocol as api, structured
from mercury_jax.serve.chat import TemplateError, chat_template_of, prompt_ids
from mercury_jax.serve.guard import Guard
from mercury_jax.serve.metrics import Metrics
from mercury_jax.serve.scheduler import EngineDown, Knobs, QueueFull, Request as EngineRequest, ShuttingDown

logger = logging.getLogger("mercury_jax.serve")
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default).
CHAT_MAX_TOKENS = 256  # Chat and FIM without max_tokens: at most this, and no more than the context leaves.
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/fim/completions")  # Counted in mercury_requests_total.
DISCONNECTED = answers.DISCONNECTED
# A stream still running at shutdown is ended this many seconds before the server's graceful-shutdown deadline, so it
# closes cleanly instead of being killed with the server's tasks.
STREAM_SHUTDOWN_MARGIN = 1.0
INLINE_CHARS = 4096  # Texts up to this long are tokenised on the event loop; longer ones on a thread.


@dataclasses.dataclass(frozen=True)
class Options:
  """How the server answers (the command line's flags).

  Attributes:
    model_name: The name ``/v1/models`` lists and every response carries.
    grace: The server's graceful-shutdown timeout: a stream may go on for about this long after shutdown begins.
    token_healing: Re-generate the last token of a plain-text completion's prompt, restricted to the tokens whose
      text starts with its characters (:mod:`~mercury_jax.sampling.healing`): not for FIM, structured output, or a
      model with a chat template (SFT: its prompts end at a boundary it learned).
    api_key: The key ``/v1/...`` requests must send (``Authorization: Bearer KEY``); None: none.
    max_body_bytes: The largest request body (larger: 413).
    request_timeout: Seconds a request may take from arrival to its last token (then 504; its slots are freed).
  """

  model_name: str
  grace: float = 30.0
  token_healing: bool = True
  api_key: str | None = None
  max_body_bytes: int = 4 << 20
  request_timeout: float = 600.0


@dataclasses.dataclass(frozen=True)
class _Text:
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


def objective_name(scheduler) -> str:
  """``verified``, ``autoregressive``, ``block_diffusion`` or ``masked_diffusion``: how the served model decodes."""
  if scheduler.draft:
    return "verified"
  if scheduler.autoregressive:
    return "autoregressive"
  return "block_diffusion" if scheduler.cfg.objective.block_size else "masked_diffusion"


async def _disconnected(request: Request) -> None:
  """Returns once the client has gone away (the body is read, so the next message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _unless_gone(request: Request, awaitable, deadline: float, timeout: api.APIError):
  """``await awaitable``, cancelled when the client goes away (:class:`ClientGone`) or ``deadline`` passes (the
  ``timeout`` error)."""
  work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(_disconnected(request))
  try:
    remaining = deadline - asyncio.get_running_loop().time()
    await asyncio.wait((work, gone), timeout=max(remaining, 0.0), return_when=asyncio.FIRST_COMPLETED)
  except BaseException:
    work.cancel()
    raise
  finally:
    left = gone.done()
    gone.cancel()
  if not work.done():
    work.cancel()
    raise ClientGone() if left else timeout
  return work.result()


def _encode(tokenizer, text: str, field: str) -> list[int]:
  """Token ids of a request's text; 400 naming ``field`` for text that is not valid Unicode."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    message = f"{field} holds {text[e.start : e.end]!r}, which is not valid Unicode text (a lone surrogate)"
    raise api.APIError(400, message, param=field) from None
  return tokenizer.encode(text)


async def _off_loop(fn, *args, size: int):
  """``fn(*args)``, on a thread when ``size`` (characters) is large, so the event loop never waits long."""
  return await asyncio.to_thread(fn, *args) if size > INLINE_CHARS else fn(*args)


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
      f"{lengths} and {field}={api.shown(given)}, together {prompt + suffix + given}, but the model's context is "
      f"{context} tokens{hint}"
    )
  raise api.APIError(400, message, param="prompt" if room < 1 else field, code="context_length_exceeded")


def _knobs(body: api.GenerationRequest, scheduler, first: int, generated: int) -> tuple[Knobs, Budget | None]:
  """``(knobs, steps per block)`` of a request whose hole of ``generated`` positions starts at canvas position
  ``first``: reasoning_effort first, explicit steps (or steps_per_block) and threshold over it; the engine's defaults
  for what is not given (steps per block None)."""
  if scheduler.autoregressive:
    for field in api.DIFFUSION_FIELDS:
      value = getattr(body, field)
      if value is not None and value is not False:
        raise api.APIError(
          400,
          f"{field}={api.shown(value)} applies to diffusion models only; this model is autoregressive (it decodes "
          "one token per forward pass)",
          param=field,
        )
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


def _document(app: FastAPI, limits: api.Limits):
  """``app.openapi`` with the bounds the model sets (:class:`~mercury_jax.serve.protocol.Limits`) written into the
  request schemas, so the document says what the server accepts."""
  maxima = {"max_tokens": limits.context, "max_completion_tokens": limits.context, "steps": limits.context}
  maxima |= {"steps_per_block": limits.block, "top_k": limits.vocab}
  build = app.openapi

  def openapi():
    if app.openapi_schema is None:
      schema = build()
      for model in schema.get("components", {}).get("schemas", {}).values():
        for name, field in model.get("properties", {}).items():
          for option in field.get("anyOf", [field]):
            if name in maxima and option.get("type") == "integer":
              option["maximum"] = maxima[name]
      app.openapi_schema = schema
    return app.openapi_schema

  return openapi


def create_app(scheduler, compiler, options: Options) -> FastAPI:
  """The FastAPI app serving ``scheduler``'s model, behind :class:`~mercury_jax.serve.guard.Guard`.

  Args:
    scheduler: A started :class:`~mercury_jax.serve.scheduler.Scheduler` (or an object with its interface).
    compiler: What compiles structured output and token healing's constraints: a started
      :class:`~mercury_jax.serve.compiling.CompilePool` (or an object with its coroutines); None: off.
    options: The server's flags.

  Raises:
    TemplateError: The checkpoint's ``data.chat_template`` does not compile.

  ``app.state.draining = True`` (set by the command line on SIGTERM) turns ``/health`` to 503 and refuses new work.
  """
  app = FastAPI(title="mercury_jax", docs_url=None, redoc_url=None)
  app.state.draining = False
  tokenizer, context = scheduler.tokenizer, scheduler.max_length
  limits = api.Limits(context=context, vocab=scheduler.vocab_size, block=scheduler.block)
  template = chat_template_of(scheduler.cfg.data.chat_template, tokenizer)
  metrics = app.state.metrics = Metrics(scheduler)
  timeout = api.APIError(
    504,
    f"the request did not finish within the server's request timeout ({options.request_timeout:g} s); its work was "
    "stopped",
    code="timeout",
  )

  def count(path: str, status: int) -> None:
    if path in PATHS:
      metrics.request(path, status)

  def answer(error: api.APIError, path: str) -> JSONResponse:
    count(path, error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

  app.add_middleware(Guard, api_key=options.api_key, max_body_bytes=options.max_body_bytes, refused=count)
  app.openapi = _document(app, limits)

  @app.exception_handler(api.APIError)
  async def api_error(request: Request, error: api.APIError):
    return answer(error, request.url.path)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, error: RequestValidationError):
    return answer(api.validation_error(error), request.url.path)

  @app.exception_handler(HTTPException)
  async def http_error(request: Request, error: HTTPException):
    message = error.detail if isinstance(error.detail, str) else "the request cannot be answered"
    return answer(api.APIError(error.status_code, message, headers=error.headers), request.url.path)

  @app.exception_handler(Exception)
  async def failed(request: Request, error: Exception):
    request_id = api.new_id("req")
    logger.error("request %s (%s) failed", request_id, request.url.path, exc_info=error)
    return answer(api.APIError.internal(request_id), request.url.path)

  async def generate(
    request: Request, body, text: _Text, *, chat: bool, shape: structured.Structure, tools: list[dict], deadline: float
  ):
    """Submits the request's choices and answers: one JSON body, or the event stream."""
    if app.state.draining:
      raise api.APIError(503, "the server is shutting down; send the request elsewhere", code="draining")
    prompt, suffix, max_tokens, healed = text.prompt, text.suffix, text.max_tokens, text.healed
    knobs, per_block = _knobs(body, scheduler, len(prompt), max_tokens)
    constraint = None
    if shape.field is not None:
      constraint = await _unless_gone(request, structured.constraint(shape, tools, compiler), deadline, timeout)
    if healed and not await _unless_gone(request, healable(tokenizer, healed), deadline, timeout):
      prompt, max_tokens, healed = text.tokenised, max_tokens - 1, ""  # Not healable: the prompt as tokenised.
      knobs, per_block = _knobs(body, scheduler, len(prompt), max_tokens)
    seed = body.seed if body.seed is not None else secrets.randbelow(api.MAX_SEED + 1)
    diffusing = bool(body.diffusing and body.stream)
    requests = [
      EngineRequest(
        tuple(prompt),
        max_tokens,
        tuple(suffix),
        knobs,
        None if per_block is None else per_block.per_block,
        seed,
        i,
        diffusing,
        constraint,
        healed,
        0 if per_block is None else per_block.extra,
      )
      for i in range(body.n or 1)
    ]
    try:
      scheduler.check(requests[0])
    except SettingError as e:
      raise api.APIError(400, str(e), param=e.field) from None
    except ValueError as e:  # From the HTTP layer, only a constraint the slots cannot hold gets here.
      raise api.APIError(400, str(e), param=shape.field) from None
    answer_id = api.new_id("chatcmpl" if chat else "cmpl")
    choices, loop = [], asyncio.get_running_loop()
    try:
      for i, engine_request in enumerate(requests):
        handle = scheduler.submit(engine_request, loop)
        choice = answers.Choice(
          i, handle, tokenizer, body.stops, metrics, calls=shape.calls, healed=healed, request_id=answer_id
        )
        choices.append(choice)
    except (QueueFull, ShuttingDown, EngineDown) as e:
      for choice in choices:
        choice.handle.cancel()
      if isinstance(e, QueueFull):
        retry = str(max(1, math.ceil(e.retry_after)))
        raise api.APIError(429, str(e), code="queue_full", headers={"Retry-After": retry}) from None
      code = "draining" if isinstance(e, ShuttingDown) else "engine_failed"
      raise api.APIError(503, str(e), code=code) from None
    form = answers.Shape(answer_id, options.model_name, chat)
    backed = 1 if healed else 0  # token healing's backed-off token: the client sent it, as part of the prompt

    def usage() -> api.Usage:
      completion = sum(max(c.tokens - backed, 0) for c in choices)
      return api.Usage.of(len(prompt) + backed + len(suffix), completion, sum(c.nfe for c in choices))

    path = request.url.path
    warned = structured.warning_headers(constraint)
    if body.stream:
      stream = answers.events(choices, form, usage if body.include_usage else None, metrics, path, deadline, timeout)
      margin = max(options.grace - STREAM_SHUTDOWN_MARGIN, 0.0)
      return EventSourceResponse(stream, sep="\n", shutdown_grace_period=margin, headers=warned)
    collect = asyncio.ensure_future(answers.collect(choices, deadline))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not collect.done():
      collect.cancel()
      metrics.request(path, DISCONNECTED)
      return Response(status_code=DISCONNECTED)
    try:
      collect.result()
    except answers.TimedOut:
      raise timeout from None
    metrics.request(path, 200)
    return JSONResponse(form.whole(choices, usage()).model_dump(mode="json"), headers=warned)

  def tokenise_completion(body: api.CompletionRequest, shape: structured.Structure, default_max_tokens: int) -> _Text:
    """A completion's :class:`_Text` (token healing is decided here)."""
    prompt = _encode(tokenizer, body.text, "prompt") or [tokenizer.bos_id]
    suffix = _encode(tokenizer, body.suffix, "suffix") if body.suffix else []
    max_tokens = _max_tokens(body.max_tokens, default_max_tokens, len(prompt), len(suffix), context, "max_tokens")
    heals = options.token_healing and (scheduler.autoregressive or scheduler.cfg.objective.block_size > 0)
    if heals and template is None and not suffix and shape.field is None:
      kept, healed = healing.back_off(tokenizer, body.text, prompt)
      if healed:  # The same positions, one more of them generated.
        return _Text(kept, suffix, max_tokens + len(prompt) - len(kept), healed, prompt)
    return _Text(prompt, suffix, max_tokens)

  async def complete(request: Request, body: api.CompletionRequest, default_max_tokens: int):
    deadline = asyncio.get_running_loop().time() + options.request_timeout
    api.check_supported(body)
    api.check_limits(body, limits)
    shape = structured.structure(body)
    size = len(body.text) + len(body.suffix or "")
    try:
      work = _off_loop(tokenise_completion, body, shape, default_max_tokens, size=size)
      text = await _unless_gone(request, work, deadline, timeout)
      return await generate(request, body, text, chat=False, shape=shape, tools=[], deadline=deadline)
    except ClientGone:
      count(request.url.path, DISCONNECTED)
      return Response(status_code=DISCONNECTED)

  @app.post("/v1/completions")
  async def completions(body: api.CompletionRequest, request: Request):
    return await complete(request, body, COMPLETIONS_MAX_TOKENS)

  @app.post("/v1/fim/completions")
  async def fim(body: api.CompletionRequest, request: Request):
    return await complete(request, body, CHAT_MAX_TOKENS)

  def tokenise_chat(body: api.ChatRequest, tools: list[dict]) -> _Text:
    """A chat request's :class:`_Text`: the rendered template's ids, BOS in front once (:func:`chat.prompt_ids`)."""
    try:
      rendered = template.render([m.as_dict() for m in body.messages], tools=tools)
    except TemplateError as e:
      raise api.APIError(400, str(e), param="messages") from None
    prompt = prompt_ids(tokenizer, _encode(tokenizer, rendered, "messages"))
    field, given = "max_tokens", body.max_tokens
    if body.max_completion_tokens is not None:
      if given is not None and given != body.max_completion_tokens:
        message = (
          f"max_tokens={api.shown(given)} and max_completion_tokens={api.shown(body.max_completion_tokens)} "
          "disagree; send one"
        )
        raise api.APIError(400, message, param="max_completion_tokens")
      field, given = "max_completion_tokens", body.max_completion_tokens
    return _Text(prompt, [], _max_tokens(given, CHAT_MAX_TOKENS, len(prompt), 0, context, field))

  @app.post("/v1/chat/completions")
  async def chat(body: api.ChatRequest, request: Request):
    deadline = asyncio.get_running_loop().time() + options.request_timeout
    api.check_supported(body)
    api.check_limits(body, limits)
    shape = structured.structure(body)
    if template is None:
      message = "this model has no chat template (data.chat_template in its config); use /v1/completions"
      raise api.APIError(400, message, param="messages", code="no_chat_template")
    tools = body.tool_dicts()
    size = sum(len(m.as_dict()["content"]) for m in body.messages)
    try:
      text = await _unless_gone(request, _off_loop(tokenise_chat, body, tools, size=size), deadline, timeout)
      return await generate(request, body, text, chat=True, shape=shape, tools=tools, deadline=deadline)
    except ClientGone:
      count(request.url.path, DISCONNECTED)
      return Response(status_code=DISCONNECTED)

  @app.get("/v1/models")
  async def models():
    card = {
      "id": options.model_name,
      "object": "model",
      "created": 0,
      "owned_by": "mercury_jax",
      "context_length": context,
      "block_length": scheduler.block,
      "objective": objective_name(scheduler),
      "decode": scheduler.decode,
      "draft_length": scheduler.draft,
    }
    return {"object": "list", "data": [card]}

  @app.get("/health")
  async def health():
    if app.state.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    if not scheduler.healthy:
      return JSONResponse({"status": "engine_failed"}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)

  return app
