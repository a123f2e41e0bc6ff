"""The special ids and tokenizer files of a converted checkpoint.

The ids come from the source's ``config.json``, then ``generation_config.json``, then the token texts of
``tokenizer_config.json`` looked up in ``tokenizer.json``; the mask id falls back to the family's known mask token
(or id), and an autoregressive model's is a placeholder (:func:`autoregressive_mask_id`). They are written as
``special_tokens.json`` (:mod:`mercury_jax.data.hf_tokenizer`), beside copies of the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mercury_jax.convert.families import AUTOREGRESSIVE, SPECS, ConvertError
from mercury_jax.data.hf_files import (
  CHAT_TEMPLATE_FILE,
  TOKENIZER_CONFIG,
  TOKENIZER_JSON,
  SpecialTokens,
  read_chat_template,
  write_special_tokens,
)

GENERATION_CONFIG = "generation_config.json"


def read_json(path: Path, what: str) -> dict[str, Any]:
  """A JSON object file, or a :class:`ConvertError` naming it."""
  try:
    value = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConvertError(f"cannot read {what} {str(path)!r}: {e}") from None
  if not isinstance(value, dict):
    raise ConvertError(f"{what} {str(path)!r} must hold a JSON object, not {type(value).__name__}")
  return value


class TokenTable:
  """Token texts -> ids of a ``tokenizer.json`` (its vocabulary and added tokens)."""

  def __init__(self, path: Path):
    spec = read_json(path, "tokenizer")
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    self.ids: dict[str, int] = dict(vocab) if isinstance(vocab, dict) else {}
    self.added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or () if "content" in t}
    self.ids.update(self.added)
    self.unk_text = model.get("unk_token")
    self.post_processor = spec.get("post_processor") or {}

  def __len__(self) -> int:
    return max(self.ids.values(), default=-1) + 1

  def lookup(self, token) -> int | None:
    """The id of a token text (a string, or transformers' ``{"content": ...}``), None if absent."""
    text = token.get("content") if isinstance(token, Mapping) else token
    return self.ids.get(text) if isinstance(text, str) else None

  def starts_with(self, token_id: int | None) -> bool:
    """The post-processor puts ``token_id`` in front of a single sequence (a BOS the tokenizer adds)."""
    single = self.post_processor.get("single") or []
    first = single[0] if single and isinstance(single[0], Mapping) else {}
    special = first.get("SpecialToken") or {}
    return token_id is not None and self.lookup(special.get("id")) == token_id


def _ids(value) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _first(*candidates) -> int | None:
  for value in candidates:
    ids = _ids(value)
    if ids:
      return ids[0]
  return None


def autoregressive_mask_id(table: TokenTable, vocab_size: int, taken: set[int], unk: int | None) -> int:
  """The mask id of an autoregressive model: a placeholder for the positions of its canvas still to be generated.

  The engine needs one for every model, but an autoregressive model never reads it: the decoder reads the network's
  output only at the last committed position, which attends (causally) to committed positions alone; the exact
  cache's prefill keeps the placeholder slots in segment 0, which nothing attends to, and rewrites a slot's keys and
  values when its token is committed; and the sampler never proposes the mask id. So it must only be a row of the
  embedding that is no text: the first id after the tokenizer's (Qwen2.5: 151665, Qwen3: 151669, where Fast-dLLM v2
  and SDAR put their mask tokens), else the last reserved special token (Llama 3's), else the unknown id.

  Args:
    table: The source's tokenizer.
    vocab_size: The model's embedding rows.
    taken: Ids with a role (EOS, BOS, padding, stops).
    unk: The unknown id, or None.

  Raises:
    ConvertError: The tokenizer fills every row and has neither a reserved token nor an unknown id.
  """
  spare = max(len(table), *(i + 1 for i in taken))
  if spare < vocab_size:
    return spare
  reserved = [i for text, i in table.added.items() if "reserved" in text and i not in taken and i < vocab_size]
  if reserved:
    return max(reserved)
  if unk is not None and unk not in taken:
    return unk
  raise ConvertError(
    f"the tokenizer uses all {vocab_size} embedding rows and has no reserved special token or unknown id to hold the "
    "engine's mask placeholder"
  )


def special_tokens(
  hf: dict[str, Any], generation: dict[str, Any], tok_config: dict[str, Any], table: TokenTable, family: str
) -> SpecialTokens:
  """The special ids of a source checkpoint (see the module docstring for the order of sources).

  Raises:
    ConvertError: no EOS or mask id can be found.
  """
  spec = SPECS[family]
  look = lambda key: table.lookup(tok_config.get(key))  # noqa: E731
  vocab_size = int(hf.get("vocab_size") or hf.get("embedding_size") or 0)
  mask = None  # An autoregressive model's is a placeholder, chosen below once the ids with a role are known.
  if family != AUTOREGRESSIVE:
    mask = _first(hf.get("mask_token_id"), generation.get("mask_token_id"), look("mask_token"))
    if mask is None:
      mask = next((table.lookup(t) for t in spec.mask_tokens if table.lookup(t) is not None), None)
    if mask is None and spec.mask_id < vocab_size:
      mask = spec.mask_id
    if mask is None:
      raise ConvertError(
        f"no mask token id: config.json has no mask_token_id and the tokenizer has no {' or '.join(spec.mask_tokens)}"
      )
  eos = _first(hf.get("eos_token_id"), generation.get("eos_token_id"), look("eos_token"))
  if eos is None:
    raise ConvertError("no end-of-sequence id: config.json and generation_config.json have no eos_token_id")
  bos = _first(hf.get("bos_token_id"), generation.get("bos_token_id"), look("bos_token"))
  pad = _first(hf.get("pad_token_id"), generation.get("pad_token_id"), look("pad_token"), eos)
  unk = look("unk_token")
  unk = unk if unk is not None else table.lookup(table.unk_text)
  stops = [*_ids(generation.get("eos_token_id")), *_ids(hf.get("eos_token_id")), look("eos_token")]
  stops += [table.lookup(t) for t in spec.chat_stops]
  stop_ids = tuple(dict.fromkeys(s for s in stops if s is not None and s != eos))
  if mask is None:
    mask = autoregressive_mask_id(table, vocab_size, {eos, pad, *stop_ids} | ({bos} - {None}), unk)
  add_bos = bos is not None and (bool(tok_config.get("add_bos_token", False)) or table.starts_with(bos))
  try:
    return SpecialTokens(
      eos_id=eos, pad_id=pad, mask_id=mask, bos_id=bos, unk_id=unk, stop_ids=stop_ids, add_bos=add_bos
    )
  except ValueError as e:
    raise ConvertError(f"special token ids: {e}") from None


def chat_template(src: Path) -> str:
  """The source's chat template ("" without one)."""
  try:
    return read_chat_template(src) or ""
  except ValueError as e:
    raise ConvertError(str(e)) from None


def write_tokenizer(src: Path, out: Path, special: SpecialTokens) -> None:
  """Copies ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` (those present) and writes
  ``special_tokens.json``."""
  for name in (TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):
    if (src / name).is_file():
      shutil.copyfile(src / name, out / name)
  write_special_tokens(out, special)
