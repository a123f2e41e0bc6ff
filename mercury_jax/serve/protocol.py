"""OpenAI-shaped requests, responses and errors of the server, as pydantic models.

Requests ignore fields they do not know (``extra="ignore"``). The fields in :data:`UNSUPPORTED` are known but not
implemented: a request that sets one to anything but its neutral value answers 400 naming it (see
:func:`check_supported`). Beyond OpenAI's fields, a request may carry the diffusion knobs ``steps``, ``threshold``,
``top_k``, ``block_length``, ``diffusing`` and ``reasoning_effort`` (:data:`REASONING_EFFORT`), and ``usage`` has
two extra fields: ``nfe`` (forward passes, summed over the choices) and ``tokens_per_forward``.

``stop`` strings end a choice where the first of them begins (:func:`find_stop`); a stream holds back the text that
could still become one (:func:`held_back`). Errors have OpenAI's body ``{"error": {"message", "type", "param",
"code"}}`` (:class:`APIError`); a request FastAPI cannot parse answers 400, not 422 (:func:`validation_error`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_CHOICES = 16  # The most choices ``n`` one request may ask for.
MAX_STOPS = 4  # The most stop strings one request may give, as OpenAI allows.
MAX_SEED = 2**31 - 1  # Seeds are non-negative 32-bit ints (larger ones would collide in the PRNG key).
# reasoning_effort -> (refinement steps per block as a fraction of the block, rounded, at least 1; the threshold
# rule's confidence bar). Fewer steps commit more tokens per forward pass: faster, less careful. Explicit
# ``steps`` and ``threshold`` fields override the mapping. "medium" halves the block's steps.
REASONING_EFFORT: dict[str, tuple[float, float]] = {
  "instant": (1 / 8, 0.7),
  "low": (1 / 4, 0.8),
  "medium": (1 / 2, 0.9),
  "high": (1.0, 0.95),
}
# Known request fields the server does not implement: field -> (the values that mean "off" and are accepted, why).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
  "logprobs": ((None, False), "is not supported"),
  "top_logprobs": ((None, 0), "is not supported"),
  "echo": ((None, False), "is not supported"),
  "best_of": ((None, 1), "is not supported (use n)"),
  "logit_bias": ((None, {}), "is not supported"),
  "presence_penalty": ((None, 0), "is not supported"),
  "frequency_penalty": ((None, 0), "is not supported"),
  "tools": ((None, []), "is not supported yet"),
  "tool_choice": ((None, "none", "auto"), "is not supported yet"),
  "response_format": ((None, {"type": "text"}), "is not supported yet"),
}
# How pydantic names the members of a union it tried, at the end of an error's location.
UNION_MEMBERS = ("str", "int", "float", "bool", "none", "list[str]", "list[ContentPart]")
# The request fields that only a diffusion model has; an autoregressive model answers 400 naming them.
DIFFUSION_FIELDS = ("steps", "threshold", "block_length", "diffusing", "reasoning_effort")


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
  include_usage: bool = False


class GenerationRequest(BaseModel):
  """The fields every generating endpoint shares."""

  model_config = ConfigDict(extra="ignore")

  model: str | None = None  # Any name is accepted; responses carry the server's model name.
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=0)
  top_p: float | None = Field(None, gt=0, le=1)
  n: int | None = Field(None, ge=1, le=MAX_CHOICES)
  seed: int | None = Field(None, ge=0, le=MAX_SEED)
  stop: str | list[str] | None = None
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  user: str | None = None
  # Diffusion knobs.
  steps: int | None = Field(None, ge=1)
  reasoning_effort: Literal["instant", "low", "medium", "high"] | None = None
  block_length: int | None = Field(None, ge=1)
  threshold: float | None = Field(None, ge=0, le=1)
  top_k: int | None = Field(None, ge=0)
  diffusing: bool | None = None
  # Known, not implemented (UNSUPPORTED).
  logprobs: Any = None
  top_logprobs: Any = None
  echo: Any = None
  best_of: Any = None
  logit_bias: Any = None
  presence_penalty: Any = None
  frequency_penalty: Any = None
  tools: Any = None
  tool_choice: Any = None
  response_format: Any = None

  @field_validator("stop")
  @classmethod
  def _stop(cls, stop):
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and len(stops) > MAX_STOPS:
      raise ValueError(f"gives {len(stops)} stop strings; at most {MAX_STOPS} are allowed")
    if stops is not None and any(not s for s in stops):
      raise ValueError("holds an empty string; every stop string needs at least one character")
    return stop

  @property
  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
  """``POST /v1/completions`` (with ``suffix``: fill in the middle) and ``POST /v1/fim/completions``."""

  prompt: str | list[str]
  suffix: str | None = None

  @field_validator("prompt")
  @classmethod
  def _one_prompt(cls, prompt):
    if isinstance(prompt, list) and len(prompt) != 1:
      raise ValueError(f"is a list of {len(prompt)} strings; send one prompt per request (a string)")
    return prompt

  @property
  def text(self) -> str:
    return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(BaseModel):
  model_config = ConfigDict(extra="ignore")
  type: str
  text: str | None = None


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="ignore")
  role: str
  content: str | list[ContentPart] | None = None
  name: str | None = None

  @field_validator("content")
  @classmethod
  def _text_only(cls, content):
    for part in content if isinstance(content, list) else ():
      if part.type != "text" or part.text is None:
        raise ValueError(f"has a part of type {part.type!r}; this model reads text parts only")
    return content

  def as_dict(self) -> dict:
    """The message for the chat template: content as one string."""
    content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
    message = {"role": self.role, "content": content or ""}
    return message if self.name is None else {**message, "name": self.name}


class ChatRequest(GenerationRequest):
  """``POST /v1/chat/completions``."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)


