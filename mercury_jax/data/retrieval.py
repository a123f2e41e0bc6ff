"""A synthetic key-value retrieval corpus: ``--corpus kv-retrieval``, needles in a haystack the model must look up.

A record is a *haystack* of filler words with needles planted at random depths, each a key and its value, followed by
queries, each the marker ``?``, a key and its value, and EOS (here ``keys=3, queries=2`` at 30 tokens)::

   pab wev pos vim dog fuf pin giw fek zoz vax hek raz pup bez mug sed bod sug nos mip vum wat ? zoz vax ? raz pup
   |needle|                            |needle|    |needle|                                    |query   |query   |

The keys name the needles' categories (``KEYS``: a record holds one needle of each of ``spec.keys`` categories) and
every key has its own set of ``VALUES_PER_KEY`` values, drawn at random for every record, so a value cannot be
memorised (``ln 64 = 4.16`` nats at chance): it is found only by attending from the query to the needle of its key,
anywhere in the context. This is RULER's multi-key needle in a haystack (Hsieh et al. 2024, arXiv 2404.06654), in the
typed form of its "multi-value" and passkey tasks (Mohtashami & Jaggi 2023, arXiv 2305.16300): the retrieval that
long-context papers use to test RoPE scaling (Chen et al. 2023, position interpolation; Peng et al. 2023, YaRN). Only
the queried values and the EOS are ``TARGET`` (noised and scored); the haystack, the markers and the query keys are
``FIXED`` context, so the loss measures retrieval alone. (Keys drawn at random per record, associative recall proper,
needs two composed attention layers; the build notes record that the tiny shape did not learn it in minutes on a
CPU.)

Every symbol is one token: a word with its leading space, or the marker ``" ?"``. The tokenizer ``prepare`` trains on
:func:`tokenizer_texts` (every symbol, many times) splits text at spaces, so each becomes one piece; :class:`Symbols`
checks this for the tokenizer at hand. Records are built from symbol ids, exactly ``seq_len`` tokens, no padding. The
needle test (:func:`needle`) builds a prompt of the same form that ends in one query.

Spec: ``kv-retrieval[:name=value,...]`` with the fields of :class:`RetrievalSpec`, e.g.
``kv-retrieval:records=20000,seed=1``. The same spec and ``--seq-len`` give the same records on any machine.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from mercury_jax import kinds as K

SPEC = "kv-retrieval"
CONSONANTS = "bcdfghjklmnprstvwxz"
VOWELS = "aeiou"
# The lexicon's consonant-vowel-consonant words (1805), in a fixed shuffled order, then cut into the keys, each key's
# values and the filler words.
_WORDS = tuple(a + b + c for a, b, c in itertools.product(CONSONANTS, VOWELS, CONSONANTS))
LEXICON = tuple(_WORDS[i] for i in np.random.default_rng(26).permutation(len(_WORDS)))
NUM_KEYS = 16
VALUES_PER_KEY = 64
KEYS = LEXICON[:NUM_KEYS]
VALUES = LEXICON[NUM_KEYS : NUM_KEYS + NUM_KEYS * VALUES_PER_KEY]  # key k's values: VALUES[k * 64 : (k + 1) * 64]
FILLER = LEXICON[NUM_KEYS + NUM_KEYS * VALUES_PER_KEY :]
QUERY = " ?"
QUERY_TOKENS = 3  # the marker, the key and the value
# Symbol ids index TEXTS: the lexicon's words, then the query marker; -1 stands for EOS in records.
TEXTS = (*(" " + w for w in LEXICON), QUERY)
KEY_SYMBOL = 0
VALUE_SYMBOL = NUM_KEYS
FILLER_SYMBOL = NUM_KEYS + NUM_KEYS * VALUES_PER_KEY
QUERY_SYMBOL = len(LEXICON)


@dataclasses.dataclass(frozen=True)
class RetrievalSpec:
  """What ``kv-retrieval:...`` generates.

  Attributes:
    records: Train records.
    validation: Validation records (drawn from their own stream of the seed).
    keys: Needles per record, one for each of the first ``keys`` of the ``NUM_KEYS`` keys.
    queries: Queries per record, each of a distinct needle (the needle test asks one).
    seed: Seed of the whole corpus.
  """

  records: int = 8192
  validation: int = 64
  keys: int = 8
  queries: int = 8
  seed: int = 0

  def validate(self) -> RetrievalSpec:
    if self.records < 1 or self.validation < 0:
      raise ValueError(f"{SPEC}: records={self.records} must be >= 1 and validation={self.validation} >= 0")
    if not 1 <= self.keys <= NUM_KEYS:
      raise ValueError(f"{SPEC}: keys={self.keys} must lie in [1, {NUM_KEYS}]")
    if not 1 <= self.queries <= self.keys:
      raise ValueError(f"{SPEC}: queries={self.queries} must lie in [1, keys={self.keys}]")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"{SPEC}: seed={self.seed} must lie in [0, 2**32)")
    return self

  @property
  def spec(self) -> str:
    """The spec string that gives this corpus (only the fields that differ from the defaults)."""
    changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default]  # fmt: skip
    return SPEC + (":" + ",".join(changed) if changed else "")

  def haystack_length(self, seq_len: int) -> int:
    """The haystack's tokens in a record of ``seq_len``: what the queries and the EOS leave.

    Raises:
      ValueError: Too short a record for the needles, the queries and the EOS.
    """
    length = seq_len - self.queries * QUERY_TOKENS - 1
    if length < 2 * self.keys:
      raise ValueError(
        f"{SPEC}: --seq-len {seq_len} cannot hold {self.keys} needles, {self.queries} queries and the EOS; use at "
        f"least {2 * self.keys + self.queries * QUERY_TOKENS + 1}"
      )
    return length


def is_spec(spec: str) -> bool:
  """Whether a ``--corpus`` value names this corpus."""
  return spec == SPEC or spec.startswith(SPEC + ":")


def parse_spec(spec: str) -> RetrievalSpec:
  """``kv-retrieval[:name=value,...]`` -> :class:`RetrievalSpec`.

  Raises:
    ValueError: Another corpus, an unknown field or a value that is not a non-negative integer.
  """
  if not is_spec(spec):
    raise ValueError(f"--corpus {spec!r} is not {SPEC}[:name=value,...]")
  fields = {f.name for f in dataclasses.fields(RetrievalSpec)}
  values = {}
  for item in filter(None, spec[len(SPEC) + 1 :].split(",")):
    name, sep, value = item.partition("=")
    if not sep or name not in fields:
      raise ValueError(f"--corpus {spec!r}: {item!r} must be name=value with a name in {sorted(fields)}")
    if not value.isdigit():
      raise ValueError(f"--corpus {spec!r}: {name}={value!r} must be a non-negative integer")
    values[name] = int(value)
  return RetrievalSpec(**values).validate()


# ----------------------------------------------------------------------------------------------- symbols


@dataclasses.dataclass(frozen=True)
class Symbols:
  """The token of each symbol (``TEXTS``) under one tokenizer: ``ids[s]`` is symbol ``s``'s token."""

  ids: np.ndarray  # int32 [symbols]
  eos_id: int

  @classmethod
  def of(cls, tokenizer) -> Symbols:
    """Each symbol's token under ``tokenizer``.

    Raises:
      ValueError: A symbol is not exactly one token (a tokenizer trained on other text, or too small a vocabulary).
    """
    ids = []
    for text in TEXTS:
      pieces = tokenizer.encode(text)
      if len(pieces) != 1:
        raise ValueError(
          f"{SPEC}: the tokenizer splits {text!r} into {len(pieces)} tokens; the corpus needs every word and "
          f"{QUERY!r} to be one token: let prepare train the tokenizer (no --tokenizer), with --vocab-size >= 4096"
        )
      ids.append(pieces[0])
    return cls(np.asarray(ids, np.int32), int(tokenizer.eos_id))

  def tokens(self, symbols: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids of symbols (-1: EOS)."""
    return np.append(self.ids, np.int32(self.eos_id))[np.asarray(symbols)]

  @staticmethod
  def text(symbols: Sequence[int] | np.ndarray) -> str:
    """The text of symbols (no EOS); the tokenizer encodes it back to their tokens."""
    return "".join(TEXTS[int(s)] for s in symbols)


def tokenizer_texts(spec: RetrievalSpec) -> list[str]:
  """Text to train the corpus's tokenizer on: every word of the lexicon and the marker, each dozens of times."""
  rng = np.random.default_rng([spec.seed, 2])
  return [Symbols.text(np.append(rng.permutation(QUERY_SYMBOL + 1), rng.permutation(QUERY_SYMBOL))) for _ in range(32)]


# ----------------------------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Haystack:
  """Filler words with needles, as symbol ids.

  Attributes:
    symbols: int32 [length].
    positions: int [keys] where needle ``k`` (of key ``k``) lies: its key, then its value.
  """

  symbols: np.ndarray
  positions: np.ndarray

  @property
  def keys(self) -> np.ndarray:
    return self.symbols[self.positions]

  @property
  def values(self) -> np.ndarray:
    return self.symbols[self.positions + 1]


def _haystack(rng: np.random.Generator, keys: int, length: int, needle_at: tuple[int, float] | None = None) -> Haystack:
  """``length`` symbols of filler with one needle of each of the first ``keys`` keys, in random order and places.

  ``needle_at = (k, depth)`` puts needle ``k`` where its key lies nearest ``depth`` (0: the first token, 1: the
  haystack's last two) and the others at random.
  """
  filler = length - 2 * keys
  order = rng.permutation(filler + keys)  # items: filler words (>= keys) and needles (< keys), shuffled
  items = np.where(order < keys, order, keys)  # needle k, or `keys` for a filler word
  if needle_at is not None:
    k, depth = needle_at
    others = items[items != k]
    index = int(round(depth * filler))  # the needle's key follows `index` filler words and the needles among them
    fillers_before = np.cumsum(others == keys)
    at = int(np.searchsorted(fillers_before, index)) + 1 if index else 0
    items = np.insert(others, at, k)
  sizes = np.where(items < keys, 2, 1)
  starts = np.cumsum(sizes) - sizes
  symbols = np.empty(length, np.int32)
  is_needle = items < keys
  symbols[starts[~is_needle]] = FILLER_SYMBOL + rng.integers(0, len(FILLER), filler)
  needles = items[is_needle]
  symbols[starts[is_needle]] = KEY_SYMBOL + needles
  symbols[starts[is_needle] + 1] = VALUE_SYMBOL + needles * VALUES_PER_KEY + rng.integers(0, VALUES_PER_KEY, keys)
  positions = np.empty(keys, np.int64)
  positions[needles] = starts[is_needle]
  return Haystack(symbols, positions)


def record(rng: np.random.Generator, spec: RetrievalSpec, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """One record's ``(symbols, kinds)``, int32 [seq_len] each: a haystack, ``spec.queries`` queries of distinct needles
  in random order and EOS (symbol -1)."""
  length = spec.haystack_length(seq_len)
  haystack = _haystack(rng, spec.keys, length)
  asked = rng.permutation(spec.keys)[: spec.queries]
  queries = np.stack([np.full(spec.queries, QUERY_SYMBOL), haystack.keys[asked], haystack.values[asked]], axis=1)
  symbols = np.concatenate([haystack.symbols, queries.reshape(-1), [-1]]).astype(np.int32)
  kinds = np.full(seq_len, K.FIXED, np.int32)
  kinds[length + 2 :: QUERY_TOKENS] = K.TARGET  # the queried values
  kinds[-1] = K.TARGET  # the EOS
  return symbols, kinds


def records(spec: RetrievalSpec, split: str, seq_len: int, symbols: Symbols) -> np.ndarray:
  """``int32 [n, 2, seq_len]`` records of ``split`` (``train``: ``spec.records``, ``validation``: ``spec.validation``)
  in the format of :mod:`mercury_jax.data.records`, from the seed's own stream for the split."""
  count = spec.records if split == "train" else spec.validation
  rng = np.random.default_rng([spec.seed, 0 if split == "train" else 1])
  out = np.empty((count, 2, seq_len), np.int32)
  for i in range(count):
    sym, kinds = record(rng, spec, seq_len)
    out[i, 0], out[i, 1] = symbols.tokens(sym), kinds
  return out


def split_stats(packed: np.ndarray, tokenizer) -> dict[str, int]:
  """A split's counts as ``prepare`` reports them: every record is one example (a document), none is skipped;
  ``characters`` are those of the targets (the values; EOS has none), ``prompt_characters`` those of the context."""
  chars = tokenizer.characters_per_token()[packed[:, 0]]  # [n, seq_len]
  kinds = packed[:, 1]
  return {
    "documents": int(packed.shape[0]),
    "skipped_documents": 0,
    "characters": int(chars[kinds == K.TARGET].sum()),
    "prompt_characters": int(chars[kinds == K.FIXED].sum()),
  }


# ----------------------------------------------------------------------------------------------- needles


@dataclasses.dataclass(frozen=True)
class Needle:
  """A needle-in-a-haystack prompt: a haystack of ``length - 2`` tokens, then ``?`` and the needle's key.

  Attributes:
    prompt: The prompt text (``length`` tokens).
    answer: The needle's value, as generated text (with its leading space).
    depth: Where the needle's key lies in the haystack, 0 (first token) to 1 (its last two).
    position: The token position of the needle's key.
  """

  prompt: str
  answer: str
  depth: float
  position: int


def needle(rng: np.random.Generator, length: int, depth: float, keys: int = RetrievalSpec.keys) -> Needle:
  """A prompt of ``length`` tokens whose haystack holds ``keys`` needles and asks for a random one, planted where its
  key lies nearest ``depth`` of the haystack.

  Raises:
    ValueError: A depth outside [0, 1], or no room for the needles.
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth={depth} must lie in [0, 1]")
  haystack_length = length - 2
  if haystack_length < 2 * keys:
    raise ValueError(
      f"a prompt of {length} tokens cannot hold {keys} needles and the query; use at least {2 * keys + 2}"
    )
  k = int(rng.integers(keys))
  haystack = _haystack(rng, keys, haystack_length, needle_at=(k, depth))
  position = int(haystack.positions[k])
  prompt = Symbols.text([*haystack.symbols, QUERY_SYMBOL, haystack.keys[k]])
  return Needle(prompt, TEXTS[int(haystack.values[k])], position / (haystack_length - 2), position)


def manifest(spec: RetrievalSpec) -> dict[str, Any]:
  """What went in (``manifest.json``): the spec, its fields and the lexicon."""
  return {
    "kind": SPEC,
    "source": spec.spec,
    "mode": "sft",
    **dataclasses.asdict(spec),
    "lexicon": {
      "words": len(LEXICON),
      "consonants": CONSONANTS,
      "vowels": VOWELS,
      "keys": list(KEYS),
      "values_per_key": VALUES_PER_KEY,
      "filler": len(FILLER),
    },
    "layout": "filler words with one needle (key, value) per key, then (?, key, value) per query, then EOS; the "
    "queried values and the EOS are targets, the rest context",
  }
