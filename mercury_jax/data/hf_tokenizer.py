"""A Hugging Face ``tokenizer.json`` tokenizer, with the special ids of a converted checkpoint.

Public diffusion LMs (LLaDA, Dream, DiffuCoder, SDAR, Fast-dLLM v2) ship a ``tokenizers`` byte-level BPE vocabulary
whose special ids are the checkpoint's, not mercury_jax's 0-4. :class:`HFTokenizer` gives such a vocabulary the
interface of the sentencepiece :class:`~mercury_jax.data.tokenizer.Tokenizer` (the protocol
:class:`~mercury_jax.data.tokenizer.TextTokenizer`), using the ``tokenizers`` library only: the runtime never
imports ``transformers`` or ``torch``.

The files of a converted checkpoint are described in :mod:`mercury_jax.data.hf_files`.

Encoding never adds special tokens itself (``add_special_tokens=False``; ``add_bos`` decides, where the caller
builds the prompt), but the text of an added token (``<|im_start|>``, ``<|start_header_id|>``) encodes to its id, so
a rendered chat template gets the ids the model was trained on. The mask token's text is the exception: it encodes
as plain text, so no prompt ever holds a mask id. A declared special id may lie past the tokenizer's pieces
(``vocab_size`` then covers it); it has no text.

Token bytes: a byte-level BPE piece stands for bytes through GPT-2's byte-to-unicode table (:func:`bytes_to_unicode`),
so :meth:`HFTokenizer.token_bytes` is exact even for a piece that holds part of a UTF-8 character (where decoding the
one id alone would write U+FFFD). Decoding joins the ids' bytes and reads them as UTF-8, so ``decode(encode(s)) ==
s`` for any string without special tokens' texts. A vocabulary without a ``ByteLevel`` decoder (sentencepiece-style
``▁`` and ``<0xNN>`` pieces) has its pieces read the sentencepiece way and decodes through the library.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import tokenizers

from mercury_jax.data.hf_files import (
  CHAT_TEMPLATE_FILE,
  SPECIAL_TOKENS_FILE,
  TOKENIZER_CONFIG,
  TOKENIZER_JSON,
  SpecialTokens,
  read_chat_template,
  read_json,
  write_special_tokens,
)

# transformers' named special tokens: a chat template sees each one the config names as a variable.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAGIC = b"mercury_jax.hf_tokenizer/1\n"  # What to_bytes() starts with (a sentencepiece proto never does).
UNKNOWN_TEXT = "\ufffd"  # What an id with no piece (past the tokenizer, or declared with no text) decodes to.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's table from each byte to the printable character that stands for it in byte-level BPE pieces.

  Printable Latin-1 bytes (``!``-``~``, ``¡``-``¬``, ``®``-``ÿ``) stand for themselves; the other 68 bytes, in
  order, take the characters from U+0100 on (so a space is ``Ġ`` and a newline ``Ċ``).
  """
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  table = {b: chr(b) for b in printable}
  for n, b in enumerate(b for b in range(256) if b not in table):
    table[b] = chr(256 + n)
  return table


def _decoder_kinds(decoder: Mapping | None) -> set[str]:
  """The ``type`` of a ``tokenizer.json`` decoder and of the decoders of a ``Sequence``."""
  if not decoder:
    return set()
  kinds = {decoder.get("type")}
  for inner in decoder.get("decoders") or ():
    kinds |= _decoder_kinds(inner)
  return kinds


