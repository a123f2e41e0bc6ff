"""This thread's CPU time over a block, taken as ``timeit`` takes its times: with the cyclic garbage collector off.
A test worker's heap holds what every earlier test of its process left (models, compiled programs, caches), and a
full collection of it costs seconds (about 3 s when forced in a worker of a full run); one that falls inside a
timed block belongs to no code under test (twice a CI run read 2.6-3.2 s for refusals that take 0.1-0.35 s)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time


@dataclasses.dataclass
class Elapsed:
  seconds: float = 0.0


@contextlib.contextmanager
def cpu_seconds():
  """``with cpu_seconds() as elapsed:`` ... ``elapsed.seconds`` is the block's CPU time on this thread."""
  enabled = gc.isenabled()
  gc.disable()
  elapsed = Elapsed()
  start = time.thread_time()
  try:
    yield elapsed
  finally:
    elapsed.seconds = time.thread_time() - start
    if enabled:
      gc.enable()
