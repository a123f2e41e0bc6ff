"""The cached-attention Pallas kernel against its reference, and the reference against brute-force loops.

Every input batch has four rows with different layouts (``_inputs``): a chunk that starts at slot 0 and holds two
segments; a chunk in the middle of a cache with left padding, another document's slots, a dead slot and live slots
after the chunk; a chunk that runs past the cache's last slot and ends in padding; and a padding row. The cache slots
the chunk occupies hold stale, large values, so reading them shows.

Tolerances. float32: the kernel and the reference add the same terms in a different order (online softmax with
rescaling, exp2 instead of exp), a few float32 ulps per term over at most 88 keys; the measured worst case is 1e-6
(absolute, outputs of magnitude about 3), so 2e-5 (absolute and relative) leaves 20x headroom while any masking or
indexing error is O(0.1) or larger (the stale slots add 50 to a value). bfloat16: the reference runs in float32 on
the same bfloat16-rounded inputs; the kernel rounds the probabilities to bfloat16 before the value matmul and the
output to bfloat16; the measured worst case is 3e-3 of the largest reference value (under one bfloat16 ulp, 2^-8),
so the bound is 2e-2 of it (about 5 ulps).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import attention, sharding
from mercury_jax.config import MeshConfig, ModelConfig
from mercury_jax.kernels import blockwise_cached_attention as bca, cached_attention as ca, masks
from mercury_jax.kernels.common import CachedInputs
from mercury_jax.kvcache import SINK, KVCache, PagedKVCache, read_pages
from mercury_jax.model import Transformer

F32 = {"atol": 2e-5, "rtol": 2e-5}
BF16_REL = 2e-2
SMALL = ca.BlockSizes(16, 16, 16)  # Several tiles even on short chunks and caches.


@dataclasses.dataclass(frozen=True)
class Case:
  chunk: int
  slots: int
  heads: int
  kv_heads: int
  mask: str
  diffusion_block: int | None = None
  head_dim: int = 32
  blocks: ca.BlockSizes | None = SMALL

  def __str__(self):
    db = self.diffusion_block or ""
    db = f"tree{self.diffusion_block.nodes}" if isinstance(db, masks.Tree) else db
    tiles = "" if self.blocks is SMALL else "-default" if self.blocks is None else f"-q{self.blocks.block_q}"
    return f"c{self.chunk}s{self.slots}h{self.heads}kv{self.kv_heads}d{self.head_dim}-{self.mask}{db}{tiles}"


def _starts(chunk: int, slots: int) -> np.ndarray:
  """Row 0 starts at slot 0; row 1 in the middle (not on a tile or diffusion-block boundary); row 2 runs past S
  (a one-token chunk starts at S)."""
  return np.array([0, slots // 2 - 3, slots - chunk // 2, 5], np.int32)


def _inputs(case: Case, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  batch, chunk, slots, d = 4, case.chunk, case.slots, case.head_dim
  starts = _starts(chunk, slots)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q = normal(batch, chunk, case.heads, d)
  k, v = normal(batch, chunk, case.kv_heads, d), normal(batch, chunk, case.kv_heads, d)
  cache_k, cache_v = normal(batch, slots, case.kv_heads, d), normal(batch, slots, case.kv_heads, d)
  segments = np.ones((batch, chunk), np.int32)
  segments[0, (chunk + 1) // 2 :] = 3  # Two segments in one chunk (a packed prompt); the second is new to the cache.
  segments[2, chunk - chunk // 4 :] = 0  # Trailing padding in the chunk that runs past S.
  segments[3] = 0  # A padding row.
  cache_segments = np.ones((batch, slots), np.int32)
  cache_segments[1, :3] = 0  # Left padding,
  cache_segments[1, 3:6] = 2  # another document,
  cache_segments[1, slots // 4] = 0  # a dead slot,
  cache_segments[1, slots // 2 - 3 + chunk + 2 :] = 0  # and live slots just after the chunk, then empty ones.
  for b, s in enumerate(starts):  # Stale slots under the chunk: large values that would show if read.
    cache_k[b, s : s + chunk] *= 4.0
    cache_v[b, s : s + chunk] += 50.0
  arrays = [jnp.asarray(x, dtype) for x in (q, k, v)]
  arrays += [jnp.asarray(segments)]
  arrays += [jnp.asarray(x, dtype) for x in (cache_k, cache_v)]
  return CachedInputs(*arrays, jnp.asarray(cache_segments), jnp.asarray(starts))


def _options(case: Case) -> dict:
  return {"mask": case.mask, "diffusion_block": case.diffusion_block}


def _kernel_and_reference(case: Case, dtype, interpret: bool = True):
  args = _inputs(case, dtype)
  kernel = jax.jit(
    lambda *a: ca.cached_attention(CachedInputs(*a), block_sizes=case.blocks, interpret=interpret, **_options(case))
  )
  with jax.default_matmul_precision("highest"):  # No TF32 in the float32 reference on a GPU.
    f32 = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in args]
    want = jax.jit(lambda *a: ca.reference_cached_attention(CachedInputs(*a), **_options(case)))(*f32)
  return kernel(*args).astype(jnp.float32), want


def _check_f32(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32)


def _check_bf16(got, want):
  bound = BF16_REL * float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=bound, rtol=0)


# Each mask (block_causal with blocks 1, 4 and 8), chunks of 1, 4, 8, 16 and 24 tokens, caches whose slot counts are
# and are not multiples of the 16-slot tiles (and one smaller than the chunk), one or two query heads per kv head,
# a head_dim that is not a power of two, and the default (Hopper) tiles shrunk by fit.
CASES = [
  Case(1, 40, 4, 2, "causal"),
  Case(8, 40, 2, 2, "causal"),
  Case(24, 64, 4, 2, "causal"),
  Case(4, 40, 2, 2, "block_causal", 1),
  Case(4, 40, 4, 2, "block_causal", 4),
  Case(8, 64, 4, 2, "block_causal", 8),
  Case(16, 40, 2, 1, "block_causal", 8),
  Case(24, 17, 2, 2, "block_causal", 4),
  Case(1, 40, 2, 2, "bidirectional"),
  Case(16, 64, 4, 2, "bidirectional"),
  Case(24, 40, 2, 2, "bidirectional", blocks=None),
  Case(8, 40, 4, 2, "block_causal", 8, head_dim=48, blocks=None),
  Case(4, 40, 4, 2, "block_causal", 4, blocks=ca.BlockSizes(32, 16, 16)),  # Query tiles of several chunk tokens.
]
BF16_CASES = [CASES[2], CASES[5], CASES[9]]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_kernel_matches_reference(case):
  _check_f32(*_kernel_and_reference(case, jnp.float32))


@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_bfloat16_kernel_matches_reference(case):
  _check_bf16(*_kernel_and_reference(case, jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_float32_kernel_matches_reference(case):
  _check_f32(*_kernel_and_reference(case, jnp.float32, interpret=False))


@pytest.mark.gpu
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_gpu_bfloat16_kernel_matches_reference(case):
  _check_bf16(*_kernel_and_reference(case, jnp.bfloat16, interpret=False))


def _brute_force(q, k, v, segments, cache_k, cache_v, cache_segments, starts, *, mask, diffusion_block):
  """The definition, one query at a time in float64, written out without ``masks``."""
  q, k, v, cache_k, cache_v = (np.asarray(x, np.float64) for x in (q, k, v, cache_k, cache_v))
  segments, cache_segments, starts = (np.asarray(x) for x in (segments, cache_segments, starts))
  batch, chunk, heads, head_dim = q.shape
  groups, slots = heads // k.shape[2], cache_k.shape[1]
  out = np.zeros(q.shape)

  def sees(p, s):
    if mask == "causal":
      return s <= p
    if mask == "block_causal":
      return s // diffusion_block <= p // diffusion_block
    return True

  for b in range(batch):
    start = int(starts[b])
    for i in range(chunk):
      seg, p = segments[b, i], start + i
      if seg == 0:
        continue
      cache = [s for s in range(slots) if not start <= s < start + chunk and sees(p, s) and cache_segments[b, s] == seg]
      own = [j for j in range(chunk) if sees(p, start + j) and segments[b, j] == seg]
      keys = np.concatenate([cache_k[b, cache], k[b, own]])  # [n, kv_heads, head_dim]
      values = np.concatenate([cache_v[b, cache], v[b, own]])
      for h in range(heads):
        logits = keys[:, h // groups] @ q[b, i, h] / np.sqrt(head_dim)
        weights = np.exp(logits - logits.max())
        out[b, i, h] = weights @ values[:, h // groups] / weights.sum()
  return out


@pytest.mark.parametrize("chunk", [1, 4, 8, 16, 24])
@pytest.mark.parametrize(
  "mask,diffusion_block",
  [("causal", None), ("block_causal", 1), ("block_causal", 4), ("block_causal", 8), ("bidirectional", None)],
)
def test_reference_matches_brute_force(chunk, mask, diffusion_block):
  options = {"mask": mask, "diffusion_block": diffusion_block}
  reference = jax.jit(lambda *a: ca.reference_cached_attention(CachedInputs(*a), **options))
  # GQA 2 over 40 slots; for two chunk sizes also one head per kv head over 17 slots (fewer than 24 chunk tokens).
  for slots, heads, kv_heads in [(40, 4, 2)] + ([(17, 2, 2)] if chunk in (8, 24) else []):
    args = _inputs(Case(chunk, slots, heads, kv_heads, mask, diffusion_block, head_dim=16), jnp.float32, seed=chunk)
    got = np.asarray(reference(*args))
    want = _brute_force(*args, **options)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{slots=}")
    np.testing.assert_array_equal(got[3], 0.0)  # The padding row.


@pytest.mark.parametrize(
  "mask,diffusion_block", [("causal", None), ("block_causal", 4), ("block_causal", 8), ("bidirectional", None)]
)
@pytest.mark.parametrize("groups", [1, 2])
def test_loops_count_every_visible_pair_once_and_visit_no_useless_tile(mask, diffusion_block, groups):
  """``cache_ranges`` and ``chunk_ranges`` for every start (0, inside the cache, past its end) and query tile.

  Simulates the kernel's loops without segments: each visible (query, key) pair is counted exactly once and no
  invisible pair is counted; an unmasked range holds only tiles inside the cache that every real query of the tile
  sees whole; every visited tile holds a visible pair. 20 chunk tokens, 70 cache slots, tiles of 16.
  """
  chunk, slots, size = 20, 70, 16
  plan = ca._Plan(
    mask=mask, diffusion_block=diffusion_block or 1, sm_scale=1.0, chunk=chunk, slots=slots, groups=groups,
    head_dim=16, blocks=ca.BlockSizes(size, size, size), interpret=True,
  )  # fmt: skip
  visible = lambda p, s: np.asarray(masks.visible(p, s, mask, block=diffusion_block))
  tiles, starts = np.meshgrid(np.arange(-(-chunk * groups // size)), np.arange(slots + 4), indexing="ij")
  cases = list(zip(tiles.ravel(), starts.ravel(), strict=True))
  each = lambda x: np.broadcast_to(np.asarray(x), (len(cases),))  # A range's bound for every case.
  tile_ids, start_ids = jnp.asarray(tiles.ravel()), jnp.asarray(starts.ravel())
  cache_ranges = [
    (each(begin), each(end), None if bounds is None else tuple(map(each, bounds)))
    for begin, end, bounds in plan.cache_ranges(tile_ids, start_ids)
  ]
  chunk_ranges = [(each(begin), each(end), masked) for begin, end, masked in plan.chunk_ranges(tile_ids, start_ids)]
  for n, (tile, start) in enumerate(cases):
    rows = np.arange(tile * size, min(tile * size + size, chunk * groups))
    pos = (start + rows // groups)[:, None]  # [rows, 1]: each row's query slot
    slot = np.arange(slots)
    truth = visible(pos, slot) & ((slot < start) | (slot >= start + chunk))  # [rows, slots]
    count = np.zeros(truth.shape, int)
    for begin, end, bounds in cache_ranges:
      for t in range(begin[n], end[n]):
        keys = np.arange(t * size, t * size + size)
        if bounds is None:
          assert keys[-1] < slots and truth[:, keys].all(), (start, tile, t)
          count[:, keys] += 1
          continue
        lo, hi = bounds[0][n], bounds[1][n]
        seen = (keys >= lo) & (keys < hi) & (keys < slots) & visible(pos, keys)
        assert seen.any(), (start, tile, t)
        count[:, keys[keys < slots]] += seen[:, keys < slots]
    np.testing.assert_array_equal(count, truth, err_msg=f"cache {start=} {tile=}")
    truth = visible(pos, start + np.arange(chunk))  # [rows, chunk]
    count = np.zeros(truth.shape, int)
    for begin, end, masked in chunk_ranges:
      for t in range(begin[n], end[n]):
        keys = np.arange(t * size, min(t * size + size, chunk))
        seen = visible(pos, start + keys)
        assert masked or seen.all(), (start, tile, t)
        assert seen.any(), (start, tile, t)
        count[:, keys] += seen
    np.testing.assert_array_equal(count, truth, err_msg=f"chunk {start=} {tile=}")


@pytest.mark.parametrize("mask,diffusion_block", [("causal", None), ("block_causal", 8)])
def test_kernel_never_loads_the_tiles_after_the_chunk_or_of_padding(mask, diffusion_block):
  """Under causal, and block_causal with whole diffusion blocks, a row reads only the tiles up to its chunk's start,
  and none that holds only left padding: NaN there (which a load would spread through ``0 * NaN``) changes nothing."""
  case = Case(8, 64, 2, 1, mask, diffusion_block)
  q, k, v, segments, cache_k, cache_v, cache_segments, _ = _inputs(case, jnp.float32)
  starts = jnp.asarray([0, 24, 40, 8], jnp.int32)  # Whole diffusion blocks; rows 1 and 2 start mid-tile.
  cache_segments = cache_segments.at[1, :16].set(0)  # Row 1: a whole tile of left padding.
  want = ca.reference_cached_attention(CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts),
                                       mask=mask, diffusion_block=diffusion_block)  # fmt: skip
  slot = jnp.arange(64)[None, :, None, None]
  unread = (slot >= (starts[:, None, None, None] + 15) // 16 * 16) | (
    (jnp.arange(4) == 1)[:, None, None, None] & (slot < 16)
  )
  poisoned = [jnp.where(unread, jnp.nan, x) for x in (cache_k, cache_v)]
  got = ca.cached_attention(CachedInputs(q, k, v, segments, *poisoned, cache_segments, starts), mask=mask,
                            diffusion_block=diffusion_block, block_sizes=SMALL, interpret=True)  # fmt: skip
  _check_f32(got, want)


def test_padding_queries_and_rows_output_zeros():
  case = Case(8, 40, 4, 2, "bidirectional")
  args = _inputs(case, jnp.float32)
  out = ca.cached_attention(args, mask="bidirectional", block_sizes=SMALL, interpret=True)
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_array_equal(np.asarray(out[3]), 0.0)  # The padding row,
  np.testing.assert_array_equal(np.asarray(out[2, 6:]), 0.0)  # and the chunk's trailing padding.


def _call_with(**changes):
  """``cached_attention`` on small valid arguments (GQA 2, C = 4, S = 32), some of them replaced."""
  args = {
    "q": jnp.zeros((2, 4, 4, 16)),
    "k": jnp.zeros((2, 4, 2, 16)),
    "v": jnp.zeros((2, 4, 2, 16)),
    "segments": jnp.ones((2, 4), jnp.int32),
    "cache_k": jnp.zeros((2, 32, 2, 16)),
    "cache_v": jnp.zeros((2, 32, 2, 16)),
    "cache_segments": jnp.ones((2, 32), jnp.int32),
    "starts": jnp.zeros((2,), jnp.int32),
    "mask": "causal",
  }
  args |= changes
  inputs = CachedInputs(*(args.pop(name) for name in CachedInputs._fields))
  return ca.cached_attention(inputs, **args, interpret=True)


def test_argument_errors_name_the_value():
  kv3 = {"k": jnp.zeros((2, 4, 3, 16)), "v": jnp.zeros((2, 4, 3, 16))}
  with pytest.raises(ValueError, match="kv_heads=3"):
    _call_with(**kv3, cache_k=jnp.zeros((2, 32, 3, 16)), cache_v=jnp.zeros((2, 32, 3, 16)))
  with pytest.raises(ValueError, match="cache_k.shape"):
    _call_with(cache_k=jnp.zeros((2, 32, 2, 8)))
  with pytest.raises(ValueError, match="float16"):
    _call_with(q=jnp.zeros((2, 4, 4, 16), jnp.float16))
  with pytest.raises(ValueError, match=r"segments.shape=\(2, 5\)"):
    _call_with(segments=jnp.ones((2, 5), jnp.int32))
  with pytest.raises(ValueError, match=r"starts.shape=\(\)"):
    _call_with(starts=jnp.int32(0))
  with pytest.raises(ValueError, match="cache_segments.shape"):
    _call_with(cache_segments=jnp.ones((2, 32), jnp.float32))
  with pytest.raises(ValueError, match="mask='block_diffusion'"):
    _call_with(mask="block_diffusion", diffusion_block=4)
  with pytest.raises(ValueError, match="diffusion_block=None"):
    _call_with(mask="block_causal")
  with pytest.raises(ValueError, match="diffusion_block=0"):
    _call_with(mask="block_causal", diffusion_block=0)
  with pytest.raises(ValueError, match="diffusion_block=4"):
    _call_with(diffusion_block=4)
  with pytest.raises(ValueError, match="block_c=24"):
    ca.BlockSizes(16, 16, 24)


def test_fit_shrinks_tiles_to_the_chunk_and_cache():
  blocks = ca.BlockSizes.get_default(128, jnp.bfloat16)
  assert blocks.fit(rows=4, chunk=1, slots=4096) == dataclasses.replace(blocks, block_q=16, block_c=16)
  assert blocks.fit(rows=1024, chunk=256, slots=20).block_k == 32
  assert blocks.fit(rows=1024, chunk=256, slots=4096) == blocks


@pytest.mark.parametrize("mask,diffusion_block", [("causal", None), ("block_causal", 8), ("bidirectional", None)])
def test_kernel_lowers_to_triton_for_gpu(mask, diffusion_block):
  """The GPU lowering (Pallas -> Triton IR) runs on any host; a missing Triton lowering rule fails here.

  Hopper-sized bfloat16 shapes: a one-token decoding step, a block-diffusion block and a prefix-cache suffix, over a
  cache whose slot count is not a multiple of the tiles.
  """
  dtype, batch, heads, kv_heads, head_dim, slots = jnp.bfloat16, 2, 8, 2, 128, 1000
  for chunk in (1, 16, 256):
    shape = jax.ShapeDtypeStruct
    args = (
      shape((batch, chunk, heads, head_dim), dtype),
      shape((batch, chunk, kv_heads, head_dim), dtype),
      shape((batch, chunk, kv_heads, head_dim), dtype),
      shape((batch, chunk), jnp.int32),
      shape((batch, slots, kv_heads, head_dim), dtype),
      shape((batch, slots, kv_heads, head_dim), dtype),
      shape((batch, slots), jnp.int32),
      shape((batch,), jnp.int32),
    )
    fn = jax.jit(lambda *a: ca.cached_attention(CachedInputs(*a), mask=mask, diffusion_block=diffusion_block))
    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_one_compilation_serves_every_start():
  case = Case(4, 40, 2, 2, "block_causal", 4)
  args = _inputs(case, jnp.float32)
  fn = jax.jit(lambda *a: ca.cached_attention(CachedInputs(*a), block_sizes=SMALL, interpret=True, **_options(case)))
  for starts in ([0, 1, 2, 3], [36, 20, 39, 0]):
    args = args._replace(starts=jnp.asarray(starts, jnp.int32))
    _check_f32(fn(*args), ca.reference_cached_attention(CachedInputs(*args), **_options(case)))
  assert fn._cache_size() == 1


# ------------------------------------------------------------------------------------------- paged caches

_KERNEL = jax.jit(ca.cached_attention, static_argnames=("mask", "diffusion_block", "block_sizes", "interpret"))


def _paged(cache_k, cache_v, cache_segments, page_size: int, seed: int = 0):
  """``(pool_k, pool_v, table)``: the dense cache laid out in a pool of pages as ``PagedKVCache`` keeps it.

  Each row's pages lie scattered over the pool in a random order; a page whose slots are all empty (segment 0) is
  the shared sink, page 0. The sink and two pages nobody holds are filled with values 100 times larger, which would
  show if a kernel read them for a live slot.
  """
  rng = np.random.default_rng(seed)
  batch, slots = cache_segments.shape
  per_row = -(-slots // page_size)
  pad = per_row * page_size - slots
  live = np.pad(np.asarray(cache_segments) != 0, ((0, 0), (0, pad))).reshape(batch, per_row, page_size).any(-1)
  pages = 1 + int(live.sum()) + 2
  table = np.zeros((batch, per_row), np.int32)  # Pages with no live slot: the sink.
  table[live] = rng.permutation(np.arange(1, pages))[: int(live.sum())]
  pools = []
  for x in (cache_k, cache_v):
    rows = np.pad(np.asarray(x), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch, per_row, page_size, *x.shape[2:])
    rows = rows.swapaxes(2, 3)  # a page holds each kv head's slots together: [batch, per_row, kv, page_size, d]
    pool = 100.0 * rng.standard_normal((pages, *rows.shape[2:])).astype(rows.dtype)
    pool[table[live]] = rows[live]
    pools.append(jnp.asarray(pool))
  return pools[0], pools[1], jnp.asarray(table)


# Pages of 16 and 32 slots with 16-slot tiles, and of 48 slots with 32-slot tiles (shrunk to 16, or a tile would
# straddle pages 0 and 1 of a row); each mask; GQA 2 and 1; row 1's chunk straddles a page boundary (starts 29 over
# pages of 16 or 32; 17 over 40 slots); caches whose slot counts are (64) and are not (40, 100) whole pages.
PAGED_CASES = [
  (Case(8, 64, 4, 2, "causal"), 16),
  (Case(4, 64, 4, 2, "block_causal", 4), 32),
  (Case(8, 64, 2, 1, "block_causal", 8), 16),
  (Case(16, 40, 4, 2, "bidirectional"), 16),
  (Case(1, 100, 4, 2, "causal", blocks=ca.BlockSizes(16, 32, 16)), 48),
]


def _check_paged_kernel(case, page_size, interpret):
  q, k, v, segments, cache_k, cache_v, cache_segments, first_starts = _inputs(case, jnp.float32)
  # Row 3, a padding row (as a free row in a batch bucket), holds no page: its whole table is on the sink.
  pool_k, pool_v, table = _paged(cache_k, cache_v, cache_segments.at[3].set(0), page_size)
  options = {"block_sizes": case.blocks, "interpret": interpret, **_options(case)}
  for starts in (first_starts, jnp.asarray([16, 15, case.slots - 1, 31], jnp.int32)):
    paged = _KERNEL(CachedInputs(q, k, v, segments, pool_k, pool_v, cache_segments, starts), table=table, **options)
    dense = _KERNEL(CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts), **options)
    with jax.default_matmul_precision("highest"):  # No TF32 in the float32 reference on a GPU.
      want = ca.reference_cached_attention(
        CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts), **_options(case)
      )
    _check_f32(paged, want)
    _check_f32(dense, want)
    _check_f32(paged, dense)


@pytest.mark.parametrize("case,page_size", PAGED_CASES, ids=lambda x: str(x) if isinstance(x, Case) else f"page{x}")
def test_paged_kernel_matches_the_dense_kernel_and_the_reference(case, page_size):
  _check_paged_kernel(case, page_size, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case,page_size", PAGED_CASES, ids=lambda x: str(x) if isinstance(x, Case) else f"page{x}")
def test_gpu_paged_kernel_matches_the_dense_kernel_and_the_reference(case, page_size):
  _check_paged_kernel(case, page_size, interpret=False)


def test_paged_kernel_reads_each_row_through_its_own_table():
  """Rows 0 and 1 swap tables: each now attends over the other's pages (the reference over the swapped layout)."""
  case, page_size = PAGED_CASES[3]
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = _inputs(case, jnp.float32)
  pool_k, pool_v, table = _paged(cache_k, cache_v, cache_segments, page_size)
  options = {"block_sizes": case.blocks, "interpret": True, **_options(case)}
  swapped = table[jnp.asarray([1, 0, 2, 3])]
  got = _KERNEL(CachedInputs(q, k, v, segments, pool_k, pool_v, cache_segments, starts), table=swapped, **options)
  before = _KERNEL(CachedInputs(q, k, v, segments, pool_k, pool_v, cache_segments, starts), table=table, **options)
  swapped_k, swapped_v = (read_pages(pool, swapped, case.slots) for pool in (pool_k, pool_v))
  want = ca.reference_cached_attention(
    CachedInputs(q, k, v, segments, swapped_k, swapped_v, cache_segments, starts), **_options(case)
  )
  _check_f32(got, want)
  assert float(jnp.min(jnp.max(jnp.abs(got[:2] - before[:2]), axis=(1, 2, 3)))) > 0.1


