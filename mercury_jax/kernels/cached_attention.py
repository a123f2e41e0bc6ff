"""Attention of a chunk of new tokens over a key-value cache plus the chunk itself: a Pallas kernel for GPUs (Triton
lowering), forward only, with its plain-``jnp`` reference.

The decoding engine runs a chunk of ``C`` tokens (one token for autoregressive decoding, a block or two for block
diffusion, up to a few hundred for the suffix of a prefix-cached prompt) against a cache of ``S`` slots per row. The
chunk's first token sits at cache slot ``starts[b]``, so its query ``i`` sits at slot ``p = starts[b] + i``. The
chunk's keys and values are *not* in the cache yet (the caller writes them after attending), so the cache slots
``[starts[b], starts[b] + C)`` hold stale values and are never read; the chunk supplies those keys itself. Slots
``>= S`` do not exist in the cache (a prefix-cache chunk may run past its end). In slot space, query ``i`` sees

* the cache slot ``s`` iff ``s`` is outside ``[starts[b], starts[b] + C)``, ``s < S``,
  ``masks.visible(p, s, mask, block=diffusion_block)`` and ``cache_segments[b, s] == segments[b, i]``;
* the chunk key ``j`` iff ``masks.visible(p, starts[b] + j, mask, block=diffusion_block)`` and
  ``segments[b, j] == segments[b, i]``;

and nothing at all if ``segments[b, i] == 0`` (padding). A query that sees no key outputs zeros.

Under ``causal`` only the cache slots below the chunk are visible; under ``bidirectional`` also every slot after it;
under ``block_causal`` the slots below it and, when the chunk does not end on a diffusion-block boundary, the slots
after it up to the end of a query's diffusion block (none when the chunk is whole diffusion blocks).

The kernel (FlashAttention-2's forward pass, Dao 2023, arXiv:2307.08691, scores in the base-2 domain as in
:mod:`flash_attention`) runs one program per (query tile, batch row, key/value head). A query tile holds ``block_q``
rows of the chunk's queries of one key/value head's group, flattened as (chunk token, head of the group), so that
each cache tile is loaded once for the whole group (grouped-query attention without repeating the cache) and a
one-token decoding step still fills a tile's rows with heads. The online softmax streams, with loop bounds computed in
the kernel from the row's ``starts``:

1. the cache tiles below the chunk (``[0, starts)``): whole tiles unmasked, the tile holding ``starts`` masked;
2. the cache tiles after the chunk that some query sees (the first and the last ones masked, those every query of
   the tile sees whole unmasked);
3. the chunk's own keys (whole tiles unmasked, the tiles on the mask's boundary masked).

A row early in its sequence therefore reads only the tiles before its ``starts``. Every range is further clipped to
the cache tiles whose segment ids can match the query tile's (computed in XLA from each tile's smallest and largest
id, as in :mod:`flash_attention`), so left padding and empty slots past a row's sequence cost no loads. Segment ids
are always applied, in every tile. No ``[C, S]`` array is ever built.

Paged caches. The cache is either dense (``cache_k [batch, S, kv_heads, head_dim]``, a row's slots contiguous) or
paged, as :class:`mercury_jax.kvcache.PagedKVCache` keeps it (vLLM's PagedAttention layout, Kwon et al. 2023,
arXiv:2309.06180): one layer's pool of pages ``[pages, kv_heads, page_size, head_dim]`` shared by the rows, and a page
table ``[batch, pages per row]`` that puts row ``b``'s slot ``s`` at slot ``s % page_size`` of page
``table[b, s // page_size]``. The same kernel reads either: a program of a paged cache gets the whole pool of its
key/value head (its ``BlockSpec`` selects the head only) and its row of the table, and loads cache tile ``t`` (slots
``[t * block_k, (t + 1) * block_k)``) from page ``table[b, t * block_k // page_size]`` at offset
``t * block_k % page_size``, one scalar load of the table per tile, the pages read in place, never gathered. A tile
must lie in one page, so ``block_k`` must divide ``page_size``: ``block_k`` (a power of two) shrinks to the largest
power of two that divides ``page_size``, and a ``page_size`` that is not a multiple of 16 (the smallest Triton tile)
is a ``ValueError`` (:func:`mercury_jax.attention.attend_cached` gathers such pages into a dense cache instead). The
segment ids stay one dense ``[batch, S]`` array in both layouts; the loop bounds are the same.

Shapes need no alignment: the query rows and the chunk's keys are zero-padded to whole tiles (cheap, chunk-sized);
the cache is read in place and its last, partial tile is loaded with a masked load. A ``head_dim`` that is not a power
of two >= 16 (Triton tiles must be) is zero-padded, which copies the cache (the whole pool of a paged one): size heads
as powers of two. float32 inputs use IEEE float32 dots (no TF32), so float32 is the exact mode; bfloat16 inputs use
tensor cores with float32 accumulation, the probabilities rounded to bfloat16 before the value matmul as in every
FlashAttention.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mercury_jax.kernels import common, masks
from mercury_jax.kernels.common import CachedInputs, cdiv, clip, dot

PAGE_MULTIPLE = common.MIN_TILE  # A paged cache's page_size must be a multiple of this (the smallest cache tile).


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes(common.TritonBlockSizes):
  """Tile sizes and Triton launch parameters; every block is a power of two >= 16.

  Attributes:
    block_q: query rows per program; a row is one (chunk token, query head of the key/value head's group).
    block_k: cache slots per step of the cache loops.
    block_c: chunk keys per step of the chunk loop.
    num_warps: warps per program.
    num_stages: software-pipelining depth of the loops.
  """

  block_q: int
  block_k: int
  block_c: int
  num_warps: int = 4
  num_stages: int = 2

  @classmethod
  def get_default(cls, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
    """Tiles for Hopper (H100/H200) that fit the kernel in its registers and shared memory.

    Checked by compiling the kernel's Triton IR to an sm_90 cubin (Triton 3.9, ``cuobjdump -res-usage``) for both
    dtypes, head_dim 64, 128 and 256, chunks of 1, 16 and 256 tokens (4 query heads per kv head, 1000 slots) and the
    three masks: no stack use (spills), at most 129 KiB of shared memory (of 227), except float32 with head_dim 256 on a
    16-row tile (a one-token step) under causal or bidirectional, which spills 160 bytes. Not yet timed on a GPU.
    bfloat16 takes the forward tiles of ``flash_attention``. float32 runs IEEE float32 dots (no tensor cores, see
    ``common.dot``), which need far more registers: small query tiles and 8 warps. ``fit`` shrinks the tiles for short
    chunks (a one-token decoding step has ``groups`` rows).

    Args:
      head_dim: the head dimension (padded internally to a power of two >= 16).
      dtype: the input dtype.
    """
    padded = common.padded_tile(head_dim)
    if jnp.dtype(dtype).itemsize > 2:
      if padded <= 64:
        return cls(32, 32, 32, num_warps=8, num_stages=2)
      if padded <= 128:
        return cls(16, 32, 16, num_warps=8, num_stages=2)
      return cls(32, 32, 32, num_warps=8, num_stages=2)
    if padded > 128:
      return cls(64, 32, 32, num_warps=8, num_stages=2)
    return cls(128, 64, 64, num_warps=4 if padded <= 64 else 8, num_stages=3)

  def fit(self, rows: int, chunk: int, slots: int) -> BlockSizes:
    """Shrinks each block to at most its padded extent: ``rows`` query rows (chunk tokens times the group's heads),
    ``chunk`` keys of the chunk, ``slots`` cache slots."""
    return self.capped(block_q=rows, block_k=slots, block_c=chunk)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call."""

  mask: str
  diffusion_block: int  # 1 for causal (a block of one); unused for bidirectional.
  sm_scale: float
  chunk: int  # C: real chunk tokens.
  slots: int  # S: cache slots.
  groups: int  # Query heads per key/value head.
  head_dim: int  # Padded head dimension.
  blocks: BlockSizes
  interpret: bool
  page_size: int | None = None  # Slots of a page of a paged cache (a multiple of block_k); None for a dense cache.

  def limit(self, pos):
    """The slots ``[0, limit)`` that ``masks.visible`` lets the query at slot ``pos`` see (int32; ``pos >= 0``).

    For bidirectional the limit is past every cache slot and every chunk slot of a query at ``pos``.
    """
    if self.mask == "bidirectional":
      return pos + self.slots + self.chunk
    return (lax.div(pos, self.diffusion_block) + 1) * self.diffusion_block

  def visible(self, pos, keys):
    return masks.visible(pos, keys, self.mask, block=self.diffusion_block)

  def _chunk_span(self, tile):
    """The slot offsets (from ``starts``) of the first and last real query of query tile ``tile``."""
    first = lax.div(tile * self.blocks.block_q, self.groups)
    last = jnp.minimum(lax.div((tile + 1) * self.blocks.block_q - 1, self.groups), self.chunk - 1)
    return first, last

  def cache_ranges(self, tile, start):
    """The cache-tile loops of query tile ``tile`` of a row whose chunk starts at slot ``start`` (int32 scalars).

    Returns ``[(begin, end, bounds)]``: the tiles ``[begin, end)`` are seen whole by every query of the tile when
    ``bounds`` is None, else only their slots in ``[lo, hi) = bounds`` that ``masks.visible`` shows to each query.
    Below the chunk every slot of ``[0, min(start, S))`` is visible under every mask; after it the slots
    ``[min(start + C, S), S)`` up to each query's ``limit``. The union over the tile's queries is bounded by its
    last real query and the whole tiles by its first, as ``limit`` never decreases along the chunk. A tile with
    slots both below and after the chunk (a chunk shorter than a tile) is in two ranges, with disjoint bounds.
    """
    block_k, slots = self.blocks.block_k, self.slots
    first, last = self._chunk_span(tile)
    below = jnp.minimum(start, slots)
    after = jnp.minimum(start + self.chunk, slots)
    hi_first = clip(self.limit(start + first), after, slots)
    hi_last = clip(self.limit(start + last), after, slots)
    begin = lax.div(after, block_k)
    end = jnp.where(hi_last > after, cdiv(hi_last, block_k), begin)
    whole_begin = clip(cdiv(after, block_k), begin, end)
    whole_end = clip(lax.div(hi_first, block_k), whole_begin, end)
    return [
      (jnp.zeros_like(below), lax.div(below, block_k), None),
      (lax.div(below, block_k), cdiv(below, block_k), (0, below)),
      (begin, whole_begin, (after, slots)),
      (whole_begin, whole_end, None),
      (whole_end, end, (after, slots)),
    ]

  def chunk_ranges(self, tile, start):
    """The chunk-key loops of query tile ``tile``: ``[(begin, end, masked)]`` over tiles of ``block_c`` keys.

    The chunk key ``j`` sits at slot ``start + j``; the keys below the first query's limit are seen whole.
    """
    block_c = self.blocks.block_c
    first, last = self._chunk_span(tile)
    whole = lax.div(clip(self.limit(start + first) - start, 0, self.chunk), block_c)
    end = cdiv(clip(self.limit(start + last) - start, 0, self.chunk), block_c)
    return [(jnp.zeros_like(whole), whole, False), (whole, end, True)]

  def compiler_params(self) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=self.blocks.num_warps, num_stages=self.blocks.num_stages)


def _kernel(
  q_ref, q_seg_ref, k_ref, v_ref, k_seg_ref, cache_k_ref, cache_v_ref, cache_seg_ref, start_ref, seg_range_ref, *refs,
  plan: _Plan,
):  # fmt: skip
  """``refs``: ``(o_ref,)`` over a dense cache; ``(table_ref, o_ref)`` over a paged one, ``cache_k_ref`` and
  ``cache_v_ref`` then being the kv head's pages ``[pages, page_size, head_dim]`` and ``table_ref`` the row's table."""
  table_ref, o_ref = refs if plan.page_size is not None else (None, *refs)
  block_q, block_k, block_c = plan.blocks.block_q, plan.blocks.block_k, plan.blocks.block_c
  slots = plan.slots
  i = pl.program_id(0)
  start = start_ref[0]
  rows = i * block_q + lax.iota(jnp.int32, block_q)  # [block_q]
  pos = start + lax.div(rows, plan.groups)  # [block_q]: each row's query slot.
  q = q_ref[...]  # [block_q, head_dim]
  q_seg = q_seg_ref[...]  # [block_q], -1 for padding rows
  scale = plan.sm_scale * common.LOG2_E

  def update(carry, k, v, k_seg, visible):
    """One online-softmax step over a key tile; ``visible`` is the positional mask or None (every pair visible)."""
    m, ell, acc = carry
    s = dot(q, k, (1, 1)) * scale  # [block_q, keys]
    same = q_seg[:, None] == k_seg[None, :]
    s = jnp.where(same if visible is None else same & visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # A row that has seen only -inf so far.
    p = jnp.exp2(s - m_shift[:, None])  # [block_q, keys]
    alpha = jnp.exp2(m - m_shift)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, (1, 0))  # [block_q, head_dim]
    return m_new, ell * alpha + jnp.sum(p, axis=1), acc

  def cache_tile(t):
    """Views of cache tile ``t`` (slots ``[t * block_k, (t + 1) * block_k)``): its keys, values and segment ids.

    A dense cache's tile is a slice of the row; a paged cache's lies in one page (``block_k`` divides ``page_size``),
    page ``table[t * block_k // page_size]`` from slot ``t * block_k % page_size``, read where it is.
    """
    first = pl.multiple_of(t * block_k, block_k)
    segs = cache_seg_ref.at[pl.ds(first, block_k)]
    if table_ref is None:
      idx = pl.ds(first, block_k)
      return cache_k_ref.at[idx, :], cache_v_ref.at[idx, :], segs
    page = table_ref[lax.div(first, plan.page_size)]
    idx = pl.ds(pl.multiple_of(lax.rem(first, plan.page_size), block_k), block_k)
    return cache_k_ref.at[page, idx, :], cache_v_ref.at[page, idx, :], segs

  def cache_step(t, carry, lo=None, hi=None):
    """Cache tile ``t``; with ``lo, hi`` a boundary tile: only the slots in ``[lo, hi)`` that ``mask`` shows."""
    tile_k, tile_v, tile_seg = cache_tile(t)
    if lo is None:
      return update(carry, tile_k[...], tile_v[...], tile_seg[...], None)
    keys = t * block_k + lax.iota(jnp.int32, block_k)  # [block_k]
    exists = keys < slots  # The last tile may run past the cache (a dense row's end, or a page's slots past it).
    k = pltriton.load(tile_k, mask=exists[:, None], other=0.0)
    v = pltriton.load(tile_v, mask=exists[:, None], other=0.0)
    k_seg = pltriton.load(tile_seg, mask=exists, other=0)
    visible = ((keys >= lo) & (keys < hi))[None, :] & plan.visible(pos[:, None], keys[None, :])
    return update(carry, k, v, k_seg, visible)

  def chunk_step(t, carry, masked: bool):
    idx = pl.ds(pl.multiple_of(t * block_c, block_c), block_c)
    keys = start + t * block_c + lax.iota(jnp.int32, block_c)  # [block_c]: the chunk keys' slots
    visible = plan.visible(pos[:, None], keys[None, :]) if masked else None
    return update(carry, k_ref[idx, :], v_ref[idx, :], k_seg_ref[idx], visible)

  seg_first, seg_end = seg_range_ref[0], seg_range_ref[1]  # The cache tiles whose segment ids can match.
  carry = common.softmax_start(block_q, plan.head_dim)
  for begin, end, bounds in plan.cache_ranges(i, start):
    if bounds is None and block_k > slots:
      continue  # No tile of a cache shorter than one tile is whole (nor can it be loaded unmasked).
    begin, end = jnp.maximum(begin, seg_first), jnp.minimum(end, seg_end)
    body = cache_step if bounds is None else functools.partial(cache_step, lo=bounds[0], hi=bounds[1])
    carry = lax.fori_loop(begin, end, body, carry)
  for begin, end, masked in plan.chunk_ranges(i, start):
    carry = lax.fori_loop(begin, end, functools.partial(chunk_step, masked=masked), carry)
  _, ell, acc = carry
  empty = ell == 0.0  # Padding rows, and rows that see nothing.
  o_ref[...] = (acc * (1.0 / jnp.where(empty, 1.0, ell))[:, None]).astype(o_ref.dtype)


def page_block_k(block_k: int, page_size: int) -> int:
  """The cache tile over pages of ``page_size`` slots: ``block_k``, or the largest power of two that divides
  ``page_size`` when ``block_k`` does not, so that every tile lies in one page.

  Raises:
    ValueError: if ``page_size`` is not a multiple of 16 (Triton tiles are powers of two >= 16).
  """
  if page_size < PAGE_MULTIPLE or page_size % PAGE_MULTIPLE:
    raise ValueError(
      f"page_size={page_size} must be a multiple of {PAGE_MULTIPLE} for the paged Pallas kernel (its cache tiles of a "
      f"power of two >= 16 slots must each lie in one page), e.g. {-(-page_size // PAGE_MULTIPLE) * PAGE_MULTIPLE}"
    )
  return math.gcd(block_k, page_size)


def _call(q, q_seg, k, v, k_seg, cache_k, cache_v, cache_segments, starts, table, plan: _Plan):
  """``q``: ``[batch, kv_heads, rows, head_dim]``; the other arrays padded; returns ``q``'s shape. ``table`` is None
  over a dense cache ``[batch, slots, kv_heads, head_dim]``, else the page table of the pools ``cache_k, cache_v``
  ``[pages, kv_heads, page_size, head_dim]``, which every program reads whole (one kv head's pages) in place."""
  batch, kv_heads, rows, head_dim = q.shape
  chunk, slots = k.shape[1], cache_segments.shape[1]
  block_q = plan.blocks.block_q
  seg_range = common.segment_ranges(q_seg, cache_segments, block_q, plan.blocks.block_k)
  if table is None:
    cache_spec = pl.BlockSpec((None, slots, None, head_dim), lambda i, b, h: (b, 0, h, 0))  # the row's slots
    paging, paging_specs = (), []
  else:
    pages, _, page_size, _ = cache_k.shape
    cache_spec = pl.BlockSpec((pages, None, page_size, head_dim), lambda i, b, h: (0, h, 0, 0))  # every page
    paging, paging_specs = (table,), [pl.BlockSpec((None, table.shape[1]), lambda i, b, h: (b, 0))]  # the row's
  return pl.pallas_call(
    functools.partial(_kernel, plan=plan),
    grid=(rows // block_q, batch, kv_heads),
    in_specs=[
      pl.BlockSpec((None, None, block_q, head_dim), lambda i, b, h: (b, h, i, 0)),  # q
      pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),  # q_seg
      pl.BlockSpec((None, chunk, None, head_dim), lambda i, b, h: (b, 0, h, 0)),  # k
      pl.BlockSpec((None, chunk, None, head_dim), lambda i, b, h: (b, 0, h, 0)),  # v
      pl.BlockSpec((None, chunk), lambda i, b, h: (b, 0)),  # k_seg
      cache_spec,  # cache_k
      cache_spec,  # cache_v
      pl.BlockSpec((None, slots), lambda i, b, h: (b, 0)),  # cache_segments
      pl.BlockSpec((None, 1), lambda i, b, h: (b, 0)),  # starts
      pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0)),  # seg_range
      *paging_specs,  # table
    ],
    out_specs=pl.BlockSpec((None, None, block_q, head_dim), lambda i, b, h: (b, h, i, 0)),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=plan.compiler_params(),
    interpret=plan.interpret,
    name="mercury_cached_attention",
  )(q, q_seg, k, v, k_seg, cache_k, cache_v, cache_segments, starts[:, None], seg_range, *paging)


