"""Host arrays onto a mesh and back, on one process or many: canvases over the batch axes, the rest replicated.

Several processes (a multi-host mesh) either all pass the same rows, or each passes its own (``per_process``): the
processes agree on one batch shape (:meth:`Placement.agree_on_batch`), each places its rows on its own devices and
reads back only those rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.settings import check_seed


class BatchLayout(NamedTuple):
  """How the processes of a ``per_process`` call share one batch (the same on every process)."""

  rows: np.ndarray  # int [processes]: each process's real rows
  length: int  # the longest canvas of any process
  local_rows: int  # rows each process contributes (its own, then padding)
  own_devices: bool  # each process's devices hold rows no other process holds


class Placement:
  """Placing and gathering for one mesh and its logical axis rules."""

  def __init__(self, mesh: Mesh, rules):
    self.mesh, self.rules = mesh, rules

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def batched(self, ndim: int) -> NamedSharding:
    """The sharding of an array whose first axis is the batch."""
    return sh.batch_sharding(self.mesh, self.rules, ndim)

  def put(self, array, sharding: NamedSharding | None = None) -> jax.Array:
    """A host array as a global array (placed by callback, so every process builds the same one)."""
    array = np.asarray(array)
    sharding = self.replicated if sharding is None else sharding
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def put_rows(self, tree):
    """Every array of ``tree`` split over the batch axes on its first axis."""
    return jax.tree.map(lambda a: self.put(a, self.batched(np.ndim(a))), tree)

  def key(self, seed: int) -> jax.Array:
    check_seed(seed)
    return self.put(jax.random.key_data(jax.random.key(seed)))

  def gather(self, array: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)

  def canvas(self, canvas: cv.Canvas, pad_id: int) -> cv.Canvas:
    """The whole batch (the same on every process), padded to the data-parallel size and split over it."""
    canvas = cv.pad_batch(canvas, sh.data_parallel_size(self.mesh, self.rules), pad_id)
    return cv.Canvas(*self.put_rows(tuple(canvas)))

  def own_canvas(self, canvas: cv.Canvas, layout: BatchLayout, pad_id: int) -> cv.Canvas:
    """This process's rows on its own devices (``layout.own_devices``), padded to ``layout.local_rows``."""
    canvas = pad_rows(canvas, layout.local_rows, pad_id)
    total = jax.process_count() * layout.local_rows
    return cv.Canvas(
      *(jax.make_array_from_process_local_data(self.batched(np.ndim(a)), a, (total, *np.shape(a)[1:])) for a in canvas)
    )

  def local_slices(self) -> int:
    """How many distinct slices of a batch split over the data axes this process's devices hold."""
    shards = sh.data_parallel_size(self.mesh, self.rules)
    indices = self.batched(1).addressable_devices_indices_map((shards,))
    return len({index[0].start for index in indices.values()})

  def agree_on_batch(self, rows: int, length: int, *, digest: int = 0, failed: bool = False) -> BatchLayout:
    """Agrees with every other process on the batch of a ``per_process`` call (collective: all processes call it).

    Args:
      rows: This process's canvas rows (may be 0).
      length: This process's canvas length.
      digest: A number that must be equal on every process (e.g. of the settings and seed).
      failed: This process could not build its rows; every process then raises.

    Raises:
      ValueError: Some process failed, or the processes' ``digest`` differ.
    """
    mine = np.asarray([rows, length, int(failed), self.local_slices(), digest & 0x7FFFFFFF], np.int32)
    table = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), mine.size)
    failures = [int(p) for p in np.flatnonzero(table[:, 2])]
    if failures:
      raise ValueError(f"process(es) {failures} could not build their prompts (see their error); nothing was sampled")
    if len(set(table[:, 4].tolist())) > 1:
      raise ValueError(
        "the processes were given different sampler settings, steps or seeds; per-process sampling needs the same "
        "ones everywhere (only the prompts differ)"
      )
    processes, shards, slices = jax.process_count(), sh.data_parallel_size(self.mesh, self.rules), table[:, 3]
    own = shards % processes == 0 and bool((slices == shards // processes).all())
    most = max(int(table[:, 0].max()), 1)
    local_rows = -(-most // (shards // processes)) * (shards // processes) if own else most
    return BatchLayout(table[:, 0], int(table[:, 1].max()), local_rows, own)


def pad_rows(canvas: cv.Canvas, rows: int, pad_id: int) -> cv.Canvas:
  """Appends all-padding rows (nothing to generate) up to ``rows``."""
  extra = rows - np.shape(canvas.tokens)[0]
  length = np.shape(canvas.tokens)[1]
  return cv.Canvas(
    np.concatenate([np.asarray(canvas.tokens, np.int32), np.full((extra, length), pad_id, np.int32)]),
    np.concatenate([np.asarray(canvas.kinds, np.int32), np.full((extra, length), K.PAD, np.int32)]),
    np.concatenate([np.asarray(canvas.streams, np.int32), np.zeros((extra,), np.int32)]),
  )


def own_rows(x: jax.Array, axis: int | None) -> np.ndarray:
  """This process's rows of a batch-sharded output (in the order ``make_array_from_process_local_data`` used)."""
  if axis is None:  # Replicated.
    return np.asarray(x.addressable_shards[0].data)
  pieces = {}
  for shard in x.addressable_shards:
    pieces.setdefault(shard.index[axis].start or 0, shard.data)
  return np.concatenate([np.asarray(pieces[start]) for start in sorted(pieces)], axis=axis)
