"""Reading prepared data: grain pipelines for training, fixed batches for evaluation, and global arrays.

Training (``train_dataset``) gives each process a disjoint slice of the train records (``[process_index::
process_count]``), shuffled with a seed and reshuffled every epoch, repeated forever and batched to the per-process
batch. Its iterator's ``get_state``/``set_state`` resume exactly, also through Orbax with
``grain.checkpoint.CheckpointHandler``. Reading uses threads only: grain's multiprocessing workers need absl flags
to be parsed and cost seconds to start.

Evaluation (``eval_batches``) builds the same global batches on any number of processes: global row ``g`` is
record ``g % num_records`` of the split, in stored order, and process ``p`` takes rows ``[p * local, (p + 1) *
local)`` of each global batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import ZipMapDataset

from mercury_jax import sharding
from mercury_jax.data import records
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.files import METADATA_FILE, TOKENIZER_FILE

FORMAT_VERSION = 1
_PREPARE_HINT = "run `python -m mercury_jax.prepare --corpus python-stdlib --out DATA_DIR` to prepare one"


def read_metadata(data_dir: str | os.PathLike) -> dict[str, Any]:
  """The ``metadata.json`` of a directory written by ``python -m mercury_jax.prepare``.

  Raises:
    ValueError: ``data_dir`` is not a prepared directory, or was written by an incompatible version.
  """
  path = Path(data_dir) / METADATA_FILE
  if not Path(data_dir).is_dir():
    raise ValueError(f"data directory {str(data_dir)!r} does not exist; {_PREPARE_HINT}")
  if not path.is_file():
    raise ValueError(f"{str(data_dir)!r} is not a prepared data directory (no {METADATA_FILE}); {_PREPARE_HINT}")
  try:
    metadata = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {str(path)!r}: {e}; {_PREPARE_HINT}") from None
  if metadata.get("format_version") != FORMAT_VERSION:
    raise ValueError(
      f"{str(path)!r} has format_version={metadata.get('format_version')!r}, this code reads "
      f"{FORMAT_VERSION}; re-run `python -m mercury_jax.prepare` with --force"
    )
  return metadata


def load_data_tokenizer(data_dir: str | os.PathLike) -> Tokenizer:
  """The tokenizer that a prepared directory was encoded with (a checkpoint's: ``tokenizer.load_tokenizer``).

  Raises:
    ValueError: ``data_dir`` is not a prepared directory (:func:`read_metadata`).
  """
  read_metadata(data_dir)
  return Tokenizer.load(Path(data_dir) / TOKENIZER_FILE)


def split_paths(data_dir: str | os.PathLike, split: str, metadata: dict[str, Any] | None = None) -> list[str]:
  """The shard paths of ``split``, in record order.

  Raises:
    ValueError: The split is unknown or has no records.
  """
  metadata = metadata or read_metadata(data_dir)
  splits = metadata["splits"]
  if split not in splits:
    raise ValueError(f"split={split!r} is not in {str(data_dir)!r}; it has {sorted(splits)}")
  if not splits[split]["records"]:
    raise ValueError(f"split {split!r} of {str(data_dir)!r} has no records (its corpus split was empty)")
  return [str(Path(data_dir) / name) for name in splits[split]["shards"]]


def _check_seq_len(data_dir: str | os.PathLike, metadata: dict[str, Any], seq_len: int) -> None:
  if seq_len != metadata["seq_len"]:
    raise ValueError(
      f"seq_len={seq_len} but {str(data_dir)!r} was prepared with seq_len={metadata['seq_len']}; "
      f"set model.max_length={metadata['seq_len']}, or re-run `python -m mercury_jax.prepare` with "
      f"--seq-len {seq_len}"
    )


def _process_layout(
  global_batch_size: int, process_index: int | None, process_count: int | None
) -> tuple[int, int, int]:
  """``(process_index, process_count, per_process_batch)`` with jax's values as defaults."""
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must lie in [0, process_count={process_count})")
  if global_batch_size < 1 or global_batch_size % process_count:
    raise ValueError(
      f"global_batch_size={global_batch_size} must be a positive multiple of the {process_count} processes"
    )
  return process_index, process_count, global_batch_size // process_count


class DecodeRecord(grain.transforms.Map):
  """Record bytes -> ``{"tokens": int32[seq_len], "kinds": int32[seq_len]}`` (module level, so it pickles), and
  ``"segments"`` (:func:`records.document_segments`) when ``document_eos`` is given."""

  def __init__(self, seq_len: int, document_eos: int | None = None):
    self.seq_len, self.document_eos = seq_len, document_eos

  def map(self, element: bytes) -> dict[str, np.ndarray]:
    record = records.decode_record(element, self.seq_len)
    if self.document_eos is not None:
      record["segments"] = records.document_segments(record["tokens"], record["kinds"], self.document_eos)
    return record


def _document_eos(metadata: dict[str, Any], documents: bool) -> int | None:
  """The EOS that ends each packed document, when batches carry document segments (LM data only)."""
  if not documents:
    return None
  if metadata["mode"] != "lm":
    raise ValueError(
      f"data.document_segments needs packed LM records (prepare's lm mode), not {metadata['mode']!r} records, which "
      "hold one example each"
    )
  return int(metadata["eos_id"])


class ConcatRows(grain.transforms.Map):
  """``(batch, batch, ...)`` -> one batch whose rows are theirs in order (module level, so it pickles)."""

  def map(self, element: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in element]) for key in element[0]}


