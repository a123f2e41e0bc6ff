"""OpenAI-shaped requests, responses and errors of the server, as pydantic models.

Requests ignore fields they do not know (``extra="ignore"``). The fields in :data:`UNSUPPORTED` are known but not
implemented: a request that sets one to anything but its neutral value answers 400 naming it (see
:func:`check_supported`); so do ``tools`` and ``tool_choice`` on ``/v1/completions`` (:data:`CHAT_ONLY`). Beyond
OpenAI's fields, a request may carry the diffusion knobs ``steps``, ``steps_per_block``, ``threshold``, ``top_k``,
``block_length``, ``diffusing`` and ``reasoning_effort`` (:data:`REASONING_EFFORT`), and the decode mode's
``decode`` and ``draft_length`` (set for the whole server at start, ``--decode`` and ``--draft-length``: a request
may restate them, anything else answers 400 naming the field); ``usage`` has two extra fields: ``nfe`` (forward
passes, summed over the choices) and ``tokens_per_forward``.

The step budgets, named for what they are (the same words as ``python -m mercury_jax.sample`` and
``Sampler.generate``):

* ``steps``: the TOTAL refinement budget for the generated length (``max_tokens``). The server splits it evenly
  over the engine blocks the hole spans (:func:`mercury_jax.sampling.settings.steps_per_block`): every block gets the
  most steps that keep the total within ``steps`` (a block never takes more steps than it has positions). A budget
  below the number of blocks spanned answers 400 naming ``steps``: every block needs a step of its own.
* ``steps_per_block``: the steps each block gets, directly (what ``steps`` meant on this server before). Send one of
  the two; neither means one token per step (the block's size in steps), the command line's default too.
* ``reasoning_effort`` maps to steps per block and a threshold (:data:`REASONING_EFFORT`); explicit fields win.

Every number has bounds (:class:`Limits` holds the ones the model and the server's flags set): a value outside them
answers 400 naming the field, before anything reaches the engine. Floats must be finite (``NaN`` and ``Infinity``
are refused). Types are strict: an integer field takes an integer only (``true``, ``4.0`` and ``"4"`` answer 400
naming it), a number field a number, a boolean field ``true`` or ``false``.

``stop`` strings (at most :data:`MAX_STOPS`, each at most :data:`MAX_STOP_LENGTH` characters) end a choice where the
first of them begins (:func:`find_stop`); a stream holds back the text that could still become one
(:func:`held_back`, linear in the stop's length). Errors have OpenAI's body ``{"error": {"message", "type", "param",
"code"}}`` (:class:`APIError`); a request FastAPI cannot parse answers 400, not 422 (:func:`validation_error`), its
``param`` the path of the bad field (``tools[1].function.name``); a value quoted in a message is cut to
:data:`SHOWN_CHARS` characters.

Structured output: ``response_format`` (both endpoints), ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(chat) are parsed here (:class:`ResponseFormat`, :class:`Tool`, :class:`NamedToolChoice`); what they ask for, the
checks that span fields and the constraint they compile to are in :mod:`mercury_jax.serve.structured`. A reply that
calls a tool is answered as OpenAI's ``tool_calls`` (:class:`ToolCall`, streamed as :class:`ToolCallDelta`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from typing import Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mercury_jax.limits import MAX_SEED

MAX_CHOICES = 16  # The most choices ``n`` one request may ask for.
MAX_STOPS = 4  # The most stop strings one request may give, as OpenAI allows.
MAX_STOP_LENGTH = 256  # The most characters of one stop string (a stream holds back up to this many).
MAX_TEMPERATURE = 100.0  # Beyond a few the distribution is flat already.
SHOWN_CHARS = 120  # A value quoted back in an error message is cut to this many characters.
# reasoning_effort -> (refinement steps per block as a fraction of the block, rounded, at least 1; the threshold
# rule's confidence bar). Fewer steps commit more tokens per forward pass: faster, less careful. Explicit
# ``steps``, ``steps_per_block`` and ``threshold`` fields override the mapping. "medium" halves the block's steps.
REASONING_EFFORT: dict[str, tuple[float, float]] = {
  "instant": (1 / 8, 0.7),
  "low": (1 / 4, 0.8),
  "medium": (1 / 2, 0.9),
  "high": (1.0, 0.95),
}
# Known request fields the server does not implement: field -> (the values that mean "off" and are accepted, why).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
  "logprobs": ((None, False), "is not supported by this server"),
  "top_logprobs": ((None, 0), "is not supported by this server"),
  "echo": ((None, False), "is not supported by this server"),
  "best_of": ((None, 1), "is not supported by this server (use n)"),
  "logit_bias": ((None, {}), "is not supported by this server"),
  "presence_penalty": ((None, 0), "is not supported by this server"),
  "frequency_penalty": ((None, 0), "is not supported by this server"),
}
# Chat fields that /v1/completions refuses the same way (a completion has no tool calls).
CHAT_ONLY: dict[str, tuple[tuple, str]] = {
  "tools": ((None, []), "applies to /v1/chat/completions only"),
  "tool_choice": ((None, "none", "auto"), "applies to /v1/chat/completions only"),
}
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and response_format names.
TOOL_CHOICES = ("none", "auto", "required")
# How pydantic names the members of a union it tried, at the end of an error's location.
UNION_MEMBERS = ("str", "int", "float", "bool", "none", "list[str]", "list[ContentPart]")
MAX_DRAFT = 64  # The longest draft_length a request may name (the served one is set at start).
# The request fields that only a diffusion model has; an autoregressive model answers 400 naming them.
DIFFUSION_FIELDS = ("steps", "steps_per_block", "threshold", "block_length", "diffusing", "reasoning_effort")


class APIError(Exception):
  """An error answered with OpenAI's error body.

  Args:
    status: The HTTP status.
    message: What is wrong and what would be right.
    param: The request field at fault, if any.
    code: A short machine-readable code, if any.
    headers: Extra response headers (``Retry-After``).
  """

  def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.headers = dict(headers or {})

  @property
  def type(self) -> str:
    if self.status == 429:
      return "rate_limit_error"
    return "invalid_request_error" if self.status < 500 else "server_error"

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

  @classmethod
  def internal(cls, request_id: str) -> APIError:
    """The 500 of a failure inside the server: a fixed message and an id to find the details in the server's log."""
    return cls(500, f"the server failed on this request (request id {request_id}); its log has the details")


