"""Chunked prefill in the server (``--prefill-chunk``) and the served context (``--max-model-len``).

A prompt whose prefill covers more than a chunk fills its row's pages in chunks (as many per engine iteration as the
command says) while the other rows keep stepping: its pages must end up holding the one-pass prefill's keys and
values and it must decode the same greedy tokens; streams already running must keep receiving tokens while a
16 K-token prompt is prefilled; a request longer than ``--max-model-len`` gets HTTP 400 with its count. How many
chunks an iteration runs (``serve.pacing``) is tested in ``test_pacing.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import types

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from random_models import drafting, random_checkpoint
from test_serve import Server

from mercury_jax.checkpoint import export_params, find_tokenizer, restore_params
from mercury_jax.kvcache import read_pages
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.sampling.text import Row
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.scheduler import Scheduler
from mercury_jax.serve.slots import SlotEngine

KINDS = ("block_diffusion", "autoregressive", "verified")
GREEDY = Knobs(0.0, 0, 1.0, 0.9)
LONG = 8192  # The long prompt of the streaming test (16 K took 34 s here, 8 K 22 s; the chunks, 17, still pace).


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("chunked")
  return {kind: random_checkpoint(root, kind, data_dir / "tokenizer.model") for kind in KINDS}


async def _updates(scheduler: Scheduler, request: Row) -> list:
  return [u async for u in scheduler.submit(request, asyncio.get_running_loop()).updates()]


def _tokens(updates) -> tuple[int, ...]:
  return tuple(t for u in updates for t in u.tokens)


@pytest.mark.parametrize("kind", ["block_diffusion", "verified"])  # the twin's causal prefill: test_chunked_prefill
def test_a_prompt_prefilled_in_chunks_holds_the_one_pass_cache_and_decodes_its_tokens(checkpoints, kind):
  """Chunks of 16 slots (pages of 3: page boundaries inside chunks and blocks); prompts of 90 and 45 tokens fill in
  several iterations, three of 5-7 tokens in one pass. Five slots: the three short rows step in the bucket of 4,
  which no free row is left to pad, so a row still filling pads it and must come out of each step as it went in
  (stepped before its last chunk, its request failed on "skipped slots")."""
  sampler = Sampler.from_checkpoint(checkpoints[kind])
  one_pass = Scheduler(sampler, ServeConfig(slots=5, page_size=3, **drafting(kind)))
  chunked = Scheduler(sampler, ServeConfig(slots=5, page_size=3, prefill_chunk=16, **drafting(kind)))
  engine = chunked.engine
  rng = np.random.default_rng(0)
  lengths = (90, 45, 5, 6, 7)
  requests = [Row.completion(tuple(rng.integers(5, 400, n).tolist()), 20, knobs=GREEDY, seed=n) for n in lengths]
  chunks = [len(engine.admission.chunk_starts(len(r.prompt))) for r in requests[:2]]
  assert (
    min(chunks) >= 3 and engine.admission.bucket(requests[2]) == 0 and one_pass.engine.admission.bucket(requests[0]) > 0
  )
  command, reference = engine.admission.command(), one_pass.engine.admission.command()
  for slot, request in enumerate(requests):
    engine.admission.admit(command, slot, request)
    one_pass.engine.admission.admit(reference, slot, request, pages=False)
  engine.run(command._replace(chunks=np.int32(1)))  # the admissions, the first chunk of the 90-token prompt
  iterations, padded, ran = 1, 0, [engine.timing.chunks]
  while engine.filling:
    assert not engine.busy & set(engine.filling)  # a row steps only once its prefill is whole
    padded += bool(set(engine.live_rows().tolist()) & set(engine.filling))
    engine.run(engine.admission.command()._replace(chunks=np.int32(1 + iterations % 2)))  # 2, 1, 2, ... chunks
    ran.append(engine.timing.chunks)
    iterations += 1
  assert sum(ran) == sum(chunks) and ran[1] == 2 and ran[-1] in (1, 2) and engine.busy == set(range(5))
  assert padded >= 2
  st = engine.state
  for slot in range(5):
    dense = one_pass.engine.prefill(reference, slot).cache  # the one-pass prefill of the same request
    live = np.asarray(dense.segments[0]) != 0
    assert live.sum() >= len(requests[slot].prompt) - 1
    np.testing.assert_array_equal(np.asarray(st.cache.segments[slot])[live], np.asarray(dense.segments[0])[live])
    for pool, values in ((st.cache.keys, dense.keys), (st.cache.values, dense.values)):
      got = jnp.stack([read_pages(pool[layer], st.cache.table[slot : slot + 1], engine.plan.slots) for layer in (0, 1)])
      np.testing.assert_allclose(np.asarray(got)[:, 0, live], np.asarray(values)[:, 0, live], atol=2e-4, rtol=1e-4)
  engine.reset()
  for scheduler in (one_pass, chunked):
    scheduler.start()

  async def main(scheduler):
    return await asyncio.gather(*(_updates(scheduler, r) for r in requests))

  try:
    got = [_tokens(u) for u in asyncio.run(main(chunked))]
    expected = [_tokens(u) for u in asyncio.run(main(one_pass))]
  finally:
    for scheduler in (one_pass, chunked):
      scheduler.shutdown(0)
  assert got == expected and all(got)


def test_streams_keep_flowing_while_an_8k_prompt_is_prefilled(checkpoints, tmp_path):
  """Four lanes of short greedy streams of the twin are running when a prompt of 8 K tokens arrives (a lane
  submits its next stream when the random model ends one with EOS, so four decode all along): it is prefilled in
  chunks of 512 tokens, paced (``serve.pacing``). Every iteration that runs a chunk also steps the streams (each
  lane receives a token, but in the iterations that admit its next stream), so none stalls for the whole prefill,
  and the chunks take about their share of the prefill's time (0.5), not all of it as one chunk per iteration would
  (a chunk here costs many of the tiny model's steps). Then the long request decodes too."""
  params, cfg = restore_params(checkpoints["autoregressive"])
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_length=LONG + 64))  # RoPE: no new weights
  path = export_params(tmp_path / "long", params, cfg, find_tokenizer(checkpoints["autoregressive"])).parent
  scheduler = Scheduler(Sampler.from_checkpoint(path), ServeConfig(slots=5, prefill_chunk=512))
  engine = scheduler.engine
  long = Row.completion(tuple(np.random.default_rng(1).integers(5, 400, LONG).tolist()), 8, knobs=GREEDY)
  chunks = len(engine.admission.chunk_starts(len(long.prompt)))
  assert chunks == LONG // 512 + 1 and max(engine.admission.buckets) == 512 and scheduler.pacer.share == 0.5
  scheduler.start()

  async def main():
    loop = asyncio.get_running_loop()
    times, starts, done = [[] for _ in range(4)], [[] for _ in range(4)], asyncio.Event()

    async def lane(i):
      for k in itertools.count():
        starts[i].append(time.perf_counter())
        handle = scheduler.submit(Row.completion((7 + i, 9 + k), 4096, knobs=GREEDY), loop)
        async for update in handle.updates():
          if update.tokens:
            times[i].append(time.perf_counter())
          if done.is_set():
            handle.cancel()
        if done.is_set():
          return

    lanes = [asyncio.create_task(lane(i)) for i in range(4)]
    while not all(times):
      await asyncio.sleep(0.01)
    submitted, before = time.perf_counter(), scheduler.stats.chunk_seconds
    long_updates = await _updates(scheduler, long)
    first = min(u.time for u in long_updates if u.tokens)
    share = (scheduler.stats.chunk_seconds - before) / (first - submitted)
    done.set()
    await asyncio.gather(*lanes)
    return times, starts, submitted, first, long_updates, share

  try:
    times, starts, submitted, first, long_updates, share = asyncio.run(main())
  finally:
    scheduler.shutdown(0)
  assert len(_tokens(long_updates)) == 8
  assert scheduler.stats.chunks == chunks  # every chunk ran once, counted
  for stream, begun in zip(times, starts, strict=True):
    during = [t for t in stream if submitted < t < first]
    new = sum(submitted < t < first for t in begun)  # streams the lane began during the prefill
    assert len(during) >= chunks - 2 - 2 * new, (len(during), new, chunks)  # a token in (nearly) every chunk's
  assert share < 0.7, share  # about the pacer's 0.5 (one chunk per iteration: above 0.9 here)


