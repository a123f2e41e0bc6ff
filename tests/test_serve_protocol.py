"""The HTTP layer of ``python -m mercury_jax.serve`` over a fake scheduler: parsing, validation and bounds, errors,
the API key and the body limit, timeouts, chat templates, stop strings, incremental detokenisation, the SSE event
format, usage and metrics, structured output and tool calls (no model runs)."""

import asyncio
import json
from typing import Any, NamedTuple

import pytest
from fastapi.testclient import TestClient

from mercury_jax.config import Config, DataConfig, ObjectiveConfig
from mercury_jax.constrain.automaton import ConstraintError
from mercury_jax.constrain.schema import tool_call_schema
from mercury_jax.data.chat_template import ChatTemplate, TemplateError
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import MASK_TEXT
from mercury_jax.sampling.settings import SettingError
from mercury_jax.sampling.text import Detokenizer
from mercury_jax.serve import protocol as api, structured
from mercury_jax.serve.answers import Choice, Shape, events
from mercury_jax.serve.routes import Options, create_app
from mercury_jax.serve.scheduler import EngineDown, QueueFull, StepStats, Update

TEMPLATE = (
  "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
  "{% if add_generation_prompt %}<assistant>{% endif %}"
)
BOS, EOS, MASK, OFFSET = 2, 3, 4, 5  # The fake tokenizer: character c is id ord(c) + OFFSET.


class FakeTokenizer:
  bos_id, eos_id, vocab_size = BOS, EOS, 1000

  def encode(self, text: str) -> list[int]:
    return [ord(c) + OFFSET for c in text]

  def decode(self, ids, *, mask_text: str = "") -> str:
    return "".join(chr(i - OFFSET) if i >= OFFSET else mask_text if i == MASK else "" for i in ids)


class FakeHandle:
  """Delivers a scripted list of updates; ``wait`` makes it hang (as a slow engine) until cancelled."""

  def __init__(self, handle_id: int, updates: list[Update], wait: bool):
    self.id, self.script, self.wait = handle_id, updates, wait
    self.submitted, self.cancelled = 0.0, False
    self._cancel = asyncio.Event()

  async def updates(self):
    for update in self.script:
      await asyncio.sleep(0)
      yield update
    if self.wait:
      await self._cancel.wait()
      yield Update((), None, True, "cancelled", 0)

  def cancel(self) -> None:
    self.cancelled = True
    self._cancel.set()


class FakeAutomaton(NamedTuple):
  kind: str
  source: Any  # The regex, the schema, or None for json_object.
  regex: str


def keyword_path(schema, keyword: str) -> str | None:
  """The dotted path of the first ``keyword`` in ``schema`` (as the compiler names a keyword it refuses), or None."""
  items = schema.items() if isinstance(schema, dict) else enumerate(schema) if isinstance(schema, list) else ()
  for key, value in items:
    if key == keyword:
      return key
    inner = keyword_path(value, keyword)
    if inner is not None:
      return f"{key}.{inner}"
  return None


class FakeCompiler:
  """The compile pool's interface: records what it compiles, and refuses ``multipleOf`` anywhere, naming its path;
  ``wait`` makes every job hang (as a slow compile) until it is cancelled."""

  def __init__(self, wait: bool = False):
    self.compiled: list[FakeAutomaton] = []
    self.wait, self.cancelled = wait, 0

  async def _compile(self, kind: str, source, regex: str) -> FakeAutomaton:
    if self.wait:
      try:
        await asyncio.Event().wait()
      except asyncio.CancelledError:
        self.cancelled += 1
        raise
    self.compiled.append(FakeAutomaton(kind, source, regex))
    return self.compiled[-1]

  async def regex(self, pattern: str) -> FakeAutomaton:
    return await self._compile("regex", pattern, pattern)

  async def json_schema(self, schema: dict) -> FakeAutomaton:
    where = keyword_path(schema, "multipleOf")
    if where is not None:
      raise ConstraintError("multipleOf is not enforced by the automaton; drop it", param=where)
    return await self._compile("json_schema", schema, f"CALL{len(self.compiled)}")

  async def json_object(self) -> FakeAutomaton:
    return await self._compile("json_object", None, "OBJECT")