@dataclasses.dataclass(frozen=True)
class Limits:
  """The bounds the served model and the server's flags set on request fields (the others are constants here).

  Attributes:
    context: The model's context in tokens: bounds prompt plus ``max_tokens`` (plus suffix), and ``steps``.
    vocab: The model's vocabulary: bounds ``top_k``.
    block: The engine's block: bounds ``steps_per_block`` (each step commits at least one token of its block).
  """

  context: int
  vocab: int
  block: int


def shown(value) -> str:
  """``repr(value)`` cut to :data:`SHOWN_CHARS` characters, for quoting a client's value back in an error."""
  try:
    text = repr(value)
  except ValueError:  # An int beyond Python's str conversion limit.
    return "<a number too long to show>"
  return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 20]}... ({len(text)} characters)"


def effort_knobs(effort: str, block: int) -> tuple[int, float]:
  """``(steps per block, threshold)`` of a ``reasoning_effort`` for blocks of ``block`` tokens."""
  fraction, threshold = REASONING_EFFORT[effort]
  return max(1, round(fraction * block)), threshold


def new_id(prefix: str) -> str:
  """A fresh response id such as ``cmpl-3f2a...``."""
  return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------ requests


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="ignore")
  include_usage: bool = Field(False, strict=True)


class JSONSchemaFormat(BaseModel):
  """``response_format.json_schema``. The server always enforces ``schema``, whether ``strict`` is true or false."""

  model_config = ConfigDict(extra="ignore", populate_by_name=True)
  name: str = Field(pattern=NAME_PATTERN)
  description: str | None = None
  schema_: dict[str, Any] = Field(alias="schema")
  strict: bool | None = Field(None, strict=True)


class ResponseFormat(BaseModel):
  model_config = ConfigDict(extra="ignore")
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JSONSchemaFormat | None = None  # Required with type "json_schema" (structured.structure).


