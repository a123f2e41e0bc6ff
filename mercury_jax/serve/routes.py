"""The HTTP routes of ``python -m mercury_jax.serve``: an OpenAI-compatible API over a :class:`Scheduler`.

Endpoints: ``POST /v1/completions`` (``prompt``, optionally ``suffix`` to fill in the middle),
``POST /v1/chat/completions`` (``messages``, rendered by the checkpoint's ``data.chat_template``; see
:mod:`mercury_jax.data.chat_template`), ``POST /v1/fim/completions`` (``prompt`` and ``suffix``, answered like
completions), ``GET /v1/models``, ``GET /health`` (503 while draining or when the engine has failed for good) and
``GET /metrics`` (Prometheus text).

Every request passes :class:`~mercury_jax.serve.guard.Guard` first: with an API key (``--api-key``), ``/v1/...`` and
``/openapi.json`` need ``Authorization: Bearer KEY`` (401 otherwise); a body above ``--max-body-bytes`` answers 413,
one slower than ``--body-timeout`` 408. Every field is bounded and strictly typed (:mod:`mercury_jax.serve.protocol`;
400 naming the field). On SIGTERM the server drains (:mod:`mercury_jax.serve.draining`): new requests answer 503, and
those still running at the ``--grace`` limit end with 503 (a stream: an error event, then ``[DONE]``). A request
that has not finished ``--request-timeout`` seconds after it arrived ends with 504 (a stream: an error event, then
``[DONE]``), and its slots are freed. A failure inside the server answers 500 with a fixed message and a request id;
the details go to the server's log only.

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
* With any ``tool_choice`` the template sees ``tools`` (see :mod:`mercury_jax.data.chat_template`), and input
  messages may carry ``tool_calls`` (assistant) and ``tool_call_id`` (``role: "tool"``). A reply makes at most one
  call, whatever ``parallel_tool_calls`` says.
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
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from mercury_jax.data.chat_template import ChatTemplate, chat_template_of
from mercury_jax.sampling.settings import SettingError
from mercury_jax.serve import answers, protocol as api, requests as ready, structured
from mercury_jax.serve.draining import Drain, InFlight
from mercury_jax.serve.guard import Guard
from mercury_jax.serve.metrics import Metrics
from mercury_jax.serve.scheduler import EngineDown, QueueFull, ShuttingDown

logger = logging.getLogger("mercury_jax.serve")
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default).
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/fim/completions")  # Counted in mercury_requests_total.
DISCONNECTED = answers.DISCONNECTED
router = APIRouter()


@dataclasses.dataclass(frozen=True)
class Options:
  """How the server answers (the command line's flags).

  Attributes:
    model_name: The name ``/v1/models`` lists and every response carries.
    grace: Seconds the requests in flight get to finish after SIGTERM; then they end with 503
      (:mod:`~mercury_jax.serve.draining`).
    token_healing: Re-generate the last token of a plain-text completion's prompt, restricted to the tokens whose
      text starts with its characters (:mod:`~mercury_jax.sampling.healing`): not for FIM, structured output, or a
      model with a chat template (SFT: its prompts end at a boundary it learned).
    api_key: The key ``/v1/...`` requests must send (``Authorization: Bearer KEY``); None: none.
    max_body_bytes: The largest request body (larger: 413).
    body_timeout: Seconds a request's body may take to arrive (slower: 408).
    request_timeout: Seconds a request may take from arrival to its last token (then 504; its slots are freed).
  """

  model_name: str
  grace: float = 30.0
  token_healing: bool = True
  api_key: str | None = None
  max_body_bytes: int = 4 << 20
  body_timeout: float = 10.0
  request_timeout: float = 600.0


@dataclasses.dataclass
class Served:
  """What the handlers of one app share (``app.state.served``): the model's scheduler, the compile pool, the flags,
  and what the app built from them once."""

  scheduler: object
  compiler: object
  options: Options
  template: ChatTemplate | None
  metrics: Metrics
  drain: Drain

  def __post_init__(self):
    scheduler = self.scheduler
    self.tokenizer, self.context = scheduler.tokenizer, scheduler.max_length
    self.limits = api.Limits(context=self.context, vocab=scheduler.vocab_size, block=scheduler.block)
    self.timeout = api.APIError(
      504,
      f"the request did not finish within the server's request timeout ({self.options.request_timeout:g} s); its "
      "work was stopped",
      code="timeout",
    )

  def count(self, path: str, status: int) -> None:
    if path in PATHS:
      self.metrics.request(path, status)

  def answer(self, error: api.APIError, path: str) -> JSONResponse:
    self.count(path, error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

  def deadline(self) -> float:
    return asyncio.get_running_loop().time() + self.options.request_timeout


def _served(request: Request) -> Served:
  return request.app.state.served


def objective_name(scheduler) -> str:
  """``verified``, ``autoregressive``, ``block_diffusion`` or ``masked_diffusion``: how the served model decodes."""
  if scheduler.draft:
    return "verified"
  if scheduler.autoregressive:
    return "autoregressive"
  return "block_diffusion" if scheduler.cfg.objective.block_size else "masked_diffusion"


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

  ``app.state.drain`` (:class:`~mercury_jax.serve.draining.Drain`) is the server's shutdown: the command line calls
  its ``signal`` on SIGTERM, which turns ``/health`` to 503, refuses new work and ends what runs at the grace limit.
  """
  app = FastAPI(title="mercury_jax", docs_url=None, redoc_url=None)
  drain = app.state.drain = Drain(options.grace)
  metrics = app.state.metrics = Metrics(scheduler)
  template = chat_template_of(scheduler.cfg.data.chat_template, scheduler.tokenizer)
  served = app.state.served = Served(scheduler, compiler, options, template, metrics, drain)
  guard = {"api_key": options.api_key, "max_body_bytes": options.max_body_bytes, "body_timeout": options.body_timeout}
  app.add_middleware(Guard, **guard, refused=served.count)
  app.add_middleware(InFlight, drain=drain, refused=served.count)  # outermost: a draining server refuses first
  app.openapi = _document(app, served.limits)
  for error, handler in HANDLERS.items():
    app.add_exception_handler(error, handler)
  app.include_router(router)
  return app


async def _api_error(request: Request, error: api.APIError):
  return _served(request).answer(error, request.url.path)


async def _invalid(request: Request, error: RequestValidationError):
  return _served(request).answer(api.validation_error(error), request.url.path)


async def _http_error(request: Request, error: HTTPException):
  message = error.detail if isinstance(error.detail, str) else "the request cannot be answered"
  return _served(request).answer(api.APIError(error.status_code, message, headers=error.headers), request.url.path)


async def _failed(request: Request, error: Exception):
  request_id = api.new_id("req")
  logger.error("request %s (%s) failed", request_id, request.url.path, exc_info=error)
  return _served(request).answer(api.APIError.internal(request_id), request.url.path)


HANDLERS = {api.APIError: _api_error, RequestValidationError: _invalid, HTTPException: _http_error, Exception: _failed}


@router.post("/v1/completions")
async def completions(body: api.CompletionRequest, request: Request):
  return await _complete(request, body, COMPLETIONS_MAX_TOKENS)


@router.post("/v1/fim/completions")
async def fim(body: api.CompletionRequest, request: Request):
  return await _complete(request, body, ready.CHAT_MAX_TOKENS)


async def _complete(request: Request, body: api.CompletionRequest, default_max_tokens: int):
  served = _served(request)
  deadline = served.deadline()
  api.check_supported(body)
  api.check_limits(body, served.limits)
  shape = structured.structure(body)
  size = len(body.text) + len(body.suffix or "")
  try:
    work = ready.off_loop(ready.tokenise_completion, served, body, shape, default_max_tokens, size=size)
    text = await ready.unless_gone(request, work, deadline, served.timeout, served.drain)
    return await _generate(request, body, text, shape, deadline)
  except ready.ClientGone:
    served.count(request.url.path, DISCONNECTED)
    return Response(status_code=DISCONNECTED)


@router.post("/v1/chat/completions")
async def chat(body: api.ChatRequest, request: Request):
  served = _served(request)
  deadline = served.deadline()
  api.check_supported(body)
  api.check_limits(body, served.limits)
  shape = structured.structure(body)
  if served.template is None:
    message = "this model has no chat template (data.chat_template in its config); use /v1/completions"
    raise api.APIError(400, message, param="messages", code="no_chat_template")
  tools = body.tool_dicts()
  size = sum(len(m.as_dict()["content"]) for m in body.messages)
  try:
    work = ready.off_loop(ready.tokenise_chat, served, body, tools, size=size)
    text = await ready.unless_gone(request, work, deadline, served.timeout, served.drain)
    return await _generate(request, body, text, shape, deadline, tools=tools)
  except ready.ClientGone:
    served.count(request.url.path, DISCONNECTED)
    return Response(status_code=DISCONNECTED)


async def _ready_text(request: Request, body, text: ready.Text, shape: structured.Structure, deadline: float, tools):
  """``(text, constraint)``: the request's constraint compiled (structured output), and its text as tokenised when
  its healed end has no token."""
  served = _served(request)
  wait = lambda work: ready.unless_gone(request, work, deadline, served.timeout, served.drain)  # noqa: E731
  constraint = None
  if shape.field is not None:
    constraint = await wait(structured.constraint(shape, tools, served.compiler))
  if text.healed and not await wait(ready.healable(served.tokenizer, text.healed)):
    text = dataclasses.replace(text, prompt=text.tokenised, max_tokens=text.max_tokens - 1, healed="")
  return text, constraint


async def _generate(request: Request, body, text: ready.Text, shape: structured.Structure, deadline: float, tools=()):
  """Submits the request's choices and answers: one JSON body, or the event stream."""
  served, scheduler = _served(request), _served(request).scheduler
  ready.knobs_of(body, scheduler, len(text.prompt), text.max_tokens)  # a bad knob answers before any compile
  text, constraint = await _ready_text(request, body, text, shape, deadline, list(tools))
  knobs, budget = ready.knobs_of(body, scheduler, len(text.prompt), text.max_tokens)
  seed = body.seed if body.seed is not None else secrets.randbelow(api.MAX_SEED + 1)
  rows = ready.rows_of(body, text, knobs, budget, constraint, seed)
  try:
    scheduler.check(rows[0])
  except SettingError as e:
    raise api.APIError(400, str(e), param=e.field) from None
  except ValueError as e:  # From the HTTP layer, only a constraint the slots cannot hold gets here.
    raise api.APIError(400, str(e), param=shape.field) from None
  chat = "chat" in request.url.path
  answer_id = api.new_id("chatcmpl" if chat else "cmpl")
  choices = _submit(served, rows, body, shape, text.healed, answer_id)
  form = answers.Shape(answer_id, served.options.model_name, chat)
  backed = 1 if text.healed else 0  # token healing's backed-off token: the client sent it, as part of the prompt

  def usage() -> api.Usage:
    completion = sum(max(c.tokens - backed, 0) for c in choices)
    return api.Usage.of(len(text.prompt) + backed + len(text.suffix), completion, sum(c.nfe for c in choices))

  warned = structured.warning_headers(constraint)
  if body.stream:
    ends = answers.Ends(deadline, served.timeout, served.drain.closing, served.drain.ended(answer_id))
    usage_of = usage if body.include_usage else None
    return EventSourceResponse(
      answers.events(choices, form, usage_of, served.metrics, request.url.path, ends), sep="\n", headers=warned
    )
  return await _whole(request, choices, form, usage, (deadline, answer_id), headers=warned)


def _submit(served: Served, rows, body, shape: structured.Structure, healed: str, answer_id: str):
  """The choices of the submitted rows (drafts only for a stream that asks for them); a refusal cancels those
  submitted and answers 429 or 503."""
  choices, loop, diffusing = [], asyncio.get_running_loop(), bool(body.diffusing and body.stream)
  options = {"calls": shape.calls, "healed": healed, "request_id": answer_id}
  try:
    for i, row in enumerate(rows):
      handle = served.scheduler.submit(row, loop, diffusing=diffusing)
      choices.append(answers.Choice(i, handle, served.tokenizer, body.stops, served.metrics, **options))
  except (QueueFull, ShuttingDown, EngineDown) as e:
    for choice in choices:
      choice.handle.cancel()
    if isinstance(e, QueueFull):
      retry = str(max(1, math.ceil(e.retry_after)))
      raise api.APIError(429, str(e), code="queue_full", headers={"Retry-After": retry}) from None
    if isinstance(e, ShuttingDown):
      raise served.drain.refused() from None
    raise api.APIError(503, str(e), code="engine_failed") from None
  return choices


async def _whole(request: Request, choices, form: answers.Shape, usage, ending: tuple[float, str], *, headers=None):
  """The one JSON body of a request that does not stream, once every choice is done (or the client left); ``headers``:
  the response's own (:func:`~mercury_jax.serve.structured.warning_headers`)."""
  served, path, (deadline, answer_id) = _served(request), request.url.path, ending
  collect = asyncio.ensure_future(answers.collect(choices, deadline, served.drain.closing))
  gone = asyncio.ensure_future(ready.disconnected(request))
  await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
  gone.cancel()
  if not collect.done():
    collect.cancel()
    served.metrics.request(path, DISCONNECTED)
    return Response(status_code=DISCONNECTED)
  try:
    collect.result()
  except answers.TimedOut:
    raise served.timeout from None
  except answers.ShutDown:
    raise served.drain.ended(answer_id) from None
  served.metrics.request(path, 200)
  began = time.perf_counter()
  response = JSONResponse(form.whole(choices, usage()).model_dump(mode="json"), headers=headers)
  served.metrics.answer_seconds.inc(time.perf_counter() - began)
  return response


@router.get("/v1/models")
async def models(request: Request):
  served = _served(request)
  scheduler = served.scheduler
  card = {
    "id": served.options.model_name,
    "object": "model",
    "created": 0,
    "owned_by": "mercury_jax",
    "context_length": served.context,
    "block_length": scheduler.block,
    "objective": objective_name(scheduler),
    "decode": scheduler.decode,
    "draft_length": scheduler.draft,
  }
  return {"object": "list", "data": [card]}


@router.get("/health")
async def health(request: Request):
  served = _served(request)
  if served.drain.draining:
    return JSONResponse({"status": "draining"}, status_code=503)
  if not served.scheduler.healthy:
    return JSONResponse({"status": "engine_failed"}, status_code=503)
  return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request):
  body, content_type = _served(request).metrics.render()
  return Response(body, media_type=content_type)