class FakeScheduler:
  """Answers every request with ``reply`` (then EOS), one block of ``block`` characters per update.

  ``n`` choices get ``reply`` with their stream index appended when ``per_stream``. ``compiler`` is a
  :class:`FakeCompiler` (None: structured output off); a constrained request is answered like any other.
  """

  def __init__(self, reply="Hello world", *, block=4, autoregressive=False, template="", context=64, **options):
    self.tokenizer = FakeTokenizer()
    objective = ObjectiveConfig(name="autoregressive" if autoregressive else "masked_diffusion", block_size=block)
    self.cfg = Config(objective=objective, data=DataConfig(chat_template=template))
    self.reply, self.block, self.autoregressive, self.max_length = reply, block, autoregressive, context
    self.block_length_fixed, self.slots, self.mask_id, self.default_steps = True, 4, MASK, block
    self.vocab_size, self.default_knobs = self.tokenizer.vocab_size, Knobs(1.0, 0, 1.0, 0.9)
    self.queue_depth, self.busy_slots, self.compilations = 1, 2, 7
    phases = {"admit": 0.125, "dispatch": 0.5, "wait": 1.5, "report": 0.0625, "post": 0.0625}
    self.stats = StepStats(5, **phases, chunks=3, chunk_seconds=0.5)
    self.stats.steps.update({4: 3, 2: 2})
    self.stats.prefills.update({32: 4, 0: 1})
    self.kv_pages, self.free_pages = 40, 31
    self.error, self.queue_full_after, self.wait, self.per_stream = None, None, False, False
    self.refuse, self.down, self.healthy = None, False, True
    self.decode, self.draft = ("ar" if autoregressive else "diffusion"), 0  # the served mode (verified: draft > 0)
    self.compiler = FakeCompiler()
    self.__dict__.update(options)
    self.requests, self.handles, self.diffusing = [], [], []

  def check(self, request) -> None:
    if self.refuse is not None:
      raise self.refuse

  def script(self, request, diffusing: bool) -> list[Update]:
    """One update per block: the block's tokens (the engine hands out what is new), the whole draft."""
    if self.error:
      return [Update((), None, True, "error", 0, error=self.error)]
    reply = self.reply + (str(request.stream) if self.per_stream else "")
    if request.heal:  # A healed prompt's end comes first.
      reply = request.heal + reply
    ids = self.tokenizer.encode(reply)[: request.max_tokens]
    reason = "stop" if len(ids) < request.max_tokens else "length"
    updates = []
    for end in range(self.block, len(ids) + self.block, self.block):
      done = end >= len(ids)
      draft = None if done or not diffusing else (*ids[:end], *[MASK] * (request.max_tokens - end))
      new = tuple(ids[end - self.block : end])
      updates.append(Update(new, draft, done, reason if done else None, end // self.block, time=0.5))
    return updates

  def submit(self, request, loop, *, diffusing=False):
    if self.down:
      raise EngineDown("the engine failed and cannot serve; the server needs a restart")
    if self.queue_full_after is not None and len(self.handles) >= self.queue_full_after:
      raise QueueFull(3, retry_after=2.5)
    self.requests.append(request)
    self.diffusing.append(diffusing)
    self.handles.append(FakeHandle(len(self.handles), [] if self.wait else self.script(request, diffusing), self.wait))
    return self.handles[-1]


def client_for(scheduler: FakeScheduler, **options) -> TestClient:
  return TestClient(create_app(scheduler, scheduler.compiler, Options("fake-model", **options)))


def sse(response) -> list:
  """The ``data:`` payloads of an event stream, JSON-decoded except ``[DONE]``."""
  payloads = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
  return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def post_raw(client: TestClient, body: bytes):
  """Posts ``body`` as JSON text as it is (what the json= argument cannot write: NaN, lone surrogates)."""
  return client.post("/v1/completions", content=body, headers={"content-type": "application/json"})


def error_of(response, status: int = 400) -> dict:
  assert response.status_code == status, response.text
  body = response.json()
  assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
  return body["error"]


# ------------------------------------------------------------------------------------------------ plain answers


def test_completion_answers_text_finish_reason_and_usage():
  scheduler = FakeScheduler("Hello world")
  body = client_for(scheduler).post("/v1/completions", json={"model": "anything", "prompt": "Hi", "max_tokens": 20})
  assert body.status_code == 200, body.text
  out = body.json()
  assert out["object"] == "text_completion" and out["model"] == "fake-model" and out["id"].startswith("cmpl-")
  assert out["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}]
  assert out["usage"] == {
    "prompt_tokens": 2,
    "completion_tokens": 11,
    "total_tokens": 13,
    "nfe": 3,
    "tokens_per_forward": round(11 / 3, 3),
  }
  # Token healing: the prompt's last token goes to the engine as one more position to generate, restricted to tokens
  # whose text starts with its characters; the reply does not repeat them and usage counts them as the prompt's.
  (request,) = scheduler.requests
  assert request.prompt == tuple(FakeTokenizer().encode("H")) and request.max_tokens == 21
  assert request.heal == "i" and request.constraint is None


def test_no_token_healing_sends_the_prompt_as_tokenised():
  scheduler = FakeScheduler("Hello world")
  client = client_for(scheduler, token_healing=False)
  out = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20}).json()
  assert out["choices"][0]["text"] == "Hello world" and out["usage"]["prompt_tokens"] == 2
  (request,) = scheduler.requests
  assert request.prompt == tuple(FakeTokenizer().encode("Hi")) and request.max_tokens == 20
  assert request.constraint is None and request.heal == ""


def test_unknown_fields_are_ignored_and_neutral_values_of_unsupported_ones_accepted():
  response = client_for(FakeScheduler()).post(
    "/v1/completions",
    json={"prompt": "x", "no_such_field": [1, 2], "logprobs": None, "echo": False, "best_of": 1, "tools": []},
  )
  assert response.status_code == 200, response.text


@pytest.mark.parametrize("field,value", [("logprobs", 2), ("echo", True), ("best_of", 3), ("presence_penalty", 0.5)])
def test_unsupported_fields_answer_400_naming_the_field(field, value):
  error = error_of(client_for(FakeScheduler()).post("/v1/completions", json={"prompt": "x", field: value}))
  assert error["param"] == field and error["message"].startswith(f"{field}=") and "not supported" in error["message"]
  assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
  "body,param,words",
  [
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "n": "many"}, "n", "valid integer"),
    ({"prompt": 5}, "prompt", "prompt=5 is invalid: input should be a valid list or input should be a valid string"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "x", "stop": [""]}, "stop", "empty string"),
    ({"prompt": "x", "reasoning_effort": "max"}, "reasoning_effort", "'instant', 'low', 'medium' or 'high'"),
    ({}, "prompt", "is required"),
  ],
)
def test_invalid_requests_answer_400_not_422(body, param, words):
  error = error_of(client_for(FakeScheduler()).post("/v1/completions", json=body))
  assert error["param"] == param and words in error["message"]


def test_malformed_json_answers_400():
  client = client_for(FakeScheduler())
  response = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
  assert "not valid JSON" in error_of(response)["message"]
  assert "JSON object" in error_of(client.post("/v1/completions", json=["x"]))["message"]


def test_setting_errors_of_the_scheduler_name_the_field():
  scheduler = FakeScheduler(refuse=SettingError("top_p", 0.5, "must be something else"))
  error = error_of(client_for(scheduler).post("/v1/completions", json={"prompt": "x", "top_p": 0.5}))
  assert error["param"] == "top_p" and error["message"] == "top_p=0.5 must be something else"


@pytest.mark.parametrize("value", [2**32, 2**63, 10**30])
@pytest.mark.parametrize("field", ["steps", "steps_per_block", "top_k", "max_tokens", "seed", "n"])
def test_every_integer_field_has_an_upper_bound_named_in_its_400(field, value):
  scheduler = FakeScheduler()
  error = error_of(client_for(scheduler).post("/v1/completions", json={"prompt": "x", field: value}))
  assert error["param"] == field and error["message"].startswith(f"{field}="), error
  assert not scheduler.requests
  bounds = {"steps": 64, "steps_per_block": 4, "top_k": 1000, "max_tokens": 62}  # context 64, block 4, vocab 1000
  if field in bounds:
    assert client_for(scheduler).post("/v1/completions", json={"prompt": "xy", field: bounds[field]}).status_code == 200


def _typed_fields(model, kind: type) -> list[str]:
  """The fields of a request model whose type is ``kind`` or ``kind | None`` (bool is not an int here)."""
  return [name for name, f in model.model_fields.items() if f.annotation in (kind, kind | None)]