def _check_args(inputs: CachedInputs, mask: str, diffusion_block: int | None, table=None):
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = inputs
  if q.ndim != 4 or k.ndim != 4 or cache_k.ndim != 4:
    raise ValueError(f"{q.shape=}, {k.shape=} and {cache_k.shape=} must be [batch, length, heads, head_dim]")
  batch, chunk, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if k.shape != v.shape or k.shape != (batch, chunk, kv_heads, head_dim):
    raise ValueError(f"{k.shape=} and {v.shape=} must both be (batch, C, kv_heads, head_dim) matching {q.shape=}")
  if heads % kv_heads:
    raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
  if table is None:
    slots = cache_k.shape[1]
    if cache_k.shape != cache_v.shape or cache_k.shape != (batch, slots, kv_heads, head_dim):
      raise ValueError(
        f"{cache_k.shape=} and {cache_v.shape=} must both be (batch, S, kv_heads, head_dim) matching {k.shape=}"
      )
  else:
    slots = cache_segments.shape[-1]
    pages, page_size = cache_k.shape[0], cache_k.shape[2]
    if cache_k.shape != cache_v.shape or cache_k.shape != (pages, kv_heads, page_size, head_dim):
      raise ValueError(
        f"paged {cache_k.shape=} and {cache_v.shape=} must both be (pages, kv_heads, page_size, head_dim) matching "
        f"{k.shape=}"
      )
    if table.ndim != 2 or table.shape[0] != batch or not jnp.issubdtype(table.dtype, jnp.integer):
      raise ValueError(f"table.shape={table.shape} ({table.dtype}) must be int32 (batch={batch}, pages per row)")
    if table.shape[1] * page_size < slots:
      raise ValueError(
        f"table.shape={table.shape} holds {table.shape[1]} pages of {page_size=} a row, fewer than the S={slots} "
        f"slots of cache_segments: it needs ceil(S / page_size) = {-(-slots // page_size)}"
      )
  if chunk < 1 or slots < 1:
    raise ValueError(f"chunk length C={chunk} and cache slots S={slots} must be positive")
  dtypes = (q.dtype, k.dtype, v.dtype, cache_k.dtype, cache_v.dtype)
  if len(set(dtypes)) != 1 or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q, k, v, cache_k, cache_v must share one floating dtype, got {[str(d) for d in dtypes]}")
  for name, x, shape in (
    ("segments", segments, (batch, chunk)),
    ("cache_segments", cache_segments, (batch, slots)),
    ("starts", starts, (batch,)),
  ):
    if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name}.shape={x.shape} ({x.dtype}) must be int32 {shape}")
  if mask in masks.CACHE_MASKS and mask not in masks.CACHE_KERNEL_MASKS:
    raise ValueError(f"{mask=} has no Pallas kernel: attention.attend_cached runs it on the XLA path")
  masks.check(mask, diffusion_block, masks.CACHE_KERNEL_MASKS)


