"""The bundled default model speaks chat: ``python -m mercury_jax.serve`` with no flag but its port (the verified
default, its chat template read from the checkpoint's config), spoken to over real sockets by the `openai` client.

Plain and streamed chat, ``response_format`` with a JSON Schema, and tools with ``tool_choice`` ``auto``,
``required`` and a named function all answer 200; a required or named call is valid JSON for the function's
parameters by construction (constrained decoding), whatever the 7 M-parameter model would write on its own. The
answers' words are weak (``mercury_jax/assets/default/MODEL_CARD.md``); only their form is asserted.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_serve import Server, _compiles_nothing, _concurrently

from mercury_jax.data import chat_format
from mercury_jax.data.tokenizer import load_tokenizer
from mercury_jax.sampling.sampler import default_checkpoint

ASK = [
  {"role": "system", "content": "You are a helpful assistant that writes Python code."},
  {"role": "user", "content": "Write a function that adds two numbers."},
]
NAME = {"type": "string", "maxLength": 12}
REPORT = {
  "type": "object",
  "properties": {"name": NAME, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
  "required": ["name", "count"],
  "additionalProperties": False,
}
GCD = chat_format.tool(
  "gcd",
  {
    "type": "object",
    "properties": {
      "a": {"type": "integer", "minimum": 0, "maximum": 999},
      "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
  },
  "Greatest common divisor.",
)
REVERSE = chat_format.tool(
  "reverse",
  {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"],
    "additionalProperties": False,
  },
)
TOOLS = [GCD, REVERSE]  # Rendered with the question: 198 tokens of the 256 the model sees.
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CALL = [{"role": "user", "content": "Call gcd with a=12 and b=18."}]
CALL_TOKENS = 48  # A call of these tools is at most about 30 tokens.
NAMED = {"type": "function", "function": {"name": "reverse"}}


@pytest.fixture(scope="module")
def server():
  srv = Server(None, quick=True)  # No flag: the bundled default and the server's own defaults.
  yield srv
  srv.stop()


@pytest.fixture(scope="module")
def client(server):
  return server.client(timeout=300)


def _model(client) -> str:
  (model,) = client.models.list().data
  return model.id


def test_plain_and_streamed_chat_render_the_bundled_template(client):
  model = _model(client)
  assert model == "mercury_jax-default"
  out = client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0)
  choice = out.choices[0]
  assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
  assert isinstance(choice.message.content, str) and 1 <= out.usage.completion_tokens <= 16
  tokenizer = load_tokenizer(default_checkpoint("default") / "tokenizer.model")
  assert out.usage.prompt_tokens == 1 + len(tokenizer.encode(chat_format.render(ASK)))  # BOS + the template's text
  chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
  assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_a_json_schema_reply_validates(client):
  response_format = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
  outs = _concurrently(
    lambda **kw: client.chat.completions.create(
      model=_model(client), messages=ASK, response_format=response_format, max_tokens=64, **kw
    ),
    [{"seed": seed} for seed in range(2)],
  )
  for out in outs:
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), REPORT)


def _called(choice) -> str:
  """The function a finished choice called, its arguments checked against that tool's parameters."""
  assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
  (call,) = choice.message.tool_calls
  assert call.type == "function" and call.id.startswith("call_")
  jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
  return call.function.name


def test_tool_choice_auto_required_and_named(server, client):
  model = _model(client)
  requests = [{"tool_choice": choice, "seed": seed} for choice in ("required", NAMED, "auto") for seed in range(2)]
  requests.append({"tool_choice": "required", "seed": 0, "max_tokens": 6})  # cut short
  with _compiles_nothing(server):  # A constraint is traced arrays of a fixed capacity, not a program.
    outs = _concurrently(
      lambda **kw: client.chat.completions.create(
        model=model, messages=CALL, tools=TOOLS, **{"max_tokens": CALL_TOKENS, **kw}
      ),
      requests,
    )
  for out in outs[:2]:
    assert _called(out.choices[0]) in PARAMETERS
  assert [_called(out.choices[0]) for out in outs[2:4]] == ["reverse"] * 2
  for out in outs[4:6]:  # "auto": a call, or text that does not start with "{"
    choice = out.choices[0]
    if choice.message.tool_calls:
      _called(choice)
    else:
      assert choice.finish_reason in ("stop", "length") and not choice.message.content.startswith("{"), choice
  short = outs[6].choices[0]
  assert short.finish_reason == "length" and short.message.tool_calls is None
  assert short.message.content.startswith('{"name":"') and outs[6].usage.completion_tokens == 6


def test_a_streamed_tool_call_arrives_whole_in_delta_tool_calls(client):
  kw = {"model": _model(client), "messages": CALL, "tools": TOOLS, "max_tokens": CALL_TOKENS, "stream": True}
  chunks = list(client.chat.completions.create(tool_choice=NAMED, seed=1, **kw))
  deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
  assert deltas[0].role == "assistant" and not any(delta.content for delta in deltas)
  (call,) = [call for delta in deltas for call in delta.tool_calls or ()]
  assert call.index == 0 and call.id.startswith("call_") and call.function.name == "reverse"
  jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["reverse"])
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
