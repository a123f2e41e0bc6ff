"""The serving engine's batch buckets and paged key-value cache.

A step runs the smallest bucket of rows (1, 2, 4, ... up to the slots) that holds every busy row, and every row reads
and writes its keys and values through its own page table. So: the paged cache must hold what the dense cache holds
and decode the same tokens (pages smaller than a block, prompts over several pages); a request's tokens must not
depend on its bucket; no load compiles; pages come back on finish, cancellation and failure; and a pool too small
for the queue makes requests wait (or 429 when the queue is full), never fail mid-stream.
"""

from __future__ import annotations

import asyncio
import random
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import drafting, random_checkpoint

from mercury_jax.config import ModelConfig
from mercury_jax.kvcache import SINK, KVCache, PagedKVCache, read_pages
from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.sampling.state import Constraint, State, put_rows, take_rows
from mercury_jax.sampling.text import Row
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.pages import NoPages, PagePool
from mercury_jax.serve.scheduler import QueueFull, Scheduler

PAGED_KINDS = ("block_diffusion", "autoregressive", "verified")


@pytest.fixture(scope="module")
def samplers(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("paged")
  tokenizer = data_dir / "tokenizer.model"
  return {kind: Sampler.from_checkpoint(random_checkpoint(root, kind, tokenizer)) for kind in PAGED_KINDS}


def _requests(count: int, seed: int, prompt_lengths=(1, 3, 7, 13, 25), max_tokens=(4, 24)) -> list[Row]:
  rng = random.Random(seed)
  out = []
  for i in range(count):
    prompt = tuple(rng.randrange(5, 400) for _ in range(rng.choice(prompt_lengths)))
    knobs = Knobs(rng.choice([0.0, 1.0]), rng.choice([0, 10]), rng.choice([1.0, 0.9]), rng.choice([0.6, 1.0]))
    out.append(Row.completion(prompt, rng.randint(*max_tokens), (), knobs, rng.choice([None, 2]), seed=i))
  return out


async def _tokens(scheduler: Scheduler, request: Row) -> tuple[tuple[int, ...], str]:
  tokens, reason = (), None
  async for update in scheduler.submit(request, asyncio.get_running_loop()).updates():
    tokens += update.tokens
    reason = update.finish_reason
  return tokens, reason


def _settled(scheduler: Scheduler, timeout: float = 30.0) -> bool:
  """Whether every page is back within ``timeout`` s (an ended request's row is released at the engine thread's
  next iteration, just after its last update)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if scheduler.free_pages == scheduler.engine.admission.pool.capacity and not scheduler.engine.busy:
      return True
    time.sleep(0.01)
  return False


def _together(scheduler: Scheduler, requests: list[Row]) -> list[tuple[tuple[int, ...], str]]:
  async def main():
    return await asyncio.gather(*(_tokens(scheduler, r) for r in requests))

  return asyncio.run(main())


# ------------------------------------------------------------------------------------------- the paged layout


def test_paged_cache_holds_and_reads_what_the_dense_cache_does():
  cfg = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
  batch, slots, page_size = 3, 21, 5  # 5 pages a row, the last one partly past the row's end
  keys = jax.random.split(jax.random.key(0), 6)
  shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
  dense = KVCache(
    jax.random.normal(keys[0], shape), jax.random.normal(keys[1], shape), jax.random.randint(keys[2], (3, 21), 0, 3)
  )
  per_row = -(-slots // page_size)
  order = np.random.default_rng(0).permutation(np.arange(1, 1 + batch * per_row)).reshape(batch, per_row)
  paged = PagedKVCache.empty(cfg, batch, slots, 1 + batch * per_row + 2, page_size)  # two pages nobody holds
  for row in range(batch):
    one = KVCache(dense.keys[:, row : row + 1], dense.values[:, row : row + 1], dense.segments[row : row + 1])
    paged = paged.insert_row(row, one, jnp.asarray(order[row], jnp.int32))

  def laid_out(cache: PagedKVCache) -> tuple[jax.Array, jax.Array]:
    return tuple(
      jnp.stack([read_pages(p[layer], cache.table, slots) for layer in range(2)]) for p in (cache.keys, cache.values)
    )

  np.testing.assert_array_equal(laid_out(paged)[0], dense.keys)
  chunk_shape = (cfg.num_layers, batch, 7, cfg.num_kv_heads, cfg.head_dim)
  chunk = KVCache(
    jax.random.normal(keys[3], chunk_shape), jax.random.normal(keys[4], chunk_shape), jnp.ones((3, 7), jnp.int32)
  )
  starts = jnp.asarray([0, 4, 17])  # row 1 crosses a page boundary, row 2 runs past its end (dropped there)
  dense, paged = dense.write(chunk, starts), paged.write(chunk, starts)
  for got, want in zip(laid_out(paged), (dense.keys, dense.values), strict=True):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(paged.segments, dense.segments)
  for got, want in zip(paged.rows(starts + 1, 6), dense.rows(starts + 1, 6), strict=True):
    np.testing.assert_array_equal(got, want)
  untouched = paged.keys[:, 1 + batch * per_row :]
  np.testing.assert_array_equal(untouched, 0.0)  # pages nobody holds were never written
  freed = paged.forget(1)
  assert int(freed.table[1].max()) == SINK and int(freed.segments[1].max()) == 0
  forgotten = freed.write(chunk, starts)  # a free row writes to the sink only
  held = np.asarray(order).ravel()
  np.testing.assert_array_equal(
    forgotten.keys[:, held[per_row : 2 * per_row]], paged.keys[:, held[per_row : 2 * per_row]]
  )


def test_page_pool_hands_out_each_page_once_and_takes_them_back():
  pool = PagePool(9)
  a, b = pool.take(0, 3), pool.take(1, 5)
  assert SINK not in a + b and len(set(a + b)) == 8
  with pytest.raises(NoPages):
    pool.take(2, 1)
  pool.give_back(0)
  assert sorted(pool.take(2, 3)) == sorted(a)
  pool.give_back(1), pool.give_back(2), pool.give_back(3)  # a slot without pages gives back nothing
  assert sorted(pool.free) == list(range(1, 9))


@pytest.mark.parametrize("kind", PAGED_KINDS)
def test_paged_rows_equal_the_dense_engine_cache_and_tokens(samplers, kind):
  """Pages of 3 slots (boundaries inside blocks of 4), prompts of 25 and 7 tokens (up to 18 pages): after admission a
  row's pages hold its dense prefill's keys and values, and it decodes the dense engine's tokens."""
  scheduler = Scheduler(samplers[kind], ServeConfig(slots=2, page_size=3, **drafting(kind)))
  engine = scheduler.engine
  requests = _requests(2, seed=1, prompt_lengths=(25, 7))
  command = engine.admission.command()
  dense_rows = []
  for slot, request in enumerate(requests):
    engine.admission.admit(command, slot, request)
    dense_rows.append(engine.prefill(command, slot))
  engine.run(command)  # admissions only
  st = engine.state
  for slot, row in enumerate(dense_rows):
    live = np.asarray(row.cache.segments[0]) != 0
    assert live.sum() > 0
    for pool, want in ((st.cache.keys, row.cache.keys), (st.cache.values, row.cache.values)):
      got = jnp.stack(
        [read_pages(pool[layer], st.cache.table[slot : slot + 1], engine.plan.slots) for layer in range(2)]
      )
      np.testing.assert_array_equal(np.asarray(got)[:, 0, live], np.asarray(want)[:, 0, live])
  finish = jax.jit(lambda p, s: engine.engine.advance(p, s))
  want = [np.asarray(finish(engine.sampler.params, row).z[0]) for row in dense_rows]
  stepper = engine.admission.command()._replace(step=np.ones((), bool))
  for _ in range(200):
    view, _ = engine.run(stepper)
    if not view.unfinished.any():
      break
  for slot in range(2):
    np.testing.assert_array_equal(np.asarray(engine.state.z[slot]), want[slot])


# ------------------------------------------------------------------------------------------- batch buckets


@pytest.fixture(scope="module")
def sixteen(samplers):
  started = {}

  def get(kind: str) -> Scheduler:
    if kind not in started:
      started[kind] = Scheduler(samplers[kind], ServeConfig(slots=16, max_queue=64, **drafting(kind)))
      started[kind].start()
    return started[kind]

  yield get
  for scheduler in started.values():
    scheduler.shutdown(0)


def _record_buckets(scheduler: Scheduler, monkeypatch) -> list[int]:
  sizes, live_rows = [], scheduler.engine.live_rows

  def recorded():
    rows = live_rows()
    sizes.append(len(rows))
    return rows

  monkeypatch.setattr(scheduler.engine, "live_rows", recorded)
  return sizes


@pytest.mark.parametrize("kind", ["block_diffusion", "autoregressive", "structured"])
def test_a_request_decodes_the_same_in_bucket_1_4_and_16_and_no_load_compiles(sixteen, kind, monkeypatch):
  scheduler = sixteen("block_diffusion" if kind == "structured" else kind)
  sizes = _record_buckets(scheduler, monkeypatch)
  others = _requests(15, seed=2)
  target = Row.completion((9, 17, 33), 20, knobs=Knobs(1.0, 0, 1.0, 0.8), seed=7)
  if kind == "structured":
    target = Row.completion(
      (9, 17, 33), 20, knobs=Knobs(1.0, 0, 1.0, 0.8), seed=7, constraint=scheduler.compiler.regex("[a-z]{3,9}")
    )
  compiled = scheduler.compilations
  alone = _together(scheduler, [target])[0]
  assert set(sizes) == {1}
  among_4 = _together(scheduler, [target, *others[:3]])[0]
  assert 4 in sizes and max(sizes) == 4
  among_16 = _together(scheduler, [target, *others])[0]
  assert max(sizes) == 16
  _together(scheduler, others[:2] + others[5:11])  # 8 rows, then fewer as they finish
  assert set(sizes) == set(scheduler.engine.row_buckets)  # the load went through every bucket
  assert alone == among_4 == among_16 and alone[0]
  if kind == "structured":
    text = scheduler.tokenizer.decode(list(alone[0]))
    assert 3 <= len(text) <= 9 and text.isalpha() and text.islower(), text
  assert scheduler.compilations == compiled  # every bucket was compiled at start-up
  assert _settled(scheduler)


def test_a_bucket_reads_its_rows_automata_in_place_and_writes_back_only_their_states():
  """A bucket's constraint keeps the whole batch's automata (a few hundred KiB a row, gathered only behind the hooks'
  ``lax.cond`` on a constrained row): ``view()`` and ``on`` are the bucket's rows' in the bucket's order, through
  a bucket of a bucket too, and ``put_rows`` writes back the rows' automaton states, never the tables."""
  rng, batch = np.random.default_rng(0), 6
  shapes = {"on": (), "start": (), "budgeted": (), "classes": (5,), "table": (3, 4), "distance": (3,), "forced": (3,)}
  shapes |= {name: (7,) for name in ("src", "cls", "dst", "edge_ok")}
  tables = constrained.Tables(**{
    name: jnp.asarray(rng.integers(0, 2, (batch, *shape)), bool) if name in ("on", "budgeted", "edge_ok")
    else jnp.asarray(rng.integers(-1, 50, (batch, *shape)), jnp.int32)
    for name, shape in shapes.items()
  })  # fmt: skip
  dfa, end = jnp.arange(batch, dtype=jnp.int32), 100 + jnp.arange(batch, dtype=jnp.int32)
  st = State(**dict.fromkeys(State._fields))._replace(
    z=jnp.zeros((batch, 4), jnp.int32), constraint=Constraint(tables, dfa, end, jnp.zeros((), jnp.int32))
  )
  rows_ = jnp.asarray([4, 1, 3])
  part = take_rows(st, rows_)
  assert part.constraint.tables is tables  # nothing gathered
  chex.assert_trees_all_equal(part.constraint.view(), jax.tree.map(lambda a: a[rows_], tables))
  np.testing.assert_array_equal(part.constraint.on, tables.on[rows_])
  np.testing.assert_array_equal(part.constraint.dfa, dfa[rows_])
  inner = take_rows(part, jnp.asarray([2, 0]))  # rows 3 and 4 of the batch
  chex.assert_trees_all_equal(inner.constraint.view(), jax.tree.map(lambda a: a[jnp.asarray([3, 4])], tables))
  moved = part._replace(constraint=part.constraint._replace(dfa=jnp.asarray([7, 8, 9], jnp.int32)))
  back = put_rows(st, rows_, moved).constraint
  assert back.tables is tables and back.rows is None
  np.testing.assert_array_equal(back.dfa, [0, 8, 2, 9, 7, 5])
  np.testing.assert_array_equal(back.end, end)


# ------------------------------------------------------------------------------------------- pages come back


def test_pages_come_back_after_200_requests_with_cancellations_and_failures(samplers, monkeypatch):
  scheduler = Scheduler(samplers["block_diffusion"], ServeConfig(slots=4, max_queue=256, kv_pages=1 + 12))
  engine = scheduler.engine
  original = engine.prefill
  failing = {13, 77, 150}  # seeds whose prefill fails: their pages must come back too

  def prefill(command, slot):
    if int(command.keys[slot][1]) in failing:  # a seed's key data is [0, seed]
      raise RuntimeError("injected prefill failure")
    return original(command, slot)

  monkeypatch.setattr(engine, "prefill", prefill)
  scheduler.start()
  rng = random.Random(5)
  requests = _requests(200, seed=3, max_tokens=(1, 40))
  waited = []

  async def one(request: Row, cancel_after: float | None):
    handle = scheduler.submit(request, asyncio.get_running_loop())
    if cancel_after is not None:
      asyncio.get_running_loop().call_later(cancel_after, handle.cancel)
    reasons = [u.finish_reason async for u in handle.updates() if u.done]
    return reasons[-1]

  async def main():
    async def watch():
      while not done.is_set():
        waited.append(scheduler.queue_depth)
        await asyncio.sleep(0.01)

    done = asyncio.Event()
    watcher = asyncio.create_task(watch())
    cancels = [None if r.seed in failing else rng.choice([None, None, 0.0, 0.05, 0.2]) for r in requests]
    out = await asyncio.gather(*(one(r, c) for r, c in zip(requests, cancels, strict=True)))
    done.set()
    await watcher
    return out

  try:
    reasons = asyncio.run(main())
    assert {"cancelled", "error"} <= set(reasons) and reasons.count("error") == len(failing)
    assert set(reasons) <= {"stop", "length", "cancelled", "error"}
    assert max(waited) > 0  # 12 pages for 4 slots: requests really waited for pages
    assert _settled(scheduler) and scheduler.free_pages == 12 and scheduler.busy_slots == 0
  finally:
    scheduler.shutdown(0)


def test_a_small_pool_makes_long_prompts_wait_then_serves_them_and_refuses_what_never_fits(samplers):
  """Pages for one long request at a time: a queue of long prompts is served one after another, each with its solo
  tokens; beyond the queue (3 waiting besides the one the pages take), 429, though rows are free; a request that
  needs more pages than the pool has is refused up front."""
  sampler = samplers["autoregressive"]
  scheduler = Scheduler(sampler, ServeConfig(slots=4, max_queue=3, kv_pages=1 + 8, page_size=8))
  scheduler.start()
  try:
    long = [Row.completion(tuple(range(10 + i, 50 + i)), 16, knobs=Knobs(1.0, 0, 1.0, 1.0), seed=i) for i in range(5)]
    assert (
      scheduler.engine.admission.pages_needed(long[0]) == 8
    )  # a padding slot, 40 and 16 positions: 57 slots, 8 pages
    solo = [_together(scheduler, [r])[0] for r in long[:4]]

    async def main():
      loop = asyncio.get_running_loop()
      with scheduler._lock:  # The engine thread admits nothing meanwhile: the queue fills, then refuses.
        handles = [scheduler.submit(r, loop) for r in long[:4]]
        with pytest.raises(QueueFull):
          scheduler.submit(long[4], loop)
      seen = [scheduler.busy_slots]
      outs = []
      for handle in handles:
        tokens = ()
        async for update in handle.updates():
          tokens += update.tokens
          seen.append(scheduler.busy_slots)
        outs.append((tokens, update.finish_reason))
      return outs, max(seen)

    together, most_busy = asyncio.run(main())
    assert together == solo and most_busy == 1  # one at a time: each takes all 8 pages
    with pytest.raises(SettingError, match="kv-pages"):
      scheduler.check(Row.completion(tuple(range(10, 70)), 60))
    assert _together(scheduler, [Row.completion((5, 6), 4, seed=1)])[0][0]  # later requests are served
  finally:
    scheduler.shutdown(0)
