"""Serving benchmark: latency against throughput of ``python -m mercury_jax.serve`` under open-loop load.

    python launch/bench_serve.py --model diffusion=runs/bd --model twin=runs/ar \\
      [--concurrency 1,4,16,64] [--requests-per-level 64] [--max-tokens 64] [--slots 64] \\
      [--extra '{"steps_per_block": 2, "threshold": 0.9}'] [--temperature 1.0] [--seed 0] [--prompts FILE] \\
      [--price] [--fairness 8] [--out bench_serve]

Needs ``httpx`` and ``matplotlib`` besides the server's own packages. For each ``--model NAME=CHECKPOINT`` the script
starts a server (``sys.executable -m mercury_jax.serve --port 0``; its log goes to ``OUT/server-NAME.log``), waits for
its ``serving`` line, sends one warm-up request, then ``--solo-requests`` requests one after another whose mean
latency is the model's *solo latency*. Then, for each concurrency level C, it sends
``max(--requests-per-level, C)`` streamed ``/v1/completions`` requests (prompts taken in turn from ``--prompts``, one
per line with ``\\n`` escapes, or a built-in list of short Python prompts):

* C = 1: strictly one after another (each is sent when the previous one has ended).
* C > 1 with ``--load closed``: C clients, each sending its next request when its previous one has ended (never
  more than C in flight: the load under which "up to the slot count" is meant).
* C > 1: open loop (the default). Arrival times are a Poisson process of rate C / solo latency (the *offered*
  concurrency, by Little's law, is C while the server keeps its solo latency), and each request is sent at its
  arrival time whatever the others are doing; nothing caps the requests in flight. A server that slows down under
  load therefore holds more than C requests at once: the *achieved* concurrency column says how many it held on
  average.

Definitions (times from the client's clock; a request's latency runs from just before it is sent to its last event):

* out tok/s: the completion tokens of the level's successful requests / the level's wall span (first send to last
  end).
* per-req tok/s: a request's completion tokens / its latency; the median over the level's requests.
* TTFT: time to the first event whose ``choices[0].text`` is non-empty (the first committed block of text).
* inter-block: the gaps between successive events with non-empty text of one request, pooled over the level.
* tok/fwd: the level's completion tokens / its forward passes (``usage.nfe``, summed; a request's nfe counts the
  passes that advanced it, not the batched passes it shared).
* achieved conc.: the time average of the requests in flight over the wall span (the sum of latencies / the span).
* errors: requests that did not answer 200 with a usage event (429 from a full queue counts; ``--max-queue``
  defaults high so that an open loop is never refused).
* engine ms/step and host %: from the server's ``/metrics`` before and after the level
  (``mercury_engine_iterations_total``, ``mercury_engine_seconds_total``, ``mercury_engine_host_seconds_total``): the
  engine thread's mean time per iteration that ran a step, and the share of it spent on the host around the engine
  (building the command, admissions, reading the step's view, handing out updates). "-" for a server without them.
* p99 of a level with fewer than 100 requests lies between its two largest values (linear interpolation).

The engine breakdown (a second table, from the server's ``mercury_engine_phase_seconds_total``): the engine thread's
time per step by phase (``admit``, ``dispatch``, ``wait``, ``report``, ``post``; they add up to engine ms/step), the
event loop's per-token work per step (``mercury_answer_seconds_total``: detokenising, stop strings, encoding the
events) and its mean lag (``mercury_event_loop_lag_seconds``). With ``--price``, once a model's levels are done the
script times every batch bucket's step and every prefill bucket's prefill bare in its own process while the server
idles (:func:`bench_slot_step.bare_costs`: the server's default engine, no HTTP), prices each level's steps and
prefills (``mercury_engine_steps_total{rows}``, ``mercury_prefills_total{slots}``) at those times, and gives the
engine's time per step over that bare work. It assumes the server's default engine flags (``--server-args`` that
change its programs, such as ``--no-batch-invariance``, are not priced right). Without ``--price`` the same ratio is
given *in place*: the server times one iteration in 32 with its prefills and step alone on the device
(``mercury_engine_timed_*``), under the level's own load, which on a CPU host includes the event loop, the client
and any other process on the cores; engine / in place is then the engine thread's overhead over the device's work.

``--fairness N``: before the levels, N requests whose JSON Schemas run past the compile timeout (integer bounds
near 2**70, a different one each) and, 0.1 s later, one whose schema is ``{"type": "boolean"}``: the seconds to
the boolean's whole answer (its compile, prefill and tokens), how many of the N were still compiling then, and
the N refusals' times (again, two of them: from the cache of refusals).

Sampling: ``--temperature`` defaults to 1.0, the model's own distribution, as a sampling client would use it (greedy
decoding makes small models loop on one phrase, text unlike what they serve); each request has seed ``--seed`` plus
its index, so a run repeats. ``--extra`` fields go to diffusion models only; a model whose ``/v1/models`` card says
``objective: autoregressive`` gets none (it would answer 400). When a model is called ``twin`` (an autoregressive
twin of the others), the summary also gives each other model's per-request speed over the twin's at the lowest level
run, and the lowest level at which the twin's out tok/s reaches or passes that model's at the same level.

Writes ``OUT/results.json`` (every request's record), ``OUT/results.md`` (the table, the command line and the
machine) and ``OUT/latency_throughput.png``. Each server is stopped with SIGTERM and must exit 0; the script exits 1
when a server failed to start, to stop cleanly, or a level had errors. The client runs on the same machine as the
server and shares its CPUs: on a small host its own parsing shows up in the latencies. The server's engine step runs
the smallest batch bucket (1, 2, 4, ... up to ``--slots`` rows) that holds its busy requests.

``--baseline-slots N`` also starts a ``--slots N`` server for each model (``--slots 1``: the command line's cost)
and runs the concurrency-1 level against both servers in turn, request by request (the two servers never work at
once, and the machine's speed drifts alike for both): the summary gives each model's concurrency-1 out tok/s with
``--slots`` over that with ``--baseline-slots``. Each server's start-up line on its key-value cache (pages, memory)
goes into the results.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

PROMPTS = (
  "def fibonacci(n):",
  "import os\n",
  "class Stack:\n    def push(self, item):",
  "def is_prime(n):",
  "def read_config(path):",
  "import json\n\ndef load(path):",
  "def merge_sorted(a, b):",
  "for i in range(10):",
  "class Node:\n    def __init__(self, value):",
  "def binary_search(items, target):",
  "def parse_args():",
  "import numpy as np\n\ndef normalize(x):",
  "def flatten(nested):",
  "with open('data.txt') as f:",
  "def quicksort(items):",
  "class Counter:\n    def increment(self):",
)
SERVING = re.compile(r"^serving (\S+) on (http://\S+)")


def _levels(text: str) -> list[int]:
  try:
    levels = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 1,4,16,64") from None
  if not levels or min(levels) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: every concurrency level must be >= 1")
  return sorted(set(levels))


def _model(text: str) -> tuple[str, str]:
  name, sep, path = text.partition("=")
  if not sep or not name or not path:
    raise argparse.ArgumentTypeError(f"{text!r} must be NAME=CHECKPOINT_DIR, e.g. diffusion=runs/bd")
  return name, path


def _extra(text: str) -> dict:
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object of request fields")
  return value


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", type=_model, action="append", required=True, metavar="NAME=CHECKPOINT_DIR")
  p.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64], help="levels, e.g. 1,4,16,64")
  p.add_argument("--requests-per-level", type=int, default=64, help="requests per level (at least the level)")
  p.add_argument("--solo-requests", type=int, default=4, help="sequential requests that measure the solo latency")
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--prompts", help="a file of prompts, one a line (write a newline inside one as \\n)")
  p.add_argument(
    "--slots", type=int, default=64, help="the server's --slots (each engine step computes all of them, even at 1)"
  )
  p.add_argument("--max-queue", type=int, default=4096, help="the server's --max-queue")
  p.add_argument("--server-args", default="", help="more flags for every server, e.g. '--no-batch-invariance'")
  p.add_argument(
    "--baseline-slots",
    type=int,
    default=0,
    help="also serve each model with this many slots and run the concurrency-1 level against both, in turn (0: no)",
  )
  p.add_argument("--extra", type=_extra, default={}, help="JSON object of request fields for diffusion models")
  p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy; default 1.0)")
  p.add_argument("--seed", type=int, default=0, help="request i gets seed SEED + i; also seeds the arrivals")
  p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds a server may take to listen")
  p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
  p.add_argument(
    "--load",
    choices=("open", "closed"),
    default="open",
    help="open: Poisson arrivals at level / solo latency (default); closed: LEVEL clients, each sending its next "
    "request when its last one ended (never more than LEVEL in flight)",
  )
  p.add_argument(
    "--price",
    action="store_true",
    help="after each model's levels, time every batch bucket's step and every prefill bucket's prefill bare (in this "
    "process, the server idle) and price each level's engine work with them (needs jax; see bench_slot_step.py)",
  )
  p.add_argument(
    "--fairness",
    type=int,
    default=0,
    metavar="N",
    help="before the levels, send N structured requests whose schemas run past the compile timeout (integer bounds "
    "near 2**70), then a {'type': 'boolean'} one, and time the boolean's answer (0: skip)",
  )
  p.add_argument("--out", default="bench_serve", help="folder for results.json, results.md and the plot")
  return p


# ------------------------------------------------------------------------------------------------ the server


class Server:
  """One ``mercury_jax.serve`` subprocess, its output copied to a log file.

  Args:
    checkpoint: The checkpoint folder to serve.
    log: The file that receives the server's stdout and stderr.
    slots: The server's ``--slots``.
    max_queue: The server's ``--max-queue``.
    extra: More flags for the server (``--server-args``).
  """

  def __init__(self, checkpoint: str, log: Path, slots: int, max_queue: int, extra: tuple[str, ...] = ()):
    self.command = [sys.executable, "-m", "mercury_jax.serve", "--checkpoint", checkpoint, "--port", "0"]
    self.command += ["--slots", str(slots), "--max-queue", str(max_queue), *extra]
    self.url: str | None = None
    self.kv_cache = ""  # The server's start-up line on its key-value cache.
    self.last_line = ""  # The server's latest non-empty output line, for the error when it fails.
    self._ready = threading.Event()
    self._log = log.open("w")
    self.process = subprocess.Popen(
      self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.process.stdout:
      self._log.write(line)
      self._log.flush()
      self.last_line = line.strip() or self.last_line
      if line.startswith("kv cache:"):
        self.kv_cache = line.strip()
      match = SERVING.match(line)
      if match and self.url is None:
        self.url = match.group(2)
        self._ready.set()
    self._ready.set()  # The process ended: wait() below sees no url.

  def wait(self, timeout: float) -> str:
    """The server's base URL once it listens.

    Raises:
      RuntimeError: It exited, or did not listen within ``timeout`` seconds.
    """
    if not self._ready.wait(timeout):
      raise RuntimeError(f"no 'serving' line within {timeout:.0f} s")
    if self.url is None:
      code = self.process.wait()
      raise RuntimeError(f"the server exited with code {code} before it listened: {self.last_line}")
    return self.url

  def stop(self, timeout: float = 120.0) -> int | None:
    """Sends SIGTERM and returns the exit code (None: still running after ``timeout`` s, then killed)."""
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
    try:
      code = self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()
      code = None
    self._reader.join(10)
    self._log.close()
    return code


# ------------------------------------------------------------------------------------------------ the client


@dataclasses.dataclass
class Record:
  """One request as the client saw it; times in seconds from the start of its level."""

  index: int
  scheduled: float  # When the load meant to send it.
  sent: float = math.nan
  ttft: float = math.nan  # From sent to the first event with text.
  gaps: list[float] = dataclasses.field(default_factory=list)  # Between successive events with text.
  end: float = math.nan
  completion_tokens: int = 0
  nfe: int = 0
  status: int | None = None
  error: str | None = None

  @property
  def latency(self) -> float:
    return self.end - self.sent


async def _request(client, url: str, body: dict, record: Record, origin: float) -> Record:
  """Sends one streamed completion and fills ``record`` from its events."""
  start = time.perf_counter()
  record.sent = start - origin
  last = None
  usage = None
  try:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
      record.status = response.status_code
      if response.status_code != 200:
        text = (await response.aread()).decode(errors="replace")
        record.error = f"HTTP {response.status_code}: {text[:300]}"
      else:
        async for line in response.aiter_lines():
          if not line.startswith("data:"):
            continue
          data = line[5:].strip()
          if data == "[DONE]":
            break
          event = json.loads(data)
          if "error" in event:
            record.error = f"stream error: {json.dumps(event['error'])[:300]}"
            continue
          if event.get("usage"):
            usage = event["usage"]
          choices = event.get("choices") or []
          if choices and choices[0].get("text"):
            now = time.perf_counter()
            if last is None:
              record.ttft = now - start
            else:
              record.gaps.append(now - last)
            last = now
  except Exception as e:  # Any failure of one request is recorded, not fatal to the level.
    record.error = f"{type(e).__name__}: {e}"[:300]
  record.end = time.perf_counter() - origin
  if record.error is None and usage is None:
    record.error = "the stream ended without a usage event"
  if usage is not None:
    record.completion_tokens, record.nfe = int(usage["completion_tokens"]), int(usage["nfe"])
  return record


def _body(index: int, prompts: list[str], args, extra: dict) -> dict:
  return {
    "prompt": prompts[index % len(prompts)],
    "max_tokens": args.max_tokens,
    "temperature": args.temperature,
    "seed": args.seed + index,
    "stream": True,
    "stream_options": {"include_usage": True},
    **extra,
  }


async def _sequential(client, url: str, bodies: list[dict]) -> list[Record]:
  origin = time.perf_counter()
  records = []
  for i, body in enumerate(bodies):
    records.append(await _request(client, url, body, Record(i, time.perf_counter() - origin), origin))
  return records


async def _alternating(client, urls: tuple[str, str], bodies: list[dict]) -> tuple[list[Record], list[Record]]:
  """Each body sent to both servers, one request at a time, in turn: the sequential level of each."""
  origin = time.perf_counter()
  records: tuple[list[Record], list[Record]] = ([], [])
  for i, body in enumerate(bodies):
    for url, out in zip(urls, records, strict=True):
      out.append(await _request(client, url, body, Record(i, time.perf_counter() - origin), origin))
  return records


async def _open_loop(client, url: str, bodies: list[dict], rate: float, rng: np.random.Generator) -> list[Record]:
  """Sends ``bodies`` at the arrivals of a Poisson process of ``rate`` per second (the first at once)."""
  arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, len(bodies) - 1))])
  origin = time.perf_counter()
  tasks = []
  for i, (body, arrival) in enumerate(zip(bodies, arrivals, strict=True)):
    delay = origin + arrival - time.perf_counter()
    if delay > 0:
      await asyncio.sleep(delay)
    tasks.append(asyncio.create_task(_request(client, url, body, Record(i, float(arrival)), origin)))
  return list(await asyncio.gather(*tasks))


async def _closed_loop(client, url: str, bodies: list[dict], clients: int) -> list[Record]:
  """``clients`` clients share ``bodies``; each sends its next one as soon as its previous one ended."""
  origin, pending, records = time.perf_counter(), list(enumerate(bodies)), []

  async def client_loop():
    while pending:
      i, body = pending.pop(0)
      records.append(await _request(client, url, body, Record(i, time.perf_counter() - origin), origin))

  await asyncio.gather(*(client_loop() for _ in range(clients)))
  return sorted(records, key=lambda r: r.index)


COUNTERS = (
  "mercury_compilations_total",
  "mercury_engine_iterations_total",
  "mercury_engine_seconds_total",
  "mercury_engine_host_seconds_total",
)
PHASES = ("admit", "dispatch", "wait", "report", "post")  # mercury_engine_phase_seconds_total{phase}
SAMPLE = re.compile(r'^(mercury_\w+)(?:\{(\w+)="([^"]*)"\})? (\S+)$')


async def _counters(client, url: str) -> dict:
  """The server's ``/metrics`` samples of ``mercury_*`` families: ``name -> value``, and ``name -> {label value:
  value}`` for the one-label families (phases, steps by rows, prefills by slots); an older server lacks some."""
  try:
    text = (await client.get(f"{url}/metrics")).text
  except Exception:
    return {}
  found: dict = {}
  for line in text.splitlines():
    match = SAMPLE.match(line)
    if match is None:
      continue
    name, label, value = match.group(1), match.group(3), float(match.group(4))
    if match.group(2) is None:
      found[name] = value
    elif match.group(2) in ("phase", "rows", "slots", "le"):
      found.setdefault(name, {})[label] = value
  return found


def _delta(before: dict, after: dict, name: str):
  """``after - before`` of a sample (a dict of them for a labelled family); None when either lacks it."""
  if name not in before and name not in after:
    return None
  a, b = after.get(name, {}), before.get(name, {})
  if isinstance(a, dict):
    return {key: a[key] - b.get(key, 0.0) for key in a}
  return a - b


def _engine_split(before: dict, after: dict) -> dict:
  """Engine ms per step, the host's share of it, and its phases in ms per step over a level (None without the
  counters); the step and prefill counts, for :func:`price`."""
  names = COUNTERS[1:]
  if not all(n in before and n in after for n in names):
    return {"engine_steps": None, "step_ms": None, "host_share": None}
  steps, engine, host = (after[n] - before[n] for n in names)
  if steps < 1:
    return {"engine_steps": 0, "step_ms": None, "host_share": None}
  out = {"engine_steps": steps, "step_ms": 1000 * (engine + host) / steps, "host_share": host / (engine + host)}
  phases = _delta(before, after, "mercury_engine_phase_seconds_total")
  if phases:
    out["phases_ms"] = {phase: 1000 * phases.get(phase, 0.0) / steps for phase in PHASES}
    out["step_ms"] = sum(out["phases_ms"].values())  # every second of the engine thread, by phase
  answer = _delta(before, after, "mercury_answer_seconds_total")
  if answer is not None:
    out["answer_ms"] = 1000 * answer / steps
  out["steps_by_rows"] = _delta(before, after, "mercury_engine_steps_total")
  out["prefills_by_slots"] = _delta(before, after, "mercury_prefills_total")
  timed = _delta(before, after, "mercury_engine_timed_steps_total")
  timed_s = _delta(before, after, "mercury_engine_timed_step_seconds_total")
  if timed and out["steps_by_rows"]:  # the device work priced at the timed iterations' times, in place
    mean = {int(float(rows)): timed_s[rows] / n for rows, n in timed.items() if n}
    if mean:
      # A bucket no timed iteration ran is priced at the nearest smaller one's time (else the nearest larger one's):
      # its device work is not overstated, so neither is the engine's time over it understated.
      below = lambda rows: max((r for r in mean if r <= rows), default=min(mean))  # noqa: E731
      priced = sum(n * mean[below(int(float(r)))] for r, n in out["steps_by_rows"].items() if n)
      out["timed_step_ms"] = 1000 * priced / steps
      prefills = _delta(before, after, "mercury_engine_timed_prefills_total") or 0
      seconds = _delta(before, after, "mercury_engine_timed_prefill_seconds_total") or 0.0
      count = sum((out["prefills_by_slots"] or {}).values())
      out["timed_prefill_ms"] = 1000 * count * seconds / prefills / steps if prefills else 0.0
      out["over_timed"] = out["step_ms"] / (out["timed_step_ms"] + out["timed_prefill_ms"])
  lag_sum = _delta(before, after, "mercury_event_loop_lag_seconds_sum")
  lag_count = _delta(before, after, "mercury_event_loop_lag_seconds_count")
  if lag_sum is not None and lag_count:
    out["loop_lag_ms"] = 1000 * lag_sum / lag_count
  return out


def price(row: dict, bare_steps: dict[int, float], bare_prefills: dict[int, float]) -> None:
  """Adds to a level's ``row`` the device work its engine did, priced at each program's bare time (ms per step: its
  steps by batch bucket and prefills by prefill bucket, over its steps), and the engine's time over it."""
  steps, prefills = row.get("steps_by_rows"), row.get("prefills_by_slots")
  if not steps or not row.get("engine_steps"):
    return
  unpriced = [int(float(k)) for k, n in prefills.items() if n and int(float(k)) not in bare_prefills]
  step_ms = sum(n * bare_steps[int(float(k))] for k, n in steps.items()) / row["engine_steps"]
  prefill_ms = sum(n * bare_prefills.get(int(float(k)), 0.0) for k, n in prefills.items()) / row["engine_steps"]
  row["bare_step_ms"], row["bare_prefill_ms"] = step_ms, prefill_ms
  row["over_bare"] = row["step_ms"] / (step_ms + prefill_ms)
  if unpriced:
    row["unpriced_prefills"] = unpriced  # chunked prefills (0): their chunks are in dispatch, not priced here


