"""How many chunks of chunked prefills an engine iteration runs: a share of the engine's time, not a token count.

A long prompt is prefilled in chunks of ``--prefill-chunk`` tokens between the steps of the requests that are decoding
(:class:`~mercury_jax.serve.slots.SlotEngine`). One device runs its programs one after the other, so a decoding stream
waits for every chunk that runs between two of its steps: its inter-token gap is the step's time plus the chunks'. A
fixed number of chunks per iteration cannot bound that gap: a chunk's time grows with the cache it reads (a chunk at
16,384 slots costs many times one at 1,024) and a step's time with the busy rows and their lengths.

:class:`PrefillPacer` gives chunked prefills a fixed share ``s`` of the engine's time while other requests decode, from
the chunk and step times it measured: the decoding streams keep ``1 - s`` of the engine, so their mean gap during a long
prefill is at most ``1 / (1 - s)`` of the steps they take beside it (2x at the default ``s = 0.5``), whatever the
prompt's length, the chunk size or the machine. (Their steps may themselves run slower beside a long prefill than alone:
docs/results/long-context.md measured 2.6x the gap alone at 0.5, beside a 16 K prompt on a CPU.) It runs as many chunks
as fit in the iteration's share when a chunk is cheaper than that (more than one per iteration), and a chunk every few
iterations when one costs more (the share is spent ahead and paid back by the steps that follow; each gap is then a
step, or a step and one chunk). With nothing decoding, the chunks run back to back, in iterations of about
:data:`IDLE_SECONDS`, so a newly arrived request still waits at most about that long for its admission.

Only process 0 measures and decides; the count travels in the iteration's command, so every process of a multi-host mesh
runs the same chunks. Where the chunks run changes no token: a row still being prefilled is inert until its last chunk.
"""

from __future__ import annotations

import dataclasses

DEFAULT_SHARE = 0.5  # The engine's time chunked prefills may take while other requests decode (--prefill-share).
MIN_SHARE, MAX_SHARE = 0.05, 0.95  # Bounds of --prefill-share: neither side is starved.
IDLE_SECONDS = 0.05  # An iteration's chunks when nothing decodes: long enough to amortise it, short for admissions.
MAX_CHUNKS = 64  # Chunks of one iteration at most (a bound on a mis-measured estimate).
SMOOTHING = 0.25  # Weight of the newest measurement in the chunk and step time estimates.


@dataclasses.dataclass
class PrefillPacer:
  """Decides each iteration's chunk count from measured times (process 0's, in the engine thread).

  Args:
    share: The engine's time chunked prefills may take while other requests decode, in
      ``[MIN_SHARE, MAX_SHARE]``.

  Attributes:
    chunk_seconds: Estimated seconds of one chunk (None until one ran).
    step_seconds: Estimated seconds of one step of the decoding rows (None until one ran beside a chunked prefill).
    debt: Seconds of chunks run ahead of the share, paid back by the steps that follow (<= 0: nothing owed; never
      below one iteration's share, so an idle stretch is not banked as a burst of chunks).
  """

  share: float = DEFAULT_SHARE
  chunk_seconds: float | None = None
  step_seconds: float | None = None
  debt: float = 0.0

  def __post_init__(self):
    if not MIN_SHARE <= self.share <= MAX_SHARE:
      raise ValueError(f"prefill share={self.share} must lie in [{MIN_SHARE}, {MAX_SHARE}]")

  @property
  def ratio(self) -> float:
    """Seconds of chunks per second of decoding steps that the share allows."""
    return self.share / (1.0 - self.share)

  def chunks(self, decoding: bool) -> int:
    """Chunks the next iteration may run (the engine runs fewer when fewer are left).

    Args:
      decoding: Whether the iteration steps rows that are decoding (beside the rows still being prefilled).
    """
    if self.chunk_seconds is None:
      return 1  # Nothing measured yet: one chunk, timed.
    if not decoding:
      return int(min(MAX_CHUNKS, max(1, IDLE_SECONDS // self.chunk_seconds)))
    if self.step_seconds is None:
      return 1
    available = self.ratio * self.step_seconds - self.debt
    if available <= 0:  # Chunks ran ahead of the share: this iteration only steps.
      return 0
    return int(min(MAX_CHUNKS, max(1, available // self.chunk_seconds)))

  def record(self, chunks: int, chunk_seconds: float, step_seconds: float | None) -> None:
    """What an iteration that had chunked prefills to run measured.

    Args:
      chunks: Chunks it ran.
      chunk_seconds: Their seconds, all together.
      step_seconds: Seconds of its step of the decoding rows; None when it stepped none.
    """
    if chunks:
      self.chunk_seconds = _smooth(self.chunk_seconds, chunk_seconds / chunks)
    if step_seconds is None:
      self.debt = 0.0  # Nothing decodes: nobody is owed time.
      return
    self.step_seconds = _smooth(self.step_seconds, step_seconds)
    self.debt = max(self.debt + chunk_seconds - self.ratio * step_seconds, -self.ratio * self.step_seconds)

  def idle(self) -> None:
    """No chunked prefill is waiting: nothing is owed (the estimates are kept for the next one)."""
    self.debt = 0.0


def _smooth(estimate: float | None, value: float) -> float:
  return value if estimate is None else (1.0 - SMOOTHING) * estimate + SMOOTHING * value