def test_paged_arguments_and_page_sizes():
  pool = lambda page_size, pages=5: jnp.zeros((pages, 2, page_size, 16))  # [pages, kv_heads, page_size, head_dim]
  for page_size in (8, 24):
    with pytest.raises(ValueError, match=f"page_size={page_size} must be a multiple of 16"):
      _call_with(cache_k=pool(page_size), cache_v=pool(page_size), table=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"table.shape=\(2, 1\) holds 1 pages"):
    _call_with(cache_k=pool(16), cache_v=pool(16), table=jnp.zeros((2, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"table.shape=\(3, 2\)"):
    _call_with(cache_k=pool(16), cache_v=pool(16), table=jnp.zeros((3, 2), jnp.int32))
  with pytest.raises(ValueError, match="paged cache_k.shape"):
    _call_with(cache_k=pool(16), cache_v=pool(16, pages=6), table=jnp.zeros((2, 2), jnp.int32))
  # A tile lies in one page: block_k shrinks to the largest power of two dividing page_size when it does not divide.
  assert [ca.page_block_k(64, size) for size in (16, 32, 48, 80, 128, 256)] == [16, 32, 16, 16, 64, 64]


@pytest.mark.parametrize("page_size", [16, 8])
def test_attend_cached_reads_pages_in_place_with_pallas_and_gathers_them_otherwise(page_size):
  """``implementation="pallas"`` passes pages of 16 slots to the kernel with no gather and gathers pages of 8
  (which the kernel cannot tile); ``xla`` always gathers. Both equal the reference over the dense cache."""
  case = Case(8, 64, 4, 2, "causal")
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = _inputs(case, jnp.float32)
  pool_k, pool_v, table = _paged(cache_k, cache_v, cache_segments, page_size)
  want = ca.reference_cached_attention(
    CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts), mask="causal"
  )
  args = CachedInputs(q, k, v, segments, pool_k, pool_v, cache_segments, starts)
  for impl in ("pallas", "xla"):
    fn = functools.partial(attention.attend_cached, mask="causal", implementation=impl, table=table)
    _check_f32(jax.jit(fn)(args), want)
    gathers = sum(eqn.primitive.name == "gather" for eqn in jax.make_jaxpr(fn)(args).jaxpr.eqns)
    assert gathers == (0 if impl == "pallas" and page_size == 16 else 2), impl  # One per pool.


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_paged_attend_cached_sharded_equals_the_reference(kv_heads):
  """On a (data 2, fsdp 2, tensor 2) mesh the kernel runs per shard: the tables and segments split by rows, the pools
  whole on every row shard (kv heads over tensor; one kv head, which cannot split, whole on every shard)."""
  case = Case(8, 64, 4, kv_heads, "causal")
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = _inputs(case, jnp.float32)
  pool_k, pool_v, table = _paged(cache_k, cache_v, cache_segments, 16)
  want = ca.reference_cached_attention(
    CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts), mask="causal"
  )
  fn = functools.partial(attention.attend_cached, mask="causal", implementation="pallas", table=table)
  args = CachedInputs(q, k, v, segments, pool_k, pool_v, cache_segments, starts)
  with jax.set_mesh(sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))), nn.logical_axis_rules(sharding.RULES):
    got = jax.jit(fn)(args)
    assert "shard_map" in str(jax.make_jaxpr(fn)(args))
  _check_f32(got, want)


