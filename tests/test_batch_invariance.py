"""Batch-invariant execution: a row's outputs are bitwise the same whatever rows share its batch, and equal to the
batched pass's up to rounding (tiles and rows are put back where they came from)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.batch_invariance import Tiling, by_rows, positionwise, tiled
from mercury_jax.config import load_config
from mercury_jax.kvcache import KVCache, PagedKVCache
from mercury_jax.model import Transformer

# The bundled models' layer shapes (their matmuls are the ones whose rounding moves with the rows on XLA:CPU).
CFG = load_config(
  "tiny",
  {
    "model.vocab_size": "512",
    "model.max_length": "64",
    "model.d_model": "256",
    "model.num_layers": "2",
    "model.num_heads": "4",
    "model.num_kv_heads": "2",
    "model.head_dim": "64",
    "model.mlp_dim": "704",
  },
).model


def test_tiled_runs_the_function_on_every_row_in_place():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(12, 6)), jnp.float32)
  fn = lambda a: {"product": a @ w, "norm": jnp.sum(a * a, axis=-1)}  # noqa: E731
  want = fn(x)
  for tiling in (Tiling(4), Tiling(5), Tiling(1), Tiling(32), Tiling(4, shards=2), Tiling(3, shards=3)):
    got = jax.jit(lambda x, tiling=tiling: tiled(fn, tiling, x))(x)
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=f"{tiling} {name}")
  with pytest.raises(ValueError, match="split evenly over the 5 data shards"):
    tiled(fn, Tiling(4, shards=5), x)
  # Over the positions of a [batch, length, features] array: outputs keep its leading axes.
  x3 = x.reshape(2, 6, 6)
  got = jax.jit(lambda x3: positionwise(fn, Tiling(4, shards=2), x3))(x3)
  assert got["product"].shape == (2, 6, 5) and got["norm"].shape == (2, 6)
  np.testing.assert_allclose(got["product"], want["product"].reshape(2, 6, 5), rtol=1e-5, atol=1e-5)


def test_by_rows_runs_the_function_on_every_row_in_place():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(6, 3, 7)), jnp.float32)
  fn = lambda a, b: (jax.nn.softmax(a, axis=-1), None if b is None else b + 1)  # noqa: E731
  for shards in (1, 2, 3, 4):  # 4 does not divide 6: pairs of rows (what divides both)
    got, none = jax.jit(lambda x, shards=shards: by_rows(fn, shards, x, None))(x)
    assert none is None
    np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), rtol=1e-6, atol=1e-7)


def _rows_in_batches(apply, inputs, batches=(1, 3, 16)):
  """Row 0 of ``inputs`` (a tuple of [16, ...] arrays) run in batches of each size, at a different position in each
  (the other rows random; the last one 11 rows in, inside a tile of several rows): its outputs per batch size."""
  out = {}
  for size in batches:
    where = {1: 0, 3: 1, 16: 11}.get(size, size // 2)
    batch = tuple(jnp.roll(a[:size], where, axis=0) for a in inputs)  # row 0 now sits at `where`
    out[size] = jax.tree.map(lambda a, where=where: np.asarray(a[where]), apply(*batch))
  return out


@pytest.mark.parametrize("changes", [{}, {"time_conditioning": True, "tie_embeddings": True}], ids=["plain", "tied_t"])
def test_a_rows_logits_do_not_depend_on_its_batch_and_match_the_batched_pass(changes):
  cfg = dataclasses.replace(CFG, **changes)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(5, 512, (16, 24)), jnp.int32)
  t = jnp.asarray(rng.uniform(size=(16,)), jnp.float32)
  params = Transformer(cfg).init(jax.random.key(0), tokens[:1], t[:1] if cfg.time_conditioning else None)["params"]
  tiling = Tiling(8)

  def run(tiling):
    model = Transformer(cfg, tiling=tiling)
    return jax.jit(lambda x, t: model.apply({"params": params}, x, t if cfg.time_conditioning else None))

  invariant, batched = run(tiling), run(None)
  per_size = _rows_in_batches(invariant, (tokens, t))
  for size, logits in per_size.items():
    np.testing.assert_array_equal(logits, per_size[1], err_msg=f"row 0 in a batch of {size}")
  np.testing.assert_allclose(invariant(tokens, t), batched(tokens, t), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_rows_chunk_over_a_cache_does_not_depend_on_its_batch(paged):
  """A block of 8 positions over a cache of 48 slots (what a serving step runs): logits and the chunk's keys."""
  cfg, rng = CFG, np.random.default_rng(3)
  slots, block, page = 48, 8, 16
  shape = (cfg.num_layers, 16, slots, cfg.num_kv_heads, cfg.head_dim)
  keys, values = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
  segments = jnp.asarray(np.where(np.arange(slots) < 40, 1, 0)[None].repeat(16, 0), jnp.int32)
  tokens = jnp.asarray(rng.integers(5, 512, (16, block)), jnp.int32)
  starts = jnp.asarray(rng.integers(8, 40, (16,)), jnp.int32)
  positions = starts[:, None] + jnp.arange(block)[None]
  params = Transformer(cfg).init(jax.random.key(0), tokens[:1])["params"]
  model = Transformer(cfg, tiling=Tiling(32))

  def apply(tokens, starts, positions, keys, values, segments):
    cache = KVCache(keys, values, segments)
    if paged:  # every row's slots on its own pages of one pool, in shuffled order
      rows, per_row = keys.shape[1], slots // page
      order = jnp.asarray(np.random.default_rng(4).permutation(rows * per_row) + 1, jnp.int32)
      table = order.reshape(rows, per_row)

      def pool(a):  # [layers, rows, slots, kv, d] -> [layers, pages, kv, page, d]
        pages = a.reshape(a.shape[0], rows, per_row, page, *a.shape[3:]).swapaxes(3, 4)
        return jnp.zeros((a.shape[0], rows * per_row + 1, *pages.shape[3:]), a.dtype).at[:, table].set(pages)

      cache = PagedKVCache(pool(keys), pool(values), segments, table)
    return model.apply(
      {"params": params},
      tokens,
      segment_ids=jnp.ones_like(tokens),
      positions=positions,
      mask="block_causal",
      diffusion_block=block,
      cache=cache,
      cache_start=starts,
      return_kv=True,
    )

  run = jax.jit(apply)
  batch_first = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [layers, rows, ...] -> [rows, layers, ...]
  inputs = (tokens, starts, positions, batch_first(keys), batch_first(values), segments)
  per_size = _rows_in_batches(
    lambda t, s, p, k, v, seg: (lambda out: (out[0], batch_first(out[1].keys)))(
      run(t, s, p, batch_first(k), batch_first(v), seg)
    ),
    inputs,
  )
  for size, (logits, chunk_keys) in per_size.items():
    np.testing.assert_array_equal(logits, per_size[1][0], err_msg=f"logits of row 0 in a batch of {size}")
    np.testing.assert_array_equal(chunk_keys, per_size[1][1], err_msg=f"keys of row 0 in a batch of {size}")