def test_every_integer_number_and_boolean_field_takes_its_own_type_only():
  integers = _typed_fields(api.ChatRequest, int)
  assert {"max_tokens", "seed", "n", "top_k", "max_completion_tokens", "steps", "draft_length"} <= set(integers)
  numbers, booleans = _typed_fields(api.ChatRequest, float), _typed_fields(api.ChatRequest, bool)
  assert {"temperature", "top_p", "threshold"} <= set(numbers) and {"stream", "diffusing"} <= set(booleans)
  scheduler = FakeScheduler(template=TEMPLATE)
  client = client_for(scheduler)
  wrong = [(f, v) for f in integers for v in (True, False, 4.0, "4")] + [(f, v) for f in numbers for v in (True, "0.5")]
  wrong += [(f, v) for f in booleans for v in (1, 0, "true")] + [("stream_options", {"include_usage": 1})]
  for field, value in wrong:
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"].startswith(field) and "valid" in error["message"], (field, value, error)
  assert not scheduler.requests
  for field, value in (("best_of", True), ("presence_penalty", False), ("top_logprobs", False)):  # not 1, nor 0
    assert error_of(client.post("/v1/completions", json={"prompt": "x", field: value}))["param"] == field
  ok = {"prompt": "x", "max_tokens": 4, "seed": 1, "n": 1, "top_k": 0, "temperature": 1, "stream": False}
  assert client.post("/v1/completions", json={**ok, "presence_penalty": 0.0, "best_of": 1}).status_code == 200


