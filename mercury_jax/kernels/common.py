"""What the attention kernels share: tile arithmetic, the float32-accumulating dot, segment ranges, a base for the
Triton kernels' block sizes, and the inputs of attention over a key-value cache.

Each kernel file keeps its own frozen block-size dataclass, kernel, public function and plain-``jnp`` reference
(:mod:`flash_attention`, :mod:`cached_attention`, :mod:`blockwise_attention`, :mod:`blockwise_cached_attention`);
what is the same in several of them lives here once. The masks and their properties live in :mod:`masks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

LOG2_E = math.log2(math.e)  # The Triton kernels score in the base-2 domain (s * sm_scale * log2(e)) and use exp2.
MIN_TILE = 16  # The smallest Triton tile (and tensor-core operand) along any axis.


class CachedInputs(NamedTuple):
  """The arrays of a chunk's attention over a key-value cache and its own keys and values (``attend_cached``).

  A pytree: it passes through ``jit``, ``shard_map`` (its partition specs are a ``CachedInputs`` too) and
  ``batch_invariance.by_rows`` as it is.

  Attributes:
    q: ``[batch, chunk, heads, head_dim]``, the chunk's queries.
    k: ``[batch, chunk, kv_heads, head_dim]``, the chunk's keys.
    v: like ``k``, the chunk's values.
    segments: ``[batch, chunk]`` int32, the chunk's segments (0: padding, whose output is zeros).
    cache_k: ``[batch, slots, kv_heads, head_dim]``, the cached keys; over a paged cache one layer's pool of pages
      ``[pages, kv_heads, page_size, head_dim]``; with a ``layer`` index, a leading axis of layers.
    cache_v: like ``cache_k``.
    cache_segments: ``[batch, slots]`` int32, each slot's segment (0: empty; dense for a paged cache too).
    starts: ``[batch]`` int32, each row's slot of its chunk's first token.
  """

  q: jax.Array
  k: jax.Array
  v: jax.Array
  segments: jax.Array
  cache_k: jax.Array
  cache_v: jax.Array
  cache_segments: jax.Array
  starts: jax.Array

  def map_cache(self, fn) -> CachedInputs:
    """These inputs with ``fn`` applied to the cached keys and to the cached values."""
    return self._replace(cache_k=fn(self.cache_k), cache_v=fn(self.cache_v))


def cdiv(a, b: int):
  """``ceil(a / b)`` of a non-negative traced int32 ``a``."""
  return lax.div(a + b - 1, b)


def clip(x, lo, hi):
  """``x`` clipped to ``[lo, hi]`` (traced ints; ``hi`` wins where ``lo > hi``)."""
  return jnp.minimum(jnp.maximum(x, lo), hi)


def padded_tile(n: int) -> int:
  """The smallest Triton tile that holds ``n`` positions: a power of two, at least :data:`MIN_TILE`."""
  return max(MIN_TILE, 1 << (n - 1).bit_length())


def dot(a, b, contract: tuple[int, int]):
  """2-D matmul contracting ``a``'s dim ``contract[0]`` with ``b``'s dim ``contract[1]``, accumulated in float32.

  float32 inputs ask for ``HIGHEST`` precision, which the Triton lowering turns into IEEE float32. Its default
  precision is TF32 (10 mantissa bits): on an H200 that put the float32 flash kernel 1e-3 off its reference, where
  the kernels' float32 tiles (``BlockSizes.get_default``) assume IEEE dots (BUILD_NOTES, "GPU").
  """
  exact = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(
    a, b, (((contract[0],), (contract[1],)), ((), ())), precision=exact, preferred_element_type=jnp.float32
  )


def softmax_start(rows: int, head_dim: int):
  """An online softmax's state ``(m, ell, acc)`` of ``rows`` queries before any key: float32 ``-inf``, 0 and 0."""
  return (
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    jnp.zeros((rows, head_dim), jnp.float32),
  )


