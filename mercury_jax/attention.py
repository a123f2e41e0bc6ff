"""The attention-implementation switch used by the model.

Layout everywhere is ``[batch, length, heads, head_dim]`` for queries and ``[batch, length, kv_heads, head_dim]``
for keys and values (grouped-query attention when ``kv_heads < heads``). ``segment_ids`` is ``[batch, length]``
int32, non-negative: a query attends only to keys of its own segment, and segment 0 marks padding. A padding query
sees nothing and every implementation returns zeros for it.

Masks (``mask=``; ``causal=True`` is shorthand for ``mask="causal"``), each a function of (query, key) positions
defined once in :mod:`mercury_jax.kernels.masks`: ``bidirectional``; ``causal``; ``block_causal``, where the query
at position ``i`` sees the keys ``j`` with ``j // diffusion_block <= i // diffusion_block``; ``block_diffusion``,
BD3-LM's training mask over the concatenation ``x_t ⊕ x_0`` (the sequence's two halves, see ``masks``); and
``verified``, TiDAR's: the same two halves with a causal clean half.

Implementations: ``xla`` (the default off GPU), ``pallas`` (our flash-attention kernel,
``mercury_jax.kernels.flash_attention``; the default on GPU, run in interpret mode elsewhere) and ``cudnn``
(``jax.nn.dot_product_attention(implementation="cudnn")``; GPU, fp16/bf16 only). ``xla`` is
``jax.nn.dot_product_attention`` with a dense boolean mask below ``BLOCKWISE_MIN_LENGTH`` tokens and, from there
on, the memory-bounded loops of :mod:`mercury_jax.kernels.blockwise_attention`, which never hold the
``[length, length]`` scores; ``attend(blockwise=True | False)`` forces either path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from mercury_jax import sharding
from mercury_jax.batch_invariance import Tiling, by_rows
from mercury_jax.config import ATTENTION_IMPLS
from mercury_jax.kernels import masks
from mercury_jax.kernels.common import CachedInputs
from mercury_jax.kvcache import read_pages

# From this length on, ``xla`` runs blockwise. Measured on this CPU (2 cores, AMD EPYC; batch 1, 4 heads, head_dim 64,
# float32, 512 x 512 chunks; `bench long-attention`, docs/results/long-context.md): at 1024 tokens blockwise took
# half the dense path's compiled temp memory (forward 12.8 vs 32 MiB, forward + backward 25 vs 50 MiB) at 1.0-3.6x its
# speed over the bidirectional, causal and block_diffusion masks; at 256-512 tokens both need 2-22 MiB and blockwise
# forward + backward ran at 0.88-2.3x the dense speed, so short sequences keep the dense path's numerics.
BLOCKWISE_MIN_LENGTH = 1024
# From this many cache slots on, the XLA path of attention over a cache reads it in tiles up to each row's last
# visible slot (kernels/blockwise_cached_attention.py) instead of scoring every slot; measured in
# docs/results/long-context.md ("The cache read up to what a chunk sees").
CACHED_BLOCKWISE_MIN_SLOTS = 2048


def resolve_implementation(name: str) -> str:
  """Turns ``auto`` into the backend's best implementation: ``pallas`` on GPU, ``xla`` elsewhere."""
  if name not in ATTENTION_IMPLS:
    raise ValueError(f"attention implementation {name!r} must be one of {ATTENTION_IMPLS}")
  if name != "auto":
    return name
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def _resolve_mask(causal: bool, mask: str | None, diffusion_block: int | None, length: int) -> str:
  if mask is None:
    mask = "causal" if causal else "bidirectional"
  elif causal and mask != "causal":
    raise ValueError(f"causal=True contradicts {mask=}; pass only one of them")
  masks.check(mask, diffusion_block, length=length)
  return mask


def _dense_mask(segment_ids: jax.Array | None, mask: str, diffusion_block: int | None, length: int):
  """``[batch or 1, 1, q, k]`` bool for ``jax.nn.dot_product_attention``, or None when nothing is masked."""
  visible = None
  if mask != "bidirectional":
    visible = masks.dense(length, mask, block=diffusion_block, xp=jnp)[None, None]
  if segment_ids is not None:
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [batch, 1, q, k]
    visible = same if visible is None else visible & same
  return visible