@pytest.mark.parametrize("field", ["temperature", "top_p", "threshold"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_floats_must_be_finite(field, value):
  body = b'{"prompt": "x", "%s": %s}' % (field.encode(), value)
  response = client_for(FakeScheduler()).post(
    "/v1/completions", content=body, headers={"content-type": "application/json"}
  )
  assert error_of(response)["param"] == field


def test_stop_strings_are_bounded_and_their_quote_in_the_error_is_cut():
  error = error_of(client_for(FakeScheduler()).post("/v1/completions", json={"prompt": "x", "stop": "s" * 1_000_000}))
  assert error["param"] == "stop" and "1000000 characters; at most 256" in error["message"]
  assert len(error["message"]) < 400
  assert client_for(FakeScheduler()).post("/v1/completions", json={"prompt": "x", "stop": "s" * 256}).status_code == 200


# ------------------------------------------------------------------------------------------------ lengths and knobs


def test_max_tokens_defaults_and_the_context_limit():
  scheduler = FakeScheduler(template=TEMPLATE, context=64)
  client = client_for(scheduler)
  client.post("/v1/completions", json={"prompt": "abc"})
  client.post("/v1/completions", json={"prompt": "a" * 60})
  client.post("/v1/fim/completions", json={"prompt": "abc", "suffix": "xyz"})
  client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
  chat_prompt = 1 + len("<user>hi\n<assistant>")
  assert [r.max_tokens for r in scheduler.requests] == [16, 4, 64 - 6, 64 - chat_prompt]
  assert scheduler.requests[2].suffix == tuple(FakeTokenizer().encode("xyz"))
  assert scheduler.requests[3].prompt[0] == BOS

  error = error_of(client.post("/v1/completions", json={"prompt": "a" * 50, "max_tokens": 20}))
  assert error["param"] == "max_tokens" and error["message"] == (
    "prompt has 50 tokens and max_tokens=20, together 70, but the model's context is 64 tokens; lower max_tokens to "
    "at most 14"
  )
  error = error_of(client.post("/v1/fim/completions", json={"prompt": "a" * 30, "suffix": "b" * 30, "max_tokens": 5}))
  assert "prompt has 30 tokens, suffix has 30 tokens and max_tokens=5, together 65" in error["message"]
  error = error_of(client.post("/v1/completions", json={"prompt": "a" * 64}))
  assert error["message"].startswith("prompt has 64 tokens but the model's context is 64 tokens")
  error = error_of(client.post("/v1/completions", json={"prompt": "a" * 70, "max_tokens": 1}))
  assert error["param"] == "prompt" and error["message"].endswith("context is 64 tokens; shorten the prompt")
  error = error_of(
    client.post(
      "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}
    )
  )
  assert error["param"] == "max_completion_tokens" and "max_completion_tokens=500" in error["message"]


def test_reasoning_effort_maps_to_steps_and_threshold_and_explicit_knobs_win():
  scheduler = FakeScheduler(block=16)
  client = client_for(scheduler)
  client.post("/v1/completions", json={"prompt": "x", "reasoning_effort": "instant"})
  client.post("/v1/completions", json={"prompt": "x", "reasoning_effort": "high", "steps_per_block": 3})
  client.post("/v1/completions", json={"prompt": "x", "threshold": 0.5, "temperature": 0, "top_k": 7, "seed": 9})
  first, second, third = scheduler.requests
  assert (first.steps_per_block, first.knobs.threshold) == (api.effort_knobs("instant", 16)) == (2, 0.7)
  assert (second.steps_per_block, second.knobs.threshold) == (3, 0.95)
  assert third.steps_per_block is None and third.knobs == Knobs(temperature=0, top_k=7, top_p=1.0, threshold=0.5)
  assert third.seed == 9


def test_steps_is_the_total_budget_and_steps_per_block_the_blocks_own():
  """``steps`` is spread over the blocks the hole spans, as ``Sampler.generate`` does, never spending more than it:
  below one step per block it answers 400 naming steps; above one step per token it is spent as one step per token."""
  scheduler = FakeScheduler(block=4, context=64)
  client = client_for(scheduler)
  # Token healing generates "b" again: canvas positions 1..17, blocks holding 3, 4, 4, 4 and 2 of them.
  body = {"prompt": "ab", "max_tokens": 16}
  for steps in (5, 8, 16, 60):
    assert client.post("/v1/completions", json={**body, "steps": steps}).status_code == 200
  # 2 a block would take 10 steps, more than 8: 1 a block and the first 3 blocks one more; 3 a block takes
  # 3 + 3 + 3 + 3 + 2 = 14 <= 16, and the first 2 blocks one more; 4 a block (17 steps) is every position.
  assert [(r.steps_per_block, r.extra_steps) for r in scheduler.requests] == [(1, 0), (1, 3), (3, 2), (4, 0)]
  error = error_of(client.post("/v1/completions", json={**body, "steps": 4}))
  assert error["param"] == "steps" and "below the 5 blocks" in error["message"]
  error = error_of(client.post("/v1/completions", json={**body, "steps": 8, "steps_per_block": 2}))
  assert error["param"] == "steps_per_block" and "send one" in error["message"]
  error = error_of(client.post("/v1/completions", json={**body, "steps_per_block": 5}))
  assert error["param"] == "steps_per_block" and "at most 4 (the block" in error["message"]


def test_diffusion_knobs_for_an_autoregressive_model_and_a_foreign_block_length_answer_400():
  client = client_for(FakeScheduler(block=1, autoregressive=True))
  cases = [("steps", 4), ("steps_per_block", 1), ("threshold", 0.5), ("diffusing", True), ("reasoning_effort", "low")]
  for field, value in cases:
    error = error_of(client.post("/v1/completions", json={"prompt": "x", field: value}))
    assert error["param"] == field and "diffusion decoding only; this model is autoregressive" in error["message"]
  assert client.post("/v1/completions", json={"prompt": "x", "temperature": 0.5}).status_code == 200
  verified = client_for(FakeScheduler(block=1, autoregressive=True, decode="verified", draft=4))
  error = error_of(verified.post("/v1/completions", json={"prompt": "x", "steps": 4}))
  assert error["param"] == "steps" and "verified decoding" in error["message"]
  assert "autoregressive" not in error["message"]
  error = error_of(client_for(FakeScheduler(block=4)).post("/v1/completions", json={"prompt": "x", "block_length": 8}))
  assert error["param"] == "block_length" and "block_length=8" in error["message"] and " 4 " in error["message"]


# ------------------------------------------------------------------------------------------------ stop strings


def test_find_stop_and_held_back():
  assert api.find_stop("abc. def", ("z", ". d")) == 3
  assert api.find_stop("abc", ("z",)) is None
  assert api.held_back("Hello wor", ("world",)) == 3
  assert api.held_back("Hello", ("x", "lo!")) == 2
  assert api.held_back("Hello", ()) == 0
  assert api.held_back("xaab", ("aaba",)) == 3 and api.held_back("aaa", ("aab",)) == 2  # Borders, not restarts.
  assert api.held_back("b" * 10, ("a" * 5,)) == 0


def test_held_back_equals_the_longest_stop_prefix_the_text_ends_with():
  rng = __import__("random").Random(0)
  for _ in range(3000):
    stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
    slow = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    assert api.held_back(text, stops) == slow, (text, stops)


def test_the_detokenizer_adds_up_to_the_whole_decode_without_re_decoding_it(data_dir):
  """Bytes of one character split over updates, pieces with leading spaces: the deltas add up to ``decode`` of all
  the ids, and each decode sees a window of the last updates only."""
  from mercury_jax.data.tokenizer import Tokenizer

  tokenizer = Tokenizer.load(data_dir / "tokenizer.model")
  ids = tokenizer.encode("def f(x):\n    return x  # naïve 😀 \u4e2d\u6587 end") * 3
  decoded = []

  class Counting:
    def decode(self, window):
      decoded.append(len(window))
      return tokenizer.decode(window)

  for size in (1, 2, 3, 5):
    detokenizer, text, decoded[:] = Detokenizer(Counting()), "", []
    for i in range(0, len(ids), size):
      piece = detokenizer.add(ids[i : i + size], final=i + size >= len(ids))
      assert "\ufffd" not in piece
      text += piece
    assert text == tokenizer.decode(ids)
    assert max(decoded) <= 6 * size + 8  # A window, never the prefix: no update re-decodes the text so far.
  # The text before a character split over updates goes out with the update; the character waits for its last byte.
  ids = tokenizer.encode("x = 1 \U0001f600")
  cut = next(k for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
  detokenizer = Detokenizer(tokenizer)
  assert detokenizer.add(ids[:cut]) == "x = 1 "
  assert detokenizer.add(ids[cut:]) == "\U0001f600"


def test_stop_straddling_a_block_edge_truncates_and_frees_the_slot():
  scheduler = FakeScheduler("Hello world. Bye", block=4)  # Blocks "Hell" "o wo" "rld." " Bye": "d. B" spans two.
  out = client_for(scheduler).post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": ["d. B", "zz"]})
  choice = out.json()["choices"][0]
  assert (choice["text"], choice["finish_reason"]) == ("Hello worl", "stop")
  assert scheduler.handles[0].cancelled


def test_streamed_deltas_hold_back_a_possible_stop_and_add_up_to_the_answer():
  scheduler = FakeScheduler("Hello world. Bye", block=4)
  client = client_for(scheduler)
  events = sse(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": "d. B", "stream": True}))
  assert events[-1] == "[DONE]"
  chunks = events[:-1]
  assert all(c["object"] == "text_completion" and c["model"] == "fake-model" for c in chunks)
  texts = [c["choices"][0]["text"] for c in chunks]
  assert texts == ["Hell", "o wo", "rl", ""]  # Of "rld.", "d." waits: it may start "d. B".
  assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
  assert len({c["id"] for c in chunks}) == 1


# ------------------------------------------------------------------------------------------------ streaming


def test_stream_with_usage_ends_with_a_usage_chunk_then_done():
  response = client_for(FakeScheduler("Hello world")).post(
    "/v1/completions", json={"prompt": "x", "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
  )
  assert response.headers["content-type"].startswith("text/event-stream")
  assert response.text.startswith('data: {"id":"cmpl-') and response.text.endswith("\n\ndata: [DONE]\n\n")
  events = sse(response)
  assert events[-1] == "[DONE]" and events[-2]["choices"] == []
  assert events[-2]["usage"]["completion_tokens"] == 11 and events[-2]["usage"]["nfe"] == 3
  assert all("usage" not in e for e in events[:-2])
  assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "Hello world"


def test_diffusing_stream_sends_whole_draft_replacements():
  events = sse(
    client_for(FakeScheduler("Hello", block=2)).post(
      "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True, "diffusing": True}
    )
  )[:-1]
  drafts = [e["choices"][0]["diffusing"] for e in events if "diffusing" in e["choices"][0]]
  assert drafts == [
    {"replace": True, "text": "He" + MASK_TEXT * 6},
    {"replace": True, "text": "Hell" + MASK_TEXT * 4},
  ]
  assert all(e["choices"][0]["text"] == "" for e in events if "diffusing" in e["choices"][0])
  assert "".join(e["choices"][0]["text"] for e in events) == "Hello"


def test_diffusing_asks_the_engine_for_drafts_only_when_streaming():
  scheduler = FakeScheduler("Hello", block=2)
  client = client_for(scheduler)
  assert "diffusing" not in client.post("/v1/completions", json={"prompt": "x", "diffusing": True}).text
  sse(client.post("/v1/completions", json={"prompt": "x", "diffusing": True, "stream": True}))
  assert scheduler.diffusing == [False, True]


def test_n_choices_use_streams_of_one_seed_and_interleave_by_index():
  scheduler = FakeScheduler("ab", block=1, per_stream=True)
  client = client_for(scheduler)
  out = client.post("/v1/completions", json={"prompt": "x", "n": 2, "seed": 5, "max_tokens": 10}).json()
  assert [c["text"] for c in out["choices"]] == ["ab0", "ab1"] and out["usage"]["completion_tokens"] == 6
  assert [(r.seed, r.stream) for r in scheduler.requests] == [(5, 0), (5, 1)]
  events = sse(client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 10, "stream": True}))[:-1]
  indices = [e["choices"][0]["index"] for e in events]
  assert indices[:2] == [0, 1]
  for i in (0, 1):
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) == f"ab{i}"
  assert scheduler.requests[2].seed == scheduler.requests[3].seed  # A drawn seed, shared by the choices.


def test_closing_a_stream_cancels_the_running_handles():
  scheduler = FakeScheduler(wait=True)

  async def run():
    handles = [scheduler.submit(None, None), scheduler.submit(None, None)]
    app = create_app(scheduler, None, Options("m"))
    choices = [Choice(i, h, scheduler.tokenizer, (), app.state.metrics) for i, h in enumerate(handles)]
    stream = events(choices, Shape("cmpl-1", "m", chat=False), None, app.state.metrics, "/v1/completions")
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.01)
    task.cancel()  # As sse-starlette does when the client goes away.
    with pytest.raises(asyncio.CancelledError):
      await task
    return handles, app.state.metrics.render()[0].decode()

  handles, metrics = asyncio.run(run())
  assert all(h.cancelled for h in handles)
  assert 'mercury_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics


# ------------------------------------------------------------------------------------------------ chat


def test_chat_template_renders_messages_in_a_sandbox():
  template = ChatTemplate(TEMPLATE)
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
  assert template.render(messages) == "<system>be brief\n<user>hi\n<assistant>"
  assert ChatTemplate("{{ messages | tojson }}").render([{"role": "user", "content": "é"}]).endswith('"é"}]')
  with pytest.raises(TemplateError, match="roles must alternate"):
    ChatTemplate("{{ raise_exception('roles must alternate') }}").render(messages)
  with pytest.raises(TemplateError, match="cannot render"):
    ChatTemplate("{{ messages.append(1) }}").render(messages)  # Immutable: no mutation of the arguments.
  with pytest.raises(TemplateError, match="does not compile"):
    ChatTemplate("{% for %}")


def test_chat_completion_and_its_stream():
  scheduler = FakeScheduler("Sure.", template=TEMPLATE)
  client = client_for(scheduler)
  messages = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
  out = client.post("/v1/chat/completions", json={"messages": messages}).json()
  assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
  assert out["choices"][0]["message"] == {"role": "assistant", "content": "Sure."}
  assert out["choices"][0]["finish_reason"] == "stop"
  assert scheduler.requests[0].prompt == (BOS, *FakeTokenizer().encode("<user>hi\n<assistant>"))

  events = sse(client.post("/v1/chat/completions", json={"messages": messages, "stream": True, "diffusing": True}))
  chunks = events[:-1]
  assert all(c["object"] == "chat.completion.chunk" for c in chunks)
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
  drafts = [c["choices"][0]["delta"] for c in chunks if "diffusing" in c["choices"][0]["delta"]]
  assert drafts and all(set(d) == {"diffusing"} and d["diffusing"]["replace"] for d in drafts)
  content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
  assert content == "Sure." and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_without_a_template_and_with_an_image_answer_400():
  error = error_of(
    client_for(FakeScheduler()).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
  )
  assert error["message"] == "this model has no chat template (data.chat_template in its config); use /v1/completions"
  image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
  error = error_of(client_for(FakeScheduler(template=TEMPLATE)).post("/v1/chat/completions", json={"messages": image}))
  assert error["param"] == "messages[0].content" and "text parts only" in error["message"]


# ------------------------------------------------------------------------------------------------ failures


def test_a_full_queue_answers_429_with_retry_after_and_cancels_what_it_submitted():
  scheduler = FakeScheduler(queue_full_after=1)
  response = client_for(scheduler).post("/v1/completions", json={"prompt": "x", "n": 2})
  error = error_of(response, 429)
  assert response.headers["retry-after"] == "3" and "capacity" in error["message"]
  assert scheduler.handles[0].cancelled


def test_an_engine_error_answers_500_with_a_request_id_not_its_details(caplog):
  client = client_for(FakeScheduler(error="XlaRuntimeError: out of memory at 0x7f00"))
  response = client.post("/v1/completions", json={"prompt": "x"})
  error = error_of(response, 500)
  assert "out of memory" not in response.text and error["type"] == "server_error"
  request_id = error["message"].split("request id ")[1].split(")")[0]
  assert request_id.startswith("cmpl-") and any(
    request_id in r.getMessage() and "out of memory" in r.getMessage() for r in caplog.records
  )
  stream = sse(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
  assert "request id cmpl-" in stream[-2]["error"]["message"] and "memory" not in stream[-2]["error"]["message"]
  assert stream[-1] == "[DONE]"


def test_an_unexpected_failure_answers_500_without_its_text(caplog):
  scheduler = FakeScheduler(refuse=RuntimeError("secret path /home/x"))
  response = TestClient(create_app(scheduler, None, Options("m")), raise_server_exceptions=False).post(
    "/v1/completions", json={"prompt": "x"}
  )
  error = error_of(response, 500)
  assert "secret" not in response.text and "request id req-" in error["message"]
  assert any("secret path" in str(r.exc_info) for r in caplog.records if r.exc_info)


def test_a_failed_engine_answers_503_and_health_says_so():
  scheduler = FakeScheduler(down=True, healthy=False)
  client = client_for(scheduler)
  assert error_of(client.post("/v1/completions", json={"prompt": "x"}), 503)["code"] == "engine_failed"
  response = client.get("/health")
  assert response.status_code == 503 and response.json() == {"status": "engine_failed"}


def test_a_request_past_its_timeout_frees_its_handles_and_gets_504_or_an_error_event():
  scheduler = FakeScheduler(wait=True)
  client = client_for(scheduler, request_timeout=0.2)
  error = error_of(client.post("/v1/completions", json={"prompt": "x", "n": 2}), 504)
  assert error["code"] == "timeout" and "0.2 s" in error["message"]
  assert len(scheduler.handles) == 2 and all(h.cancelled for h in scheduler.handles)
  stream = sse(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
  assert stream[-2]["error"]["code"] == "timeout" and stream[-1] == "[DONE]"
  assert scheduler.handles[-1].cancelled
  slow = FakeScheduler(compiler=FakeCompiler(wait=True))  # A compile that hangs is stopped too.
  body = {"prompt": "x", "response_format": {"type": "json_object"}}
  assert error_of(client_for(slow, request_timeout=0.2).post("/v1/completions", json=body), 504)["code"] == "timeout"
  assert slow.compiler.cancelled == 1 and not slow.requests


def test_a_prompt_end_no_token_starts_with_goes_as_tokenised():
  scheduler = FakeScheduler("Hello")
  assert client_for(scheduler).post("/v1/completions", json={"prompt": "a\u2603"}).status_code == 200
  (request,) = scheduler.requests  # The snowman is past the fake vocabulary: no token writes it.
  assert request.prompt == tuple(FakeTokenizer().encode("a\u2603")) and request.heal == ""


def test_lone_surrogates_in_a_prompt_answer_400():
  body = b'{"prompt": "ab\\ud800c"}'
  response = client_for(FakeScheduler()).post(
    "/v1/completions", content=body, headers={"content-type": "application/json"}
  )
  assert error_of(response)["param"] == "prompt"


# ------------------------------------------------------------------------------------------------ the guard


def test_an_api_key_guards_v1_but_not_health_or_metrics():
  client = client_for(FakeScheduler(), api_key="s3cret")
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
    response = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    error = error_of(response, 401)
    assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
  assert error_of(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
  ok = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
  assert ok.status_code == 200
  assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
  assert 'mercury_requests_total{endpoint="/v1/completions",status="401"} 3.0' in client.get("/metrics").text


def test_a_body_over_the_limit_answers_413_with_or_without_a_length():
  client = client_for(FakeScheduler(), max_body_bytes=2048)
  big = json.dumps({"prompt": "x" * 4096}).encode()
  error = error_of(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
  assert error["code"] == "body_too_large" and "2048 bytes" in error["message"]

  def chunks(data):  # No Content-Length: a chunked body, counted as it arrives.
    for i in range(0, len(data), 512):
      yield data[i : i + 512]

  headers = {"content-type": "application/json"}
  assert error_of(client.post("/v1/completions", content=chunks(big), headers=headers), 413)["code"] == "body_too_large"
  small = json.dumps({"prompt": "x"}).encode()
  assert client.post("/v1/completions", content=chunks(small), headers=headers).status_code == 200


def test_unknown_paths_and_methods_answer_in_openai_shape():
  client = client_for(FakeScheduler())
  assert error_of(client.get("/v1/nothing"), 404)["message"] == "Not Found"
  assert error_of(client.get("/v1/completions"), 405)["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------------------ other endpoints


def test_health_models_and_draining():
  scheduler = FakeScheduler(block=4, context=64)
  app = create_app(scheduler, scheduler.compiler, Options("fake-model"))
  client = TestClient(app)
  assert client.get("/health").json() == {"status": "ok"}
  (card,) = client.get("/v1/models").json()["data"]
  assert (card["id"], card["owned_by"], card["context_length"]) == ("fake-model", "mercury_jax", 64)
  assert (card["block_length"], card["objective"]) == (4, "block_diffusion")
  app.state.drain.draining = True
  response = client.get("/health")
  assert response.status_code == 503 and response.json() == {"status": "draining"}
  response = client.post("/v1/completions", json={"prompt": "x"})
  assert error_of(response, 503)["code"] == "draining"
  assert response.headers["retry-after"] == "1" and response.headers["connection"] == "close"


def test_at_the_grace_limit_plain_requests_answer_503_and_streams_an_error_event_then_done():
  scheduler = FakeScheduler(wait=True)  # Every request runs until it is cancelled.
  slow = FakeScheduler(compiler=FakeCompiler(wait=True))  # A compile that never ends.
  for fake, body in (
    (scheduler, {"prompt": "x", "n": 2}),
    (slow, {"prompt": "x", "response_format": {"type": "json_object"}}),
  ):
    app = create_app(fake, fake.compiler, Options("m", grace=3))
    with TestClient(app) as client:
      client.portal.call(app.state.drain.closing.set)  # The grace limit, as the drain sets it.
      response = client.post("/v1/completions", json=body)
      error = error_of(response, 503)
      assert error["code"] == "shutdown" and "request id " in error["message"] and "3 s" in error["message"]
      assert response.headers["retry-after"] == "1"
      stream = sse(client.post("/v1/completions", json={**body, "stream": True}))
      if fake is scheduler:
        assert stream[-2]["error"]["code"] == "shutdown" and stream[-1] == "[DONE]"
  assert len(scheduler.handles) == 4 and all(h.cancelled for h in scheduler.handles)
  assert slow.compiler.cancelled == 2 and not slow.requests


def test_metrics_read_the_scheduler_and_count_requests_tokens_and_forward_passes():
  scheduler = FakeScheduler("Hello world")
  client = client_for(scheduler)
  client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30})
  client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
  response = client.get("/metrics")
  assert response.headers["content-type"].startswith("text/plain")
  text = response.text
  for line in (
    "mercury_queue_depth 1.0",
    "mercury_busy_slots 2.0",
    "mercury_kv_pages 40.0",
    "mercury_kv_pages_free 31.0",
    "mercury_compilations_total 7.0",
    "mercury_engine_iterations_total 5.0",
    "mercury_engine_seconds_total 2.0",
    "mercury_engine_host_seconds_total 0.25",
    'mercury_engine_phase_seconds_total{phase="admit"} 0.125',
    'mercury_engine_phase_seconds_total{phase="wait"} 1.5',
    'mercury_engine_phase_seconds_total{phase="post"} 0.0625',
    'mercury_engine_steps_total{rows="4"} 3.0',
    'mercury_prefills_total{slots="0"} 1.0',
    "mercury_prefill_chunks_total 3.0",
    "mercury_prefill_chunk_seconds_total 0.5",
    "mercury_generated_tokens_total 11.0",
    'mercury_requests_total{endpoint="/v1/completions",status="200"} 1.0',
    'mercury_requests_total{endpoint="/v1/completions",status="400"} 1.0',
    "mercury_request_nfe_count 1.0",
    "mercury_request_nfe_sum 3.0",
    "mercury_time_to_first_token_seconds_count 1.0",
    "mercury_tokens_per_forward_count 1.0",
  ):
    assert line in text, line
  answering = float(text.split("\nmercury_answer_seconds_total ")[1].split()[0])
  assert 0 < answering < 1  # the reply's detokenising and encoding, timed
  scheduler.compilations = 9
  assert "mercury_compilations_total 9.0" in client.get("/metrics").text


# ------------------------------------------------------------------------------------------------ structured output

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {
  "type": "function",
  "function": {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
  },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_reaches_every_choice_as_its_constraint_whatever_strict_says(strict):
  scheduler = FakeScheduler('{"age":3}', template=TEMPLATE, context=256)
  client = client_for(scheduler)
  response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}}
  out = client.post("/v1/completions", json={"prompt": "x", "n": 2, "response_format": response_format}).json()
  assert [c["text"] for c in out["choices"]] == ['{"age":3}'] * 2
  first, second = scheduler.requests
  assert first.constraint == second.constraint == FakeAutomaton("json_schema", SCHEMA, "CALL0")
  body = {"messages": ASK, "response_format": response_format, "stream": True, "diffusing": True}
  events = sse(client.post("/v1/chat/completions", json=body))
  assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == '{"age":3}'
  client.post("/v1/fim/completions", json={"prompt": "a", "suffix": "b", "response_format": response_format})
  assert [r.constraint.kind for r in scheduler.requests[2:]] == ["json_schema", "json_schema"]
  assert scheduler.requests[3].suffix == tuple(FakeTokenizer().encode("b"))


def test_json_object_and_text_formats():
  scheduler = FakeScheduler("{}")
  client = client_for(scheduler)
  client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}})
  client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "text"}, "stop": "z"})
  client.post("/v1/completions", json={"prompt": "x"})
  assert [r.constraint for r in scheduler.requests] == [FakeAutomaton("json_object", None, "OBJECT"), None, None]


def test_a_structured_answer_cut_by_max_tokens_finishes_with_length():
  out = client_for(FakeScheduler('{"age":31}')).post(
    "/v1/completions", json={"prompt": "x", "max_tokens": 5, "response_format": JSON_SCHEMA}
  )
  assert out.json()["choices"][0]["text"] == '{"age' and out.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
  "response_format,param,words",
  [
    ({"type": "json_schema"}, "response_format.json_schema", "is required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "is required"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name", "is required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema", "dict"),
    (
      {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
      "response_format.json_schema.name",
      "pattern",
    ),
    ({"type": "xml"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ("json", "response_format", "valid dictionary"),
  ],
)
def test_a_malformed_response_format_answers_400_naming_the_field(response_format, param, words):
  scheduler = FakeScheduler()
  error = error_of(
    client_for(scheduler).post("/v1/completions", json={"prompt": "x", "response_format": response_format})
  )
  assert error["param"] == param and words in error["message"], error
  assert not scheduler.requests


def test_a_schema_the_compiler_refuses_answers_400_with_its_keyword_path():
  schema = {"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}
  response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
  scheduler = FakeScheduler()
  error = error_of(
    client_for(scheduler).post("/v1/completions", json={"prompt": "x", "response_format": response_format})
  )
  assert error["param"] == "response_format.json_schema.schema.properties.age.multipleOf"
  assert (
    error["code"] == "invalid_schema" and error["message"] == "multipleOf is not enforced by the automaton; drop it"
  )
  assert not scheduler.requests


def test_nan_and_infinity_in_a_schema_answer_400_naming_their_path_without_a_log_line(caplog):
  deep = {"type": "number", "minimum": float("nan")}
  for _ in range(300):
    deep = {"type": "array", "items": deep}
  cases = [
    ({"type": "number", "minimum": float("nan")}, "response_format.json_schema.schema.minimum"),
    ({"enum": [1, float("inf")]}, "response_format.json_schema.schema.enum[1]"),
    (deep, "response_format.json_schema.schema" + ".items" * 300 + ".minimum"),
  ]
  scheduler = FakeScheduler(template=TEMPLATE)
  client = client_for(scheduler)
  for schema, param in cases:
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    body = json.dumps({"prompt": "x", "response_format": response_format}).encode()  # NaN, as Python writes it
    error = error_of(post_raw(client, body))
    assert error["param"] == param and "finite" in error["message"], error
  tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": float("-inf")}}}
  body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
  response = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
  assert error_of(response)["param"] == "tools[0].function.parameters.maximum"
  assert not scheduler.compiler.compiled and not scheduler.requests
  assert not [r for r in caplog.records if r.levelno >= 30], caplog.records  # no warning, no error, no traceback
  assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_structured_output_off_answers_400():
  client = client_for(FakeScheduler(template=TEMPLATE, context=256, compiler=None))
  error = error_of(client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}}))
  assert error["param"] == "response_format" and "off on this server" in error["message"]
  error = error_of(client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}))
  assert error["param"] == "tools" and "off on this server" in error["message"]
  assert client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}).json()