# ------------------------------------------------------------------------------------------------ statistics


def _pct(values, q: float) -> float:
  values = [v for v in values if not math.isnan(v)]
  return float(np.percentile(values, q)) if values else math.nan


def summarize(records: list[Record], level: int, load: str, rate: float | None) -> dict:
  """The level's row of the table (definitions in the module docstring)."""
  ok = [r for r in records if r.error is None]
  span = max(r.end for r in records) - min(r.sent for r in records)
  tokens = sum(r.completion_tokens for r in ok)
  nfe = sum(r.nfe for r in ok)
  return {
    "concurrency": level,
    "load": load,
    "rate_rps": rate,
    "requests": len(records),
    "errors": len(records) - len(ok),
    "span_s": span,
    "achieved_concurrency": sum(r.latency for r in records) / span if span > 0 else math.nan,
    "output_tokens": tokens,
    "output_tokens_per_s": tokens / span if span > 0 else math.nan,
    "per_request_tokens_per_s_p50": _pct([r.completion_tokens / r.latency for r in ok if r.latency > 0], 50),
    "ttft_p50_s": _pct([r.ttft for r in ok], 50),
    "ttft_p99_s": _pct([r.ttft for r in ok], 99),
    "inter_block_p50_s": _pct([g for r in ok for g in r.gaps], 50),
    "inter_block_p99_s": _pct([g for r in ok for g in r.gaps], 99),
    "latency_p50_s": _pct([r.latency for r in ok], 50),
    "latency_p99_s": _pct([r.latency for r in ok], 99),
    "tokens_per_forward": tokens / nfe if nfe else math.nan,
    "max_send_lag_s": max(r.sent - r.scheduled for r in records),
  }