class GenerationRequest(BaseModel):
  """The fields every generating endpoint shares."""

  model_config = ConfigDict(extra="ignore")
  refused: ClassVar[dict[str, tuple[tuple, str]]] = UNSUPPORTED  # Fields accepted with their neutral values only.

  model: str | None = None  # Any name is accepted; responses carry the server's model name.
  max_tokens: int | None = Field(None, ge=1, strict=True)  # At most the context left after the prompt.
  temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False, strict=True)
  top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, strict=True)
  n: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True)
  seed: int | None = Field(None, ge=0, le=MAX_SEED, strict=True)
  stop: str | list[str] | None = None
  stream: bool | None = Field(None, strict=True)
  stream_options: StreamOptions | None = None
  user: str | None = None
  response_format: ResponseFormat | None = None
  # Diffusion knobs (the module docstring says what the step budgets mean).
  steps: int | None = Field(None, ge=1, strict=True)  # Total, for the generated length; at most Limits.context.
  steps_per_block: int | None = Field(None, ge=1, strict=True)  # Per block; at most Limits.block.
  reasoning_effort: Literal["instant", "low", "medium", "high"] | None = None
  block_length: int | None = Field(None, ge=1, strict=True)
  threshold: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, strict=True)
  top_k: int | None = Field(None, ge=0, strict=True)  # At most Limits.vocab; 0 keeps every token.
  diffusing: bool | None = Field(None, strict=True)
  # Verified decoding: the served mode and draft length (set at start, --decode / --draft-length; a request may only
  # restate them).
  decode: Literal["auto", "ar", "diffusion", "verified"] | None = None
  draft_length: int | None = Field(None, ge=1, le=MAX_DRAFT, strict=True)
  # Known, not implemented (UNSUPPORTED).
  logprobs: Any = None
  top_logprobs: Any = None
  echo: Any = None
  best_of: Any = None
  logit_bias: Any = None
  presence_penalty: Any = None
  frequency_penalty: Any = None

  @field_validator("stop")
  @classmethod
  def _stop(cls, stop):
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and len(stops) > MAX_STOPS:
      raise ValueError(f"gives {len(stops)} stop strings; at most {MAX_STOPS} are allowed")
    if stops is not None and any(not s for s in stops):
      raise ValueError("holds an empty string; every stop string needs at least one character")
    longest = max(map(len, stops or ()), default=0)
    if longest > MAX_STOP_LENGTH:
      raise ValueError(f"holds a string of {longest} characters; at most {MAX_STOP_LENGTH} are allowed")
    return stop

  @property
  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
  """``POST /v1/completions`` (with ``suffix``: fill in the middle) and ``POST /v1/fim/completions``."""

  refused: ClassVar[dict[str, tuple[tuple, str]]] = {**UNSUPPORTED, **CHAT_ONLY}

  prompt: str | list[str]
  suffix: str | None = None
  tools: Any = None  # CHAT_ONLY
  tool_choice: Any = None  # CHAT_ONLY

  @field_validator("prompt")
  @classmethod
  def _one_prompt(cls, prompt):
    if isinstance(prompt, list) and len(prompt) != 1:
      raise ValueError(f"is a list of {len(prompt)} strings; send one prompt per request (a string)")
    return prompt

  @property
  def text(self) -> str:
    return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class FunctionSpec(BaseModel):
  """``tools[i].function``: ``parameters`` is the JSON Schema of the arguments (absent: none), always enforced."""

  model_config = ConfigDict(extra="ignore")
  name: str = Field(pattern=NAME_PATTERN)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = Field(None, strict=True)


class Tool(BaseModel):
  model_config = ConfigDict(extra="ignore")
  type: Literal["function"]
  function: FunctionSpec


class FunctionName(BaseModel):
  model_config = ConfigDict(extra="ignore")
  name: str


class NamedToolChoice(BaseModel):
  """``tool_choice`` naming one function: the reply is a call of it."""

  model_config = ConfigDict(extra="ignore")
  type: Literal["function"]
  function: FunctionName


class FunctionCall(BaseModel):
  model_config = ConfigDict(extra="ignore")
  name: str
  arguments: str  # JSON text of an object.


