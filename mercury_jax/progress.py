"""Progress of a long command on stderr, with an estimate of the time left.

On a terminal it is a tqdm bar redrawn in place (tqdm also comes with the Hugging Face tokenizers). Otherwise (a log
file, a pipe, CI) it is a plain line after the first unit, then every ``every`` seconds, and one at the end, so a log
holds a few readable lines instead of carriage returns::

  mercury_jax.evaluate: 12/72 batches (17%), 1m05s elapsed, about 5m25s left

The estimate is the mean time per unit times the units left. The first unit usually carries the compilation, so
from the second unit on the mean leaves it out; a plain line is written after each of the first two units.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def duration(seconds: float) -> str:
  """``seconds`` as ``42s``, ``3m05s`` or ``1h02m``."""
  seconds = max(0, round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _terminal_width(stream: TextIO) -> int:
  """Columns of the terminal ``stream`` writes to; 0 when it is not one (or one without a size: a bare pty)."""
  try:
    return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
  except (AttributeError, OSError, ValueError):
    return 0


class Progress:
  """Counts ``total`` units of work; :meth:`update` after each, :meth:`close` (or the ``with`` block's end) at the end.

  Args:
    total: Units of work in all (at least 1).
    desc: What is running, the line's prefix (``mercury_jax.evaluate``).
    unit: The units' name (``batches``).
    enabled: False prints nothing (a process other than the first of a multi-host run, a quiet caller).
    every: Seconds between two plain lines.
    stream: Where to write (default ``sys.stderr``); a bar only when it is a terminal.
  """

  def __init__(
    self,
    total: int,
    desc: str,
    unit: str = "steps",
    *,
    enabled: bool = True,
    every: float = 30.0,
    stream: TextIO | None = None,
  ):
    if total < 1:
      raise ValueError(f"total={total} must be >= 1")
    self.total, self.desc, self.unit, self.every = total, desc, unit, every
    self.stream = stream or sys.stderr
    self.enabled, self.done = enabled, 0
    self.start = self.shown = time.monotonic()
    self.first: tuple[int, float] | None = None  # Units done and the clock at the first update (compilation's end).
    self.bar = None
    if enabled and _terminal_width(self.stream) > 0:
      from tqdm import tqdm

      self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True, leave=True)

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def left(self) -> float | None:
    """Seconds left at the mean time per unit (after the first unit, once there is one more); None when done."""
    if not 0 < self.done < self.total:
      return None
    now = time.monotonic()
    if self.first is not None and self.done > self.first[0]:
      per_unit = (now - self.first[1]) / (self.done - self.first[0])
    else:
      per_unit = (now - self.start) / self.done
    return per_unit * (self.total - self.done)

  def line(self) -> str:
    """The plain progress line: units done, share, time so far and the estimate of the time left."""
    elapsed = time.monotonic() - self.start
    text = f"{self.desc}: {self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%), "
    text += f"{duration(elapsed)} elapsed"
    left = self.left()
    if left is not None:
      text += f", about {duration(left)} left"
    return text

  def update(self, n: int = 1) -> None:
    """Counts ``n`` more units done."""
    self.done = min(self.total, self.done + n)
    now = time.monotonic()
    early = self.first is None or self.shown <= self.first[1]  # The first or the second update.
    if self.first is None:
      self.first = (self.done, now)
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.update(n)
      return
    if (early or now - self.shown >= self.every) and self.done < self.total:
      self.shown = now
      self.stream.write(self.line() + "\n")
      self.stream.flush()

  def close(self) -> None:
    """Ends the bar, or writes the last plain line (once)."""
    if not self.enabled:
      return
    self.enabled = False
    if self.bar is not None:
      self.bar.close()
      return
    self.stream.write(self.line() + "\n")
    self.stream.flush()
