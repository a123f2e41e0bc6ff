"""Structured output of the server: what a request asks for, the constraint its reply follows, and tool calls.

:func:`structure` reads a request's structured output (a :class:`Structure`) and answers 400 for what does not go
together; :func:`constraint` compiles it into the automaton every choice of the request is decoded under;
:func:`parse_tool_call` reads a finished reply back as a call. How the answers look (``message.tool_calls``, the
streamed ``delta.tool_calls``, ``finish_reason``) is described in :mod:`mercury_jax.serve.routes`.

The request fields (models in :mod:`mercury_jax.serve.protocol`):

* ``response_format``: ``{"type": "text"}`` (or absent) is plain text; ``{"type": "json_object"}`` any JSON object;
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`` JSON that validates
  against ``schema`` (:class:`~mercury_jax.serve.protocol.JSONSchemaFormat`; always enforced, whether ``strict`` is
  true or false). Both endpoints read it.
* ``tools`` (chat only): ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``
  (:class:`~mercury_jax.serve.protocol.Tool`; names match ``^[a-zA-Z0-9_-]{1,64}$`` and differ, ``parameters``
  describes an object). ``tool_choice`` is ``"none"`` (the reply is text), ``"auto"`` (the default with tools: text
  or one call), ``"required"`` (one call of any tool) or ``{"type": "function", "function": {"name"}}`` (one call of
  that tool). ``parallel_tool_calls`` is accepted; a reply holds at most one call either way.
* A JSON ``response_format`` together with tools the model may call (``tool_choice`` other than ``"none"``) answers
  400 naming ``response_format``; ``stop`` together with a reply that is structured as a whole (a JSON
  ``response_format``, ``tool_choice`` ``"required"`` or a named function) answers 400 naming ``stop``, since a stop
  string could cut the structured text and leave it invalid.

The constraint (compiled by the server's :class:`~mercury_jax.serve.compiling.CompilePool`: worker processes with a
time and a memory limit per job, cached):

* ``json_object`` and ``json_schema``: the answer is compact JSON (no whitespace between tokens). A schema the
  compiler refuses answers 400, code ``invalid_schema``, ``param`` ``response_format.json_schema.schema`` followed by
  the compiler's keyword path (``.properties.age.multipleOf``).
* ``tool_choice`` ``"required"`` or a named function: one call, the JSON object ``{"name": NAME, "arguments":
  {...}}`` whose arguments validate against that tool's ``parameters``
  (:func:`~mercury_jax.constrain.schema.tool_call_schema`). A parameters schema the compiler refuses answers 400
  naming ``tools[i].function.parameters`` and the keyword path.
* ``tool_choice`` ``"auto"``: text or one call, and the call marker is the call object's opening brace. The
  constraint is the regex ``(?:CALL)|TEXT`` where CALL is the regex the compiler built for the call's JSON Schema
  (:attr:`Automaton.regex <mercury_jax.constrain.automaton.Automaton.regex>`) and TEXT (:data:`TEXT_REPLY`) is any
  non-empty text that does not start with ``{``: a reply that starts with ``{`` is a call, any other is a text reply
  (so a text reply never starts with ``{``, and an empty reply is not allowed).
* ``tool_choice`` ``"none"`` and ``response_format`` ``text``: no constraint.

The compiler's warning line for a schema (keywords and formats it read as annotations and ignored, lengths it writes
shorter than the schema allows: :attr:`Automaton.warnings <mercury_jax.constrain.automaton.Automaton.warnings>`) is
returned in the response header ``x-schema-warnings`` (:func:`warning_headers`), ASCII with backslash escapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid

from mercury_jax.constrain.automaton import Automaton, ConstraintError
from mercury_jax.constrain.schema import tool_call_schema
from mercury_jax.serve.protocol import APIError, ChatRequest, FunctionCall, GenerationRequest, NamedToolChoice, ToolCall

WARNING_HEADER = "x-schema-warnings"  # The compiler's warning line for the request's schema (module docstring).
# The text branch of a tool_choice "auto" reply: text that does not start with "{", which opens a call. Not empty, so
# the first character always says which branch a reply took.
TEXT_REPLY = r"[^{][\s\S]*"


@dataclasses.dataclass(frozen=True)
class Structure:
  """What shape a request's reply must have (:func:`structure`).

  Attributes:
    format: ``response_format.type``: ``"text"``, ``"json_object"`` or ``"json_schema"``.
    schema: The JSON Schema of ``"json_schema"``; None otherwise.
    calls: ``"none"`` (a text reply), ``"auto"`` (text or one tool call) or ``"required"`` (one tool call).
    tool: With ``"required"``: the function the call must be of (``tool_choice`` named it); None: any tool.
  """

  format: str = "text"
  schema: dict | None = None
  calls: str = "none"
  tool: str | None = None

  @property
  def field(self) -> str | None:
    """The request field that asked for the structure (``tools`` or ``response_format``); None for plain text."""
    if self.calls != "none":
      return "tools"
    return None if self.format == "text" else "response_format"

  @property
  def whole(self) -> bool:
    """The whole reply is structured text (JSON, or a call), which a stop string must not cut."""
    return self.format != "text" or self.calls == "required"


def _calls(body: ChatRequest) -> tuple[str, str | None]:
  """``(Structure.calls, Structure.tool)`` of a chat request; 400 for tools or a tool_choice that do not fit."""
  choice, names = body.tool_choice, {}
  shown = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
  for i, tool in enumerate(body.tools or ()):
    name = tool.function.name
    if name in names:
      raise APIError(
        400,
        f"tools[{i}].function.name={name!r} repeats the name of tools[{names[name]}]; give each tool its own name",
        param=f"tools[{i}].function.name",
      )
    names[name] = i
    kind = (tool.function.parameters or {}).get("type", "object")
    if kind != "object":
      raise APIError(
        400,
        f"tools[{i}].function.parameters.type={kind!r} must be 'object': a call's arguments are a JSON object",
        param=f"tools[{i}].function.parameters.type",
      )
  if not names:
    if choice == "required" or isinstance(choice, NamedToolChoice):
      raise APIError(
        400, f"tool_choice={shown!r} needs tools to call; send tools or drop tool_choice", param="tool_choice"
      )
    return "none", None
  if isinstance(choice, NamedToolChoice):
    if choice.function.name not in names:
      raise APIError(
        400,
        f"tool_choice names the function {choice.function.name!r}, which is not among the tools ({', '.join(names)})",
        param="tool_choice",
      )
    return "required", choice.function.name
  return choice or "auto", None


def structure(body: GenerationRequest) -> Structure:
  """The reply shape a request asks for (module docstring).

  Raises:
    APIError: 400 naming the field, for a combination that cannot be.
  """
  given = body.response_format
  kind = given.type if given is not None else "text"
  schema = None
  if kind == "json_schema":
    if given.json_schema is None:
      message = 'response_format.json_schema is required with response_format.type "json_schema"'
      raise APIError(400, message, param="response_format.json_schema")
    schema = given.json_schema.schema_
  calls, tool = _calls(body) if isinstance(body, ChatRequest) else ("none", None)
  if kind != "text" and calls != "none":
    raise APIError(
      400,
      f"response_format {kind} cannot be combined with tools the model may call (tool_choice "
      f"{repr(calls) if tool is None else f'naming {tool!r}'}): send tool_choice 'none' for a {kind} reply, or drop "
      "response_format",
      param="response_format",
    )
  if schema is not None:
    _check_finite(schema, "response_format.json_schema.schema")
  for i, given_tool in enumerate(getattr(body, "tools", None) or ()):
    _check_finite(given_tool.function.parameters, f"tools[{i}].function.parameters")
  shape = Structure(kind, schema, calls, tool)
  if body.stops and shape.whole:
    what = f"response_format {kind}" if kind != "text" else "a required tool call"
    raise APIError(
      400,
      f"stop cannot be combined with {what}: a stop string could cut the structured reply and leave it invalid; "
      "drop stop",
      param="stop",
    )
  return shape


def _check_finite(value, param: str) -> None:
  """400 naming the path of the first ``NaN`` or infinity in a schema: JSON has neither, but the body's parser takes
  them, and no bound or enum of a schema means anything with one. Iterative, each path a linked list of its parts (a
  schema may nest far deeper than Python's recursion limit, and a copied path would cost its depth per node)."""
  stack = [(value, None)]  # (item, its path: (key, the parent's path) or None at the top)
  while stack:
    item, path = stack.pop()
    if isinstance(item, float) and not math.isfinite(item):
      parts = []
      while path is not None:
        key, path = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
      where = param + "".join(reversed(parts))
      raise APIError(400, f"{where}={item!r} must be a finite number (JSON has no NaN or Infinity)", param=where)
    if isinstance(item, dict):
      stack.extend((v, (k, path)) for k, v in reversed(item.items()))
    elif isinstance(item, list):
      stack.extend((v, (i, path)) for i, v in reversed(list(enumerate(item))))


def _schema_param(shape: Structure, tools: list[dict], where: str | None) -> str:
  """The request field a :class:`ConstraintError` is about; ``where``: its keyword path in the compiled schema."""
  if shape.calls == "none":
    if shape.format == "json_object":
      return "response_format"
    return "response_format.json_schema.schema" + (f".{where}" if where else "")
  # In the call schema (tool_call_schema), tool i's parameters are at anyOf.i.properties.arguments, or at
  # properties.arguments when there is one tool to call.
  found = re.fullmatch(r"(?:anyOf\.(\d+)\.)?properties\.arguments(\..+)?", where or "")
  if found is None or (found[1] is None and shape.tool is None and len(tools) != 1):
    return "tools"
  names = [tool["function"]["name"] for tool in tools]
  i = int(found[1]) if found[1] is not None else names.index(shape.tool) if shape.tool is not None else 0
  return f"tools[{i}].function.parameters{found[2] or ''}"


async def constraint(shape: Structure, tools: list[dict], compiler) -> Automaton | None:
  """The automaton a reply must follow (module docstring), or None for plain text.

  Args:
    shape: What the request asks for (:func:`structure`).
    tools: The request's tools as dicts (``[]`` without).
    compiler: The server's :class:`~mercury_jax.serve.compiling.CompilePool` (coroutines named as the
      :class:`~mercury_jax.constrain.automaton.Compiler`'s methods); None: structured output is off.

  Raises:
    APIError: 400 when structured output is off, or the compiler refuses the constraint (or runs past its limits).
  """
  if shape.field is None:
    return None
  if compiler is None:
    message = (
      f"{shape.field} needs structured output, which is off on this server (started without a constraint capacity)"
    )
    raise APIError(400, message, param=shape.field, code="unsupported")
  try:
    if shape.format == "json_object":
      return await compiler.json_object()
    if shape.format == "json_schema":
      return await compiler.json_schema(shape.schema)
    call = await compiler.json_schema(tool_call_schema(tools, shape.tool))
    if shape.calls == "required":
      return call
    either = await compiler.regex(f"(?:{call.regex})|{TEXT_REPLY}")
    return dataclasses.replace(either, warnings=call.warnings) if getattr(call, "warnings", ()) else either
  except ConstraintError as e:
    raise APIError(400, str(e), param=_schema_param(shape, tools, e.param), code="invalid_schema") from None


def warning_headers(constraint: Automaton | None) -> dict[str, str]:
  """The response headers of a reply under ``constraint``: :data:`WARNING_HEADER` with its warnings, if any."""
  lines = getattr(constraint, "warnings", ())
  if not lines:
    return {}
  return {WARNING_HEADER: "; ".join(lines).encode("ascii", "backslashreplace").decode("ascii")}


def new_call_id() -> str:
  """A fresh tool call id such as ``call_3f2a...``."""
  return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_call(text: str) -> ToolCall | None:
  """The call a reply's text makes (the JSON object ``{"name": NAME, "arguments": {...}}``), or None when it makes none.

  The call gets a fresh id; its ``arguments`` are compact JSON text.
  """
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return None
  if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
    return None
  name, arguments = value["name"], value["arguments"]
  if not isinstance(name, str) or not isinstance(arguments, dict):
    return None
  arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
  return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))
