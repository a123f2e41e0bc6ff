"""Token healing: a prompt that ends inside what the tokenizer would merge with the next text.

Tokenizers merge across the boundary a prompt draws: the training data writes ``):`` and its newline as one token,
and ``fib`` then ``onacci`` as ``fibonacci``, but a prompt that stops at ``:`` or ``fibon`` is tokenised without the
merge, so the model sees a token sequence it rarely saw and continues it badly (on the prompt's own line, or with a
broken identifier). Healing backs the prompt's last token off and re-generates it: its position becomes one more
masked position of the hole, which may only take the tokens whose text starts with the removed characters
(:func:`allowed_tokens`, a one-position token mask of the engine: ``State.healing``, no automaton to compile and no
dynamic program to run). The prompt's own token is always among them, and so are the merges the training data wrote
(``):\n``, ``fibonacci``). The diffusion model and its autoregressive twin get the same treatment, and every other
position decodes exactly as without healing.

The removed characters are part of the prompt, not of the completion: :func:`strip` takes them off the generated
text. Off for whole-sequence checkpoints (so one checkpoint decodes one way whatever its cache), for templates,
alongside a structured-output constraint, for per-process prompts, and for SFT-style prompts (``bos``; on the server,
models with a chat template): SFT records tokenise the prompt on its own, so its end is a boundary the model learned,
and it was never trained to write a prompt token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from mercury_jax.data.tokenizer import NUM_SPECIAL, TextTokenizer
from mercury_jax.sampling.state import Healing

CACHE_SIZE = 1024  # Masks kept per tokenizer: a prompt's last token is one of a few thousand.


def back_off(tokenizer: TextTokenizer, prompt: str, ids: list[int]) -> tuple[list[int], str]:
  """``(ids without their last token, that token's characters)``, or ``(ids, "")`` when there is nothing to heal:
  fewer than two tokens (one must stay, BOS counts), or a last token whose text is not the prompt's end (a tokenizer
  that normalises text)."""
  if len(ids) < 2:
    return ids, ""
  head = tokenizer.decode(ids[:-1])
  if len(head) >= len(prompt) or not prompt.startswith(head):
    return ids, ""
  return ids[:-1], prompt[len(head) :]


def healable(tokenizer: TextTokenizer, healed: str) -> bool:
  """Whether some token's text starts with ``healed`` (otherwise the prompt is used as tokenised)."""
  try:
    _allowed(tokenizer, healed)
  except ValueError:
    return False
  return True


def strip(text: str, healed: str) -> str:
  """The completion after the prompt: ``text`` (decoded from the healed position on) without the ``healed``
  characters it starts with ("" while it has not written them all yet)."""
  if not healed:
    return text
  return text[len(healed) :] if text.startswith(healed) else ""


@functools.lru_cache(maxsize=8)
def token_texts(tokenizer: TextTokenizer) -> tuple[str | None, ...]:
  """Each id's text, as decoding it alone writes it; None for the special ids (``special_mask``; ids 0-4, the
  sentencepiece layout, for a tokenizer without one) and for ids that write no text or part of a character (a byte
  of a multi-byte one, a byte-level piece that splits one), which healing never proposes."""
  special = getattr(tokenizer, "special_mask", None)
  if special is None:
    special = np.arange(tokenizer.vocab_size) < NUM_SPECIAL
  texts: list[str | None] = [None] * tokenizer.vocab_size
  for token_id in np.flatnonzero(~special).tolist():
    text = tokenizer.decode([token_id])
    texts[token_id] = text if text and "\ufffd" not in text else None
  return tuple(texts)


def allowed_tokens(tokenizer: TextTokenizer, healed: str, vocab_size: int) -> np.ndarray:
  """bool [vocab_size]: the tokens whose text starts with ``healed`` (ids beyond the tokenizer: never).

  Cached per tokenizer and text (:data:`CACHE_SIZE` entries), so a server's prompts ending alike cost one scan of the
  vocabulary.

  Raises:
    ValueError: ``healed`` is empty or no token starts with it.
  """
  mask = _allowed(tokenizer, healed)
  if vocab_size < mask.size:
    raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {mask.size}")
  return np.pad(mask, (0, vocab_size - mask.size))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _allowed(tokenizer: TextTokenizer, healed: str) -> np.ndarray:
  if not healed:
    raise ValueError("the healed text is empty; there is nothing to heal")
  mask = np.fromiter((t is not None and t.startswith(healed) for t in token_texts(tokenizer)), bool)
  if not mask.any():
    raise ValueError(f"no token of the tokenizer starts with {healed!r}")
  mask.flags.writeable = False
  return mask


def masks(tokenizer: TextTokenizer, texts: Sequence[str], positions: Sequence[int], vocab_size: int) -> Healing:
  """The engine's token-healing state of rows (:class:`~mercury_jax.sampling.state.Healing`, numpy): a row with
  healed characters ``texts[r]`` lets its canvas position ``positions[r]`` take only the tokens whose text starts
  with them; a row with "" heals nothing (slot -1)."""
  allowed = np.ones((len(texts), vocab_size), bool)
  slot = np.full((len(texts),), -1, np.int32)
  for row, (text, position) in enumerate(zip(texts, positions, strict=True)):
    if text:
      allowed[row] = allowed_tokens(tokenizer, text, vocab_size)
      slot[row] = position
  return Healing(allowed, slot)