def _ms(seconds: float) -> str:
  if math.isnan(seconds):
    return "-"
  return f"{1000 * seconds:.1f}" if seconds < 0.01 else f"{1000 * seconds:.0f}"


def _num(value: float, digits: int = 1) -> str:
  return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def price_levels(checkpoint: str, slots: int, levels: list[dict]) -> dict:
  """Times the server's programs bare (:func:`bench_slot_step.bare_costs`, in this process while the server idles)
  and prices every level's engine work with them (:func:`price`)."""
  from bench_slot_step import bare_costs

  from mercury_jax.sampling.sampler import Sampler

  print("  timing the steps and prefills bare (the server idles)", flush=True)
  steps, prefills = bare_costs(Sampler.from_checkpoint(checkpoint), slots)
  for row in levels:
    price(row, steps, prefills)
    if "over_bare" in row:
      print(
        f"  concurrency {row['concurrency']}: engine {row['step_ms']:.1f} ms/step against "
        f"{row['bare_step_ms']:.1f} ms of bare steps and {row['bare_prefill_ms']:.1f} ms of bare prefills: "
        f"{row['over_bare']:.3f}x",
        flush=True,
      )
  return {"step_ms": steps, "prefill_ms": prefills}


def breakdown_table(models: dict) -> str:
  """The engine thread's time per step by phase, the event loop's, and the engine's time over its bare work."""
  head = (
    "| model | conc. | engine ms/step | admit | dispatch | wait | report | post | answers (loop) | loop lag ms "
    "| in place: step + prefill ms | engine / in place | bare: step + prefill ms | engine / bare |"
  )
  lines = [head, "|" + "---|" * 14]
  for name, model in models.items():
    for row in model.get("levels", []):
      phases = row.get("phases_ms")
      if not phases:
        continue
      bare, timed = row.get("bare_step_ms"), row.get("timed_step_ms")
      priced = "-" if bare is None else f"{bare:.1f} + {row['bare_prefill_ms']:.1f}"
      in_place = "-" if timed is None else f"{timed:.1f} + {row['timed_prefill_ms']:.1f}"
      lines.append(
        f"| {name} | {row['concurrency']} | {row['step_ms']:.1f} | "
        + " | ".join(f"{phases[p]:.2f}" for p in PHASES)
        + f" | {_num(row.get('answer_ms'), 2)} | {_num(row.get('loop_lag_ms'), 2)} | {in_place} "
        f"| {_num(row.get('over_timed'), 3)} | {priced} | {_num(row.get('over_bare'), 3)} |"
      )
  return "\n".join(lines) if len(lines) > 2 else ""


