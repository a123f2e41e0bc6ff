"""What the engine thread hands a request, and how: :class:`Update` objects delivered to the asyncio loop that
submitted the request (:class:`Handle`), the refusals of :meth:`~mercury_jax.serve.scheduler.Scheduler.submit`, and
where the engine thread's time goes (:class:`StepStats`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

from mercury_jax.sampling.text import Row

# One iteration in this many steps runs timed (``SlotEngine.dispatch(timed=True)``, not overlapped): its prefills and
# its step alone on the device, as loaded right now, which prices the device's share of the engine's time in place.
TIMED_EVERY = 32


@dataclasses.dataclass(frozen=True)
class Update:
  """What a request has new after a step.

  Attributes:
    tokens: The token ids that became final since the previous update (EOS and padding removed); the request's text
      is the concatenation of every update's ``tokens``.
    draft: With ``diffusing``: the whole completion now, final tokens plus the last step's proposals in the open
      block, later positions as the mask id; None otherwise.
    done: The request's last update.
    finish_reason: When done: ``stop`` (EOS), ``length`` (the hole is full), ``cancelled`` or ``error``.
    nfe: Forward passes the request has needed so far (its prefill included).
    error: The message when ``finish_reason`` is ``error`` (for the log, not for clients).
    time: ``time.perf_counter()`` when the engine produced it.
  """

  tokens: tuple[int, ...]
  draft: tuple[int, ...] | None
  done: bool
  finish_reason: str | None
  nfe: int
  error: str | None = None
  time: float = 0.0


class ShuttingDown(RuntimeError):
  """The server is draining and takes no new request."""


class EngineDown(RuntimeError):
  """The engine failed and could not start afresh: the server takes no new request."""


class QueueFull(Exception):
  """Every slot is busy (or the key-value cache's free pages are spoken for) and ``max_queue`` requests wait beyond
  those the free rows and pages are about to take; try again after ``retry_after`` seconds."""

  def __init__(self, waiting: int, retry_after: float):
    super().__init__(f"the server is at capacity ({waiting} requests are waiting); retry after {retry_after:.0f} s")
    self.retry_after = retry_after


class Handle:
  """A submitted request: its updates arrive on the asyncio loop that submitted it.

  Args:
    request_id: The scheduler's number for it (the log's tag).
    request: The row to generate.
    loop: The asyncio loop its updates go to.
    wake: Wakes the engine thread (a cancellation frees the row before the next step).
    diffusing: Also deliver the whole draft after every step.
  """

  def __init__(self, request_id: int, request: Row, loop: asyncio.AbstractEventLoop, wake: Callable, diffusing=False):
    self.id, self.request, self.loop, self._wake, self.diffusing = request_id, request, loop, wake, diffusing
    self.submitted = time.perf_counter()
    self._queue: asyncio.Queue[Update] = asyncio.Queue()
    self.cancelled = False

  def _deliver(self, update: Update) -> None:  # Called on the engine thread.
    post(self.loop, [(self, update)])

  async def updates(self) -> AsyncIterator[Update]:
    """Yields updates until the one with ``done``."""
    while True:
      update = await self._queue.get()
      yield update
      if update.done:
        return

  def cancel(self) -> None:
    """Gives the request up (thread-safe); its slot is freed before the next step."""
    self.cancelled = True
    self._wake()


def post(loop: asyncio.AbstractEventLoop, items: list[tuple[Handle, Update]]) -> None:
  """Hands ``items`` to their handles on ``loop``, with one wake-up of the loop (called on the engine thread)."""
  try:
    loop.call_soon_threadsafe(_receive, items)
  except RuntimeError:  # The loop is closed: nobody is listening any more.
    for handle, _ in items:
      handle.cancelled = True


def _receive(items: list[tuple[Handle, Update]]) -> None:
  for handle, update in items:
    handle._queue.put_nowait(update)


@dataclasses.dataclass
class StepStats:
  """Where the engine thread's time goes, summed over its iterations (read by ``/metrics``).

  Every second of an iteration that runs a step falls in exactly one phase, so the phases add up to the engine's
  time per step. With the step overlapped (``ServeConfig.overlap``), ``wait`` is the part of the device's work
  that the host's phases did not cover.

  Attributes:
    iterations: Engine iterations that ran a step.
    admit: Seconds building commands: releases, admissions and their pages (host).
    dispatch: Seconds dispatching releases, prefills and the step (host: JAX's dispatch, the admissions' arrays),
      and running chunks of chunked prefills (waited for: ``chunk_seconds``).
    wait: Seconds waiting for a step's view (the device's work the host did not overlap, and the copy).
    report: Seconds reading views: each request's new tokens, drafts and end (host).
    post: Seconds handing the updates to the event loops (host).
    chunks: Chunks of chunked prefills run.
    chunk_seconds: Their seconds (a part of ``dispatch``).
    steps: Steps run, by batch bucket (rows).
    prefills: Prefills run, by prefill bucket (slots; 0: a chunked prefill's row).
    timed_steps, timed_step_seconds: Steps of the timed iterations (one in :data:`TIMED_EVERY`) by batch bucket, and
      their seconds alone on the device (the copy of their view included).
    timed_prefills, timed_prefill_seconds: The timed iterations' prefills and their seconds alone on the device.
  """

  iterations: int = 0
  admit: float = 0.0
  dispatch: float = 0.0
  wait: float = 0.0
  report: float = 0.0
  post: float = 0.0
  chunks: int = 0
  chunk_seconds: float = 0.0
  steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  prefills: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_step_seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_prefills: int = 0
  timed_prefill_seconds: float = 0.0

  PHASES: ClassVar[tuple[str, ...]] = ("admit", "dispatch", "wait", "report", "post")

  @property
  def engine_seconds(self) -> float:
    """Seconds in the engine: dispatches and waiting for the device."""
    return self.dispatch + self.wait

  @property
  def host_seconds(self) -> float:
    """Seconds of host work around the engine: commands, admissions, reading views, handing out updates."""
    return self.admit + self.report + self.post