@pytest.mark.parametrize(
  "extra,param,words",
  [
    ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop", "response_format json_object"),
    ({"tools": [WEATHER], "tool_choice": "required", "stop": ["x"]}, "stop", "a required tool call"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tool_choice 'auto'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "pattern"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "x" * 65}}]}, "tools[1].function.name", "pattern"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "repeats the name of tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "is required"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}, "tools[0].function.parameters", ""),
    (
      {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}]},
      "tools[0].function.parameters.type",
      "must be 'object'",
    ),
    ({"tools": {"name": "a"}}, "tools", "valid list"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
      {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
      "tool_choice",
      "'add', which is not among the tools (get_weather)",
    ),
  ],
)
def test_bad_tools_and_combinations_answer_400_naming_the_field(extra, param, words):
  scheduler = FakeScheduler(template=TEMPLATE, context=256)
  error = error_of(client_for(scheduler).post("/v1/chat/completions", json={"messages": ASK, **extra}))
  assert error["param"] == param and words in error["message"], error
  assert not scheduler.requests and not scheduler.compiler.compiled


@pytest.mark.parametrize("field,value", [("tools", [WEATHER]), ("tool_choice", "required")])
def test_tools_on_completions_answer_400_naming_the_field(field, value):
  error = error_of(client_for(FakeScheduler()).post("/v1/completions", json={"prompt": "x", field: value}))
  assert error["param"] == field and "/v1/chat/completions only" in error["message"]