def cached_attention(
  inputs: CachedInputs,
  *,
  table: jax.Array | None = None,
  mask: str,
  diffusion_block: int | None = None,
  sm_scale: float | None = None,
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
) -> jax.Array:
  """A chunk's attention over a key-value cache and its own keys (module docstring), with the Pallas kernel.

  The cache is dense (``table=None``: ``cache_k`` holds each row's slots) or paged (``cache_k`` is one layer's pool
  of pages and ``table`` each row's pages, read in place; see the module docstring for the ``block_k`` rule).

  Args:
    inputs: the chunk's queries, keys, values and segments and the cache's keys, values, segments and the chunk's
      ``starts`` (:class:`~mercury_jax.kernels.common.CachedInputs`). The queries carry their rotary embedding
      already; ``heads`` must be a multiple of ``kv_heads``; segment ids are non-negative, 0 for padding (which
      sees nothing and outputs zeros) and empty slots. The cache slots ``[starts, starts + C)`` are not read, and
      ``starts + C`` may exceed ``S`` (a prefix-cache chunk): slots ``>= S`` do not exist. With ``table``,
      ``cache_k`` and ``cache_v`` are the pools of pages ``[pages, kv_heads, page_size, head_dim]``, ``page_size`` a
      multiple of 16, and ``cache_segments`` (dense) gives ``S``.
    table: int32 ``[batch, pages per row >= ceil(S / page_size)]`` or None: row ``b``'s slot ``s`` is slot
      ``s % page_size`` of page ``table[b, s // page_size]`` (:class:`mercury_jax.kvcache.PagedKVCache`); every entry
      must be a page of the pool (nothing checks it on a GPU).
    mask: one of ``masks.CACHE_KERNEL_MASKS`` (``bidirectional``, ``causal``, ``block_causal``), in slot space.
    diffusion_block: the block of ``"block_causal"``; must be None for the other masks.
    sm_scale: multiplies the scores; defaults to ``head_dim ** -0.5``.
    block_sizes: tiles; defaults to ``BlockSizes.get_default(head_dim, q.dtype)``, shrunk by ``fit`` to the chunk
      and, over pages, ``block_k`` to a divisor of ``page_size``.
    interpret: run the kernel with the Pallas interpreter (any backend; slow).

  Returns:
    ``[batch, C, heads, head_dim]`` in ``q.dtype``; all accumulation is float32.

  Raises:
    ValueError: for inconsistent shapes or dtypes, an unknown mask, or a ``page_size`` that is not a multiple of 16.
  """
  _check_args(inputs, mask, diffusion_block, table)
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = inputs
  batch, chunk, heads, head_dim = q.shape
  kv_heads, slots = k.shape[2], cache_segments.shape[1]
  groups = heads // kv_heads
  blocks = (block_sizes or BlockSizes.get_default(head_dim, q.dtype)).fit(chunk * groups, chunk, slots)
  page_size = None
  if table is not None:
    page_size = cache_k.shape[2]
    blocks = dataclasses.replace(blocks, block_k=page_block_k(blocks.block_k, page_size))
  rows = -(-chunk * groups // blocks.block_q) * blocks.block_q  # Padded query rows.
  padded_chunk = -(-chunk // blocks.block_c) * blocks.block_c
  padded_dim = common.padded_tile(head_dim)
  plan = _Plan(
    mask=mask,
    diffusion_block=diffusion_block if masks.KINDS[mask].block else 1,
    sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
    chunk=chunk,
    slots=slots,
    groups=groups,
    head_dim=padded_dim,
    blocks=blocks,
    interpret=interpret,
    page_size=page_size,
  )
  segments, cache_segments = segments.astype(jnp.int32), cache_segments.astype(jnp.int32)
  pad_dim = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, padded_dim - head_dim),)) if padded_dim != head_dim else x
  # Query rows (chunk token, head of the group) of each kv head: [batch, kv_heads, C * groups, head_dim].
  q_rows = pad_dim(q).reshape(batch, chunk, kv_heads, groups, padded_dim).transpose(0, 2, 1, 3, 4)
  q_rows = q_rows.reshape(batch, kv_heads, chunk * groups, padded_dim)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - chunk * groups), (0, 0)))
  q_seg = jnp.repeat(jnp.where(segments == 0, -1, segments), groups, axis=1)  # Padding queries match no key.
  q_seg = jnp.pad(q_seg, ((0, 0), (0, rows - chunk * groups)), constant_values=-1)  # [batch, rows]
  pad_chunk = lambda x: jnp.pad(x, ((0, 0), (0, padded_chunk - chunk)) + ((0, 0),) * (x.ndim - 2))
  k, v = (pad_chunk(pad_dim(x)) for x in (k, v))  # [batch, padded C, kv_heads, padded head_dim]
  k_seg = pad_chunk(segments)  # Padding keys get segment 0, which no query matches.
  if table is not None:
    table = table.astype(jnp.int32)
  cache_k, cache_v = pad_dim(cache_k), pad_dim(cache_v)
  out = _call(q_rows, q_seg, k, v, k_seg, cache_k, cache_v, cache_segments, starts.astype(jnp.int32), table, plan)
  out = out[:, :, : chunk * groups, :head_dim].reshape(batch, kv_heads, chunk, groups, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, chunk, heads, head_dim)