def test_a_request_over_max_model_len_gets_400_with_its_count(checkpoints, monkeypatch):
  path = checkpoints["block_diffusion"]
  sampler = Sampler.from_checkpoint(path)
  monkeypatch.setattr(SlotEngine, "warm_up", lambda self: None)  # The check and the sizes need no program.
  scheduler = Scheduler(sampler, ServeConfig(slots=1, max_model_len=48))
  with pytest.raises(SettingError, match="together 50 positions, but the model's context is 48 tokens"):
    scheduler.check(Row.completion(tuple(range(5, 45)), 10))
  assert scheduler.engine.plan.slots <= 4 + 48 and scheduler.engine.admission.pages_per_row == -(-(4 + 48) // 16)
  srv = Server(path, "--slots", "1", "--max-model-len", "48", "--prefill-chunk", "16", quick=True)
  try:
    assert any("requests of up to 48 tokens, prompts prefilled in chunks of 16 tokens" in line for line in srv.log)
    client = srv.client(timeout=120)
    text = "def f(x):\n  return x + 1\n" * 3
    count = len(sampler.tokenizer.encode(text))
    assert 40 <= count <= 47, count
    with pytest.raises(openai.BadRequestError) as error:
      client.completions.create(model="tiny", prompt=text, max_tokens=10)
    message = (
      f"prompt has {count} tokens and max_tokens=10, together {count + 10}, but the model's context is 48 tokens"
    )
    assert error.value.status_code == 400 and message in str(error.value)
    out = client.completions.create(model="tiny", prompt=text, max_tokens=48 - count, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.prompt_tokens == count
  finally:
    srv.stop()


def test_an_iteration_admits_one_pass_prefills_within_the_chunk_budget(checkpoints, monkeypatch):
  """With ``prefill_chunk=32``: prompts whose prefill covers 28 slots are admitted one per iteration (the budget),
  prompts of a few tokens several at once, and a long prompt's admission (its first chunk) spends the whole budget;
  the first waiting request is always admitted. (Admission is the host's: no program runs, none is compiled.)"""
  monkeypatch.setattr(SlotEngine, "warm_up", lambda self: None)
  scheduler = Scheduler(Sampler.from_checkpoint(checkpoints["block_diffusion"]), ServeConfig(slots=6, prefill_chunk=32))
  engine, admission = scheduler.engine, scheduler.engine.admission
  medium = Row.completion(tuple(range(5, 25)), 4)  # its prefill covers 28 slots
  short = Row.completion((5, 6), 4)  # 8 slots
  long = Row.completion(tuple(range(5, 69)), 4)  # 72 slots: chunked
  assert admission.bucket(long) == len(admission.buckets) and admission.bucket(medium) < len(admission.buckets)
  loop = asyncio.new_event_loop()
  try:
    for request in (medium, medium, short, short, long, short):
      scheduler.submit(request, loop)
    counts = []
    while scheduler.queue_depth:
      admitted = scheduler._admit(engine.admission.command())
      counts.append(len(admitted))
      for slot in admitted:  # The slot stays taken, as the engine thread keeps it after running the command.
        scheduler._active[slot] = types.SimpleNamespace(handle=types.SimpleNamespace(cancelled=False))
  finally:
    loop.close()
  assert counts == [1, 1, 2, 1, 1]


def test_a_step_pads_its_bucket_with_free_rows_before_rows_still_being_prefilled():
  """The bucket of 4 for 3 busy rows takes free row 4 before row 3, whose prompt has chunks left; only when no free
  row is left does a filling row pad the bucket (inert there: the first test)."""
  engine = types.SimpleNamespace(busy={0, 1, 2}, filling={3: [8, 16]}, slots=5, row_buckets=(1, 2, 4, 5))
  np.testing.assert_array_equal(SlotEngine.live_rows(engine), [0, 1, 2, 4])
  engine.filling = {3: [8], 4: [8, 16]}  # every other row is filling: the bucket must still be full
  assert SlotEngine.live_rows(engine).tolist() in ([0, 1, 2, 3], [0, 1, 2, 4])
  engine.busy, engine.filling = {0}, {1: [8]}
  np.testing.assert_array_equal(SlotEngine.live_rows(engine), [0])