def test_paged_kernel_lowers_to_triton_for_gpu():
  """The paged kernel's GPU lowering: bfloat16 Hopper tiles (block_k 64 shrunk to 16) over pages of 16 slots."""
  dtype, batch, heads, kv_heads, head_dim, slots, page_size, pages = jnp.bfloat16, 2, 8, 2, 128, 1000, 16, 200
  shape = jax.ShapeDtypeStruct
  for chunk in (1, 16):
    args = (
      shape((batch, chunk, heads, head_dim), dtype),
      shape((batch, chunk, kv_heads, head_dim), dtype),
      shape((batch, chunk, kv_heads, head_dim), dtype),
      shape((batch, chunk), jnp.int32),
      shape((pages, kv_heads, page_size, head_dim), dtype),
      shape((pages, kv_heads, page_size, head_dim), dtype),
      shape((batch, slots), jnp.int32),
      shape((batch,), jnp.int32),
      shape((batch, -(-slots // page_size)), jnp.int32),
    )
    fn = jax.jit(
      lambda *a: ca.cached_attention(CachedInputs(*a[:8]), table=a[8], mask="block_causal", diffusion_block=8)
    )
    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_transformer_over_a_paged_cache_gives_the_dense_cache_logits():
  """``attention="pallas"``: a block-causal pass of 8 tokens over a prefilled cache, through pages of 16 slots
  (scattered, a row's unused page on the sink; row 1's chunk straddles a page boundary) and through the dense cache.
  """
  cfg = ModelConfig(
    vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, max_length=64,
    dtype="float32", attention="pallas",
  )  # fmt: skip
  model = Transformer(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(5, 64, (2, 28)), jnp.int32)
  params = model.init(jax.random.key(0), tokens[:, :8])["params"]
  prefill = Transformer(dataclasses.replace(cfg, attention="xla"))
  _, kv = prefill.apply({"params": params}, tokens[:, :20], mask="block_causal", diffusion_block=4, return_kv=True)
  dense = KVCache.empty(cfg, 2, 48).write(kv, 0)
  paged = PagedKVCache.empty(cfg, 2, 48, pages=8, page_size=16)
  for row, pages in enumerate(([5, 2, SINK], [7, 1, 3])):
    one = KVCache(dense.keys[:, row : row + 1], dense.values[:, row : row + 1], dense.segments[row : row + 1])
    paged = paged.insert_row(row, one, jnp.asarray(pages, jnp.int32))
  paged = paged._replace(segments=paged.segments.at[1, 13:].set(0))  # Row 1 resumes at slot 13.
  dense = dense._replace(segments=paged.segments)
  starts = jnp.asarray([20, 13], jnp.int32)
  chunk = jnp.stack([tokens[0, 20:28], tokens[1, 13:21]])
  positions = starts[:, None] + jnp.arange(8)[None, :]

  @jax.jit
  def logits(cache):
    return model.apply(
      {"params": params}, chunk, positions=positions, mask="block_causal", diffusion_block=4, cache=cache,
      cache_start=starts,
    )  # fmt: skip

  want = logits(dense)
  np.testing.assert_allclose(np.asarray(logits(paged)), np.asarray(want), atol=1e-5, rtol=1e-5)
  swapped = logits(paged._replace(table=paged.table[::-1]))  # The same pass over the other row's pages differs,
  assert float(jnp.max(jnp.abs(swapped - want))) > 1e-3  # by 100 times the tolerance (2e-3 measured).


# ------------------------------------------------------------------------------------------- the XLA path in tiles

# One token and 24 over a cache, block-causal chunks with GQA 2 and 1, a cache smaller than its chunk, the verified
# chunk.
# A draft tree (masks.Tree): 6 nodes, two pre-draft blocks of 3.
TREE = masks.Tree((-1, 0, 0, 1, 2, 1), (0, 1), 3)
TILED_CASES = [
  CASES[0], CASES[2], CASES[4], CASES[6], CASES[7], Case(6, 64, 4, 2, "verify_chunk", 2),
  Case(TREE.size, 64, 4, 2, "verify_chunk", TREE),
]  # fmt: skip


def _one_shot(case: Case, args):
  """The XLA path's one softmax over every slot (``attention._cached_xla``), the tiles' reference."""
  return jax.jit(lambda a: attention._cached_xla(a, case.mask, case.diffusion_block))(args)


@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_the_cache_read_in_tiles_equals_one_softmax_over_every_slot(case):
  """Dense in tiles of 16 and 24 slots (a last tile that overlaps the one before) and paged (pages of 8 and 16 slots:
  tiles of 24 and 32, a last tile past the cache), every bounded mask, chunks that start at slot 0, mid-cache and
  past the end."""
  args = _inputs(case, jnp.float32)
  want = _one_shot(case, args)
  if case.mask != "verify_chunk":
    _check_f32(want, ca.reference_cached_attention(CachedInputs(*args), **_options(case)))
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = args
  for tile, page_size in ((16, None), (24, None), (24, 8), (24, 16)):
    tiled = jax.jit(functools.partial(bca.cached_attention, tile=tile, **_options(case)))
    if page_size is None:
      _check_f32(tiled(args), want)
      continue
    pool_k, pool_v, table = _paged(cache_k, cache_v, cache_segments.at[3].set(0), page_size)
    _check_f32(tiled(args._replace(cache_k=pool_k, cache_v=pool_v), table=table), want)


@pytest.mark.parametrize("mask, diffusion_block", [("causal", None), ("block_causal", 4), ("verify_chunk", 2)])
def test_tiles_past_the_last_visible_slot_are_never_read(mask, diffusion_block):
  """Values of NaN in every tile past the batch's last visible slot: a read would turn the output into NaN (a masked
  score gives weight 0, and 0 * NaN = NaN)."""
  chunk = 6 if mask == "verify_chunk" else 4
  case = Case(chunk, 160, 4, 2, mask, diffusion_block)
  q, k, v, segments, cache_k, cache_v, cache_segments, _ = _inputs(case, jnp.float32)
  starts = jnp.asarray([0, 37, 21, 5], jnp.int32)
  end = int(jnp.max(bca.visible_end(starts, chunk, mask, diffusion_block)))
  first_unread = -(-end // 16) * 16
  poisoned = cache_v.at[:, first_unread:].set(jnp.nan)
  args = CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts)
  got = bca.cached_attention(args._replace(cache_v=poisoned), mask=mask, diffusion_block=diffusion_block, tile=16)
  assert first_unread < 160 and np.isfinite(np.asarray(got)).all()
  _check_f32(got, _one_shot(case, args))


def test_a_rows_result_is_the_same_whatever_the_other_rows_read():
  """Row 0 (a chunk at slot 0) beside a row that reads one tile or nine: bitwise the same, since the extra tiles are
  fully masked for row 0 and leave its softmax state as it was."""
  case = Case(4, 160, 4, 2, "causal")
  args = _inputs(case, jnp.float32)
  tiled = jax.jit(functools.partial(bca.cached_attention, mask="causal", tile=16))
  outs = [np.asarray(tiled(args._replace(starts=jnp.asarray([0, s, 3, 5], jnp.int32)))) for s in (2, 140)]
  np.testing.assert_array_equal(outs[0][0], outs[1][0])


def test_attend_cached_reads_long_caches_in_tiles_and_short_ones_in_one_softmax():
  """Told apart by the program: the tiled reading loops (a while loop), the one-shot softmax does not."""
  chunk, kv = 8, (2, 16)

  def text(slots: int, blockwise=None) -> str:
    q = jax.ShapeDtypeStruct((1, chunk, 4, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, chunk, *kv), jnp.float32)
    cache = jax.ShapeDtypeStruct((1, slots, *kv), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    cache_seg = jax.ShapeDtypeStruct((1, slots), jnp.int32)

    def fn(q, k, v, seg, ck, cv, cs):
      return attention.attend_cached(
        CachedInputs(q, k, v, seg, ck, cv, cs, jnp.zeros((1,), jnp.int32)),
        mask="causal",
        implementation="xla",
        blockwise=blockwise,
      )

    return jax.jit(fn).lower(q, k, k, seg, cache, cache, cache_seg).as_text()

  assert "while" in text(attention.CACHED_BLOCKWISE_MIN_SLOTS)
  assert "while" not in text(attention.CACHED_BLOCKWISE_MIN_SLOTS - 16)
  assert "while" in text(64, blockwise=True)
  chunk, cache = jnp.zeros((1, 4, 2, 16)), jnp.zeros((1, 8, 2, 16))
  segments, cache_segments = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 8), jnp.int32)
  inputs = CachedInputs(chunk, chunk, chunk, segments, cache, cache, cache_segments, jnp.zeros(1, jnp.int32))
  with pytest.raises(ValueError, match="blockwise=True needs a mask"):
    attention.attend_cached(inputs, mask="bidirectional", blockwise=True)
