"""The serving engine in process: slots, continuous batching, per-slot knobs, cancellation and failures, for the three
kinds of checkpoint (block diffusion, the autoregressive twin, whole-sequence diffusion) through the same engine; and
the engine thread surviving a failing step or admission, seen through the real HTTP routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient
from random_models import drafting

from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.sampling.text import Row
from mercury_jax.serve.commands import key_data
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.routes import Options, create_app
from mercury_jax.serve.scheduler import QueueFull, Scheduler, Update

KINDS = {
  "block_diffusion": (ModelConfig(causal=False), ObjectiveConfig(block_size=4)),
  "autoregressive": (ModelConfig(causal=True), ObjectiveConfig(name="autoregressive")),
  "whole_sequence": (ModelConfig(causal=False), ObjectiveConfig()),
  "verified": (ModelConfig(causal=False), ObjectiveConfig(name="verified", draft_length=4)),
}


def _checkpoint(root: Path, kind: str, tokenizer: Path) -> Path:
  model, objective = KINDS[kind]
  model = ModelConfig(
    vocab_size=512, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    max_length=40, causal=model.causal,
  )  # fmt: skip
  params = nn.meta.unbox(Transformer(model).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: p * 8.0, params)  # Sharper distributions than the 0.02 init.
  cfg = Config(model=model, objective=objective, name=kind)
  return export_params(root / kind, params, cfg, tokenizer).parent


@pytest.fixture(scope="module", params=list(KINDS))
def scheduler(request, tmp_path_factory, data_dir):
  path = _checkpoint(tmp_path_factory.mktemp("engine"), request.param, data_dir / "tokenizer.model")
  block_length = 8 if request.param == "whole_sequence" else 0  # The others have their trained block.
  config = ServeConfig(slots=4, max_queue=64, block_length=block_length, **drafting(request.param))
  sched = Scheduler(Sampler.from_checkpoint(path), config)
  sched.start()
  yield sched
  sched.shutdown(0)


def _requests(scheduler: Scheduler, count: int) -> list[Row]:
  rng = random.Random(0)
  encode = scheduler.tokenizer.encode
  out = []
  for i in range(count):
    prompt = tuple(encode(rng.choice(["def f(x):", "import os", "x = 1", "class A:"])))
    knobs = Knobs(
      temperature=rng.choice([0.0, 0.8, 1.0]),
      top_k=rng.choice([0, 0, 10]),
      top_p=rng.choice([1.0, 0.9]),
      threshold=rng.choice([0.6, 1.0]),
    )
    suffix = tuple(encode(" return")) if rng.random() < 0.3 else ()
    per_block = rng.choice([None, 1, 2])
    out.append(Row.completion(prompt, rng.randint(1, 20), suffix, knobs, per_block, seed=i, stream=rng.randint(0, 3)))
  return out


def _whole(updates: list[Update]) -> Update:
  """The last update with every update's new tokens in it: what the request generated."""
  last = updates[-1]
  return Update(sum((u.tokens for u in updates), ()), last.draft, last.done, last.finish_reason, last.nfe, last.error)


async def _run(scheduler: Scheduler, request: Row, diffusing: bool = False):
  updates = [u async for u in scheduler.submit(request, asyncio.get_running_loop(), diffusing=diffusing).updates()]
  return updates


def test_every_request_equals_its_solo_run_whatever_runs_beside_it(scheduler):
  requests = _requests(scheduler, 24)

  async def main():
    solo = [_whole(await _run(scheduler, r)) for r in requests]
    compiled = scheduler.compilations
    together = [_whole(u) for u in await asyncio.gather(*(_run(scheduler, r) for r in requests))]
    return solo, together, scheduler.compilations - compiled

  solo, together, compiled = asyncio.run(main())
  assert [(u.tokens, u.finish_reason) for u in together] == [(u.tokens, u.finish_reason) for u in solo]
  assert compiled == 0
  for request, update in zip(requests, solo, strict=True):
    assert update.done and update.finish_reason in ("stop", "length")
    assert len(update.tokens) <= request.max_tokens
    assert update.finish_reason == "stop" or len(update.tokens) == request.max_tokens
    assert update.nfe >= 1
  assert scheduler.busy_slots == 0 and scheduler.queue_depth == 0