def _zero_padding_rows(out: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """Padding queries (segment 0) output zeros, as the Pallas kernel defines them."""
  if segment_ids is None:
    return out
  return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _xla(q, k, v, segment_ids, mask, diffusion_block, *, blockwise: bool | None = None):
  """Dense below ``BLOCKWISE_MIN_LENGTH`` tokens (or with ``blockwise=False``), else blockwise."""
  if blockwise if blockwise is not None else q.shape[1] >= BLOCKWISE_MIN_LENGTH:
    from mercury_jax.kernels import blockwise_attention as bw

    return bw.blockwise_attention(q, k, v, segment_ids=segment_ids, mask=mask, diffusion_block=diffusion_block)
  dense = _dense_mask(segment_ids, mask, diffusion_block, q.shape[1])
  out = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")
  return _zero_padding_rows(out, segment_ids)


def _cudnn(q, k, v, segment_ids, mask, diffusion_block):
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"implementation='cudnn' needs float16 or bfloat16 inputs, got {q.dtype}; use 'pallas' or 'xla'")
  if segment_ids is None and mask in ("bidirectional", "causal"):  # cuDNN's own causal mask skips masked tiles.
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask == "causal", implementation="cudnn")
  # Segments and the block masks have no cuDNN mask type: they go in as a dense additive bias, O(batch * length^2).
  dense = _dense_mask(segment_ids, mask, diffusion_block, q.shape[1])
  out = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn")
  return _zero_padding_rows(out, segment_ids)


def _head_split(q_shape, k_shape, mesh, rules, *, length: bool):
  """``(q_spec, kv_spec, select_kv)`` of attention run per shard: rows over the data axes, query heads over
  ``tensor``, the length over ``sequence`` when ``length`` (else whole). When the kv heads split like the query heads,
  each shard holds whole groups (local query head ``h`` reads local kv head ``h // groups``) and ``select_kv`` is
  None; otherwise (say one kv head over two head shards) every shard gets all kv heads, and ``select_kv`` takes the
  ones its query heads read (the shard_map transpose then sums their gradients over the head shards)."""
  sh = sharding
  length_axis = sh.LENGTH if length else None
  q_spec = sh.mesh_spec((sh.BATCH, length_axis, sh.ACT_HEADS, sh.HEAD_DIM), q_shape, mesh, rules)
  kv_spec = sh.mesh_spec((sh.BATCH, length_axis, sh.ACT_KV_HEADS, sh.HEAD_DIM), k_shape, mesh, rules)
  rows, head_axes = q_spec[0], q_spec[2]
  if kv_spec[2] == head_axes:
    return q_spec, P(rows, q_spec[1], head_axes, kv_spec[3]), None
  heads, kv_heads = q_shape[2], k_shape[2]
  names = (head_axes,) if isinstance(head_axes, str) else head_axes or ()
  local_heads = heads // math.prod(mesh.shape[a] for a in names)

  def select_kv(x, axis=2):  # axis: the kv heads' ([b, l, kv, d]; a pool of pages [pages, kv, page_size, d]: 1)
    first = jax.lax.axis_index(head_axes) * local_heads
    return jnp.take(x, (first + jnp.arange(local_heads)) // (heads // kv_heads), axis=axis)  # [b, l, local, d]

  return q_spec, P(rows, q_spec[1], None, kv_spec[3]), select_kv if names else None


def _context_parallel(q, k, v, segment_ids, mask, diffusion_block, *, layout, strategy: str):
  """Attention over a sequence split over the ``sequence`` mesh axis, per shard inside a ``shard_map``
  (:mod:`mercury_jax.kernels.context_parallel`): rows over the data axes, heads over ``tensor``, positions over
  ``sequence`` in ``layout``. Every implementation takes this path (its per-shard loops are the blockwise XLA ones)."""
  from mercury_jax.kernels import context_parallel as cp

  mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
  q_spec, kv_spec, select_kv = _head_split(q.shape, k.shape, mesh, rules, length=True)
  if q_spec[1] is None or q_spec[3] is not None:
    raise ValueError(
      f"context parallelism over {layout.shards} shards needs the length split over the sequence axis and whole "
      f"head_dims; the rules shard q {q.shape} as {q_spec}"
    )
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  half = q.shape[1] // 2 if mask in masks.TWO_HALVES else None

  def per_shard(q, k, v, segment_ids):
    if select_kv is not None:
      k, v = select_kv(k), select_kv(v)
    return cp.attention(
      q, k, v, segment_ids, mask=mask, diffusion_block=diffusion_block, half=half, axis=q_spec[1], layout=layout,
      strategy=strategy,
    )  # fmt: skip

  specs = (q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1]))
  return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(
    q, k, v, segment_ids.astype(jnp.int32)
  )