def test_tool_parameters_the_compiler_refuses_answer_400_naming_the_tool():
  bad = {"type": "function", "function": {"name": "half", "parameters": {"properties": {"x": {"multipleOf": 0.5}}}}}
  client = client_for(FakeScheduler(template=TEMPLATE, context=256))
  for tool_choice in ("auto", {"type": "function", "function": {"name": "half"}}):
    body = {"messages": ASK, "tools": [WEATHER, bad], "tool_choice": tool_choice}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"] == "tools[1].function.parameters.properties.x.multipleOf", error
    assert error["code"] == "invalid_schema"


def tool_call_of(message: dict) -> dict:
  """The one call of a chat message, checked for OpenAI's shape."""
  assert message["role"] == "assistant" and message["content"] is None
  (call,) = message["tool_calls"]
  assert set(call) == {"id", "type", "function"} and call["type"] == "function" and call["id"].startswith("call_")
  return call["function"]


@pytest.mark.parametrize(
  "tool_choice,name", [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]
)
def test_required_and_named_tool_choice_constrain_the_reply_to_a_call(tool_choice, name):
  scheduler = FakeScheduler(CALL, template=TEMPLATE, block=8, context=256)
  body = {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": tool_choice, "parallel_tool_calls": True}
  out = client_for(scheduler).post("/v1/chat/completions", json=body).json()
  assert tool_call_of(out["choices"][0]["message"]) == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
  assert out["choices"][0]["finish_reason"] == "tool_calls"
  assert out["usage"]["completion_tokens"] == len(CALL)
  (request,) = scheduler.requests
  assert request.constraint == FakeAutomaton("json_schema", tool_call_schema([WEATHER, ADD], name), "CALL0")


def test_auto_tool_choice_answers_a_call_or_text_and_stop_applies_to_text_only():
  scheduler = FakeScheduler(CALL, template=TEMPLATE, context=256)
  client = client_for(scheduler)
  body = {"messages": ASK, "tools": [WEATHER, ADD], "stop": ["Paris"]}  # tool_choice defaults to "auto".
  out = client.post("/v1/chat/completions", json=body).json()
  assert tool_call_of(out["choices"][0]["message"])["arguments"] == '{"city":"Paris"}'
  assert out["choices"][0]["finish_reason"] == "tool_calls"
  call_schema, auto = scheduler.compiler.compiled
  assert call_schema == FakeAutomaton("json_schema", tool_call_schema([WEATHER, ADD]), "CALL0")
  regex = f"(?:CALL0)|{structured.TEXT_REPLY}"
  assert scheduler.requests[0].constraint == auto == FakeAutomaton("regex", regex, auto.source)

  scheduler.reply = "Sunny in Paris, 20 C."
  out = client.post("/v1/chat/completions", json={**body, "tool_choice": "auto"}).json()
  assert out["choices"][0]["message"] == {"role": "assistant", "content": "Sunny in "}
  assert out["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_none_decodes_plain_text_but_the_template_sees_the_tools():
  template = "{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}" + TEMPLATE
  scheduler = FakeScheduler("{not a call}", template=template, context=256)
  body = {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": "none"}
  out = client_for(scheduler).post("/v1/chat/completions", json=body).json()
  assert out["choices"][0]["message"] == {"role": "assistant", "content": "{not a call}"}
  (request,) = scheduler.requests
  assert request.constraint is None and not scheduler.compiler.compiled
  assert FakeTokenizer().decode(request.prompt[1:]).startswith("[get_weather,add]<user>")


def test_an_incomplete_call_is_answered_as_content_with_length():
  scheduler = FakeScheduler(CALL, template=TEMPLATE, context=256)
  client = client_for(scheduler)
  body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 12}
  out = client.post("/v1/chat/completions", json=body).json()
  assert out["choices"][0]["message"] == {"role": "assistant", "content": CALL[:12]}
  assert out["choices"][0]["finish_reason"] == "length"
  events = sse(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
  assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant"}, {"content": CALL[:12]}]
  assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_streamed_call_is_one_tool_calls_delta_then_the_finish():
  scheduler = FakeScheduler(CALL, template=TEMPLATE, block=4, context=256)
  client = client_for(scheduler)
  body = {"messages": ASK, "tools": [WEATHER, ADD], "stream": True, "stream_options": {"include_usage": True}}
  events = sse(client.post("/v1/chat/completions", json=body))
  assert (
    events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == len(CALL)
  )
  chunks = [e["choices"][0] for e in events[:-2]]
  assert [c["delta"] for c in chunks[::2]] == [{"role": "assistant"}, {}]
  assert [c["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
  (call,) = chunks[1]["delta"]["tool_calls"]
  assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
  assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
  assert set(chunks[1]["delta"]) == {"tool_calls"}

  scheduler.reply = "No call here."
  events = sse(client.post("/v1/chat/completions", json=body))[:-2]
  assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "No call here."
  assert len(events) == 1 + 4 and events[-1]["choices"][0]["finish_reason"] == "stop"  # Streamed as it comes.


def test_earlier_tool_calls_and_tool_results_reach_the_template():
  template = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.id }}:{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
    "{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %}|{% endfor %}<assistant>"
  )
  scheduler = FakeScheduler("It is sunny.", template=template, context=256)
  call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
  messages = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
  ]
  out = client_for(scheduler).post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]}).json()
  assert out["choices"][0]["message"]["content"] == "It is sunny."
  prompt = FakeTokenizer().decode(scheduler.requests[0].prompt[1:])
  assert prompt == "<user>weather in Paris?|<assistant>call_1:get_weather(Paris)|<tool>sunny@call_1|<assistant>"