def test_overlapping_the_host_with_the_step_changes_no_token(scheduler, monkeypatch):
  """The engine thread dispatches a step before it reads the previous one's view (a finished row then takes one more
  step before its release): every request gets the tokens, end and forward passes it gets one step at a time."""
  requests = _requests(scheduler, 12)
  original, overlapped = scheduler.engine.dispatch, []

  def dispatch(command, **kwargs):
    overlapped.append(scheduler._pending is not None)
    return original(command, **kwargs)

  monkeypatch.setattr(scheduler.engine, "dispatch", dispatch)

  async def together():
    return [_whole(u) for u in await asyncio.gather(*(_run(scheduler, r) for r in requests))]

  with_overlap = asyncio.run(together())
  assert scheduler.overlap and sum(overlapped) > len(overlapped) // 2  # most steps went out with one still running
  monkeypatch.setattr(scheduler, "overlap", False)
  overlapped.clear()
  one_at_a_time = asyncio.run(together())
  assert not any(overlapped)
  same = lambda u: (u.tokens, u.finish_reason, u.nfe)  # noqa: E731
  assert [same(u) for u in with_overlap] == [same(u) for u in one_at_a_time]


def test_updates_hand_out_new_tokens_and_drafts_cover_the_hole(scheduler):
  """Each update carries the tokens that became final with it; a draft is the whole hole: the final tokens so far,
  then the open block's proposals, then masks. The tokens equal the canvas the engine would have read back whole."""
  request = Row.completion(tuple(scheduler.tokenizer.encode("def f(x):")), 16, steps_per_block=2)
  updates = asyncio.run(_run(scheduler, request, diffusing=True))
  so_far = ()
  for update in updates:
    so_far += update.tokens
    if update.draft is not None:
      assert len(update.draft) == 16 and update.draft[: len(so_far)] == so_far
  assert so_far == _whole(updates).tokens and len(so_far) <= 16
  plain = _whole(asyncio.run(_run(scheduler, Row.completion(request.prompt, 16, steps_per_block=2))))
  assert plain.tokens == so_far
  if not scheduler.autoregressive:
    assert sum(u.draft is not None for u in updates) >= 2


def test_cancelled_and_failing_requests_leave_alone_and_the_others_finish(scheduler, monkeypatch):
  good = _requests(scheduler, 6)
  bad = Row.completion((7, 7, 7), 5, seed=99)
  original = scheduler.engine.prefill

  def prefill(command, slot):  # A fault inside the engine, for the bad request only.
    if tuple(command.tokens[slot, :3]) == bad.prompt:
      raise RuntimeError("boom")
    return original(command, slot)

  monkeypatch.setattr(scheduler.engine, "prefill", prefill)

  async def main():
    loop = asyncio.get_running_loop()
    solo = [_whole(await _run(scheduler, r)) for r in good]
    long = scheduler.submit(Row.completion((5, 6), 30, knobs=Knobs(1.0, 0, 1.0, 1.0), steps_per_block=8), loop)
    failing = _run(scheduler, bad)
    tasks = [asyncio.ensure_future(_run(scheduler, r)) for r in good]
    long.cancel()
    failed = await failing
    long_updates = [u async for u in long.updates()]
    return solo, [_whole(await t) for t in tasks], failed[-1], long_updates[-1]

  solo, together, failed, cancelled = asyncio.run(main())
  assert failed.finish_reason == "error" and "boom" in failed.error
  assert cancelled.done and cancelled.finish_reason == "cancelled"
  assert [u.tokens for u in together] == [u.tokens for u in solo]
  assert scheduler.busy_slots == 0


def test_bad_requests_and_a_full_queue(scheduler, monkeypatch):
  with pytest.raises(ValueError, match="context is 40 tokens"):
    scheduler.check(Row.completion((5,) * 30, 20))
  with pytest.raises(ValueError, match="top_p=0.0 must lie in"):
    scheduler.check(Row.completion((5,), 4, knobs=Knobs(1.0, 0, 0.0, 0.9)))
  # Every number that reaches the engine's int32 and float32 arrays is bounded, so admission cannot overflow.
  for request, field in [
    (Row.completion((5,), 4, knobs=Knobs(1.0, 2**31, 1.0, 0.9)), "top_k"),
    (Row.completion((5,), 4, knobs=Knobs(1.0, 2**63, 1.0, 0.9)), "top_k"),
    (Row.completion((5,), 4, knobs=Knobs(float("inf"), 0, 1.0, 0.9)), "temperature"),
    (Row.completion((5,), 4, knobs=Knobs(1.0, 0, 1.0, float("nan"))), "threshold"),
    (Row.completion((5,), 4, steps_per_block=2**31), "steps_per_block"),
    (Row.completion((5,), 4, seed=2**63), "seed"),
    (Row.completion((5,), 4, stream=-1), "stream"),
  ]:
    with pytest.raises(SettingError) as error:
      scheduler.check(request)
    assert error.value.field == field
  monkeypatch.setattr(scheduler, "max_queue", 1)

  async def fill():
    """With the engine thread held off (the lock is re-entrant for this thread), an idle scheduler takes a request
    per free slot plus max_queue, and refuses the next; then the ones it took run to their end."""
    loop, small = asyncio.get_running_loop(), Row.completion((5,), 4)
    with scheduler._lock:
      handles = [scheduler.submit(small, loop) for _ in range(scheduler.slots + 1)]
      with pytest.raises(QueueFull, match="at capacity"):
        scheduler.submit(small, loop)
    return [[u async for u in handle.updates()][-1].finish_reason for handle in handles]

  assert set(asyncio.run(fill())) <= {"stop", "length"}