def _pallas(q, k, v, segment_ids, mask, diffusion_block):
  from mercury_jax.kernels import flash_attention as fa  # Pallas's Triton lowering loads only when a kernel runs.

  kernel = functools.partial(
    fa.flash_attention, mask=mask, diffusion_block=diffusion_block, interpret=jax.default_backend() != "gpu"
  )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel(q, k, v, segment_ids=segment_ids)
  # A pallas_call cannot be partitioned by GSPMD, so the kernel runs per shard: batch over the data axes, heads over
  # `tensor`; length and head_dim stay whole (a sequence split over `sequence` takes the context-parallel path).
  q_spec, kv_spec, select_kv = _head_split(q.shape, k.shape, mesh, nn.get_logical_axis_rules(), length=False)
  if q_spec[3] is not None:
    raise ValueError(f"the pallas kernel needs whole head_dims; the rules shard q as {q_spec}")
  seg_spec = P(q_spec[0], None)

  def per_shard(q, k, v, *segment_ids):
    if select_kv is not None:
      k, v = select_kv(k), select_kv(v)
    return kernel(q, k, v, segment_ids=segment_ids[0] if segment_ids else None)

  args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
  if segment_ids is not None:
    args, specs = args + (segment_ids,), specs + (seg_spec,)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool = False,
  segment_ids: jax.Array | None = None,
  implementation: str = "auto",
  mask: str | None = None,
  diffusion_block: int | None = None,
  blockwise: bool | None = None,
  layout=None,
  context_parallel: str = "all_gather",
) -> jax.Array:
  """Scaled dot-product attention; returns ``[batch, length, heads, head_dim]`` in ``q.dtype``.

  Args:
    q: ``[batch, length, heads, head_dim]``.
    k: ``[batch, length, kv_heads, head_dim]``.
    v: like ``k``.
    causal: shorthand for ``mask="causal"``.
    segment_ids: optional int32 ``[batch, length]``; 0 marks padding (those queries output zeros).
    implementation: ``auto``, ``xla``, ``pallas`` or ``cudnn`` (see the module docstring).
    mask: ``bidirectional``, ``causal``, ``block_causal``, ``block_diffusion`` or ``verified``; None follows
      ``causal``.
    diffusion_block: block size of ``block_causal``, ``block_diffusion`` and ``verified``.
    blockwise: the ``xla`` implementation's path: None picks blockwise from ``BLOCKWISE_MIN_LENGTH`` tokens on,
      True / False force the blockwise / dense path. Only for ``xla`` (also when ``auto`` resolves to it).
    layout: a :class:`mercury_jax.kernels.context_parallel.SequenceLayout`: the sequence is split over the
      ``sequence`` mesh axis in this layout (the caller permuted it so), and attention runs context-parallel,
      whatever ``implementation``; None: the whole sequence on every shard of that axis.
    context_parallel: with ``layout``, ``all_gather`` or ``ring``.
  """
  mask = _resolve_mask(causal, mask, diffusion_block, q.shape[1])
  if layout is not None:
    return _context_parallel(
      q, k, v, segment_ids, mask, diffusion_block, layout=layout, strategy=context_parallel
    )  # fmt: skip
  impl = resolve_implementation(implementation)
  if impl == "xla":
    return _xla(q, k, v, segment_ids, mask, diffusion_block, blockwise=blockwise)
  if blockwise is not None:
    raise ValueError(f"{blockwise=} applies to implementation='xla' only, not to {impl!r}; pass blockwise=None")
  fn = {"pallas": _pallas, "cudnn": _cudnn}[impl]
  return fn(q, k, v, segment_ids, mask, diffusion_block)


def _cached_xla(inputs: CachedInputs, mask: str, diffusion_block: int | None, *, split=None, heads_first=False):
  """Attention over ``[cache ; chunk]`` with two score blocks and one softmax, so the cache is never concatenated.

  The products are plain matmuls batched over ``[batch, kv_heads]``, the query rows of a key/value head's group laid
  out as one ``[groups * chunk, head_dim]`` matrix (on XLA:CPU the einsum that kept the head axes between the query
  and slot axes made this attention 1.8-3.4x slower for a prefill chunk of 512 tokens over 4 K and 16 K slots:
  ``bench long-context cached``, ``docs/results/long-context.md``). The scores are laid out slots-major, ``keys @
  queries^T`` ``[batch, kv_heads, keys, rows]``: the keys, the large operand, are read as they lie, ``[slots,
  head_dim]`` row-major, and only the queries are transposed; the softmax reduces over the keys' axis and the
  weighted values' product contracts it (``scores^T`` against ``[slots, head_dim]``). The usual ``queries @ keys^T``
  either copies every key into ``[head_dim, slots]`` or runs a product that packs them: 1.8x the time of the
  attention of a serving step in ``docs/results/serving.md`` ("Batch buckets over a paged KV cache").

  It is batch-invariant (:mod:`mercury_jax.batch_invariance`): a row's output does not depend on the rows beside it.
  Each product is a matmul batched over ``[batch, kv_heads]``, which XLA runs as one product per batch element
  whatever their number; a maximum rounds nothing; and the normaliser, a sum whose order XLA:CPU picks by the batch's
  shape, is taken by the weighted values' product instead, through a column of ones appended to the values.

  ``split``: the mesh axis the cache's slots are split over, inside a ``shard_map`` (:func:`_cached_split`): this
  shard's cache holds the slots from ``axis_index * slots``, the first shard alone scores the chunk's own keys, and
  the softmax's maximum, normaliser and weighted values are reduced over the shards (split-K, as flash-decoding).

  ``heads_first``: the cache is ``[batch, kv_heads, slots, head_dim]``, as a paged cache's pages are gathered
  (``kvcache.read_pages``); a dense cache ``[batch, slots, kv_heads, head_dim]`` is transposed first."""
  q, k, v, segments, cache_k, cache_v, cache_segments, starts = inputs
  batch, chunk, heads, head_dim = q.shape
  kv_heads, dtype = k.shape[2], v.dtype
  groups = heads // kv_heads
  offset = 0 if split is None else jax.lax.axis_index(split) * cache_segments.shape[1]
  in_cache, in_chunk = masks.cached(
    segments, cache_segments, starts, mask, block=diffusion_block, xp=jnp, offset=offset
  )
  if split is not None:
    in_chunk = in_chunk & (jax.lax.axis_index(split) == 0)
  to_heads_first = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)  # noqa: E731  [b, n, kv, d] -> [b, kv, n, d]
  if heads_first:
    cache_k, cache_v = cache_k.astype(jnp.float32), cache_v.astype(jnp.float32)
  else:
    cache_k, cache_v = to_heads_first(cache_k), to_heads_first(cache_v)
  k, v = to_heads_first(k), to_heads_first(v)
  q = q.reshape(batch, chunk, kv_heads, groups, head_dim).astype(jnp.float32) * head_dim**-0.5
  q = q.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * chunk, head_dim)  # rows: (group, chunk token)
  batched = ((0, 1), (0, 1))
  scores = lambda keys: jax.lax.dot_general(keys, q, (((3,), (3,)), batched))  # noqa: E731  [b, kv, keys, rows]
  keys_major = lambda visible: jnp.swapaxes(jnp.tile(visible, (1, groups, 1)), 1, 2)[:, None]  # noqa: E731
  cached = jnp.where(keys_major(in_cache), scores(cache_k), -jnp.inf)  # [b, kv, slots, groups * chunk]
  own = jnp.where(keys_major(in_chunk), scores(k), -jnp.inf)  # [b, kv, chunk, groups * chunk]
  top = jnp.maximum(jnp.max(cached, axis=2), jnp.max(own, axis=2))[:, :, None]  # [b, kv, 1, groups * chunk]
  if split is not None:
    top = jax.lax.pmax(top, split)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # A query that sees nothing: every weight is 0.
  ones = lambda x: jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)  # noqa: E731
  weigh = lambda weights, values: jax.lax.dot_general(weights, ones(values), (((2,), (2,)), batched))  # noqa: E731
  out = weigh(jnp.exp(cached - top), cache_v) + weigh(jnp.exp(own - top), v)  # [b, kv, groups * chunk, d + 1]
  if split is not None:
    out = jax.lax.psum(out, split)
  out, total = out[..., :head_dim], out[..., head_dim:]
  out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
  out = out.reshape(batch, kv_heads, groups, chunk, head_dim).transpose(0, 3, 1, 2, 4)  # [b, chunk, kv, groups, d]
  return out.reshape(batch, chunk, heads, head_dim).astype(dtype)