def markdown_table(models: dict) -> str:
  head = (
    "| model | conc. | load | req | err | achieved conc. | out tok/s | per-req tok/s p50 | TTFT p50 / p99 ms "
    "| inter-block p50 / p99 ms | latency p50 / p99 ms | tok/fwd | engine ms/step | host % |"
  )
  lines = [head, "|" + "---|" * 14]
  for name, model in models.items():
    for row in model.get("levels", []):
      host = row.get("host_share")
      load = row["load"]
      if load == "poisson":
        load = f"Poisson {row['rate_rps']:.2f} req/s"
      elif load == "closed":
        load = f"closed, {row['concurrency']} clients"
      lines.append(
        f"| {name} | {row['concurrency']} | {load} | {row['requests']} | {row['errors']} "
        f"| {_num(row['achieved_concurrency'], 2)} | {_num(row['output_tokens_per_s'])} "
        f"| {_num(row['per_request_tokens_per_s_p50'])} | {_ms(row['ttft_p50_s'])} / {_ms(row['ttft_p99_s'])} "
        f"| {_ms(row['inter_block_p50_s'])} / {_ms(row['inter_block_p99_s'])} "
        f"| {_ms(row['latency_p50_s'])} / {_ms(row['latency_p99_s'])} | {_num(row['tokens_per_forward'], 2)} "
        f"| {_num(row.get('step_ms'))} | {_num(None if host is None else 100 * host)} |"
      )
  return "\n".join(lines)


