"""The serving benchmark's parts: a ``python -m mercury_jax.serve`` subprocess, the client that loads it, the table.

:class:`Server` starts a server and waits for its ``serving`` line; :func:`request` sends one streamed
``/v1/completions`` request and records what the client saw (:class:`Record`); :func:`sequential`,
:func:`alternating`, :func:`open_loop` and :func:`closed_loop` are the loads of ``python -m mercury_jax.bench serve``;
:func:`summarize` is a level's row of its table (the definitions are in :mod:`mercury_jax.bench.serve`),
:func:`markdown_table` and :func:`plot` show the rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

SERVING = re.compile(r"^serving (\S+) on (http://\S+)")

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


async def request(client, url: str, body: dict, record: Record, origin: float) -> Record:
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


def request_body(index: int, prompts: list[str], args, extra: dict) -> dict:
  """Request ``index``'s JSON body: the prompts taken in turn, seed ``--seed`` + ``index``, streamed with usage."""
  return {
    "prompt": prompts[index % len(prompts)],
    "max_tokens": args.max_tokens,
    "temperature": args.temperature,
    "seed": args.seed + index,
    "stream": True,
    "stream_options": {"include_usage": True},
    **extra,
  }


async def sequential(client, url: str, bodies: list[dict]) -> list[Record]:
  origin = time.perf_counter()
  records = []
  for i, body in enumerate(bodies):
    records.append(await request(client, url, body, Record(i, time.perf_counter() - origin), origin))
  return records


async def alternating(client, urls: tuple[str, str], bodies: list[dict]) -> tuple[list[Record], list[Record]]:
  """Each body sent to both servers, one request at a time, in turn: the sequential level of each."""
  origin = time.perf_counter()
  records: tuple[list[Record], list[Record]] = ([], [])
  for i, body in enumerate(bodies):
    for url, out in zip(urls, records, strict=True):
      out.append(await request(client, url, body, Record(i, time.perf_counter() - origin), origin))
  return records


async def open_loop(client, url: str, bodies: list[dict], rate: float, rng: np.random.Generator) -> list[Record]:
  """Sends ``bodies`` at the arrivals of a Poisson process of ``rate`` per second (the first at once)."""
  arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, len(bodies) - 1))])
  origin = time.perf_counter()
  tasks = []
  for i, (body, arrival) in enumerate(zip(bodies, arrivals, strict=True)):
    delay = origin + arrival - time.perf_counter()
    if delay > 0:
      await asyncio.sleep(delay)
    tasks.append(asyncio.create_task(request(client, url, body, Record(i, float(arrival)), origin)))
  return list(await asyncio.gather(*tasks))


async def closed_loop(client, url: str, bodies: list[dict], clients: int) -> list[Record]:
  """``clients`` clients share ``bodies``; each sends its next one as soon as its previous one ended."""
  origin, pending, records = time.perf_counter(), list(enumerate(bodies)), []

  async def client_loop():
    while pending:
      i, body = pending.pop(0)
      records.append(await request(client, url, body, Record(i, time.perf_counter() - origin), origin))

  await asyncio.gather(*(client_loop() for _ in range(clients)))
  return sorted(records, key=lambda r: r.index)


COUNTERS = (
  "mercury_compilations_total",
  "mercury_engine_iterations_total",
  "mercury_engine_seconds_total",
  "mercury_engine_host_seconds_total",
)


# ------------------------------------------------------------------------------------------------ statistics


def percentile(values, q: float) -> float:
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
    "per_request_tokens_per_s_p50": percentile([r.completion_tokens / r.latency for r in ok if r.latency > 0], 50),
    "ttft_p50_s": percentile([r.ttft for r in ok], 50),
    "ttft_p99_s": percentile([r.ttft for r in ok], 99),
    "inter_block_p50_s": percentile([g for r in ok for g in r.gaps], 50),
    "inter_block_p99_s": percentile([g for r in ok for g in r.gaps], 99),
    "latency_p50_s": percentile([r.latency for r in ok], 50),
    "latency_p99_s": percentile([r.latency for r in ok], 99),
    "tokens_per_forward": tokens / nfe if nfe else math.nan,
    "max_send_lag_s": max(r.sent - r.scheduled for r in records),
  }


def ms(seconds: float) -> str:
  if math.isnan(seconds):
    return "-"
  return f"{1000 * seconds:.1f}" if seconds < 0.01 else f"{1000 * seconds:.0f}"


def num(value: float, digits: int = 1) -> str:
  return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


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
        f"| {num(row['achieved_concurrency'], 2)} | {num(row['output_tokens_per_s'])} "
        f"| {num(row['per_request_tokens_per_s_p50'])} | {ms(row['ttft_p50_s'])} / {ms(row['ttft_p99_s'])} "
        f"| {ms(row['inter_block_p50_s'])} / {ms(row['inter_block_p99_s'])} "
        f"| {ms(row['latency_p50_s'])} / {ms(row['latency_p99_s'])} | {num(row['tokens_per_forward'], 2)} "
        f"| {num(row.get('step_ms'))} | {num(None if host is None else 100 * host)} |"
      )
  return "\n".join(lines)


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
