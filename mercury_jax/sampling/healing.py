"""Token healing: a prompt that ends inside what the tokenizer would merge with the next text.

Tokenizers merge across the boundary a prompt draws: the training data writes ``):`` and its newline as one token,
and ``fib`` then ``onacci`` as ``fibonacci``, but a prompt that stops at ``:`` or ``fibon`` is tokenised without the
merge, so the model sees a token sequence it rarely saw and continues it badly (on the prompt's own line, or with a
broken identifier). Healing backs the prompt's last token off and re-generates it: its position becomes one more
masked position of the hole, constrained to texts that start with the removed characters
(:meth:`~mercury_jax.constrain.automaton.Compiler.heal`). The constraint runs in the block engine like any other, so
the diffusion model and its autoregressive twin get the same treatment; the engine lets the row go at the end of the
block that wrote the characters (``Automaton.free``), so later blocks decode exactly as without it.

The removed characters are part of the prompt, not of the completion: :func:`strip` takes them off the generated
text. Off for whole-sequence checkpoints (their refinement loop has no constraint; with an approximate cache too,
so one checkpoint decodes one way), for templates, alongside a
structured-output constraint, for per-process prompts, and for SFT-style prompts (``bos``; on the server, models with
a chat template): SFT records tokenise the prompt on its own, so its end is a boundary the model learned, and it was
never trained to write a prompt token.
"""

from __future__ import annotations

from mercury_jax.data.tokenizer import Tokenizer


def back_off(tokenizer: Tokenizer, prompt: str, ids: list[int]) -> tuple[list[int], str]:
  """``(ids without their last token, that token's characters)``, or ``(ids, "")`` when there is nothing to heal:
  fewer than two tokens (one must stay, BOS counts), or a last token whose text is not the prompt's end (a tokenizer
  that normalises text)."""
  if len(ids) < 2:
    return ids, ""
  head = tokenizer.decode(ids[:-1])
  if len(head) >= len(prompt) or not prompt.startswith(head):
    return ids, ""
  return ids[:-1], prompt[len(head) :]


def strip(text: str, healed: str) -> str:
  """The completion after the prompt: ``text`` (decoded from the healed position on) without the ``healed``
  characters it starts with ("" while it has not written them all yet)."""
  if not healed:
    return text
  return text[len(healed) :] if text.startswith(healed) else ""