def test_parse_tool_call_reads_only_a_call_object():
  call = structured.parse_tool_call('{"name":"f","arguments":{"x":"é","y":[1,2]}}')
  assert (call.function.name, call.function.arguments) == ("f", '{"x":"é","y":[1,2]}') and call.id.startswith("call_")
  for text in (
    '{"name":"f"}',
    '{"name":"f","arguments":[]}',
    '{"name":"f","arguments":{}',
    "hi",
    '{"name":1,"arguments":{}}',
  ):
    assert structured.parse_tool_call(text) is None, text


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--constraint-capacity", "5,5"], "--constraint-capacity='5,5' must be three positive integers"),
    (["--constraint-capacity", "0,1,1"], "--constraint-capacity='0,1,1' must be three positive integers"),
    (["--slots", "0"], "--slots=0 must be >= 1"),
    (["--port", "70000"], "--port=70000 must lie in [0, 65535]"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-body-bytes", "10"], "--max-body-bytes=10 must be >= 1024"),
    (["--request-timeout", "0"], "--request-timeout=0.0 must be > 0 seconds"),
    (["--compile-workers", "0"], "--compile-workers=0 must be >= 1"),
    (["--compile-timeout", "nan"], "--compile-timeout=nan must be > 0 seconds"),
    (["--kv-pages", "1"], "--kv-pages=1 must be >= 2 (page 0 is the sink"),
    (["--page-size", "0"], "--page-size=0 must lie in [1, 4096]"),
    (["--max-model-len", "0"], "--max-model-len=0 must be >= 1"),
    (["--prefill-chunk", "-1"], "--prefill-chunk=-1 must lie in [0, 1048576] (0: one pass)"),
    (["--prefill-share", "1"], "--prefill-share=1.0 must lie in [0.05, 0.95]"),
    (["--invariant-tile", "100000"], "--invariant-tile=100000 must lie in [0, 1024]"),
    (["--invariant-tile", "-1"], "--invariant-tile=-1 must lie in [0, 1024]"),
    (["--prefill-share", "nan"], "--prefill-share=nan must lie in [0.05, 0.95]"),
    (["--max-model-len", "1000000"], "--max-model-len=1000000 exceeds the model's context of"),
    (["--no-batch-invariance", "--slots", "0"], "--slots=0 must be >= 1"),
    (["--solver", "rk4"], "--solver='rk4' is unknown; choose one of euler, heun"),
    (["--guidance", "2147483648"], "--guidance=2147483648.0 must lie in [0, 16]"),
    (["--guidance", "nan"], "--guidance=nan must lie in [0, 16]"),
  ],
)
def test_bad_server_flags_are_one_line_and_exit_code_2(flags, message, capsys):
  from mercury_jax.serve.__main__ import main

  with pytest.raises(SystemExit) as exit_info:
    main(flags)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"mercury_jax.serve: error: {message}") and err.count("\n") == 1, err