EPOCHS = 10**9  # A mixture's sources repeat this many epochs (finite, so grain can mix and zip them; never reached).


def _mixed_records(
  sources: Sequence[tuple[str, float]], seq_len: int, seed: int, decode: DecodeRecord
) -> grain.MapDataset:
  """The train records of prepared directories, each shuffled (source ``i`` with ``seed + i``) and repeated, mixed
  record by record in proportion to their weights (grain's deterministic ``MapDataset.mix``), decoded."""
  datasets = []
  for i, (data_dir, _) in enumerate(sources):
    metadata = read_metadata(data_dir)
    _check_seq_len(data_dir, metadata, seq_len)
    source = grain.sources.ArrayRecordDataSource(split_paths(data_dir, "train", metadata))
    datasets.append(grain.MapDataset.source(source).shuffle(seed=(seed + i) % 2**32).repeat(EPOCHS))
  mixed = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, [w for _, w in sources])
  return mixed.map(decode)


def train_dataset(
  data_dir: str | os.PathLike,
  *,
  seq_len: int,
  global_batch_size: int,
  seed: int,
  process_index: int | None = None,
  process_count: int | None = None,
  num_threads: int = 2,
  prefetch: int = 8,
  document_segments: bool = False,
  mix: Sequence[tuple[str, float]] = (),
  distill: Sequence[tuple[str, float]] = (),
  distill_batch_size: int = 0,
) -> grain.IterDataset:
  """An endless, shuffled stream of this process's training batches.

  ``iter(dataset)`` is a ``grain.DatasetIterator``: save ``it.get_state()`` (or ``grain.checkpoint.CheckpointSave
  (it)`` in Orbax) and a fresh iterator given that state yields exactly the batches that would have come next.

  Args:
    data_dir: A directory written by ``python -m mercury_jax.prepare``.
    seq_len: Must equal the prepared ``seq_len``.
    global_batch_size: Batch over all processes; each process yields ``global_batch_size // process_count`` rows.
    seed: Shuffle seed in ``[0, 2**32)``; epoch ``e`` is shuffled with ``seed + e``.
    process_index: This process's index; defaults to ``jax.process_index()``.
    process_count: Number of processes; defaults to ``jax.process_count()``.
    num_threads: Reader threads.
    prefetch: Elements buffered ahead.
    document_segments: Batches also carry ``"segments"``, each packed document its own attention segment
      (``data.document_segments``; LM data).
    mix: More prepared directories ``(dir, weight)`` (``data.mix``) whose train records are mixed into
      ``data_dir``'s (weight 1), record by record in proportion to the weights; the rows of a batch are drawn from
      the mixed stream. Empty: ``data_dir`` alone, exactly as before mixtures existed.
    distill: Self-distillation sets ``(dir, weight)`` (``data.distill``: ``python -m mercury_jax.distill``),
      mixed with each other by weight; ``distill_batch_size`` of their records (over all processes) follow the
      ``global_batch_size`` rows of every batch, so the first rows are exactly the batches without them.
    distill_batch_size: Rows from ``distill`` per global batch.

  Returns:
    An IterDataset of ``{"tokens": int32[local_batch, seq_len], "kinds": int32[local_batch, seq_len]}``.
  """
  metadata = read_metadata(data_dir)
  _check_seq_len(data_dir, metadata, seq_len)
  process_index, process_count, local_batch = _process_layout(global_batch_size, process_index, process_count)
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed} must lie in [0, 2**32)")
  if bool(distill) != (distill_batch_size > 0):
    raise ValueError(f"distill ({len(distill)} sets) and distill_batch_size={distill_batch_size} go together")
  source = grain.sources.ArrayRecordDataSource(split_paths(data_dir, "train", metadata))
  if len(source) == 0:
    raise ValueError(f"the train split of {str(data_dir)!r} has no records")
  # One global order for every process count: the shuffled stream is cut into per-process chunks, and global
  # batch k is chunks k*P .. k*P+P-1, so process p reads only its own rows (chunk k*P+p) and the global batch, its
  # row order and the iterator state ({"next_index": k}) are the same for 1, 2 or 64 processes.
  decode = DecodeRecord(seq_len, _document_eos(metadata, document_segments))
  if mix or distill:
    dataset = _mixed_records([(str(data_dir), 1.0), *mix], seq_len, seed, decode)
  else:
    dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat().map(decode)
  dataset = dataset.batch(local_batch, drop_remainder=True)[process_index::process_count]
  if distill:
    if document_segments:
      raise ValueError("data.document_segments does not apply to self-distillation records; set it to false")
    _, _, distill_local = _process_layout(distill_batch_size, process_index, process_count)
    drafts = _mixed_records(distill, seq_len, seed, DecodeRecord(seq_len))
    drafts = drafts.batch(distill_local, drop_remainder=True)[process_index::process_count]
    rows = min(len(dataset), len(drafts))
    dataset = ZipMapDataset([dataset[:rows], drafts[:rows]]).map(ConcatRows())
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  return dataset.to_iter_dataset(options)


