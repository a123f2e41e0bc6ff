"""A sentencepiece BPE tokenizer with the fixed special ids the diffusion model relies on.

Ids 0-4 are always ``pad``, ``unk``, ``bos``, ``eos`` and ``mask`` (the piece ``[MASK]``). The mask is a *control*
symbol: it has an id but no surface form, so no text ever encodes to it (a source file that contains the string
"[MASK]" is tokenized like any other text). Diffusion puts ``mask_id`` into token arrays directly.

Training settings suit code: byte fallback (nothing is ever ``unk``; this reserves 256 pieces), digits split,
no normalisation, whitespace kept exactly and runs of spaces allowed as pieces, and no dummy prefix, so encoding
two strings separately and concatenating the ids decodes to the concatenated strings. ``decode(encode(s)) == s``
for any string.

Converted Hugging Face checkpoints bring their own vocabulary and special ids instead
(:class:`~mercury_jax.data.hf_tokenizer.HFTokenizer`). Both backends satisfy :class:`TextTokenizer`, the interface
the engine, the structured-output compiler and the server use; :func:`load_tokenizer` finds a checkpoint's tokenizer
of either kind and :func:`tokenizer_from_bytes` rebuilds one from its ``to_bytes()``.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import sentencepiece as spm

from mercury_jax.files import TOKENIZER_FILE

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
MASK_ID = 4
MASK_PIECE = "[MASK]"
NUM_SPECIAL = 5
NUM_BYTE_PIECES = 256
# Below this the byte pieces, the specials and the characters of even a small ASCII corpus do not fit.
MIN_VOCAB_SIZE = NUM_BYTE_PIECES + NUM_SPECIAL + 128

MAX_TRAINING_SENTENCES = 50_000  # Training sentences are chunks of up to LINES_PER_SENTENCE lines.
LINES_PER_SENTENCE = 16
MAX_SENTENCE_CHARS = 8192  # Longer chunks are cut; sentencepiece would silently skip them.


@runtime_checkable
class TextTokenizer(Protocol):
  """What every tokenizer backend provides: :class:`Tokenizer` (sentencepiece, ids 0-4 special) and
  :class:`~mercury_jax.data.hf_tokenizer.HFTokenizer` (a converted checkpoint's ``tokenizer.json``).

  ``vocab_size``, ``pad_id``, ``unk_id``, ``bos_id``, ``eos_id`` and ``mask_id`` are ints; ``encode`` adds no special
  tokens; ``decode`` drops special ids and renders the mask as ``mask_text``; ``to_bytes`` is everything the
  tokenizer is (:func:`tokenizer_from_bytes` rebuilds it, and its hash names it).
  """

  vocab_size: int
  pad_id: int
  unk_id: int
  bos_id: int
  eos_id: int
  mask_id: int
  stop_ids: tuple[int, ...]  # The ids that end an answer, EOS first.
  add_bos: bool  # A chat prompt starts with bos_id when the rendered template did not write it.
  special_mask: np.ndarray  # bool [vocab_size]: ids that never stand for text (structured output and healing).
  chat_template: str | None  # The tokenizer's own chat template (a converted checkpoint's), or None.
  template_tokens: dict[str, str]  # The special-token texts a chat template sees (bos_token, ...).

  def id_to_piece(self, token_id: int) -> str: ...

  def token_bytes(self, token_id: int) -> bytes: ...

  def characters_per_token(self) -> np.ndarray: ...

  def encode(self, text: str) -> list[int]: ...

  def encode_batch(self, texts: Sequence[str], num_threads: int = 2) -> list[list[int]]: ...

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = False, mask_text: str = "") -> str: ...

  def to_bytes(self) -> bytes: ...

  def save(self, path: str | os.PathLike) -> None: ...


class Tokenizer:
  """A loaded sentencepiece model whose special ids have been checked.

  Args:
    model_proto: The serialized sentencepiece ``ModelProto``.
    name: Where it came from, for error messages.

  Raises:
    ValueError: The model does not have pad/unk/bos/eos/``[MASK]`` at ids 0-4.
  """

  def __init__(self, model_proto: bytes, name: str = "<bytes>"):
    self._proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    sp = self._sp
    found = {
      "pad": sp.pad_id(),
      "unk": sp.unk_id(),
      "bos": sp.bos_id(),
      "eos": sp.eos_id(),
      "mask": sp.piece_to_id(MASK_PIECE),
    }
    wanted = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "mask": MASK_ID}
    if found != wanted or sp.id_to_piece(MASK_ID) != MASK_PIECE:
      raise ValueError(
        f"tokenizer {name} has special ids {found}, but mercury_jax needs {wanted} "
        f"(mask = piece {MASK_PIECE!r}); train one with mercury_jax.data.tokenizer.train_tokenizer"
      )
    self._special = np.zeros(sp.get_piece_size(), dtype=bool)
    self._special[[PAD_ID, BOS_ID, EOS_ID, MASK_ID]] = True
    self._never_text = np.zeros(sp.get_piece_size(), dtype=bool)
    self._never_text[:NUM_SPECIAL] = True
    self._never_text.flags.writeable = False

  # --------------------------------------------------------------------------------------------- I/O

  @classmethod
  def from_bytes(cls, model_proto: bytes) -> Tokenizer:
    """Builds a tokenizer from a serialized sentencepiece model."""
    return cls(model_proto)

  def to_bytes(self) -> bytes:
    """The serialized sentencepiece model (what ``save`` writes)."""
    return self._proto

  @classmethod
  def load(cls, path: str | os.PathLike) -> Tokenizer:
    """Reads a ``.model`` file.

    Raises:
      ValueError: The file is missing, unreadable, not a sentencepiece model, or has the wrong special ids.
    """
    try:
      with open(path, "rb") as f:
        proto = f.read()
    except OSError as e:
      raise ValueError(f"cannot read tokenizer {str(path)!r}: {e.strerror or e}") from None
    try:
      return cls(proto, name=repr(str(path)))
    except RuntimeError as e:  # sentencepiece's parse failure.
      raise ValueError(f"{str(path)!r} is not a sentencepiece model: {e}") from None

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model; ``Tokenizer.load(path)`` gives back an equal tokenizer."""
    with open(path, "wb") as f:
      f.write(self._proto)

  # --------------------------------------------------------------------------------------------- ids

  @property
  def vocab_size(self) -> int:
    """Number of pieces; every id the tokenizer produces is below this."""
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def unk_id(self) -> int:
    return UNK_ID

  @property
  def bos_id(self) -> int:
    return BOS_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def mask_id(self) -> int:
    return MASK_ID

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (EOS_ID,)

  @property
  def add_bos(self) -> bool:
    """True: SFT records, and so chat prompts, are ``[BOS] + prompt``."""
    return True

  @property
  def special_mask(self) -> np.ndarray:
    """bool [vocab_size]: ids 0-4."""
    return self._never_text

  @property
  def chat_template(self) -> str | None:
    """None: a mercury_jax model's template is its config's ``data.chat_template``."""
    return None

  @property
  def template_tokens(self) -> dict[str, str]:
    """Empty: the special tokens are ids, not text, so a template's ``bos_token`` renders as ""."""
    return {}

  def id_to_piece(self, token_id: int) -> str:
    """The piece string of one id, e.g. ``"▁self"`` or ``"<0x0A>"`` (for debugging)."""
    return self._sp.id_to_piece(int(token_id))

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one id writes: a byte piece its byte, a text piece its UTF-8 with ``▁`` as a space, ids 0-4 b""."""
    token_id = int(token_id)
    if self._sp.is_control(token_id) or self._sp.is_unknown(token_id):
      return b""
    piece = self._sp.id_to_piece(token_id)
    if self._sp.is_byte(token_id):
      return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()

  def characters_per_token(self) -> np.ndarray:
    """``int64[vocab_size]``: how many characters of decoded text each id stands for.

    A piece's characters with ``▁`` as a space; a byte piece counts 1 when it starts a UTF-8 character and 0 for a
    continuation byte; control and unknown ids count 0. With no dummy prefix and no normalisation, the counts of a
    text's ids sum to ``len(text)``, so evaluation can count the characters of exactly the tokens it scores.
    """
    counts = np.zeros(self.vocab_size, np.int64)
    for token_id in range(self.vocab_size):
      if self._sp.is_control(token_id) or self._sp.is_unknown(token_id):
        continue
      piece = self._sp.id_to_piece(token_id)
      if self._sp.is_byte(token_id):
        counts[token_id] = int((int(piece[3:5], 16) & 0xC0) != 0x80)
      else:
        counts[token_id] = len(piece.replace("\u2581", " "))
    return counts

  # --------------------------------------------------------------------------------------------- text

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``, without BOS or EOS. Never contains pad, unk, bos, eos or mask ids."""
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str], num_threads: int = 2) -> list[list[int]]:
    """``[encode(t) for t in texts]``, computed on ``num_threads`` threads."""
    return self._sp.encode(list(texts), num_threads=num_threads)

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = False, mask_text: str = "") -> str:
    """Text of ``ids``, robust to what a sampler or a padded record contains.

    Pad, bos and eos ids produce no text. Each mask id is rendered as ``mask_text`` (nothing by default; e.g.
    ``"_"`` to show undecided positions). Ids outside ``[0, vocab_size)`` (a model may have a larger vocabulary than
    its tokenizer) decode as unknown, ``" ⁇ "``.

    Args:
      ids: A 1-D sequence or array of ids.
      stop_at_eos: Drop everything from the first eos on (for one sampled document).
      mask_text: The text that stands for each mask id.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if stop_at_eos:
      (eos,) = np.nonzero(ids == EOS_ID)
      if eos.size:
        ids = ids[: eos[0]]
    ids = np.where((ids < 0) | (ids >= self.vocab_size), UNK_ID, ids)
    pieces, run = [], []
    for token_id in ids.tolist():
      if token_id == MASK_ID and mask_text:
        pieces.append(self._sp.decode(run))
        pieces.append(mask_text)
        run = []
      elif not self._special[token_id]:
        run.append(token_id)
    pieces.append(self._sp.decode(run))
    return "".join(pieces)


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
  """The tokenizer of a checkpoint (an export, a step folder or a train workdir), looked for in ``path`` and the two
  folders above it: ``tokenizer.model`` gives a sentencepiece :class:`Tokenizer`, ``tokenizer.json`` with
  ``special_tokens.json`` (a converted Hugging Face checkpoint) an
  :class:`~mercury_jax.data.hf_tokenizer.HFTokenizer`. ``path`` may also be a ``tokenizer.model`` file. (A prepared
  data folder's tokenizer: ``pipeline.load_data_tokenizer``.)

  Raises:
    FileNotFoundError: Neither is found.
    ValueError: A tokenizer file is malformed.
  """
  from mercury_jax.data import hf_files, hf_tokenizer

  path = Path(path).absolute()
  if path.is_file() and path.suffix == ".model":
    return Tokenizer.load(path)
  half = None
  for folder in (path, path.parent, path.parent.parent):
    if (folder / TOKENIZER_FILE).is_file():
      return Tokenizer.load(folder / TOKENIZER_FILE)
    if (folder / hf_files.TOKENIZER_JSON).is_file():
      if (folder / hf_files.SPECIAL_TOKENS_FILE).is_file():
        return hf_tokenizer.HFTokenizer.load(folder)
      half = half or folder
  hint = (
    f" ({str(half)!r} has {hf_files.TOKENIZER_JSON} but no {hf_files.SPECIAL_TOKENS_FILE}; write it with "
    "mercury_jax.data.hf_files.write_special_tokens)"
    if half
    else ""
  )
  raise FileNotFoundError(
    f"no tokenizer in {str(path)!r} or the two folders above it: expected {TOKENIZER_FILE} or "
    f"{hf_files.TOKENIZER_JSON} with {hf_files.SPECIAL_TOKENS_FILE}{hint}"
  )


def tokenizer_from_bytes(data: bytes) -> TextTokenizer:
  """Rebuilds a tokenizer of either backend from its ``to_bytes()``."""
  from mercury_jax.data import hf_tokenizer

  if data.startswith(hf_tokenizer.MAGIC):
    return hf_tokenizer.HFTokenizer.from_bytes(data)
  return Tokenizer.from_bytes(data)


def _training_sentences(texts: Iterable[str], max_sentences: int, seed: int) -> list[str]:
  """Cuts texts into chunks of a few lines (newlines kept, so pieces can learn them) and keeps a uniform sample.

  Reservoir sampling with a fixed seed: the sample is deterministic and the texts are read once.
  """
  rng = random.Random(seed)
  sample: list[str] = []
  seen = 0
  for text in texts:
    lines = text.splitlines(keepends=True)
    for start in range(0, len(lines), LINES_PER_SENTENCE):
      chunk = "".join(lines[start : start + LINES_PER_SENTENCE])
      for cut in range(0, len(chunk), MAX_SENTENCE_CHARS):
        sentence = chunk[cut : cut + MAX_SENTENCE_CHARS]
        if len(sample) < max_sentences:
          sample.append(sentence)
        else:
          slot = rng.randrange(seen + 1)
          if slot < max_sentences:
            sample[slot] = sentence
        seen += 1
  return sample


def train_tokenizer(
  texts: Iterable[str], vocab_size: int, *, max_sentences: int = MAX_TRAINING_SENTENCES, seed: int = 0
) -> Tokenizer:
  """Trains a BPE tokenizer on ``texts`` in seconds, deterministically.

  Args:
    texts: Training documents (read once).
    vocab_size: Target number of pieces, including the 5 specials and 256 byte pieces. A small corpus may give
      fewer (``hard_vocab_limit=False``); read ``Tokenizer.vocab_size``.
    max_sentences: At most this many chunks of ``LINES_PER_SENTENCE`` lines are sampled for training.
    seed: Seed of the sample.

  Raises:
    ValueError: ``vocab_size`` is too small, or the texts are empty or hold more distinct characters than fit.
  """
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(
      f"vocab_size={vocab_size} is too small: byte fallback takes {NUM_BYTE_PIECES} pieces and the "
      f"specials {NUM_SPECIAL}; use at least {MIN_VOCAB_SIZE} (e.g. 4096)"
    )
  sentences = _training_sentences(texts, max_sentences, seed)
  if not any(sentences):
    raise ValueError("cannot train a tokenizer on empty texts")
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences),
      model_writer=model,
      model_type="bpe",
      vocab_size=vocab_size,
      byte_fallback=True,
      control_symbols=[MASK_PIECE],
      pad_id=PAD_ID,
      unk_id=UNK_ID,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      character_coverage=1.0,
      split_digits=True,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      hard_vocab_limit=False,
      max_sentence_length=4 * MAX_SENTENCE_CHARS,
      num_threads=2,
      minloglevel=2,
    )
  except RuntimeError as e:
    reason = str(e).split("] ")[-1].split(" Increase vocab_size")[0]
    raise ValueError(
      f"sentencepiece could not train with vocab_size={vocab_size}: {reason} The vocabulary must hold "
      f"{NUM_BYTE_PIECES + NUM_SPECIAL} fixed pieces plus every distinct character, try a larger "
      "--vocab-size"
    ) from None
  return Tokenizer(model.getvalue(), name="<trained>")
