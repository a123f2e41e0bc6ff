"""A live server under hostile requests: huge knobs, a megabyte stop string, schemas whose automaton explodes, a 50 MB
body, a body slower than its Content-Length, missing and wrong API keys, SIGTERM with 8 requests in flight, and
SIGTERM with requests that outlast the grace period. Real sockets, the official ``openai`` client where it can send
the request, a tiny random-weights checkpoint (what it writes does not matter here).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time
from pathlib import Path

import flax.linen as nn
import httpx
import jax
import jax.numpy as jnp
import openai
import pytest
from random_models import random_checkpoint
from test_serve import Server

from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, DataConfig, ModelConfig, ObjectiveConfig
from mercury_jax.data.tokenizer import EOS_ID
from mercury_jax.model import Transformer

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def f(x):"


def flat_checkpoint(root: Path, tokenizer: Path, context: int, template: str = "", endless: bool = False) -> Path:
  """A block-diffusion checkpoint (blocks of 4) with the random weights of its init: nearly flat distributions, so
  the threshold rule commits one token per step, and EOS ends about one request in four before 400 tokens.
  ``endless``: never EOS, so every request runs to ``max_tokens`` (one embedding dimension is a large constant
  that only EOS's logit reads, negatively)."""
  model = ModelConfig(
    vocab_size=512, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    max_length=context, causal=False,
  )  # fmt: skip
  params = nn.meta.unbox(Transformer(model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  if endless:
    params["embedding"] = params["embedding"].at[:, 0].set(8.0)
    params["head"] = params["head"].at[0].set(0.0).at[0, EOS_ID].set(-30.0)
  cfg = Config(model=model, objective=ObjectiveConfig(block_size=4), data=DataConfig(chat_template=template))
  return export_params(root / "flat", params, cfg, tokenizer).parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir) -> Path:
  return random_checkpoint(tmp_path_factory.mktemp("hostile"), "block_diffusion", data_dir / "tokenizer.model")


@pytest.fixture(scope="module")
def server(checkpoint):
  """Compile jobs stop after 0.5 s, so a schema that slips past the compiler's own size checks answers in time; a
  body must arrive within 1 s."""
  flags = ("--slots", "4", "--api-key", KEY, "--compile-timeout", "0.5", "--body-timeout", "1")
  srv = Server(checkpoint, *flags, quick=True)
  yield srv
  assert srv.stop() == 0, "".join(srv.log)


def _client(srv: Server, key: str = KEY, **kwargs) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, **kwargs)


def _post(srv: Server, body, **kwargs) -> httpx.Response:
  return httpx.post(f"{srv.url}/v1/completions", json=body, headers=AUTH, timeout=60, **kwargs)


def _served(srv: Server) -> None:
  """The server is healthy and answers a normal request in full."""
  assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
  out = _client(srv, timeout=60).completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
  assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1


def _rss(pid: int) -> int:
  """Resident bytes of process ``pid`` and its children (Linux /proc)."""
  total, pids = 0, [pid]
  for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
      try:
        stat = (entry / "stat").read_text()
      except OSError:
        continue
      if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
        pids.append(int(entry.name))
  for p in pids:
    try:
      status = Path(f"/proc/{p}/status").read_text()
    except OSError:
      continue
    total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
  return total


@pytest.mark.parametrize("field", ["steps", "steps_per_block", "top_k", "draft_length"])
def test_knobs_at_2_to_the_31_and_63_answer_400_and_the_engine_goes_on(server, field):
  for value in (2**31, 2**63):
    response = _post(server, {"prompt": PROMPT, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
  _served(server)


def test_a_megabyte_stop_string_answers_400(server):
  response = _post(server, {"prompt": PROMPT, "max_tokens": 4, "stop": "x" * 1_000_000})
  assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
  assert len(response.content) < 1000  # The string is not echoed back.
  _served(server)


@pytest.mark.parametrize(
  "schema",
  [
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 100000}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x{1000000}$"}}, "required": ["a"]},
  ],
  ids=["minLength", "pattern"],  # (a long maxLength is written shorter: a subset, named in x-schema-warnings)
)
def test_schemas_whose_automaton_explodes_answer_400_within_a_second_without_memory_growth(server, schema):
  pid = server.process.pid
  before = _rss(pid)
  response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
  for _ in range(2):  # The second one is answered from the cache of refusals.
    start = time.monotonic()
    response = _post(server, {"prompt": PROMPT, "max_tokens": 4, "response_format": response_format})
    elapsed = time.monotonic() - start
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_schema" and elapsed < 1.0, (elapsed, response.text)
  time.sleep(1.0)  # The killed compiling process's replacement starts.
  grown = _rss(pid) - before
  assert grown < 100 << 20, f"the server and its compiling processes grew by {grown >> 20} MiB"
  _served(server)


def test_a_50_mb_body_answers_413_without_being_read(server):
  pid = server.process.pid
  before = _rss(pid)
  body = b'{"prompt": "' + b"x" * (50 << 20) + b'"}'
  response = httpx.post(
    f"{server.url}/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"}, timeout=60
  )
  assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
  assert _rss(pid) - before < 25 << 20  # The body never reached the server's memory.
  _served(server)


def test_a_missing_or_bad_api_key_answers_401_and_health_and_metrics_stay_open(server):
  with pytest.raises(openai.AuthenticationError) as error:
    _client(server, key="wrong").completions.create(model="m", prompt=PROMPT, max_tokens=4)
  assert error.value.status_code == 401 and error.value.code == "invalid_api_key"
  with pytest.raises(openai.AuthenticationError):
    _client(server, key="wrong").models.list()
  response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
  assert response.status_code == 401 and set(response.json()["error"]) == {"message", "type", "param", "code"}
  assert httpx.get(f"{server.url}/health").status_code == 200
  assert httpx.get(f"{server.url}/metrics").status_code == 200
  assert httpx.get(f"{server.url}/openapi.json").status_code == 401  # The API's description is for its clients.
  assert "/v1/completions" in httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()["paths"]
  assert [m.id for m in _client(server).models.list().data]


def test_a_body_slower_than_its_content_length_answers_408_and_closes_the_connection(server):
  body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
  head = (
    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n"
  ).encode()
  with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
    conn.sendall(head + body)  # 100 bytes short, and nothing more comes
    answer = b""
    while chunk := conn.recv(65536):  # The server answers, then closes: recv returns b"".
      answer += chunk
  status, _, rest = answer.partition(b"\r\n")
  assert status.startswith(b"HTTP/1.1 408"), answer
  error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
  assert error["code"] == "body_timeout" and "1 s" in error["message"] and f"{len(body)} bytes" in error["message"]
  _served(server)


def _complete(url: str, body: dict) -> tuple[int, dict | None]:
  """``(status, outcome)`` of one request; outcome: the finish reason and text of a complete answer, else None."""
  if not body.get("stream"):
    response = httpx.post(url, json=body, timeout=120)
    if response.status_code != 200:
      return response.status_code, None
    choice = response.json()["choices"][0]
    return 200, {"finish_reason": choice["finish_reason"], "text": choice["text"]}
  text, reason, done = "", None, False
  with httpx.stream("POST", url, json=body, timeout=120) as response:
    for line in response.iter_lines():
      if line == "data: [DONE]":
        done = True
      elif line.startswith("data: "):
        event = json.loads(line[len("data: ") :])
        if "error" in event:
          return response.status_code, None
        text += event["choices"][0]["text"]
        reason = event["choices"][0]["finish_reason"] or reason
  return response.status_code, {"finish_reason": reason, "text": text} if done and reason else None


def test_sigterm_with_8_requests_in_flight_loses_none_and_exits_0(tmp_path, data_dir):
  """8 requests (half of them streamed) of about 100 steps each, in 4 slots: SIGTERM once the server has accepted
  all of them (4 running, the others waiting for a slot); each one finishes complete within --grace, and the process
  exits 0.

  A drain that dropped a running or a waiting request, cut a stream short or exited otherwise than 0 fails here as it
  did with 32 requests in 64 slots: uvicorn waits for every open connection and the scheduler for every running and
  waiting request, whatever their number. 4 slots compile 3 batch buckets at start-up where 64 compiled 7.
  Structured output, not used here, is off: its automaton tables make every step's program larger.
  """
  path = flat_checkpoint(tmp_path, data_dir / "tokenizer.model", 128)
  srv = Server(path, "--slots", "4", "--grace", "60", "--constraint-capacity", "0", quick=True)
  try:
    url = f"{srv.url}/v1/completions"
    bodies = [
      {"prompt": PROMPT, "max_tokens": 100, "steps_per_block": 4, "seed": i, "stream": i % 2 == 1} for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
      futures = [pool.submit(_complete, url, body) for body in bodies]
      deadline = time.monotonic() + 60
      while True:
        metrics = httpx.get(f"{srv.url}/metrics").text
        waiting = _sample(metrics, "mercury_queue_depth")
        running = _sample(metrics, "mercury_busy_slots") + waiting
        if running + _sample(metrics, "mercury_requests_total", 'status="200"') >= len(bodies):
          break
        assert time.monotonic() < deadline, f"the server never accepted the {len(bodies)} requests"
        time.sleep(0.02)
      srv.process.send_signal(signal.SIGTERM)
      outcomes = [f.result() for f in futures]
    print(f"{running:.0f} requests in flight at SIGTERM, {waiting:.0f} of them waiting for a slot")
    assert running >= len(bodies) // 2, f"only {running:.0f} requests were in flight at SIGTERM"
    code = srv.stop()
    assert code == 0, "".join(srv.log)
    assert all(status == 200 and outcome is not None for status, outcome in outcomes), outcomes
    assert all(outcome["finish_reason"] in ("stop", "length") for _, outcome in outcomes)
  except Exception as error:
    raise AssertionError(f"{error}\n{srv.kill()}") from error
  finally:
    srv.kill()


def _sample(metrics: str, name: str, labels: str = "") -> float:
  """The value of ``name`` (with ``labels`` among its labels) in a /metrics text; 0 when absent."""
  for line in metrics.splitlines():
    if line.startswith(name) and labels in line and not line.startswith("#"):
      return float(line.rsplit(" ", 1)[1])
  return 0.0


def _outcome(url: str, body: dict) -> dict:
  """What one request got, however it ended: its status, ``Retry-After``, the error (a plain body's, or a stream's
  error event), whether a stream ended with ``[DONE]`` right after its last event, and a transport error (a body cut
  short) as text."""
  out = {"status": None, "retry_after": None, "error": None, "done": False, "finished": False, "transport": None}
  try:
    if not body.get("stream"):
      response = httpx.post(url, json=body, timeout=120)
      out["status"], out["retry_after"] = response.status_code, response.headers.get("retry-after")
      payload = response.json()
      out["error"], out["finished"] = payload.get("error"), "choices" in payload
      return out
    with httpx.stream("POST", url, json=body, timeout=120) as response:
      out["status"] = response.status_code
      events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    out["done"] = events[-1:] == ["[DONE]"]
    last = json.loads(events[-2]) if len(events) >= 2 else {}
    out["error"] = last.get("error")
    out["finished"] = bool(last.get("choices") and last["choices"][0]["finish_reason"])
  except httpx.HTTPError as error:
    out["transport"] = f"{type(error).__name__}: {error}"
  return out


def test_at_the_grace_limit_requests_in_flight_end_with_503_or_an_error_event_then_done(tmp_path, data_dir):
  """2 slots, --max-queue 14, --grace 2: 16 requests of 2,000 tokens at a token per step (about 2 s each on 2 cores,
  none ended early by EOS) arrive at once (all taken: 2 run, 14 wait), a 17th is refused with 429, then SIGTERM. While
  the server drains, /health answers 503 and a new request 503 (the port still listens); at the grace limit every
  request still in flight ends properly: a plain one with 503 (OpenAI's error object, code "shutdown", its request id,
  Retry-After), a stream with that error as an event, then [DONE]; no body is cut short, and the process exits 0
  without a traceback. The plain requests are sent last, so they wait at the grace limit; requests long against the
  test's own pauses keep the 16 held until the 17th arrives (with 400 tokens, some ending at EOS, a slot could free
  first on a loaded machine and the 17th was taken)."""
  path = flat_checkpoint(tmp_path, data_dir / "tokenizer.model", 2048, endless=True)
  flags = ("--slots", "2", "--max-queue", "14", "--grace", "2", "--constraint-capacity", "0")
  srv = Server(path, *flags, quick=True)
  url = f"{srv.url}/v1/completions"
  try:
    bodies = [
      {"prompt": PROMPT, "max_tokens": 2000, "steps_per_block": 4, "seed": i, "stream": i < 12} for i in range(16)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
      futures = [pool.submit(_outcome, url, body) for body in bodies]
      deadline = time.monotonic() + 60
      while True:  # until the 16 are held (or one ended: refused)
        metrics = httpx.get(f"{srv.url}/metrics").text
        held = _sample(metrics, "mercury_busy_slots") + _sample(metrics, "mercury_queue_depth")
        if held >= len(bodies) or any(f.done() for f in futures):
          break
        assert time.monotonic() < deadline, "the server never took the 16 requests"
        time.sleep(0.02)
      full = httpx.post(url, json=bodies[-1], timeout=60)  # 2 busy slots, 14 waiting: no room
      srv.process.send_signal(signal.SIGTERM)
      time.sleep(0.2)
      health = httpx.get(f"{srv.url}/health", timeout=10)
      late = httpx.post(url, json=bodies[-1], timeout=10)
      outcomes = [f.result() for f in futures]
    code = srv.stop()
    log = "".join(srv.log)
  except Exception as error:
    raise AssertionError(f"{error}\n{srv.kill()}") from error
  finally:
    srv.kill()
  assert held == len(bodies), f"{held:.0f} of {len(bodies)} requests held: 429 while slots were free?"
  assert full.status_code == 429 and float(full.headers["retry-after"]) > 0, full.text
  assert full.json()["error"]["type"] == "rate_limit_error" and full.json()["error"]["code"] == "queue_full"
  assert health.status_code == 503 and health.json() == {"status": "draining"}
  assert late.status_code == 503 and late.json()["error"]["code"] == "draining" and late.headers["retry-after"]
  assert code == 0, log
  assert not [o for o in outcomes if o["transport"]], outcomes  # nothing cut mid-body
  streams, plain = outcomes[:12], outcomes[12:]
  for o in plain:
    assert o["finished"] or (o["status"] == 503 and o["retry_after"] and o["error"]["code"] == "shutdown"), o
  for o in streams:
    assert o["status"] == 200 and o["done"] and (o["finished"] or o["error"]["code"] == "shutdown"), o
  ended = [o for o in outcomes if o["error"]]
  assert sum(o in ended for o in plain) and sum(o in ended for o in streams), (outcomes, log)
  assert all("request id cmpl-" in o["error"]["message"] for o in ended)
  assert "Traceback" not in log and "Cancel" not in log and "ASGI" not in log, log