def eval_batches(
  data_dir: str | os.PathLike,
  split: str,
  *,
  seq_len: int,
  global_batch_size: int,
  num_batches: int | None,
  process_index: int | None = None,
  process_count: int | None = None,
  document_segments: bool = False,
) -> list[dict[str, np.ndarray]]:
  """The same per-process evaluation batches on every call.

  Args:
    data_dir: A directory written by ``python -m mercury_jax.prepare``.
    split: ``"validation"`` or ``"train"``.
    seq_len: Must equal the prepared ``seq_len``.
    global_batch_size: Batch over all processes.
    num_batches: How many batches; records wrap around when the split is smaller. ``None`` makes one exact pass:
      ``ceil(records / global_batch_size)`` batches whose surplus rows are all padding (kind 0, so they add no loss
      and no target tokens), so summed losses cover each record exactly once.
    process_index: This process's index; defaults to ``jax.process_index()``.
    process_count: Number of processes; defaults to ``jax.process_count()``.
    document_segments: See :func:`train_dataset`.

  Returns:
    A list of ``{"tokens": int32[local_batch, seq_len], "kinds": int32[local_batch, seq_len]}``.
  """
  metadata = read_metadata(data_dir)
  _check_seq_len(data_dir, metadata, seq_len)
  process_index, _, local_batch = _process_layout(global_batch_size, process_index, process_count)
  source = grain.sources.ArrayRecordDataSource(split_paths(data_dir, split, metadata))
  num_records = len(source)
  one_pass = num_batches is None
  if one_pass:
    num_batches = -(-num_records // global_batch_size)
  elif num_batches < 0:
    raise ValueError(f"num_batches={num_batches} must be >= 0 (or None for one pass over the split)")
  decode = DecodeRecord(seq_len, _document_eos(metadata, document_segments))
  padding = {"tokens": np.full([seq_len], metadata["pad_id"], np.int32), "kinds": np.zeros([seq_len], np.int32)}
  if document_segments:
    padding["segments"] = np.zeros([seq_len], np.int32)
  batches = []
  for step in range(num_batches):
    start = step * global_batch_size + process_index * local_batch
    rows = [
      padding if one_pass and row >= num_records else decode.map(source[row % num_records])
      for row in range(start, start + local_batch)
    ]
    batches.append({key: np.stack([r[key] for r in rows]) for key in padding})
  return batches


def to_global(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh, rules) -> dict[str, jax.Array]:
  """Assembles global ``jax.Array``s, sharded over the mesh's data axes, from this process's rows.

  Args:
    batch: Per-process arrays ``[local_batch, ...]``.
    mesh: The device mesh.
    rules: The logical-to-mesh rules table (``sharding.axis_rules(...)``).

  Returns:
    Arrays of shape ``[local_batch * jax.process_count(), ...]``.
  """
  out = {}
  for key, local in batch.items():
    local = np.asarray(local)
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    ways = sharding.data_parallel_size(mesh, rules)
    if global_shape[0] % ways:
      raise ValueError(
        f"the global batch of {global_shape[0]} rows ({key!r}) must be a multiple of the {ways} "
        "data-parallel shards of the mesh; change data.batch_size"
      )
    target = sharding.batch_sharding(mesh, rules, local.ndim)
    out[key] = jax.make_array_from_process_local_data(target, local, global_shape)
  return out