def reference_cached_attention(
  inputs: CachedInputs, *, mask: str, diffusion_block: int | None = None, sm_scale: float | None = None
) -> jax.Array:
  """The same function as ``cached_attention`` with ``jax.nn.dot_product_attention`` over ``[cache ; chunk]``.

  Builds the dense ``[batch, C, S + C]`` mask (:func:`mercury_jax.kernels.masks.cached`) and concatenates the
  chunk's keys and values after the cache's: O(C * (S + C)) memory, for CPUs and for checking the kernel. Logits and
  softmax are float32.
  """
  _check_args(inputs, mask, diffusion_block)
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = inputs
  in_cache, in_chunk = masks.cached(segments, cache_segments, starts, mask, block=diffusion_block, xp=jnp)
  visible = jnp.concatenate([in_cache, in_chunk], axis=-1)  # [batch, C, S + C]: over [cache slots ; chunk keys]
  keys = jnp.concatenate([cache_k, k], axis=1)  # [batch, S + C, kv_heads, head_dim]
  values = jnp.concatenate([cache_v, v], axis=1)
  out = jax.nn.dot_product_attention(q, keys, values, mask=visible[:, None], scale=sm_scale, implementation="xla")
  return jnp.where(jnp.any(visible, axis=-1)[:, :, None, None], out, jnp.zeros((), out.dtype))
