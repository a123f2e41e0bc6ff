"""The serving engine in process: slots, continuous batching, per-slot knobs, cancellation and failures, for the three
kinds of checkpoint (block diffusion, the autoregressive twin, whole-sequence diffusion) through the same engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.serve.scheduler import Knobs, QueueFull, Request, Scheduler

KINDS = {
  "block_diffusion": (ModelConfig(causal=False), ObjectiveConfig(block_size=4)),
  "autoregressive": (ModelConfig(causal=True), ObjectiveConfig(name="autoregressive")),
  "whole_sequence": (ModelConfig(causal=False), ObjectiveConfig()),
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
  sched = Scheduler(Sampler.from_checkpoint(path), slots=4, max_queue=64, block_length=block_length)
  sched.start()
  yield sched
  sched.shutdown(0)


def _requests(scheduler: Scheduler, count: int) -> list[Request]:
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
      steps=rng.choice([None, 1, 2]),
    )
    suffix = tuple(encode(" return")) if rng.random() < 0.3 else ()
    out.append(Request(prompt, rng.randint(1, 20), suffix, knobs, seed=i, stream=rng.randint(0, 3)))
  return out


async def _run(scheduler: Scheduler, request: Request):
  updates = [u async for u in scheduler.submit(request, asyncio.get_running_loop()).updates()]
  return updates


def test_every_request_equals_its_solo_run_whatever_runs_beside_it(scheduler):
  requests = _requests(scheduler, 24)

  async def main():
    solo = [(await _run(scheduler, r))[-1] for r in requests]
    compiled = scheduler.compilations
    together = [u[-1] for u in await asyncio.gather(*(_run(scheduler, r) for r in requests))]
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


def test_updates_grow_a_prefix_and_drafts_cover_the_hole(scheduler):
  request = Request(tuple(scheduler.tokenizer.encode("def f(x):")), 16, knobs=Knobs(steps=2), diffusing=True)
  updates = asyncio.run(_run(scheduler, request))
  final = updates[-1].tokens
  for update in updates:
    assert final[: len(update.tokens)] == update.tokens
    if update.draft is not None:
      assert len(update.draft) == 16
  if not scheduler.autoregressive:
    assert sum(u.draft is not None for u in updates) >= 2


def test_cancelled_and_failing_requests_leave_alone_and_the_others_finish(scheduler, monkeypatch):
  good = _requests(scheduler, 6)
  bad = Request((7, 7, 7), 5, seed=99)
  original = scheduler.engine.prefill

  def prefill(command, slot):  # A fault inside the engine, for the bad request only.
    if tuple(command.tokens[slot, :3]) == bad.prompt:
      raise RuntimeError("boom")
    return original(command, slot)

  monkeypatch.setattr(scheduler.engine, "prefill", prefill)

  async def main():
    loop = asyncio.get_running_loop()
    solo = [(await _run(scheduler, r))[-1] for r in good]
    long = scheduler.submit(Request((5, 6), 30, knobs=Knobs(steps=8, threshold=1.0)), loop)
    failing = _run(scheduler, bad)
    tasks = [asyncio.ensure_future(_run(scheduler, r)) for r in good]
    long.cancel()
    failed = await failing
    long_updates = [u async for u in long.updates()]
    return solo, [(await t)[-1] for t in tasks], failed[-1], long_updates[-1]

  solo, together, failed, cancelled = asyncio.run(main())
  assert failed.finish_reason == "error" and "boom" in failed.error
  assert cancelled.done and cancelled.finish_reason == "cancelled"
  assert [u.tokens for u in together] == [u.tokens for u in solo]
  assert scheduler.busy_slots == 0


def test_bad_requests_and_a_full_queue(scheduler, monkeypatch):
  with pytest.raises(ValueError, match="context is 40 tokens"):
    scheduler.check(Request((5,) * 30, 20))
  with pytest.raises(ValueError, match="top_p=0.0 must lie in"):
    scheduler.check(Request((5,), 4, knobs=Knobs(top_p=0.0)))
  monkeypatch.setattr(scheduler, "max_queue", 0)

  async def submit():
    scheduler.submit(Request((5,), 4), asyncio.get_running_loop())

  with pytest.raises(QueueFull, match="at capacity"):
    asyncio.run(submit())
