"""Packing token ids into fixed-length records, and ArrayRecord shard I/O.

The record format (the trainer and evaluation depend on it): each record is the bytes of an
``np.ndarray(int32, shape [2, seq_len])``. Row 0 holds token ids, row 1 token kinds (``mercury_jax.kinds``):
``PAD`` fills the tail of the last language-modelling record, ``FIXED`` is an SFT prompt (clean context, no loss),
``TARGET`` is noised and scored.

Language modelling (``pack_lm``): documents, each followed by EOS, are concatenated and cut into ``seq_len`` chunks
of kind ``TARGET``; a chunk may start mid-document. The final partial chunk is kept and padded, so no text is lost
and even a one-file validation split has a record.

SFT (``pack_sft``): one example per record: ``[BOS] + prompt`` (kind ``FIXED``), then ``response + [EOS]``, then
EOS up to ``seq_len`` (all kind ``TARGET``); an SFT record has no ``PAD``. The EOS padding is masked and scored like
the response, as in LLaDA's SFT recipe (Nie et al. 2025, "Large Language Diffusion Models", section 2.3). Were it
``PAD``, the denoiser would always see exactly ``len(response) + 1`` masks, learn where the answer ends from their
number, and at inference let the canvas length dictate the answer's length; on a canvas that always runs to
``seq_len`` it learns to end the answer by predicting EOS. Examples longer than ``seq_len`` are skipped, never
truncated, so the characters counted for an evaluation are exactly those of the responses in the records (EOS
padding has no characters, but its tokens are among the scored ``target_tokens``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from mercury_jax.kinds import FIXED, PAD, TARGET

RECORD_DTYPE = np.int32
SHARD_SUFFIX = ".array_record"


def encode_record(record: np.ndarray) -> bytes:
  """The bytes of one ``[2, seq_len]`` record (row 0 ids, row 1 kinds)."""
  record = np.asarray(record)
  assert record.ndim == 2 and record.shape[0] == 2, record.shape
  return record.astype(RECORD_DTYPE).tobytes()


def decode_record(data: bytes, seq_len: int | None = None) -> dict[str, np.ndarray]:
  """``{"tokens": int32[seq_len], "kinds": int32[seq_len]}`` of one record's bytes.

  Raises:
    ValueError: The byte length does not match ``seq_len`` (or is not a whole ``[2, L]`` int32 array).
  """
  itemsize = np.dtype(RECORD_DTYPE).itemsize
  length = len(data) // (2 * itemsize)
  if len(data) != 2 * itemsize * length or (seq_len is not None and length != seq_len):
    raise ValueError(
      f"a record of {len(data)} bytes is not an int32 [2, {seq_len or 'L'}] array; "
      "was the data prepared with another --seq-len?"
    )
  record = np.frombuffer(data, dtype=RECORD_DTYPE).reshape(2, length)
  return {"tokens": record[0].copy(), "kinds": record[1].copy()}


def document_segments(tokens: np.ndarray, kinds: np.ndarray, eos_id: int) -> np.ndarray:
  """Attention segments that keep each document of packed LM records apart: ``int32`` like ``tokens`` (``[..., L]``).

  :func:`pack_lm` ends every document with ``eos_id``, so a record's segments count its documents: 1 up to and
  including the first EOS, 2 from there to the next, ...; padding is segment 0. The first document of a record may
  be the end of one that began in the record before it (a segment of its own here).
  """
  ends = (tokens == eos_id) & (kinds != PAD)
  segments = 1 + np.cumsum(ends, axis=-1, dtype=np.int32) - ends  # an EOS belongs to the document it ends
  return np.where(kinds == PAD, 0, segments).astype(np.int32)


def pack_lm(documents: Iterable[Sequence[int]], seq_len: int, *, eos_id: int, pad_id: int) -> np.ndarray:
  """Concatenates ``doc + [eos]`` for every document and cuts the stream into records.

  Returns:
    ``int32[num_records, 2, seq_len]``; the last record is padded (ids ``pad_id``, kind ``PAD``).
  """
  pieces = []
  for doc in documents:
    pieces.append(np.asarray(doc, dtype=RECORD_DTYPE))
    pieces.append(np.asarray([eos_id], dtype=RECORD_DTYPE))
  stream = np.concatenate(pieces) if pieces else np.zeros([0], RECORD_DTYPE)
  num_records = -(-stream.size // seq_len)
  tokens = np.full([num_records * seq_len], pad_id, dtype=RECORD_DTYPE)
  kinds = np.full([num_records * seq_len], PAD, dtype=RECORD_DTYPE)
  tokens[: stream.size] = stream
  kinds[: stream.size] = TARGET
  records = np.stack([tokens.reshape(num_records, seq_len), kinds.reshape(num_records, seq_len)], axis=1)
  return records


def pack_sft(
  examples: Iterable[tuple[Sequence[int], Sequence[int]]], seq_len: int, *, bos_id: int, eos_id: int
) -> tuple[np.ndarray, list[int]]:
  """One record per ``(prompt_ids, response_ids)`` example, its response padded with EOS targets to ``seq_len``.

  Each kept record is ``[BOS] + prompt`` (``FIXED``), then ``response + [EOS]`` and EOS up to ``seq_len``
  (``TARGET``). The EOS padding is a target, not ``PAD``, following LLaDA's SFT recipe (Nie et al. 2025, "Large
  Language Diffusion Models", section 2.3): every record's canvas then runs to ``seq_len``, so the number of masks
  does not leak the response's length and the model learns where the answer ends by predicting EOS, as it must on a
  sampling canvas longer than the answer.

  Returns:
    ``(records, skipped)``: ``int32[num_kept, 2, seq_len]`` and the indices of examples that did not fit
    (``1 + len(prompt) + len(response) + 1 > seq_len``).
  """
  rows, skipped = [], []
  for index, (prompt, response) in enumerate(examples):
    prompt_ids = [bos_id, *prompt]
    response_end = len(prompt_ids) + len(response)
    if response_end + 1 > seq_len:
      skipped.append(index)
      continue
    record = np.full([2, seq_len], eos_id, dtype=RECORD_DTYPE)
    record[0, : len(prompt_ids)] = prompt_ids
    record[0, len(prompt_ids) : response_end] = response
    record[1, : len(prompt_ids)] = FIXED
    record[1, len(prompt_ids) :] = TARGET
    rows.append(record)
  records = np.stack(rows) if rows else np.zeros([0, 2, seq_len], RECORD_DTYPE)
  return records, skipped


def pack_sft_packed(
  examples: Iterable[tuple[Sequence[int], Sequence[int]]], seq_len: int, *, bos_id: int, eos_id: int, pad_id: int
) -> tuple[np.ndarray, list[int]]:
  """SFT examples packed several to a record, in order, for next-token objectives (the twin, ``verified``).

  Each example is ``[BOS] + prompt`` (``FIXED``) then ``response + [EOS]`` (``TARGET``); examples follow each other
  until the next one does not fit, and the rest of the record is ``PAD``. Unlike :func:`pack_sft` no EOS padding is
  scored: a next-token model learns where an answer ends from its own EOS, and a record holds as many answers as fit
  (as language-modelling records hold several documents, a later example sees the earlier ones).

  Returns:
    ``(records, skipped)``: ``int32[num_records, 2, seq_len]`` and the indices of examples longer than ``seq_len``.
  """
  rows, skipped = [], []
  tokens, kinds = [], []

  def close():
    record = np.full([2, seq_len], pad_id, dtype=RECORD_DTYPE)
    record[1] = PAD
    record[0, : len(tokens)], record[1, : len(kinds)] = tokens, kinds
    rows.append(record)

  for index, (prompt, response) in enumerate(examples):
    example = [bos_id, *prompt, *response, eos_id]
    if len(example) > seq_len:
      skipped.append(index)
      continue
    if len(tokens) + len(example) > seq_len:
      close()
      tokens, kinds = [], []
    tokens += example
    kinds += [FIXED] * (1 + len(prompt)) + [TARGET] * (len(response) + 1)
  if tokens:
    close()
  records = np.stack(rows) if rows else np.zeros([0, 2, seq_len], RECORD_DTYPE)
  return records, skipped


def record_stats(records: np.ndarray, *, eos_id: int | None = None) -> dict[str, int]:
  """Counts of records and of non-padding, target and prompt tokens in ``int32[n, 2, seq_len]``.

  Args:
    records: Packed records.
    eos_id: For SFT records (``pack_sft``): also count ``eos_padding_tokens``, the target tokens after each
      record's first EOS (the response's own EOS ends it; the rest pad it to ``seq_len``). They are part of
      ``target_tokens``, since the objective scores them, but have no characters.
  """
  kinds = records[:, 1]
  stats = {
    "records": int(records.shape[0]),
    "tokens": int(np.count_nonzero(kinds != PAD)),
    "target_tokens": int(np.count_nonzero(kinds == TARGET)),
    "prompt_tokens": int(np.count_nonzero(kinds == FIXED)),
  }
  if eos_id is not None:
    is_eos = (records[:, 0] == eos_id) & (kinds == TARGET)
    after_first_eos = np.cumsum(is_eos, axis=1) - is_eos > 0  # [n, seq_len]
    stats["eos_padding_tokens"] = int(np.count_nonzero(after_first_eos & (kinds == TARGET)))
  return stats


def shard_names(split: str, num_shards: int) -> list[str]:
  """``["train-00000-of-00004.array_record", ...]``."""
  return [f"{split}-{i:05d}-of-{num_shards:05d}{SHARD_SUFFIX}" for i in range(num_shards)]


def write_shards(records: np.ndarray, directory: str | os.PathLike, split: str, num_shards: int) -> list[str]:
  """Writes ``records`` in order, in contiguous runs, to at most ``num_shards`` shards (none for zero records).

  Reading the returned shards in order gives the records in their original order.

  Returns:
    The shard file names, relative to ``directory``.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards={num_shards} must be >= 1")
  num_shards = min(num_shards, len(records))
  names = shard_names(split, num_shards)
  for name, part in zip(names, np.array_split(records, num_shards) if num_shards else [], strict=True):
    writer = ArrayRecordWriter(str(Path(directory) / name), "group_size:1")
    for record in part:
      writer.write(encode_record(record))
    writer.close()
  return names


def read_shards(paths: Sequence[str | os.PathLike]) -> np.ndarray:
  """All records of ``paths``, in order, as ``int32[n, 2, seq_len]`` (for inspection and tests)."""
  records = []
  for path in paths:
    reader = ArrayRecordReader(str(path))
    records.extend(reader.read_all())
    reader.close()
  if not records:
    return np.zeros([0, 2, 0], RECORD_DTYPE)
  seq_len = len(records[0]) // (2 * np.dtype(RECORD_DTYPE).itemsize)
  return np.stack([np.frombuffer(r, RECORD_DTYPE).reshape(2, seq_len) for r in records])
