"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own.

Read from the scheduler when scraped: ``mercury_queue_depth``, ``mercury_busy_slots``, ``mercury_slots``,
``mercury_compilations_total`` (XLA programs the engine compiled; it should stop growing after warm-up, since
per-request knobs are traced), and where the engine thread's time goes (``Scheduler.stats``,
:class:`~mercury_jax.serve.scheduler.StepStats`):

* ``mercury_engine_iterations_total``: iterations that ran a step;
* ``mercury_engine_phase_seconds_total{phase}``: the engine thread's seconds by phase, which add up to its time:
  ``admit`` (releases, admissions and their pages), ``dispatch`` (dispatching releases, prefills and the step, and
  running chunks of chunked prefills), ``wait`` (waiting for a step's view: the device work the host did not overlap),
  ``report`` (reading views into each request's tokens) and ``post`` (handing updates to the event loop). The engine's
  time per step is their sum over ``mercury_engine_iterations_total`` between two scrapes;
* ``mercury_engine_seconds_total`` (``dispatch`` + ``wait``) and ``mercury_engine_host_seconds_total`` (``admit`` +
  ``report`` + ``post``), as before the phases;
* ``mercury_engine_steps_total{rows}``: steps by batch bucket; ``mercury_prefills_total{slots}``: prefills by prefill
  bucket (``0``: a chunked prefill's row), so a benchmark can price the device work from each program's bare time;
* ``mercury_engine_timed_steps_total{rows}``, ``mercury_engine_timed_step_seconds_total{rows}``,
  ``mercury_engine_timed_prefills_total`` and ``mercury_engine_timed_prefill_seconds_total``: one iteration in
  ``scheduler.TIMED_EVERY`` runs its prefills and its step alone on the device and times them, so the device's share
  of a step is known in place, under the load the server is under (on a CPU the event loop and other processes share
  the cores with the device's threads);
* ``mercury_prefill_chunks_total`` and ``mercury_prefill_chunk_seconds_total``: chunks of chunked prefills and their
  time (``serve.pacing`` holds them to ``--prefill-share`` of the engine's time while other requests decode).

The event loop's side: ``mercury_answer_seconds_total`` (detokenising updates, looking for stop strings and encoding
the answers and stream events: the per-token work of the HTTP side) and ``mercury_event_loop_lag_seconds`` (how late
a timer the loop sets every :data:`LAG_PERIOD` seconds fires: the time a request waits for the loop; observed by
:meth:`Metrics.watch_loop`, which the command line runs). Recorded by the routes: ``mercury_generated_tokens_total``,
``mercury_tokens_per_second`` (generated tokens over the last :data:`RATE_WINDOW` seconds),
``mercury_time_to_first_token_seconds`` (submit to the first committed token of each choice), ``mercury_request_nfe``
and ``mercury_tokens_per_forward`` (per choice, when it ends) and ``mercury_requests_total{endpoint, status}`` (HTTP
status of every API request; a stream that fails after its headers counts as 500, one whose client went away as 499).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RATE_WINDOW = 10.0  # Seconds of generated tokens that mercury_tokens_per_second averages over.
LAG_PERIOD = 0.05  # Seconds between the event loop's lag probes.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NFE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TPF_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)


class _Engine(Collector):
  """The counters read from the scheduler at scrape time: compilations and the engine thread's time."""

  FAMILIES = (
    ("mercury_compilations", "XLA programs compiled by the engine", lambda s: s.compilations),
    ("mercury_engine_iterations", "Engine iterations that ran a step", lambda s: s.stats.iterations),
    ("mercury_engine_seconds", "Seconds dispatching or waiting for the device", lambda s: s.stats.engine_seconds),
    ("mercury_engine_host_seconds", "Seconds on the host around steps", lambda s: s.stats.host_seconds),
    ("mercury_prefill_chunks", "Chunks of chunked prefills run", lambda s: s.stats.chunks),
    ("mercury_prefill_chunk_seconds", "Seconds the chunks of chunked prefills took", lambda s: s.stats.chunk_seconds),
    ("mercury_engine_timed_prefills", "Prefills of the timed iterations", lambda s: s.stats.timed_prefills),
    (
      "mercury_engine_timed_prefill_seconds",
      "Their seconds alone on the device",
      lambda s: s.stats.timed_prefill_seconds,
    ),
  )
  LABELLED = (  # (family, help, label, StepStats counter)
    ("mercury_engine_steps", "Engine steps by batch bucket (rows)", "rows", "steps"),
    ("mercury_prefills", "Prefills by bucket (slots; 0: chunked)", "slots", "prefills"),
    ("mercury_engine_timed_steps", "Steps of the timed iterations by batch bucket", "rows", "timed_steps"),
    ("mercury_engine_timed_step_seconds", "Their seconds alone on the device", "rows", "timed_step_seconds"),
  )

  def __init__(self, scheduler):
    self.scheduler = scheduler

  def describe(self):
    names = [name for name, _, _ in self.FAMILIES] + [name for name, _, _, _ in self.LABELLED]
    return [CounterMetricFamily(name, name) for name in [*names, "mercury_engine_phase_seconds"]]

  def collect(self):
    stats = self.scheduler.stats
    for name, text, read in self.FAMILIES:
      family = CounterMetricFamily(name, text)
      family.add_metric([], read(self.scheduler))
      yield family
    family = CounterMetricFamily(
      "mercury_engine_phase_seconds", "Seconds of the engine thread by phase", labels=["phase"]
    )
    for phase in stats.PHASES:
      family.add_metric([phase], getattr(stats, phase))
    yield family
    for name, text, label, field in self.LABELLED:
      family = CounterMetricFamily(name, text, labels=[label])
      for key, value in sorted(dict(getattr(stats, field)).items()):
        family.add_metric([str(key)], value)
      yield family


class Metrics:
  """The metrics of one server.

  Args:
    scheduler: Read at scrape time: ``queue_depth``, ``busy_slots``, ``slots``, ``kv_pages``, ``free_pages``,
      ``compilations`` and ``stats``.
    clock: Seconds on the clock of ``Update.time`` (``time.perf_counter``).
  """

  def __init__(self, scheduler, *, clock=time.perf_counter):
    self.registry = registry = CollectorRegistry()
    self._clock = clock
    self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens), oldest first
    Gauge("mercury_queue_depth", "Requests waiting for a slot", registry=registry).set_function(
      lambda: scheduler.queue_depth
    )
    Gauge("mercury_busy_slots", "Engine slots generating", registry=registry).set_function(lambda: scheduler.busy_slots)
    Gauge("mercury_slots", "Engine slots", registry=registry).set_function(lambda: scheduler.slots)
    Gauge(
      "mercury_kv_pages", "Pages of the key-value cache's pool (the sink excluded)", registry=registry
    ).set_function(lambda: scheduler.kv_pages)
    Gauge("mercury_kv_pages_free", "Free pages of the key-value cache's pool", registry=registry).set_function(
      lambda: scheduler.free_pages
    )
    Gauge(
      "mercury_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW:g} s", registry=registry
    ).set_function(self.tokens_per_second)
    registry.register(_Engine(scheduler))
    self.tokens = Counter("mercury_generated_tokens", "Generated (committed) tokens", registry=registry)
    histogram = functools.partial(Histogram, registry=registry)
    self.ttft = histogram(
      "mercury_time_to_first_token_seconds",
      "Seconds from submit to the first committed token of a choice",
      buckets=TTFT_BUCKETS,
    )
    self.nfe = histogram("mercury_request_nfe", "Forward passes a choice needed", buckets=NFE_BUCKETS)
    self.tpf = histogram(
      "mercury_tokens_per_forward", "Generated tokens per forward pass of a choice", buckets=TPF_BUCKETS
    )
    self.requests = Counter(
      "mercury_requests", "API requests by endpoint and HTTP status", ("endpoint", "status"), registry=registry
    )
    self.answer_seconds = Counter(
      "mercury_answer_seconds",
      "Seconds the event loop spent detokenising updates and encoding answers and stream events",
      registry=registry,
    )
    self.loop_lag = histogram(
      "mercury_event_loop_lag_seconds",
      f"How late a timer the event loop sets every {LAG_PERIOD:g} s fires",
      buckets=LAG_BUCKETS,
    )

  def add_tokens(self, count: int, when: float) -> None:
    """``count`` new tokens committed at ``when`` (clock seconds)."""
    if count > 0:
      self.tokens.inc(count)
      self._recent.append((when, count))

  def tokens_per_second(self) -> float:
    """Generated tokens per second over the last :data:`RATE_WINDOW` seconds."""
    start = self._clock() - RATE_WINDOW
    while self._recent and self._recent[0][0] < start:
      self._recent.popleft()
    return sum(count for _, count in self._recent) / RATE_WINDOW

  def first_token(self, seconds: float) -> None:
    self.ttft.observe(max(seconds, 0.0))

  def choice_done(self, tokens: int, nfe: int) -> None:
    """A choice ended having generated ``tokens`` in ``nfe`` forward passes."""
    self.nfe.observe(nfe)
    if nfe:
      self.tpf.observe(tokens / nfe)

  def request(self, endpoint: str, status: int) -> None:
    self.requests.labels(endpoint=endpoint, status=str(status)).inc()

  async def watch_loop(self) -> None:
    """Observes the running event loop's lag for ever (run it as a task on the loop the routes run on)."""
    loop = asyncio.get_running_loop()
    while True:
      before = loop.time()
      await asyncio.sleep(LAG_PERIOD)
      self.loop_lag.observe(max(loop.time() - before - LAG_PERIOD, 0.0))

  def render(self) -> tuple[bytes, str]:
    """The Prometheus text exposition and its content type."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST
