"""Key-value caches of the decoding engine: one dense row per request, or a shared pool of pages.

Both are plain pytrees with the same interface (``slots``, :meth:`write`, :meth:`rows`, ``segments``), so the engine's
cache strategies (:mod:`mercury_jax.sampling.caches`) and the model's attention read either one:

* :class:`KVCache`: ``[layers, batch, slots, ...]``. The command line and the Python ``Sampler`` decode fixed
  batches with it: every row holds a whole canvas anyway, and the attention reads it without an index.
* :class:`PagedKVCache`: keys and values live in a pool of pages of ``page_size`` slots shared by every row; row
  ``r``'s slot ``s`` is slot ``s % page_size`` of page ``table[r, s // page_size]`` (vLLM's PagedAttention, Kwon et
  al. 2023, arXiv 2309.06180). The serving engine keeps one pool for all its slots: a request holds only the pages
  its canvas covers, and a step over any subset of the rows (a batch bucket) reads the rows' pages through their
  tables without copying a cache. Page 0 is the *sink*: the table of a free row, and the table entries past a row's
  canvas, point at it. Writes there are thrown away in effect (nothing reads them as live: their slots are in
  segment 0, which no query sees), so a free row in a bucket can run the step's uniform program harmlessly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from mercury_jax import sharding as sh
from mercury_jax.config import ModelConfig, dtype_of

SINK = 0  # The page every unassigned table entry points at (never handed to a request).
# The dense cache's logical axes (keys, values, segments): rows, slots, kv heads (KVCache.constrained).
_LOGICAL = (
  (None, sh.BATCH, sh.LENGTH, sh.ACT_KV_HEADS, sh.HEAD_DIM),
  (None, sh.BATCH, sh.LENGTH, sh.ACT_KV_HEADS, sh.HEAD_DIM),
  (sh.BATCH, sh.LENGTH),
)


class KVCache(NamedTuple):
  """Keys and values of every layer at every slot of a batch of rows: a plain pytree its owner carries and writes.

  The model never writes it: a pass over a chunk returns the chunk's own keys and values (``return_kv``), and the
  caller writes them with :meth:`write` where it wants them. A chunk's keys and values have the same layout, with the
  chunk's length in place of ``slots``.
  """

  keys: jax.Array  # [layers, batch, slots, kv_heads, head_dim]
  values: jax.Array  # [layers, batch, slots, kv_heads, head_dim]
  segments: jax.Array  # [batch, slots] int32: each slot's segment (0: empty or padding, which nothing sees)

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, slots: int) -> KVCache:
    """An all-empty cache (every slot in segment 0) of at least ``slots`` slots: on a mesh with a ``sequence`` axis
    rounded up to a multiple of its shards, so that they split it (the extra slots stay in segment 0: no query
    sees them)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    shards = 1 if mesh.empty or not rules else sh.sequence_shards(mesh, rules)
    slots = -(-slots // shards) * shards
    shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype_of(cfg.dtype)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, slots), jnp.int32)).constrained()

  def constrained(self) -> KVCache:
    """This cache with its sharding stated: rows over the data axes, slots over ``sequence`` (a context-parallel
    mesh keeps ``1 / shards`` of every row's slots per device; attention over it reduces across the shards), kv heads
    over ``tensor``. Axes that do not divide a dimension are left out; a no-op outside a mesh."""
    return KVCache(*(sh.constrain(a, axes) for a, axes in zip(self, _LOGICAL, strict=True)))

  def _split(self):
    """``(specs of the cache's arrays, the mesh axis its slots are split over)`` in a mesh context, or None when its
    slots are whole on every device (no mesh, no ``sequence`` axis, or one whose shards do not divide the slots)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if mesh.empty or not rules:
      return None
    specs = KVCache(*(sh.mesh_spec(axes, a.shape, mesh, rules) for a, axes in zip(self, _LOGICAL, strict=True)))
    return (specs, specs.segments[1]) if specs.segments[1] is not None else None

  @property
  def slots(self) -> int:
    return self.segments.shape[1]

  def _slots(self, starts: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """``(rows, slots)`` [batch, size] indices of the ``size`` slots from ``starts[r]`` of every row ``r``."""
    batch = self.segments.shape[0]
    starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (batch,))
    return jnp.arange(batch)[:, None], starts[:, None] + jnp.arange(size)[None, :]

  def write(self, chunk: KVCache, starts: jax.Array) -> KVCache:
    """This cache with ``chunk`` written at slots ``starts[r] ...`` of every row ``r`` (``starts``: [] or [batch]).

    One scatter per array, indexed on the batch and slot axes where they lie (a ``vmap`` over the batch axis, which is
    not the leading one, would transpose the whole cache twice at every write). With the slots split over
    ``sequence``, each shard writes the chunk's slots that fall in its own range (:meth:`_local`), the chunk whole on
    every shard; a write at slot 0 (a prefill) should use :meth:`write_prefix`, which keeps a split chunk split."""
    split = self._split()
    if split is not None:
      return self._local(split, lambda cache, chunk, starts: cache._write(chunk, starts), starts, chunk)
    return self._write(chunk, starts)

  def _write(self, chunk: KVCache, starts: jax.Array) -> KVCache:
    rows, slots = self._slots(starts, chunk.slots)
    slots = jnp.where(slots >= 0, slots, self.slots)  # Slots before this cache (another shard's): dropped.
    return KVCache(
      self.keys.at[:, rows, slots].set(chunk.keys.astype(self.keys.dtype), mode="drop"),
      self.values.at[:, rows, slots].set(chunk.values.astype(self.values.dtype), mode="drop"),
      self.segments.at[rows, slots].set(chunk.segments, mode="drop"),
    )

  def write_prefix(self, chunk: KVCache) -> KVCache:
    """This cache with ``chunk`` written at slots ``0 ..`` of every row: a select against the chunk padded to the
    cache's slots, which GSPMD partitions without gathering a chunk or a cache split over ``sequence``."""
    if chunk.slots > self.slots:
      raise ValueError(f"a chunk of {chunk.slots} slots does not fit a cache of {self.slots}")
    inside = jnp.arange(self.slots) < chunk.slots  # [slots]

    def put(old, new, slot_axis: int):
      new = jnp.pad(
        new.astype(old.dtype), [(0, self.slots - chunk.slots if d == slot_axis else 0) for d in range(old.ndim)]
      )
      return jnp.where(inside.reshape([-1 if d == slot_axis else 1 for d in range(old.ndim)]), new, old)

    return KVCache(
      put(self.keys, chunk.keys, 2), put(self.values, chunk.values, 2), put(self.segments, chunk.segments, 1)
    ).constrained()

  def rows(self, starts: jax.Array, size: int) -> KVCache:
    """The ``size`` slots from ``starts[r]`` of every row ``r``, as a chunk (whole on every shard of ``sequence``)."""
    split = self._split()
    if split is None:
      return self._rows(starts, size)

    def local(cache, _, starts):  # This shard's slots of the chunk, zeros elsewhere; summed over the shards.
      chunk = cache._rows(starts, size)
      _, slots = cache._slots(starts, size)
      here = (slots >= 0) & (slots < cache.slots)  # [batch, size]
      kv_here = here[None, :, :, None, None]
      masked = KVCache(
        jnp.where(kv_here, chunk.keys, 0), jnp.where(kv_here, chunk.values, 0), jnp.where(here, chunk.segments, 0)
      )
      return KVCache(*(jax.lax.psum(a, split[1]) for a in masked))

    return self._local(split, local, starts, chunk_out=True)

  def _rows(self, starts: jax.Array, size: int) -> KVCache:
    rows, slots = self._slots(starts, size)
    return KVCache(
      self.keys.at[:, rows, slots].get(mode="clip"),
      self.values.at[:, rows, slots].get(mode="clip"),
      self.segments.at[rows, slots].get(mode="clip"),
    )

  def _local(self, split, fn, starts, chunk: KVCache | None = None, *, chunk_out: bool = False):
    """``fn(this shard's cache, chunk, starts)`` per shard of a cache whose slots are split over ``sequence``
    (``split``: :meth:`_split`), inside a ``shard_map``, with ``starts`` counted from the shard's first slot: a
    chunk (``chunk`` in; the result with ``chunk_out``) is whole on every shard of that axis, the cache split."""
    specs, axis = split
    whole = lambda spec: P(*spec[:2], None, *spec[3:])  # noqa: E731  The cache's spec with the slots unsplit.
    chunk_specs = KVCache(whole(specs.keys), whole(specs.values), P(specs.segments[0], None))
    starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32), self.segments.shape[:1])

    def per_shard(cache, starts, *chunk):
      local = starts - jax.lax.axis_index(axis) * cache.slots
      return fn(cache, chunk[0] if chunk else None, local)

    in_specs = (specs, P(specs.segments[0])) + ((chunk_specs,) if chunk is not None else ())
    args = (self, starts) + ((chunk,) if chunk is not None else ())
    out_specs = chunk_specs if chunk_out else specs
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

  def layers(self) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(the layer index, scanned over layers; what every layer reads: the stacked keys and values)`` for the model's
    layer scan. A layer reads its own slice inside its attention (``attend_cached(layer=)``): a slice made by the scan
    would be copied out of the stack once per layer and step when the attention loops over it."""
    return jnp.arange(self.keys.shape[0], dtype=jnp.int32), (self.keys, self.values)

  # Row moves (:mod:`mercury_jax.sampling.state`): keys and values keep their rows on axis 1, segments on axis 0.

  def _by_rows(self, fn) -> KVCache:
    return KVCache(fn(self.keys, 1), fn(self.values, 1), fn(self.segments, 0))

  def take_rows(self, rows: jax.Array) -> KVCache:
    """The rows ``rows`` [n]."""
    return self._by_rows(lambda a, axis: jnp.take(a, rows, axis=axis))

  def put_rows(self, rows: jax.Array, part: KVCache) -> KVCache:
    """This cache with ``part`` (a :meth:`take_rows` after a step) written back at ``rows``."""
    return KVCache(
      self.keys.at[:, rows].set(part.keys),
      self.values.at[:, rows].set(part.values),
      self.segments.at[rows].set(part.segments),
    )

  def select_rows(self, keep: jax.Array, other: KVCache) -> KVCache:
    """This cache in the rows ``keep`` [b] marks and ``other`` in the others (a chunk's keys and values, too)."""

    def pick(a, b, axis):
      shape = [1] * a.ndim
      shape[axis] = keep.shape[0]
      return jnp.where(keep.reshape(shape), a, b)

    return KVCache(
      pick(self.keys, other.keys, 1), pick(self.values, other.values, 1), pick(self.segments, other.segments, 0)
    )

  def insert_row(self, slot: jax.Array, row: KVCache, table: jax.Array | None = None) -> KVCache:
    """This cache with the one-row cache ``row`` in row ``slot`` (``table`` is the paged cache's; unused)."""
    del table
    at = lambda a, r, axis: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=axis)  # noqa: E731
    return KVCache(at(self.keys, row.keys, 1), at(self.values, row.values, 1), at(self.segments, row.segments, 0))

  def repeat_rows(self, n: int) -> KVCache:
    """``n`` copies of each row."""
    return self._by_rows(lambda a, axis: jnp.repeat(a, n, axis=axis))

  def forget(self, row: jax.Array) -> KVCache:
    """This cache with row ``row`` holding nothing (every slot in segment 0, which no query sees)."""
    return self._replace(segments=self.segments.at[row].set(0))


