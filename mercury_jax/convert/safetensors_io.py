"""Reading Hugging Face safetensors checkpoints one tensor at a time, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor's name to its
``dtype``, ``shape`` and ``data_offsets`` (``[begin, end)`` bytes after the header), and the raw little-endian data.
:func:`open_checkpoint` reads the headers of a single ``model.safetensors`` or of the shards named by
``model.safetensors.index.json`` and checks each file holds every byte its header promises; :func:`read_into` reads
one tensor into a caller's (preallocated) array, cast on the way, so the host never holds more than the output and
the tensor being read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes this reader takes (every float format public checkpoints ship in).
DTYPE_CODES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
_MAX_HEADER = 100 * 2**20  # The format's own limit on the JSON header (100 MB).


class CheckpointError(ValueError):
  """A checkpoint file is missing, truncated or malformed; the message names the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lies: its file, dtype, shape and absolute byte offset."""

  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # Absolute offset of the first byte in ``file``.

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
  """The tensors of one safetensors file, checked against the file's size.

  Raises:
    CheckpointError: the file is shorter than its header says, the header is not valid JSON, or a tensor has an
      unsupported dtype or inconsistent offsets.
  """
  size = path.stat().st_size
  with path.open("rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise CheckpointError(f"{path.name}: {size} bytes is too short for a safetensors file (truncated?)")
    length = int.from_bytes(prefix, "little")
    if length > _MAX_HEADER or 8 + length > size:
      raise CheckpointError(
        f"{path.name}: header of {length} bytes does not fit in the file's {size} bytes (truncated or not safetensors)"
      )
    try:
      header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path.name}: the safetensors header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path.name}: the safetensors header is not a JSON object")
  tensors, end = {}, 0
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      code, shape, (begin, stop) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(f"{path.name}: tensor {name!r} has a malformed header entry {entry!r}") from None
    if code not in DTYPE_CODES:
      raise CheckpointError(f"{path.name}: tensor {name!r} has dtype {code}; supported: {', '.join(DTYPE_CODES)}")
    info = TensorInfo(path, np.dtype(DTYPE_CODES[code]), shape, 8 + length + int(begin))
    if stop - begin != info.nbytes:
      raise CheckpointError(
        f"{path.name}: tensor {name!r} {code}{list(shape)} needs {info.nbytes} bytes but its offsets span "
        f"{stop - begin}"
      )
    tensors[name], end = info, max(end, 8 + length + int(stop))
  if end > size:
    raise CheckpointError(f"{path.name}: the header promises {end} bytes but the file has {size} (truncated)")
  return tensors


def open_checkpoint(folder: Path) -> dict[str, TensorInfo]:
  """Every tensor of the checkpoint in ``folder``: a single ``model.safetensors`` or the shards of its index.

  Raises:
    CheckpointError: no weights, a shard the index names is missing, or a file is truncated or malformed.
  """
  index = folder / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
      raise CheckpointError(f"{INDEX_FILE} in {str(folder)!r} has no readable weight_map") from None
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(set(weight_map.values())):
      if not (folder / shard).is_file():
        raise CheckpointError(f"shard {shard!r} named by {INDEX_FILE} is missing from {str(folder)!r}")
      tensors.update(read_header(folder / shard))
    unlisted = sorted(set(weight_map) - set(tensors))
    if unlisted:
      raise CheckpointError(
        f"tensor {unlisted[0]!r} is listed in {INDEX_FILE} under {weight_map[unlisted[0]]!r} but that shard lacks it"
      )
    return tensors
  if (folder / SINGLE_FILE).is_file():
    return read_header(folder / SINGLE_FILE)
  raise CheckpointError(
    f"no weights in {str(folder)!r}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards (safetensors only; "
    "PyTorch .bin checkpoints are not read)"
  )


def read(info: TensorInfo) -> np.ndarray:
  """The tensor's data in its stored dtype (one fresh array, freed when the caller drops it)."""
  flat = np.fromfile(info.file, dtype=info.dtype, count=int(np.prod(info.shape, dtype=np.int64)), offset=info.offset)
  return flat.reshape(info.shape)


def copy_cast(dst: np.ndarray, src: np.ndarray) -> None:
  """``dst[...] = src`` cast to ``dst``'s dtype, with exact fast paths for bfloat16 (``src`` may be a transposed view).

  numpy copies a custom dtype such as ``ml_dtypes.bfloat16`` element by element through the dtype's generic functions;
  the same bits as ``uint16`` copy at memory speed, and bfloat16 -> float32 is a 16-bit left shift.
  """
  bf16 = np.dtype(ml_dtypes.bfloat16)
  if src.dtype == dst.dtype and src.dtype == bf16:
    np.copyto(dst.view(np.uint16), src.view(np.uint16))
  elif src.dtype == bf16 and dst.dtype == np.float32:
    bits = dst.view(np.uint32)
    np.copyto(bits, src.view(np.uint16))
    bits <<= 16
  else:
    np.copyto(dst, src, casting="unsafe")


def transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> None:
  """``dst[...] = src.T`` cast to ``dst``'s dtype, tile by tile: a whole-matrix strided transpose misses the cache
  on every element (about 3x slower for the MLP matrices of a 2B model)."""
  rows, cols = src.shape
  for i in range(0, rows, tile):
    for j in range(0, cols, tile):
      copy_cast(dst[j : j + tile, i : i + tile], src[i : i + tile, j : j + tile].T)