def check_supported(request: GenerationRequest) -> None:
  """Raises a 400 :class:`APIError` for a field of :data:`UNSUPPORTED` set to a value that is not "off"."""
  for field, (neutral, why) in UNSUPPORTED.items():
    value = getattr(request, field)
    if value not in neutral:
      allowed = " or ".join(repr(v) for v in neutral if v is not None)
      raise APIError(
        400, f"{field}={value!r} {why} by this server; omit it (or send {allowed})", param=field, code="unsupported"
      )


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
  """Where the first occurrence of any stop string begins in ``text[start:]`` (an index into ``text``), or None."""
  found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
  return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
  """How many characters at the end of ``text`` could begin a stop string, so must wait for the next tokens."""
  return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def validation_error(error: RequestValidationError) -> APIError:
  """A 400 naming the first bad field of a request FastAPI could not parse, with its value and what is wanted."""
  errors = error.errors()
  first = errors[0]
  if first["type"] == "json_invalid":
    return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
  where = lambda e: [str(p) for p in e["loc"] if p != "body"]
  path = where(first)
  if len(path) > 1 and path[-1] in UNION_MEMBERS:  # The message below covers every member tried.
    path = path[:-1]
  param, value = ".".join(path), first.get("input")
  if not path:
    return APIError(400, f"the request body must be a JSON object, not {value!r}")
  if first["type"] == "missing":
    return APIError(400, f"{param} is required", param=param)
  if first["type"] == "value_error":
    return APIError(400, f"{param}={value!r} {first['msg'].removeprefix('Value error, ')}", param=param)
  wanted = sorted({e["msg"][:1].lower() + e["msg"][1:] for e in errors if where(e)[: len(path)] == path})
  return APIError(400, f"{param}={value!r} is invalid: {' or '.join(wanted)}", param=param)


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
  content: str


class ChatChoice(BaseModel):
  index: int
  message: ChatMessageOut
  logprobs: None = None
  finish_reason: str | None = None


class ChatDelta(BaseModel):
  role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
  content: str | None = Field(None, exclude_if=_absent_if_none)
  diffusing: Diffusing | None = Field(None, exclude_if=_absent_if_none)


class ChatChunkChoice(BaseModel):
  index: int
  delta: ChatDelta
  logprobs: None = None
  finish_reason: str | None = None


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
