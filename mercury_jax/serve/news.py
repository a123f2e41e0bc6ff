"""A request's news after a step: the tokens that became final in its row, its draft, or its end, read from the
step's :class:`~mercury_jax.serve.commands.View` (the engine thread's, with the scheduler's lock held)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mercury_jax.serve.commands import View
from mercury_jax.serve.handles import Handle, Update


@dataclasses.dataclass
class Active:
  """A request in its row: what of its hole is delivered."""

  handle: Handle
  start: int  # first slot of the hole
  end: int  # one past its last slot
  upto: int  # slots before this one are delivered (final)
  tokens: list[int] = dataclasses.field(default_factory=list)  # the final tokens so far
  stopped: bool = False  # an EOS ended the hole


@dataclasses.dataclass(frozen=True)
class Reader:
  """Reads a row's news from a step's view.

  Attributes:
    width: The tokens a step commits at most from its window's first slot (the block, or the draft length).
    draft: Verified decoding's draft length (0: off).
    mask_id, eos_id, pad_id: The engine's special tokens.
  """

  width: int
  draft: int
  mask_id: int
  eos_id: int
  pad_id: int

  def news(self, slot: int, active: Active, view: View, now: float) -> tuple[Update | None, bool]:
    """``(the request's update after a step or None, whether it is done)``: newly final tokens, its draft, or its
    end."""
    worked, starts = int(view.worked[slot]), int(view.starts[slot])
    done = not bool(view.unfinished[slot])
    final = []  # (first slot, tokens) of the blocks that became final
    if done or starts > worked:
      final.append((worked, view.block[slot]))
    if done and starts > worked:  # Tokens a constraint forced into the next block, which filled the hole.
      final.append((starts, view.upcoming[slot]))
    new = []
    for first, tokens in final:  # An unfinished verified row's worked tokens are final up to its next slot only.
      new += self._take(slot, active, first, tokens, None if done else starts)
    nfe = int(view.nfe[slot])
    if done:
      stopped = active.stopped
      constraint = active.handle.request.constraint
      if constraint is not None:  # Complete structured text stops; a valid but unfinished prefix ran out of room.
        stopped = constraint.accepts(active.tokens + [self.eos_id] * stopped)
      return Update(tuple(new), None, True, "stop" if stopped else "length", nfe, time=now), True
    draft = None
    if active.handle.diffusing:  # The final tokens, the open block's proposals, then masks.
      first, tokens = (starts, view.upcoming[slot]) if starts > worked else (worked, view.block[slot])
      low, high = max(first, active.upto), min(first + self.width, active.end)
      piece = tokens[low - first : high - first]
      if starts == worked or self.draft:  # verified: the drafts the next step verifies, from ``starts``
        piece = np.where(piece == self.mask_id, view.proposal[slot, low - first : high - first], piece)
      draft = active.tokens + piece.tolist()
      draft = tuple(draft + [self.mask_id] * (active.end - active.start - len(draft)))
    if new or draft is not None:
      return Update(tuple(new), draft, False, None, nfe, time=now), False
    return None, False

  def _take(self, slot: int, active: Active, first: int, tokens: np.ndarray, limit: int | None) -> list[int]:
    """The request's tokens in the final block of ``tokens`` at slot ``first`` (before slot ``limit`` when given),
    up to its first EOS (recorded)."""
    if active.stopped:
      return []
    low, high = max(first, active.upto), min(first + self.width, active.end, limit or active.end)
    if low > active.upto:
      raise RuntimeError(f"row {slot} skipped slots {active.upto}..{low}: its blocks were not all reported")
    if high <= low:
      return []
    piece = tokens[low - first : high - first]
    eos = np.flatnonzero(piece == self.eos_id)
    if eos.size:
      piece, active.stopped = piece[: eos[0]], True
    new = [t for t in piece.tolist() if t != self.pad_id and t != self.mask_id]
    active.tokens.extend(new)
    active.upto = high
    return new
