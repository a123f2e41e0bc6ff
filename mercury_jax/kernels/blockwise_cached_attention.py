"""Attention of a chunk over a long key-value cache in plain XLA, reading only the cache tiles it can see.

The one-shot XLA path (``attention._cached_xla``) scores every slot of the cache, masked or not: a decoding step of
a 200-token request in a server whose rows hold 16 K slots pays for 16 K slots, and the chunks of a chunked prefill
together score the whole square of the prompt instead of its causal half. Here the cache is read in tiles of
``tile`` slots by a ``fori_loop`` that stops at the last tile any query of the chunk can see (each row's bound
from its chunk's position and the mask: :func:`visible_end`; the batch runs to its longest row's), with the online
softmax of :mod:`mercury_jax.kernels.blockwise_attention` across the tiles and the chunk's own keys. A paged cache
(``table``) is read a tile of pages at a time through the table, never gathered whole.

The rows' results do not depend on one another: a tile that lies past a row's bound is fully masked for it, and a
fully masked tile leaves the running maximum, normaliser and accumulator bitwise as they were. Slots ``[s, s + T)``
are tile ``s // T`` whatever the batch, so the same row sums the same tiles in the same order in any batch.

Only the masks whose visible slots end before the chunk's end are bounded (``causal``, ``block_causal`` and the
verified chunk, :data:`mercury_jax.kernels.masks.BOUNDED`); a bidirectional chunk sees every slot and keeps the
one-shot path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mercury_jax.kernels import masks
from mercury_jax.kernels.common import CachedInputs
from mercury_jax.kvcache import read_pages

DEFAULT_TILE = 512  # Slots per tile (rounded up to whole pages of a paged cache).


def visible_end(starts: jax.Array, chunk: int, mask: str, block: int | None) -> jax.Array:
  """``[batch]`` int32: a slot past every cached slot that some query of each row's chunk may see (conservative).

  A query at slot ``p`` sees cached slots ``<= p`` (causal), those of its own and earlier blocks (block-causal: up to
  the end of the block of the chunk's last slot), or the slots before the chunk (the verified chunk, whatever its
  draft tree).
  """
  if mask == "verify_chunk":
    return starts
  if mask == "causal":
    return starts + chunk
  if mask == "block_causal":
    return ((starts + chunk - 1) // block + 1) * block
  raise ValueError(f"{mask=} is not bounded; the bounded masks are {masks.BOUNDED}")


def cached_attention(
  inputs: CachedInputs,
  *,
  mask: str,
  diffusion_block: int | None = None,
  table: jax.Array | None = None,
  tile: int = DEFAULT_TILE,
  layer: jax.Array | None = None,
) -> jax.Array:
  """``attention.attend_cached``'s result, reading the cache tile by tile up to each row's last visible slot.

  Args:
    inputs: the chunk and the cache (:class:`~mercury_jax.kernels.common.CachedInputs`); with ``table``,
      ``cache_k`` and ``cache_v`` are one layer's pools ``[pages, kv_heads, page_size, head_dim]``.
    mask: one of :data:`mercury_jax.kernels.masks.BOUNDED`.
    diffusion_block: the block of ``block_causal``; the tree (or draft length) of ``verify_chunk``.
    table: ``[batch, ceil(slots / page_size)]`` int32 page table of a paged cache.
    tile: slots per tile (a paged cache's is rounded up to whole pages).
    layer: with it, ``cache_k`` and ``cache_v`` carry a leading axis of layers and the tiles are read from this
      one's: slicing the layer out before the loop would copy it once per call (XLA materialises a loop's operands).

  Returns:
    ``[batch, chunk, heads, head_dim]`` in ``v``'s dtype.
  """
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = inputs
  batch, chunk, heads, head_dim = q.shape
  kv_heads, slots = k.shape[2], cache_segments.shape[1]
  groups = heads // kv_heads
  if layer is None:  # One layer's cache: as a stack of one.
    cache_k, cache_v, layer = cache_k[None], cache_v[None], jnp.zeros((), jnp.int32)
  page = 1 if table is None else cache_k.shape[3]
  tile = min(-(-tile // page) * page, -(-slots // page) * page)
  tiles = -(-slots // tile)
  end = jnp.minimum(jnp.max(visible_end(starts, chunk, mask, diffusion_block)), slots)
  live = lambda visible: jnp.tile(visible, (1, groups, 1))[:, None]  # noqa: E731  [b, 1, groups * chunk, keys]
  heads_first = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)  # noqa: E731  [b, n, kv, d] -> [b, kv, n, d]
  q = q.reshape(batch, chunk, kv_heads, groups, head_dim).astype(jnp.float32) * head_dim**-0.5
  q = q.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * chunk, head_dim)  # rows: (group, chunk token)

  def fold(state, scores, values):
    m, ell, acc = state
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # A row that has seen nothing yet keeps weight 0.
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    return m_new, ell * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + jnp.matmul(p, values)

  # The chunk's own keys first (masks.cached over no cached slot gives their part alone).
  _, in_chunk = masks.cached(segments, cache_segments[:, :0], starts, mask, block=diffusion_block, xp=jnp)
  own = jnp.where(live(in_chunk), jnp.matmul(q, jnp.swapaxes(heads_first(k), 2, 3)), -jnp.inf)
  stats = q.shape[:-1]
  state = fold((jnp.full(stats, -jnp.inf), jnp.zeros(stats), jnp.zeros(q.shape)), own, heads_first(v))

  # Slots past the cache (a paged cache's last tile) are in segment 0, on the sink page: seen by nobody.
  padded_segments = jnp.pad(cache_segments, ((0, 0), (0, tiles * tile - slots)))
  if table is not None:
    table = jnp.pad(table, ((0, 0), (0, tiles * tile // page - table.shape[1])))

  def tile_step(j, state):
    first = jnp.minimum(j * tile, slots - tile) if table is None else j * tile  # a dense last tile overlaps
    if table is None:  # [layers, b, slots, kv, d] -> this layer's [b, kv, tile, d]
      keys, values = (
        heads_first(lax.dynamic_slice(c, (layer, 0, first, 0, 0), (1, batch, tile, *c.shape[3:]))[0])
        for c in (cache_k, cache_v)
      )
    else:  # The tile's pages through the table, heads-first as the pool keeps them: [b, kv, tile, d].
      pages = lax.dynamic_slice_in_dim(table, j * (tile // page), tile // page, axis=1)
      keys, values = (read_pages(c, pages, tile, layer=layer, heads_first=True) for c in (cache_k, cache_v))
      keys, values = keys.astype(jnp.float32), values.astype(jnp.float32)
    seg = lax.dynamic_slice_in_dim(padded_segments, first, tile, axis=1)
    in_cache, _ = masks.cached(segments, seg, starts, mask, block=diffusion_block, xp=jnp, offset=first)
    in_cache = in_cache & (first + jnp.arange(tile) >= j * tile)[None, None]  # slots an earlier tile scored: once
    scores = jnp.where(live(in_cache), jnp.matmul(q, jnp.swapaxes(keys, 2, 3)), -jnp.inf)
    return fold(state, scores, values)

  m, ell, acc = lax.fori_loop(0, (end + tile - 1) // tile, tile_step, state)
  out = jnp.where(ell[..., None] > 0, acc / jnp.where(ell > 0, ell, 1.0)[..., None], 0.0)
  out = out.reshape(batch, kv_heads, groups, chunk, head_dim).transpose(0, 3, 1, 2, 4)  # [b, chunk, kv, groups, d]
  return out.reshape(batch, chunk, heads, head_dim).astype(v.dtype)