class ToolCall(BaseModel):
  """A call the assistant made: in a response's ``message.tool_calls``, and in earlier assistant messages."""

  model_config = ConfigDict(extra="ignore")
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall

  def as_dict(self) -> dict:
    """The call for the chat template: ``arguments`` as a dict when it is a JSON object (as HF templates expect)."""
    try:
      arguments = json.loads(self.function.arguments)
    except json.JSONDecodeError:
      arguments = None
    if not isinstance(arguments, dict):
      arguments = self.function.arguments
    return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ContentPart(BaseModel):
  model_config = ConfigDict(extra="ignore")
  type: str
  text: str | None = None


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="ignore")
  role: str
  content: str | list[ContentPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCall] | None = None  # An assistant message's calls.
  tool_call_id: str | None = None  # A "tool" message: the call it answers.

  @field_validator("content")
  @classmethod
  def _text_only(cls, content):
    for part in content if isinstance(content, list) else ():
      if part.type != "text" or part.text is None:
        raise ValueError(f"has a part of type {part.type!r}; this model reads text parts only")
    return content

  def as_dict(self) -> dict:
    """The message for the chat template: content as one string; ``name``, ``tool_calls`` and ``tool_call_id`` when
    given (see :meth:`ToolCall.as_dict`)."""
    content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
    message = {"role": self.role, "content": content or ""}
    if self.name is not None:
      message["name"] = self.name
    if self.tool_calls is not None:
      message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
    if self.tool_call_id is not None:
      message["tool_call_id"] = self.tool_call_id
    return message


class ChatRequest(GenerationRequest):
  """``POST /v1/chat/completions``."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1, strict=True)
  tools: list[Tool] | None = None
  tool_choice: Any = None  # None, one of TOOL_CHOICES, or a NamedToolChoice.
  parallel_tool_calls: bool | None = Field(None, strict=True)  # Accepted; a reply holds at most one call either way.

  @field_validator("tool_choice")
  @classmethod
  def _tool_choice(cls, choice):
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
      return choice
    try:
      return NamedToolChoice.model_validate(choice)
    except ValidationError:
      raise ValueError(
        'must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'
      ) from None

  def tool_dicts(self) -> list[dict]:
    """The tools as plain dicts (what the chat template and the call schema read); [] without tools."""
    return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]


def check_supported(request: GenerationRequest) -> None:
  """Raises a 400 :class:`APIError` for a field the request refuses (:data:`UNSUPPORTED`, :data:`CHAT_ONLY`) set to a
  value that is not "off"."""
  for field, (neutral, why) in request.refused.items():
    value = getattr(request, field)
    if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):  # true is not 1
      allowed = " or ".join(repr(v) for v in neutral if v is not None)
      raise APIError(400, f"{field}={shown(value)} {why}; omit it (or send {allowed})", param=field, code="unsupported")


def check_limits(request: GenerationRequest, limits: Limits) -> None:
  """Raises a 400 :class:`APIError` naming the first field above a bound the model sets (:class:`Limits`).

  ``max_tokens`` is checked again with the prompt's length, once it is tokenised (the routes' ``_max_tokens``).
  """
  bounds = (
    ("max_tokens", request.max_tokens, limits.context, "the model's context"),
    ("max_completion_tokens", getattr(request, "max_completion_tokens", None), limits.context, "the model's context"),
    ("steps", request.steps, limits.context, "the model's context"),
    ("steps_per_block", request.steps_per_block, limits.block, "the block: each step commits at least one token"),
    ("top_k", request.top_k, limits.vocab, "the vocabulary; 0 keeps every token"),
  )
  for field, value, most, what in bounds:
    if value is not None and value > most:
      raise APIError(400, f"{field}={shown(value)} must be at most {most} ({what})", param=field)
  if request.steps is not None and request.steps_per_block is not None:
    message = "steps (the total budget) and steps_per_block (per block) both given; send one"
    raise APIError(400, message, param="steps_per_block")


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
  """Where the first occurrence of any stop string begins in ``text[start:]`` (an index into ``text``), or None."""
  found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
  return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
  """How many characters at the end of ``text`` could begin a stop string, so must wait for the next tokens.

  The longest proper prefix of a stop string that ``text`` ends with, found by running the stop's Knuth-Morris-Pratt
  automaton over the last ``len(stop) - 1`` characters: linear in the stop's length.
  """
  longest = 0
  for stop in stops:
    fail, matched = _failure(stop), 0
    for char in text[max(len(text) - len(stop) + 1, 0) :] if len(stop) > 1 else "":
      while matched and stop[matched] != char:
        matched = fail[matched - 1]
      matched += stop[matched] == char
      if matched == len(stop):  # A whole stop string (find_stop's business): go on with its longest border.
        matched = fail[matched - 1]
    longest = max(longest, matched)
  return longest


@functools.lru_cache(maxsize=256)
def _failure(stop: str) -> tuple[int, ...]:
  """KMP's failure function of ``stop``: for each prefix, the length of its longest proper border."""
  fail, k = [0] * len(stop), 0
  for i in range(1, len(stop)):
    while k and stop[i] != stop[k]:
      k = fail[k - 1]
    k += stop[i] == stop[k]
    fail[i] = k
  return tuple(fail)