class HFTokenizer:
  """A ``tokenizer.json`` vocabulary with a checkpoint's special ids (the module docstring has the files).

  Args:
    tokenizer_json: The text of ``tokenizer.json``.
    special: The checkpoint's special ids.
    config: ``tokenizer_config.json``'s object (its token texts), or None.
    chat_template: The checkpoint's chat template, or None.
    name: Where it came from, for error messages.

  Raises:
    ValueError: ``tokenizer_json`` is not a tokenizer.
  """

  def __init__(
    self,
    tokenizer_json: str,
    special: SpecialTokens,
    config: Mapping | None = None,
    chat_template: str | None = None,
    name: str = "<bytes>",
  ):
    try:
      self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # noqa: BLE001  The library raises plain Exception for a bad file.
      raise ValueError(f"tokenizer {name} is not a Hugging Face tokenizer.json: {e}") from None
    self._json = tokenizer_json
    self._special_tokens = special
    # The template is kept apart (a chat_template.jinja wins over the config's).
    self._config = {k: v for k, v in config.items() if k != "chat_template"} if config is not None else None
    self._chat_template = chat_template
    spec = json.loads(tokenizer_json)
    self._byte_level = "ByteLevel" in _decoder_kinds(spec.get("decoder"))
    byte_fallback = "ByteFallback" in _decoder_kinds(spec.get("decoder"))

    vocab = self._tok.get_vocab(with_added_tokens=True)
    added = self._tok.get_added_tokens_decoder()
    declared = [special.eos_id, special.pad_id, special.mask_id, special.bos_id, special.unk_id, *special.stop_ids]
    size = max([*vocab.values(), *(i for i in declared if i is not None)]) + 1
    self._pieces: list[str] = [""] * size
    self._bytes: list[bytes] = [b""] * size
    unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    for piece, token_id in vocab.items():
      self._pieces[token_id] = piece
      if token_id in added:
        self._bytes[token_id] = added[token_id].content.encode()
      elif self._byte_level:
        self._bytes[token_id] = b"".join(
          bytes([unicode_to_byte[c]]) if c in unicode_to_byte else c.encode() for c in piece
        )
      elif byte_fallback and _BYTE_PIECE.fullmatch(piece):
        self._bytes[token_id] = bytes([int(piece[3:5], 16)])
      else:
        self._bytes[token_id] = piece.replace("\u2581", " ").encode()
    self._special = np.zeros(size, bool)
    self._special[[i for i in declared if i is not None]] = True
    self._special[[i for i, token in added.items() if token.special]] = True
    self._special.flags.writeable = False
    self._has_piece = np.zeros(size, bool)
    self._has_piece[list(vocab.values())] = True
    self._mask_text = self._pieces[special.mask_id] if special.mask_id in added else ""
    self._stops = tuple(dict.fromkeys([special.eos_id, *special.stop_ids]))

  # --------------------------------------------------------------------------------------------- I/O

  @classmethod
  def load(cls, directory: str | os.PathLike) -> HFTokenizer:
    """Reads a converted checkpoint's tokenizer folder (``tokenizer.json``, ``special_tokens.json`` and optionally
    ``tokenizer_config.json`` / ``chat_template.jinja``).

    Raises:
      FileNotFoundError: ``tokenizer.json`` or ``special_tokens.json`` is missing.
      ValueError: A file is unreadable or malformed.
    """
    directory = Path(directory)
    for file in (TOKENIZER_JSON, SPECIAL_TOKENS_FILE):
      if not (directory / file).is_file():
        raise FileNotFoundError(f"no {file} in {str(directory)!r}")
    special = SpecialTokens.from_json(
      read_json(directory / SPECIAL_TOKENS_FILE), repr(str(directory / SPECIAL_TOKENS_FILE))
    )
    config = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else None
    return cls(
      (directory / TOKENIZER_JSON).read_text(),
      special,
      config,
      read_chat_template(directory),
      name=repr(str(directory)),
    )

  def save(self, directory: str | os.PathLike) -> None:
    """Writes ``tokenizer.json``, ``special_tokens.json`` and (with a config or template) ``tokenizer_config.json``
    into ``directory``; ``HFTokenizer.load(directory)`` gives back an equal tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_JSON).write_text(self._json)
    write_special_tokens(directory, self._special_tokens)
    if self._config is not None or self._chat_template is not None:
      config = {**(self._config or {}), "chat_template": self._chat_template}
      (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
      (directory / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)

  def to_bytes(self) -> bytes:
    """Everything the tokenizer is, as bytes (:data:`MAGIC`, then JSON): ``from_bytes`` rebuilds it (the structured-
    output compiler's worker processes do), and its hash names the tokenizer."""
    state = {
      "tokenizer": self._json,
      "special_tokens": self._special_tokens.to_json(),
      "config": self._config,
      "chat_template": self._chat_template,
    }
    return MAGIC + json.dumps(state, ensure_ascii=False).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> HFTokenizer:
    """Rebuilds a tokenizer from :meth:`to_bytes`.

    Raises:
      ValueError: ``data`` did not come from ``to_bytes``.
    """
    if not data.startswith(MAGIC):
      raise ValueError("the bytes are not a serialized HFTokenizer (they do not start with its magic line)")
    state = json.loads(data[len(MAGIC) :])
    special = SpecialTokens.from_json(state["special_tokens"])
    return cls(state["tokenizer"], special, state["config"], state["chat_template"])

  # --------------------------------------------------------------------------------------------- ids

  @property
  def vocab_size(self) -> int:
    """One past the largest id of a piece or a declared special id."""
    return len(self._pieces)

  @property
  def pad_id(self) -> int:
    return self._special_tokens.pad_id

  @property
  def unk_id(self) -> int:
    """The unknown id, or the pad id when the checkpoint has none (byte-level BPE never needs it)."""
    unk = self._special_tokens.unk_id
    return self.pad_id if unk is None else unk

  @property
  def bos_id(self) -> int:
    """The BOS id, or the EOS id (the document boundary) when the checkpoint has none: a prompt that must start with
    a known token (an empty one) starts with it."""
    bos = self._special_tokens.bos_id
    return self.eos_id if bos is None else bos

  @property
  def eos_id(self) -> int:
    return self._special_tokens.eos_id

  @property
  def mask_id(self) -> int:
    return self._special_tokens.mask_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The ids that end an answer: EOS first, then the checkpoint's ``stop_ids``."""
    return self._stops

  @property
  def add_bos(self) -> bool:
    return self._special_tokens.add_bos

  @property
  def special_tokens(self) -> SpecialTokens:
    return self._special_tokens

  @property
  def tokenizer_json(self) -> str:
    """The text of ``tokenizer.json``: the vocabulary, merges, added tokens and text pipeline."""
    return self._json

  @property
  def special_mask(self) -> np.ndarray:
    """bool [vocab_size]: ids that are never text (the declared ones and the added tokens marked special)."""
    return self._special

  def id_to_piece(self, token_id: int) -> str:
    """The piece string of one id as ``tokenizer.json`` spells it (e.g. ``"Ġself"``), "" for an id without one."""
    token_id = int(token_id)
    return self._pieces[token_id] if 0 <= token_id < self.vocab_size else ""

  def token_bytes(self, token_id: int) -> bytes:
    """The exact bytes one id stands for in decoded text (b"" for special ids and ids without a piece)."""
    token_id = int(token_id)
    if not 0 <= token_id < self.vocab_size or self._special[token_id]:
      return b""
    return self._bytes[token_id]

  def characters_per_token(self) -> np.ndarray:
    """``int64[vocab_size]``: the UTF-8 characters each id starts (its bytes that are not continuation bytes), 0 for
    special ids; the counts of a text's ids sum to ``len(text)``."""
    counts = np.zeros(self.vocab_size, np.int64)
    for token_id in np.flatnonzero(~self._special).tolist():
      counts[token_id] = sum((b & 0xC0) != 0x80 for b in self._bytes[token_id])
    return counts

  # --------------------------------------------------------------------------------------------- chat

  @property
  def chat_template(self) -> str | None:
    """The checkpoint's chat template (``tokenizer_config.json`` or ``chat_template.jinja``), or None."""
    return self._chat_template

  @property
  def template_tokens(self) -> dict[str, str]:
    """The special-token texts a chat template sees (``bos_token``, ``eos_token``, ...), as ``transformers`` passes
    them: the ones ``tokenizer_config.json`` names; without a config, the texts of the declared ids."""
    if self._config is None:
      ids = {"bos_token": self._special_tokens.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
      ids |= {"unk_token": self._special_tokens.unk_id, "mask_token": self.mask_id}
      return {key: self._pieces[i] for key, i in ids.items() if i is not None and self._pieces[i]}
    texts = {}
    for key in TEMPLATE_TOKENS:
      value = self._config.get(key)
      value = value.get("content") if isinstance(value, Mapping) else value
      if isinstance(value, str):
        texts[key] = value
    return texts

  # --------------------------------------------------------------------------------------------- text

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``, adding no special tokens; added tokens' texts encode to their ids, but never the mask's
    (its text encodes as plain text)."""
    return self._no_mask(text, self._tok.encode(text, add_special_tokens=False).ids)

  def encode_batch(self, texts: Sequence[str], num_threads: int = 2) -> list[list[int]]:
    """``[encode(t) for t in texts]`` (the library's own threads; ``num_threads`` is not used)."""
    del num_threads
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [self._no_mask(t, e.ids) for t, e in zip(texts, encodings, strict=True)]

  def _no_mask(self, text: str, ids: list[int]) -> list[int]:
    """``ids``, or when they hold the mask id (its text is in ``text``), that text encoded as plain text."""
    if self.mask_id not in ids or not self._mask_text:
      return ids
    mask = self._mask_text
    literal = self._tok.encode(mask[:1], add_special_tokens=False).ids + self.encode(mask[1:])
    out: list[int] = []
    for i, part in enumerate(text.split(mask)):
      out += literal if i else []
      out += self.encode(part) if part else []
    return out

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = False, mask_text: str = "") -> str:
    """Text of ``ids``, robust to what a sampler or a padded record contains.

    Special ids produce no text. Each mask id is rendered as ``mask_text`` (nothing by default). Ids with no piece
    (outside the tokenizer, e.g. a model with a larger vocabulary) decode as ``U+FFFD``.

    Args:
      ids: A 1-D sequence or array of ids.
      stop_at_eos: Drop everything from the first of :attr:`stop_ids` on (for one sampled answer).
      mask_text: The text that stands for each mask id.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if stop_at_eos:
      (stops,) = np.nonzero(np.isin(ids, self._stops))
      if stops.size:
        ids = ids[: stops[0]]
    pieces, run = [], []
    for token_id in ids.tolist():
      if token_id == self.mask_id and mask_text:
        pieces += [self._decode_run(run), mask_text]
        run = []
      elif 0 <= token_id < self.vocab_size and self._special[token_id]:
        continue
      elif 0 <= token_id < self.vocab_size and self._has_piece[token_id]:
        run.append(token_id)
      else:
        pieces += [self._decode_run(run), UNKNOWN_TEXT]
        run = []
    pieces.append(self._decode_run(run))
    return "".join(pieces)

  def _decode_run(self, run: list[int]) -> str:
    if not run:
      return ""
    if self._byte_level:
      return b"".join(self._bytes[i] for i in run).decode("utf-8", errors="replace")
    return self._tok.decode(run, skip_special_tokens=False)