class PagedKVCache(NamedTuple):
  """Keys and values in a pool of pages shared by the rows, addressed through a per-row page table (see the module
  docstring). The segments stay one dense ``[batch, slots]`` array: a few bytes a slot, gathered with the rows."""

  # A page holds each kv head's slots together, ``[kv_heads, page_size, head_dim]``: gathered through the table, the
  # pages come out heads-first, as the attention's products read them, with no transpose (read_pages).
  keys: jax.Array  # [layers, pages, kv_heads, page_size, head_dim] (page 0: the sink)
  values: jax.Array  # [layers, pages, kv_heads, page_size, head_dim]
  segments: jax.Array  # [batch, slots] int32
  table: jax.Array  # [batch, ceil(slots / page_size)] int32: each run of page_size slots' page

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, slots: int, pages: int, page_size: int) -> PagedKVCache:
    """A pool of ``pages`` pages (the sink included), every row's table on the sink."""
    if pages < 2:
      raise ValueError(f"pages={pages} must be >= 2 (page 0 is the sink)")
    if page_size < 1:
      raise ValueError(f"page_size={page_size} must be >= 1")
    shape = (cfg.num_layers, pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    dtype = dtype_of(cfg.dtype)
    table = jnp.full((batch, -(-slots // page_size)), SINK, jnp.int32)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, slots), jnp.int32), table)

  @property
  def slots(self) -> int:
    return self.segments.shape[1]

  @property
  def page_size(self) -> int:
    return self.keys.shape[3]

  def _address(self, starts: jax.Array, size: int) -> tuple[jax.Array, ...]:
    """``(rows, slots, pages, offsets)`` [batch, size] of the ``size`` slots from ``starts[r]`` of every row ``r``;
    ``slots`` may run past the row's end, ``pages`` and ``offsets`` are those of the slot clipped to the last one."""
    batch, size_p = self.segments.shape[0], self.page_size
    starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (batch,))
    rows, slots = jnp.arange(batch)[:, None], starts[:, None] + jnp.arange(size)[None, :]
    clipped = jnp.minimum(slots, self.slots - 1)
    return rows, slots, self.table[rows, clipped // size_p], clipped % size_p

  def write(self, chunk: KVCache, starts: jax.Array) -> PagedKVCache:
    """This cache with ``chunk`` (a dense chunk, as the model returns it) written at slots ``starts[r] ...`` of every
    row ``r``, through the rows' tables (slots past a row's end are dropped)."""
    rows, slots, pages, offsets = self._address(starts, chunk.slots)
    pages = jnp.where(slots < self.slots, pages, self.keys.shape[1])  # past the pool: dropped

    def put(pool: jax.Array, new: jax.Array) -> jax.Array:  # pool[:, pages, :, offsets] is [batch, size, layers, ...]
      return pool.at[:, pages, :, offsets].set(new.transpose(1, 2, 0, 3, 4).astype(pool.dtype), mode="drop")

    return self._replace(
      keys=put(self.keys, chunk.keys),
      values=put(self.values, chunk.values),
      segments=self.segments.at[rows, slots].set(chunk.segments, mode="drop"),
    )

  def rows(self, starts: jax.Array, size: int) -> KVCache:
    """The ``size`` slots from ``starts[r]`` of every row ``r``, as a dense chunk."""
    rows, slots, pages, offsets = self._address(starts, size)
    slots = jnp.minimum(slots, self.slots - 1)
    take = lambda pool: pool[:, pages, :, offsets].transpose(2, 0, 1, 3, 4)  # noqa: E731  -> [layers, batch, size, ...]
    return KVCache(take(self.keys), take(self.values), self.segments[rows, slots])

  def layers(self) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(the layer index, scanned over layers; (key pools, value pools, table))``: each layer reads its rows'
    pages of its own pool through the table (:class:`KVCache.layers`)."""
    return jnp.arange(self.keys.shape[0], dtype=jnp.int32), (self.keys, self.values, self.table)

  # Row moves (:mod:`mercury_jax.sampling.state`): the pool is every row's; a row's segments and table are its own.

  def insert_row(self, slot: jax.Array, row: KVCache, table: jax.Array) -> PagedKVCache:
    """This cache with row ``slot`` on the pages ``table`` [ceil(slots / page_size)] holding the one-row dense cache
    ``row`` (an admitted request's prefill); slots whose table entry is the sink keep nothing. Whole pages are
    written, one contiguous ``[kv_heads, page_size, head_dim]`` block each (the row's last page padded)."""
    per_row, size = table.shape[0], self.page_size

    def pages(a: jax.Array) -> jax.Array:  # [layers, 1, slots, kv, d] -> [layers, per_row, kv, page_size, d]
      a = jnp.pad(a[:, 0], ((0, 0), (0, per_row * size - a.shape[2]), (0, 0), (0, 0)))
      return a.reshape(a.shape[0], per_row, size, *a.shape[2:]).swapaxes(2, 3)

    put = lambda pool, new: pool.at[:, table].set(pages(new).astype(pool.dtype))  # noqa: E731
    return PagedKVCache(
      put(self.keys, row.keys),
      put(self.values, row.values),
      self.segments.at[slot].set(row.segments[0]),
      self.table.at[slot].set(table),
    )

  def forget(self, row: jax.Array) -> PagedKVCache:
    """This cache with row ``row`` holding no page (its table on the sink, every slot in segment 0)."""
    return self._replace(segments=self.segments.at[row].set(0), table=self.table.at[row].set(SINK))

  def take_rows(self, rows: jax.Array) -> PagedKVCache:
    """The rows ``rows`` [n] over the same pool (a batch bucket's view: nothing of the pool is copied)."""
    return self._replace(segments=self.segments[rows], table=self.table[rows])

  def put_rows(self, rows: jax.Array, part: PagedKVCache) -> PagedKVCache:
    """This cache after a step over :meth:`take_rows` ``(rows)``: ``part``'s pool, and its rows' segments and tables."""
    return PagedKVCache(
      part.keys, part.values, self.segments.at[rows].set(part.segments), self.table.at[rows].set(part.table)
    )

  def select_rows(self, keep: jax.Array, other: PagedKVCache) -> PagedKVCache:
    """This cache: the pool is every row's, and a row that must stay as it was wrote nothing into it."""
    del keep, other
    return self

  def repeat_rows(self, n: int) -> PagedKVCache:
    """``n`` copies of each row's table and segments over the same pool."""
    return self._replace(segments=jnp.repeat(self.segments, n, axis=0), table=jnp.repeat(self.table, n, axis=0))


def read_pages(
  pool: jax.Array, table: jax.Array, slots: int, layer: jax.Array | None = None, *, heads_first: bool = False
) -> jax.Array:
  """Each row's slots of one layer's pages ``pool`` [pages, kv_heads, page_size, head_dim] through ``table``
  [batch, ceil(slots / page_size)]: ``[batch, slots, kv_heads, head_dim]``, as a dense cache holds them, or with
  ``heads_first`` ``[batch, kv_heads, slots, head_dim]``, as the attention's products read them, in one gather and no
  transpose (each page keeps a head's slots together). With ``layer``, ``pool`` holds every layer ``[layers, pages,
  ...]`` and layer ``layer``'s pages are read in the same gather (no copy of the layer's pool)."""
  batch, per_row = table.shape
  heads = jnp.arange(pool.shape[-3], dtype=table.dtype)[None, :, None]
  pages = table[:, None, :]  # with ``heads``: [batch, kv_heads, per_row]
  gathered = pool[pages, heads] if layer is None else pool[layer, pages, heads]  # [batch, kv, per_row, size, d]
  gathered = gathered.reshape(batch, heads.shape[1], per_row * gathered.shape[3], gathered.shape[4])[:, :, :slots]
  return gathered if heads_first else jnp.swapaxes(gathered, 1, 2)