def test_an_admission_derives_the_seeds_key_on_the_host_as_jax_does():
  """The engine thread admits while a step runs, so a request's key is not asked of the device (it would wait)."""
  for seed in (0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1):
    expected = np.asarray(jax.random.key_data(jax.random.key(seed)))
    assert key_data(seed).dtype == np.uint32 and (key_data(seed) == expected).all(), seed


# ------------------------------------------------------------------------------------------- failures over HTTP


def _client(scheduler: Scheduler) -> TestClient:
  return TestClient(create_app(scheduler, None, Options("m", token_healing=False)))


def test_a_failing_step_answers_500_and_the_engine_serves_the_next_request(scheduler, monkeypatch, caplog):
  """One jitted step raises: the requests it carried end with 500 (a request id, not the error), the engine starts
  afresh, and the next request is served; /health stays ok."""
  original, admit, armed, fired = scheduler.engine._step, scheduler.engine.admission.admit, [], []

  def admitted(*args, **kwargs):  # the first step after this request is admitted carries it
    armed.append(1)
    return admit(*args, **kwargs)

  def step(*args):
    if armed and not fired:  # not a step the engine dispatched before (a pipelined one may carry no request)
      fired.append(1)
      raise RuntimeError("injected step failure")
    return original(*args)

  monkeypatch.setattr(scheduler.engine.admission, "admit", admitted)
  monkeypatch.setattr(scheduler.engine, "_step", step)
  client = _client(scheduler)
  failed = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0})
  assert failed.status_code == 500 and "injected" not in failed.text
  assert "request id cmpl-" in failed.json()["error"]["message"]
  assert any("injected step failure" in str(r.exc_info) for r in caplog.records if r.exc_info)
  served = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0})
  assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] in ("stop", "length")
  assert client.get("/health").json() == {"status": "ok"} and scheduler.healthy and scheduler.busy_slots == 0


def test_a_failing_admission_fails_that_request_alone(scheduler, monkeypatch):
  original = scheduler.engine.admission.admit

  def admit(command, slot, request):
    if request.seed == 13:
      raise OverflowError("Python int too large to convert to C int")
    return original(command, slot, request)

  monkeypatch.setattr(scheduler.engine.admission, "admit", admit)
  client = _client(scheduler)
  assert client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 4, "seed": 13}).status_code == 500
  assert client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 4, "seed": 14}).status_code == 200
  assert scheduler.healthy


def test_an_engine_that_cannot_start_afresh_turns_health_503(scheduler, monkeypatch):
  """Every step fails and so does the reset: the thread gives up; its requests end with 500, /health says 503 and
  new requests get 503 instead of hanging. (Then the test mends the module's scheduler for the tests after it.)"""
  if scheduler.autoregressive or scheduler.engine.whole_sequence:
    pytest.skip("the engine thread's failure handling does not depend on the kind of model; one kind checks it")

  def fail(*_):
    raise RuntimeError("injected: the device is gone")

  monkeypatch.setattr(scheduler.engine, "_step", fail)
  monkeypatch.setattr(scheduler.engine, "reset", fail)
  client = _client(scheduler)
  try:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      body = {"prompt": "x = 1", "max_tokens": 4}
      statuses = list(pool.map(lambda _: client.post("/v1/completions", json=body).status_code, range(4)))
    assert 500 in statuses and set(statuses) <= {500, 503}, statuses  # 503: sent after the thread gave up.
    assert not scheduler.healthy and client.get("/health").status_code == 503
    response = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 4})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_failed"
  finally:
    monkeypatch.undo()
    scheduler._failure = None
    scheduler.engine.reset()
    scheduler.start()