def segment_ranges(q_seg, k_seg, block_q: int, block_k: int, *, per_query_tile: bool = True, parts: int = 1):
  """Per part, the tile range of the other side that can hold a pair with equal segment ids; int32
  ``[batch, tiles, 2 * parts]``.

  Entry ``[b, tile, 2 * part : 2 * part + 2]`` is the ``[first, end)`` of the tiles of the other side, within
  ``part`` of the sequence, that share an id with ``tile``. Computed in XLA before a kernel from each tile's smallest
  and largest id, so that the kernel skips tiles through its loop bounds instead of a branch (which would stop
  Triton from pipelining the loop). Any id layout is correct (tiles inside a range that match nothing are merely
  masked); for packed sequences, ids non-decreasing along each part, the ranges are exact.

  Args:
    q_seg: query ids ``[batch, rows]`` with -1 for padding; ``rows`` a multiple of ``block_q``.
    k_seg: key ids ``[batch, keys]`` with 0 for padding; a last partial tile is padded with 0 (one part only).
    block_q: query tile size.
    block_k: key tile size.
    per_query_tile: True: for each query tile the range of key tiles; False: for each key tile the range of query
      tiles.
    parts: 1, or 2 for the halves of the two-halves masks (no tile straddles them).
  """
  batch, rows = q_seg.shape
  keys = k_seg.shape[1]
  whole = -(-keys // block_k) * block_k
  if whole != keys:
    if parts != 1:
      raise ValueError(f"{keys=} must be whole tiles of {block_k=} for {parts=}")
    k_seg = jnp.pad(k_seg, ((0, 0), (0, whole - keys)))
  q_tiles = q_seg.reshape(batch, rows // block_q, block_q)  # [batch, q tiles, block_q]
  k_tiles = k_seg.reshape(batch, whole // block_k, block_k)  # [batch, k tiles, block_k]
  q_hi = jnp.max(q_tiles, axis=-1)
  q_lo = jnp.min(jnp.where(q_tiles < 0, jnp.iinfo(jnp.int32).max, q_tiles), axis=-1)  # Padding queries match nothing.
  k_lo, k_hi = jnp.min(k_tiles, axis=-1), jnp.max(k_tiles, axis=-1)
  overlap = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])  # [batch, q tiles, k tiles]
  if not per_query_tile:
    overlap = jnp.swapaxes(overlap, 1, 2)  # [batch, k tiles, q tiles]
  tiles, n = overlap.shape[1:]
  overlap = overlap.reshape(batch, tiles, parts, n // parts)  # [batch, tiles, parts, other tiles per part]
  index = jnp.arange(n).reshape(parts, n // parts)
  first = jnp.min(jnp.where(overlap, index, n), axis=-1)  # [batch, tiles, parts]
  end = jnp.max(jnp.where(overlap, index + 1, 0), axis=-1)
  return jnp.stack([first, jnp.maximum(first, end)], axis=-1).reshape(batch, tiles, 2 * parts).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, slots=True)
class TritonBlockSizes:
  """The base of a Triton kernel's frozen block sizes: every field named ``block_*`` is a tile, a power of two at
  least :data:`MIN_TILE` (Triton tiles and tensor cores), checked when the sizes are made."""

  def __post_init__(self):
    for name, value in self.tiles().items():
      if value < MIN_TILE or value & (value - 1):
        raise ValueError(
          f"{type(self).__name__}.{name}={value} must be a power of two >= {MIN_TILE} (Triton tiles and tensor cores)"
        )

  def tiles(self) -> dict[str, int]:
    """``{name: size}`` of the ``block_*`` fields, in their order."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("block_")}

  def capped(self, **extents: int):
    """These sizes with each named tile shrunk to at most the tile that holds its ``extents`` positions."""
    return dataclasses.replace(self, **{name: min(getattr(self, name), padded_tile(n)) for name, n in extents.items()})