def compare_to_twin(models: dict) -> list[str]:
  """Each model against the one named ``twin``: per-request speed at the lowest level, and the throughput crossover."""
  twin = models.get("twin", {}).get("levels")
  if not twin:
    return []
  by_level = {row["concurrency"]: row for row in twin}
  lines = []
  for name, model in models.items():
    rows = {row["concurrency"]: row for row in model.get("levels", [])}
    common = sorted(set(rows) & set(by_level))
    if name == "twin" or not common:
      continue
    low = common[0]
    ratio = rows[low]["per_request_tokens_per_s_p50"] / by_level[low]["per_request_tokens_per_s_p50"]
    lines.append(f"- {name} / twin, per-request output tok/s (p50) at concurrency {low}: {ratio:.2f}x")
    cross = next((c for c in common if by_level[c]["output_tokens_per_s"] >= rows[c]["output_tokens_per_s"]), None)
    where = f"at concurrency {cross}" if cross is not None else "not within the levels run"
    lines.append(f"- twin's out tok/s reaches or passes {name}'s (same level): {where}")
  return lines


def plot(models: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  panels = (("latency", "request latency (s)"), ("ttft", "time to first token (s)"))
  for ax, (key, label) in zip(axes, panels, strict=True):
    for i, (name, model) in enumerate(models.items()):
      rows = model.get("levels", [])
      if not rows:
        continue
      color = f"C{i}"
      x = [row["output_tokens_per_s"] for row in rows]
      for q, style in (("p50", "-o"), ("p99", "--s")):
        y = [row[f"{key}_{q}_s"] for row in rows]
        ax.plot(x, y, style, color=color, label=f"{name} {q}")
        for xi, yi, row in zip(x, y, rows, strict=True):
          ax.annotate(str(row["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("throughput (output tokens/s)")
    ax.set_ylabel(label)
    ax.set_title(f"{label} vs throughput (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _finite(value):
  """``value`` with every NaN or infinity turned into None (strict JSON has neither)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v) for v in value]
  return value


def machine() -> dict:
  cpu = platform.processor() or "unknown"
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


# ------------------------------------------------------------------------------------------------ the run


def hostile_schema(i: int) -> dict:
  """A schema whose compile runs past any short timeout: an integer bound near 2**70 (a different one each)."""
  return {"type": "integer", "minimum": 2**70 - 7 - i}


async def fairness(client, url: str, count: int) -> dict:
  """``count`` structured requests with :func:`hostile_schema`, then (0.1 s later) one with ``{"type": "boolean"}``:
  seconds to the boolean's whole answer, and each hostile request's status and seconds. A boolean schema alone first
  (another description, so neither is cached) gives the same answer's seconds on the same host without them."""

  async def ask(schema: dict) -> tuple[int, float, str]:
    body = {
      "prompt": "answer = ",
      "max_tokens": 4,
      "temperature": 0,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    began = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text[:200]
    return response.status_code, time.perf_counter() - began, text

  _, alone, _ = await ask({"type": "boolean", "description": "alone"})
  slow = [asyncio.create_task(ask(hostile_schema(i))) for i in range(count)]
  await asyncio.sleep(0.1)
  status, seconds, text = await ask({"type": "boolean"})
  pending = sum(not task.done() for task in slow)
  outcomes = await asyncio.gather(*slow)
  again = [await ask(hostile_schema(i)) for i in range(min(count, 2))]  # known to time out: from the cache
  out = {
    "hostile_count": count,
    "boolean_status": status,
    "boolean_s": seconds,
    "boolean_alone_s": alone,
    "boolean_text": text,
    "hostile_pending_when_answered": pending,
    "hostile": [{"status": c, "seconds": t} for c, t, _ in outcomes],
    "hostile_again_s": [t for _, t, _ in again],
  }
  print(
    f"  fairness: the boolean schema answered {status} in {seconds:.3f} s ({text!r}; alone {alone:.3f} s) with "
    f"{pending} of {count} hostile schemas still compiling; those answered {sorted({c for c, _, _ in outcomes})} in "
    f"{min(t for _, t, _ in outcomes):.1f}-{max(t for _, t, _ in outcomes):.1f} s, again in "
    f"{', '.join(f'{t:.3f}' for _, t, _ in again)} s",
    flush=True,
  )
  return out


async def bench_model(
  url: str, args, prompts: list[str], rng: np.random.Generator, baseline: str | None = None
) -> dict:
  """Warm-up, solo latency and every level against the server at ``url`` (and the concurrency-1 level against the
  ``baseline`` server too, in turn)."""
  import httpx

  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  timeout = httpx.Timeout(args.request_timeout, connect=60.0)
  async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
    card = (await client.get(f"{url}/v1/models")).json()["data"][0]
    extra = {} if card.get("objective") == "autoregressive" else args.extra
    for server_url in (url,) if baseline is None else (url, baseline):
      warm = await _request(client, server_url, _body(0, prompts, args, extra), Record(-1, 0.0), time.perf_counter())
      if warm.error:
        raise RuntimeError(f"the warm-up request failed: {warm.error}")
    solo = await _sequential(client, url, [_body(i, prompts, args, extra) for i in range(args.solo_requests)])
    failed = [r.error for r in solo if r.error]
    if failed:
      raise RuntimeError(f"a solo request failed: {failed[0]}")
    solo_latency = float(np.mean([r.latency for r in solo]))
    print(f"  {card['id']}: objective {card.get('objective')}, solo latency {1000 * solo_latency:.0f} ms", flush=True)
    fair = await fairness(client, url, args.fairness) if args.fairness else None
    levels, baseline_row = [], None
    for level in args.concurrency:
      count = max(args.requests_per_level, level)
      bodies = [_body(i, prompts, args, extra) for i in range(count)]
      before = await _counters(client, url)
      if level == 1 and baseline is not None:
        (records, base), rate, load = await _alternating(client, (url, baseline), bodies), None, "sequential"
        baseline_row = summarize(base, level, load, rate)
      elif level == 1:
        records, rate, load = await _sequential(client, url, bodies), None, "sequential"
      elif args.load == "closed":
        records, rate, load = await _closed_loop(client, url, bodies, level), None, "closed"
      else:
        rate, load = level / solo_latency, "poisson"
        records = await _open_loop(client, url, bodies, rate, rng)
      after = await _counters(client, url)
      row = summarize(records, level, load, rate)
      compiled = "mercury_compilations_total"
      row["compilations"] = after[compiled] - before[compiled] if compiled in before and compiled in after else None
      row |= _engine_split(before, after)
      row["records"] = [dataclasses.asdict(r) for r in records]
      levels.append(row)
      split = ""
      if row["host_share"] is not None:
        split = f", engine {row['step_ms']:.1f} ms/step with {100 * row['host_share']:.1f} % on the host"
      print(
        f"  concurrency {level}: {row['output_tokens_per_s']:.1f} out tok/s, "
        f"latency p50 {_ms(row['latency_p50_s'])} ms, achieved {row['achieved_concurrency']:.2f}, "
        f"{row['errors']} errors{split}",
        flush=True,
      )
  out = {"card": card, "extra": extra, "solo_latency_s": solo_latency, "levels": levels}
  if fair is not None:
    out["fairness"] = fair
  if baseline_row is not None:
    out["baseline_level"] = baseline_row
    ours = next(row for row in levels if row["concurrency"] == 1)
    ratio = ours["output_tokens_per_s"] / baseline_row["output_tokens_per_s"]
    print(f"  concurrency 1: {ratio:.2f}x the out tok/s of the --slots {args.baseline_slots} server", flush=True)
  return out


def _prompts(path: str | None) -> list[str]:
  if path is None:
    return list(PROMPTS)
  lines = [line.replace("\\n", "\n") for line in Path(path).read_text().splitlines() if line.strip()]
  if not lines:
    raise SystemExit(f"bench_serve: --prompts {path!r} has no prompts")
  return lines


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  names = [name for name, _ in args.model]
  if len(set(names)) != len(names):
    raise SystemExit(f"bench_serve: model names repeat: {names}")
  if args.requests_per_level < 1 or args.solo_requests < 1 or args.max_tokens < 1:
    raise SystemExit("bench_serve: --requests-per-level, --solo-requests and --max-tokens must be >= 1")
  prompts = _prompts(args.prompts)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = shlex.join(["python", *sys.argv] if argv is None else ["python", "launch/bench_serve.py", *argv])
  models: dict[str, dict] = {}
  failed = False
  for name, checkpoint in args.model:
    print(f"{name}: starting the server on {checkpoint}", flush=True)
    extra = tuple(shlex.split(args.server_args))
    server = Server(checkpoint, out / f"server-{name}.log", args.slots, args.max_queue, extra)
    base = None
    if args.baseline_slots:
      base = Server(checkpoint, out / f"server-{name}-baseline.log", args.baseline_slots, args.max_queue, extra)
    model: dict = {"checkpoint": checkpoint, "server_command": shlex.join(server.command)}
    try:
      url = server.wait(args.startup_timeout)
      base_url = None if base is None else base.wait(args.startup_timeout)
      print(f"  listening on {url}" + ("" if base is None else f" (--slots {args.baseline_slots}: {base_url})"))
      model["kv_cache"] = server.kv_cache
      if base is not None:
        model["baseline_kv_cache"] = base.kv_cache
      rng = np.random.default_rng(args.seed)
      model.update(asyncio.run(bench_model(url, args, prompts, rng, base_url)))
      if args.price:
        model["bare"] = price_levels(checkpoint, args.slots, model["levels"])
    except Exception as e:  # The model's failure is reported; the other models still run.
      model["error"] = f"{type(e).__name__}: {e}"
      print(f"  failed: {model['error']}", flush=True)
      failed = True
    if base is not None and base.stop() != 0:
      print(f"  the --slots {args.baseline_slots} server did not exit 0 after SIGTERM")
      failed = True
    code = server.stop()
    model["server_exit_code"] = code
    if code != 0:
      print(f"  the server's exit code after SIGTERM was {code}, not 0 (see {out / f'server-{name}.log'})")
      failed = True
    failed = failed or any(row["errors"] for row in model.get("levels", []))
    models[name] = model

  table = markdown_table(models)
  breakdown = breakdown_table(models)
  comparison = compare_to_twin(models)
  info = machine()
  notes = [
    "Concurrency 1 runs its requests strictly one after another; "
    + (
      "higher levels are LEVEL closed-loop clients (each sends its next request when its last one ended). "
      if args.load == "closed"
      else "higher levels are open-loop Poisson arrivals at rate = level / solo latency (offered concurrency = level). "
    )
    + "Times in ms; p99 of fewer than 100 requests interpolates between the largest ones.",
  ]
  for name, model in models.items():
    if "error" in model:
      notes.append(f"{name}: {model['error']}")
    elif model.get("server_exit_code") != 0:
      notes.append(f"{name}: the server exited with code {model.get('server_exit_code')} after SIGTERM")
    for row in model.get("levels", []):
      if row.get("compilations"):
        compiled = f"{row['compilations']:.0f} programs during level {row['concurrency']}"
        notes.append(f"{name}: the server compiled {compiled}")
  for name, model in models.items():
    if model.get("kv_cache"):
      notes.append(f"{name} (--slots {args.slots}): {model['kv_cache']}")
    if model.get("baseline_kv_cache"):
      notes.append(f"{name} (--slots {args.baseline_slots}): {model['baseline_kv_cache']}")
    row, base = next((r for r in model.get("levels", []) if r["concurrency"] == 1), None), model.get("baseline_level")
    if row and base:
      comparison.append(
        f"- {name}, concurrency 1, out tok/s: {row['output_tokens_per_s']:.1f} with --slots {args.slots}, "
        f"{base['output_tokens_per_s']:.1f} with --slots {args.baseline_slots} (interleaved): "
        f"{row['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x; TTFT p50 "
        f"{_ms(row['ttft_p50_s'])} / {_ms(base['ttft_p50_s'])} ms"
      )
  print()
  print(table)
  print()
  if breakdown:
    print(breakdown)
    print()
  for line in comparison + notes:
    print(line if line.startswith("- ") else f"- {line}")

  settings = {k: v for k, v in vars(args).items() if k != "model"}
  settings |= {"prompts": args.prompts or "built-in", "models": dict(args.model)}
  markdown = [
    "# Serving benchmark",
    "",
    f"Command: `{command}`",
    "",
    f"Machine: {info['cpu']}, {info['cores']} cores ({info['platform']}, Python {info['python']})",
    "",
    f"Settings: max_tokens {args.max_tokens}, temperature {args.temperature}, seed {args.seed}, slots {args.slots}, "
    f"extra (diffusion only) `{json.dumps(args.extra)}`",
    "",
    table,
    "",
    *([breakdown, ""] if breakdown else []),
    *comparison,
    *(f"- {note}" for note in notes),
    "",
  ]
  (out / "results.md").write_text("\n".join(markdown))
  results = {"command": command, "machine": info, "settings": settings, "models": models, "comparison": comparison}
  (out / "results.json").write_text(json.dumps(_finite(results), indent=1))
  written = [out / "results.md", out / "results.json"]
  if any(model.get("levels") for model in models.values()):
    try:
      plot(models, out / "latency_throughput.png")
      written.append(out / "latency_throughput.png")
    except ImportError:  # The measurements are written; only the figure needs the bench extra.
      print("no figure: matplotlib is not installed (pip install -e '.[bench]')")
  print(f"\nwrote {', '.join(map(str, written))}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