def _dotted(path: list) -> str:
  """A field's path as a param: ``["tools", 1, "function", "name"]`` -> ``tools[1].function.name``."""
  text = ""
  for part in path:
    text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
  return text


def validation_error(error: RequestValidationError) -> APIError:
  """A 400 naming the first bad field of a request FastAPI could not parse, with its value and what is wanted."""
  errors = error.errors()
  first = errors[0]
  if first["type"] == "json_invalid":
    return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
  where = lambda e: [p for p in e["loc"] if p != "body"]
  path = where(first)
  if len(path) > 1 and path[-1] in UNION_MEMBERS:  # The message below covers every member tried.
    path = path[:-1]
  param, value = _dotted(path), shown(first.get("input"))
  if not path:
    return APIError(400, f"the request body must be a JSON object, not {value}")
  if first["type"] == "missing":
    return APIError(400, f"{param} is required", param=param)
  if first["type"] == "value_error":
    return APIError(400, f"{param}={value} {first['msg'].removeprefix('Value error, ')}", param=param)
  wanted = sorted({e["msg"][:1].lower() + e["msg"][1:] for e in errors if where(e)[: len(path)] == path})
  return APIError(400, f"{param}={value} is invalid: {' or '.join(wanted)}", param=param)


# ------------------------------------------------------------------------------------------------ responses


class Usage(BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int
  nfe: int  # Forward passes of all choices together.
  tokens_per_forward: float  # completion_tokens / nfe.

  @classmethod
  def of(cls, prompt_tokens: int, completion_tokens: int, nfe: int) -> Usage:
    return cls(
      prompt_tokens=prompt_tokens,
      completion_tokens=completion_tokens,
      total_tokens=prompt_tokens + completion_tokens,
      nfe=nfe,
      tokens_per_forward=round(completion_tokens / nfe, 3) if nfe else 0.0,
    )


class Diffusing(BaseModel):
  """A draft snapshot: ``text`` replaces the whole previous draft of the choice (undecided positions as ░)."""

  replace: bool = True
  text: str


def _absent_if_none(value) -> bool:
  return value is None


class CompletionChoice(BaseModel):
  index: int
  text: str
  logprobs: None = None
  finish_reason: str | None = None
  diffusing: Diffusing | None = Field(None, exclude_if=_absent_if_none)


class ChatMessageOut(BaseModel):
  role: Literal["assistant"] = "assistant"
  content: str | None  # None when the reply is a tool call.
  tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent_if_none)


class _Choice(BaseModel):
  index: int
  logprobs: None = None
  finish_reason: str | None = None


class ChatChoice(_Choice):
  message: ChatMessageOut


class ToolCallDelta(BaseModel):
  """A streamed call: sent once, complete (its whole ``arguments``), as the first and only piece of call ``index``."""

  index: int
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall


class ChatDelta(BaseModel):
  role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
  content: str | None = Field(None, exclude_if=_absent_if_none)
  tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_absent_if_none)
  diffusing: Diffusing | None = Field(None, exclude_if=_absent_if_none)


class ChatChunkChoice(_Choice):
  delta: ChatDelta


class _Response(BaseModel):
  id: str
  object: str
  created: int = Field(default_factory=lambda: int(time.time()))
  model: str


class Completion(_Response):
  """A ``text_completion``: the whole answer, or (streaming) one chunk of it."""

  object: Literal["text_completion"] = "text_completion"
  choices: list[CompletionChoice]
  usage: Usage | None = Field(None, exclude_if=_absent_if_none)


class ChatCompletion(_Response):
  object: Literal["chat.completion"] = "chat.completion"
  choices: list[ChatChoice]
  usage: Usage


class ChatCompletionChunk(_Response):
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  choices: list[ChatChunkChoice]
  usage: Usage | None = Field(None, exclude_if=_absent_if_none)