def _row_split(inputs: CachedInputs, mesh, rules):
  """``(specs, select_kv)`` of the cached attention run per shard: a ``CachedInputs`` of the partition specs of
  ``inputs``' dense layout, rows over the data axes and heads over ``tensor`` (:func:`_head_split`), the chunk and
  the cache's slots whole; and :func:`_head_split`'s ``select_kv``."""
  q_spec, kv_spec, select_kv = _head_split(inputs.q.shape, inputs.k.shape, mesh, rules, length=False)
  rows = q_spec[0]
  q_spec, kv_spec = P(rows, None, q_spec[2], None), P(rows, None, kv_spec[2], None)
  specs = CachedInputs(q_spec, kv_spec, kv_spec, P(rows, None), kv_spec, kv_spec, P(rows, None), P(rows))
  return specs, select_kv


def _cached_split(inputs: CachedInputs, mask: str, diffusion_block: int | None):
  """:func:`_cached_xla` over a cache whose slots are split over ``sequence`` (``KVCache.constrained``), or None when
  they are not: per shard inside a ``shard_map``, rows over the data axes and heads over ``tensor``, so no shard
  gathers another's slots; the chunk is whole on every shard."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  rules = nn.get_logical_axis_rules()
  slots = sharding.mesh_spec((sharding.BATCH, sharding.LENGTH), inputs.cache_segments.shape, mesh, rules)[1]
  if slots is None:
    return None
  specs, select_kv = _row_split(inputs, mesh, rules)
  rows, cache_spec = specs.q[0], P(specs.q[0], slots, specs.k[2], None)
  specs = specs._replace(cache_k=cache_spec, cache_v=cache_spec, cache_segments=P(rows, slots))

  def per_shard(inputs):
    if select_kv is not None:
      inputs = inputs._replace(k=select_kv(inputs.k), v=select_kv(inputs.v)).map_cache(select_kv)
    return _cached_xla(inputs, mask, diffusion_block, split=slots)

  return jax.shard_map(per_shard, mesh=mesh, in_specs=(specs,), out_specs=specs.q, check_vma=False)(inputs)


def _cached_pallas(inputs: CachedInputs, mask: str, diffusion_block: int | None, table=None):
  """The Pallas kernel (:mod:`mercury_jax.kernels.cached_attention`; interpret mode off GPU), per shard on a mesh:
  rows over the data axes, heads over ``tensor`` (kv heads with them when they split alike, else whole on every
  shard, which then reads the kv heads its query heads use).

  With ``table``, ``cache_k`` and ``cache_v`` are one layer's pools ``[pages, kv_heads, page_size, head_dim]``, read
  in place. A pool is not split by rows (any row's table may name any page): on a mesh it is replicated over the data
  axes, its kv heads split like the chunk's (``P(None, kv heads' axes, None, None)``), while the tables, like the
  segments, split by rows. When the kv heads do not split like the query heads, each shard takes the kv heads it
  reads out of the whole pool, a copy of the pool."""
  from mercury_jax.kernels import cached_attention as ca

  kernel = functools.partial(
    ca.cached_attention, mask=mask, diffusion_block=diffusion_block, interpret=jax.default_backend() != "gpu"
  )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel(inputs, table=table)
  specs, select_kv = _row_split(inputs, mesh, nn.get_logical_axis_rules())
  if table is not None:  # A pool: every page on every row shard.
    pool_spec = P(None, specs.k[2], None, None)
    specs = specs._replace(cache_k=pool_spec, cache_v=pool_spec)

  def per_shard(inputs, *table):
    if select_kv is not None:
      inputs = inputs._replace(k=select_kv(inputs.k), v=select_kv(inputs.v))
      inputs = inputs.map_cache(lambda c: select_kv(c, axis=1 if table else 2))
    return kernel(inputs, table=table[0] if table else None)

  args, in_specs = (inputs,), (specs,)
  if table is not None:
    args, in_specs = (inputs, table), (specs, P(specs.q[0], None))
  return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=specs.q, check_vma=False)(*args)


def attend_cached(
  inputs: CachedInputs,
  *,
  mask: str,
  diffusion_block: int | None = None,
  implementation: str = "auto",
  table: jax.Array | None = None,
  blockwise: bool | None = None,
  layer: jax.Array | None = None,
  tiling: Tiling | None = None,
) -> jax.Array:
  """Attention of a chunk over a key-value cache and its own keys and values (what each query sees:
  :func:`mercury_jax.kernels.masks.cached`).

  The cache is dense, or paged (``table``, :class:`mercury_jax.kvcache.PagedKVCache`): the Pallas kernel reads the
  pages in place through the table. The XLA path (``xla``, ``cudnn``, ``verify_chunk``) reads a cache of
  ``CACHED_BLOCKWISE_MIN_SLOTS`` slots or more tile by tile up to the last slot a row's chunk can see
  (:mod:`mercury_jax.kernels.blockwise_cached_attention`, pages through the table), and a shorter one (or the
  Pallas kernel when ``page_size`` is not a multiple of 16) after gathering each row's pages into a dense cache
  (``kvcache.read_pages``), in one softmax.

  Args:
    inputs: the chunk's queries ``[batch, chunk, heads, head_dim]``, keys and values ``[batch, chunk, kv_heads,
      head_dim]`` and segments ``[batch, chunk]`` (0: padding, whose output is zeros); the cached keys and values
      ``[batch, slots, kv_heads, head_dim]`` (with ``table``, one layer's pools of pages ``[pages, kv_heads,
      page_size, head_dim]``), the cache's segments ``[batch, slots]`` (dense for a paged cache too) and ``starts``
      ``[batch]``, each row's first slot of the chunk (:class:`~mercury_jax.kernels.common.CachedInputs`).
    mask: one of ``masks.CACHE_MASKS``: ``causal``, ``block_causal`` or ``bidirectional``, in slot space; or
      ``verify_chunk``, a verify-and-draft chunk of a draft tree's nodes and pre-draft blocks (``masks.verify_chunk``;
      ``k + k*k`` queries for the chain) over the slots before ``starts``.
    diffusion_block: the block of ``block_causal``; the :class:`~mercury_jax.kernels.masks.Tree` of ``verify_chunk``
      (or its draft length ``k``: the chain).
    implementation: ``auto``, ``xla``, ``pallas`` or ``cudnn`` (``cudnn`` runs the XLA path: cuDNN has no mask for a
      cache with per-row chunk positions; so does ``verify_chunk``, which the Pallas kernel does not implement).
    table: ``[batch, ceil(slots / page_size)]`` int32, each row's pages (None: a dense cache).
    blockwise: the XLA path's reading: None tiles from ``CACHED_BLOCKWISE_MIN_SLOTS`` slots on (for the masks whose
      visible slots end with the chunk), True / False force the tiles / the one-shot softmax.
    layer: with it, ``cache_k`` and ``cache_v`` hold every layer (a leading ``layers`` axis) and this one reads its
      own: inside the tiles' loop, so that no copy of the layer's cache is made for the loop.
    tiling: Batch-invariant (:mod:`mercury_jax.batch_invariance`): a row's output does not depend on the rows beside
      it. The Pallas kernel is (one program per row), so is the one-softmax XLA path with its normaliser taken by a
      product; the others run row by row.

  Returns:
    ``[batch, chunk, heads, head_dim]`` in ``v``'s dtype.
  """
  masks.check(mask, diffusion_block, masks.CACHE_MASKS)
  inputs = inputs._replace(starts=jnp.broadcast_to(jnp.asarray(inputs.starts, jnp.int32), inputs.q.shape[:1]))
  impl = resolve_implementation(implementation)
  pallas = impl == "pallas" and mask in masks.CACHE_KERNEL_MASKS
  mesh = jax.sharding.get_abstract_mesh()
  if pallas and not mesh.empty and sharding.sequence_shards(mesh, nn.get_logical_axis_rules()) > 1:
    pallas = False  # A cache split over `sequence`: the XLA path, whose softmax GSPMD reduces across the shards.
  from mercury_jax.kernels import blockwise_cached_attention as bca

  if blockwise and mask not in masks.BOUNDED:
    raise ValueError(f"{blockwise=} needs a mask whose visible slots end with the chunk, one of {masks.BOUNDED}")
  long = inputs.cache_segments.shape[1] >= CACHED_BLOCKWISE_MIN_SLOTS
  tiled = not pallas and mask in masks.BOUNDED and (long if blockwise is None else blockwise)
  # A cache split over `sequence` reads each shard's slots in one softmax (_cached_split).
  sequence_split = not mesh.empty and sharding.sequence_shards(mesh, nn.get_logical_axis_rules()) > 1
  if tiling is not None and not pallas and (tiled or sequence_split):  # Row by row: the tiles' online softmax.
    options = dict(mask=mask, diffusion_block=diffusion_block, implementation=implementation, blockwise=blockwise)
    if table is None and layer is not None:  # A dense cache's rows go one by one: this layer's, batch first.
      inputs, layer = inputs.map_cache(lambda c: c[layer]), None
    pools = None if table is None else (inputs.cache_k, inputs.cache_v)  # A pool of pages is every row's: never split.

    def row(inputs, table):
      if pools is not None:
        inputs = inputs._replace(cache_k=pools[0], cache_v=pools[1])
      return attend_cached(inputs, table=table, layer=layer, **options)

    if pools is not None:
      inputs = inputs._replace(cache_k=None, cache_v=None)
    return by_rows(row, tiling.shards, inputs, table)
  if tiled and (table is not None or not sequence_split):
    return bca.cached_attention(inputs, mask=mask, diffusion_block=diffusion_block, table=table, layer=layer)
  if table is not None:
    in_place = False
    if pallas:
      from mercury_jax.kernels import cached_attention as ca

      in_place = inputs.cache_k.shape[-2] % ca.PAGE_MULTIPLE == 0  # [..., pages, kv_heads, page_size, head_dim]
    if not in_place:  # Each row's pages gathered: heads-first for the XLA path's products, which read them as they
      # are; as a dense cache for the Pallas kernel and for a cache split over `sequence` (_cached_split). The layer's
      # pages in the same gather: a slice of the layer's pool first would be a copy of the pool (hoisted out of a loop
      # over rows, InvariantNetwork's).
      slots, heads_first = inputs.cache_segments.shape[1], not pallas and not sequence_split
      inputs = inputs.map_cache(lambda p: read_pages(p, table, slots, layer=layer, heads_first=heads_first))
      table, layer = None, None
      if heads_first:
        return _cached_xla(inputs, mask, diffusion_block, heads_first=True)
  if layer is not None:
    inputs = inputs.map_cache(lambda c: c[layer])
  if pallas:
    return _cached_pallas(inputs, mask, diffusion_block, table)
  split = _cached_split(inputs, mask, diffusion_block) if table is None else None
  return _cached_xla(inputs, mask, diffusion_block) if split is None else split
