"""Serving benchmark: latency against throughput of ``python -m mercury_jax.serve`` under open-loop load.

    python -m mercury_jax.bench serve --model diffusion=runs/bd --model twin=runs/ar \\
      [--concurrency 1,4,16,64] [--requests-per-level 64] [--max-tokens 64] [--slots 64] \\
      [--extra '{"steps_per_block": 2, "threshold": 0.9}'] [--temperature 1.0] [--seed 0] [--prompts FILE] \\
      [--price] [--fairness 8] [--out bench_serve]

Needs ``httpx`` and ``matplotlib`` besides the server's own packages. For each ``--model NAME=CHECKPOINT`` the command
starts a server (``sys.executable -m mercury_jax.serve --port 0``; its log goes to ``OUT/server-NAME.log``), waits for
its ``serving`` line, sends one warm-up request, then ``--solo-requests`` requests one after another whose mean
latency is the model's *solo latency*. Then, for each concurrency level C, it sends
``max(--requests-per-level, C)`` streamed ``/v1/completions`` requests (prompts taken in turn from ``--prompts``, one
per line with ``\\n`` escapes, or a built-in list of short Python prompts, ``prompts.CODE_PROMPTS``):

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
command times every batch bucket's step and every prefill bucket's prefill bare in its own process while the server
idles (:func:`mercury_jax.bench.slot_step.bare_costs`: the server's default engine, no HTTP), prices each level's
steps and prefills (``mercury_engine_steps_total{rows}``, ``mercury_prefills_total{slots}``) at those times, and gives
the engine's time per step over that bare work. It assumes the server's default engine flags (``--server-args`` that
change its programs, such as ``--no-batch-invariance``, are not priced right). Without ``--price`` the same ratio is
given *in place*: the server times one iteration in 32 with its prefills and step alone on the device
(``mercury_engine_timed_*``), under the level's own load, which on a CPU host includes the event loop, the client and
any other process on the cores; engine / in place is then the engine thread's overhead over the device's work.

``--fairness N``: before the levels, N requests whose JSON Schemas run past the compile timeout (a ``oneOf`` of 800
object branches, a different one each) and, 0.1 s later, one whose schema is ``{"type": "boolean"}``: the seconds to
the boolean's whole answer (its compile, prefill and tokens), how many of the N were still compiling then, and
the N refusals' times (again, two of them: from the cache of refusals).

Sampling: ``--temperature`` defaults to 1.0, the model's own distribution, as a sampling client would use it (greedy
decoding makes small models loop on one phrase, text unlike what they serve); each request has seed ``--seed`` plus
its index, so a run repeats. ``--extra`` fields go to diffusion models only; a model whose ``/v1/models`` card says
``objective: autoregressive`` gets none (it would answer 400). When a model is called ``twin`` (an autoregressive
twin of the others), the summary also gives each other model's per-request speed over the twin's at the lowest level
run, and the lowest level at which the twin's out tok/s reaches or passes that model's at the same level.

Writes ``OUT/results.json`` (every request's record), ``OUT/results.md`` (the table, the command line and the
machine) and ``OUT/latency_throughput.png``. Each server is stopped with SIGTERM and must exit 0; the command exits 1
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
import functools
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from mercury_jax import usage
from mercury_jax.bench import engine_split as split, serving
from mercury_jax.bench.prompts import CODE_PROMPTS
from mercury_jax.bench.report import finite
from mercury_jax.bench.throughput import host_info

_fail = functools.partial(usage.fail, "mercury_jax.bench serve")


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


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    "process, the server idle) and price each level's engine work with them (see the slot-step command)",
  )
  p.add_argument(
    "--fairness",
    type=int,
    default=0,
    metavar="N",
    help="before the levels, send N structured requests whose schemas run past the compile timeout (each a oneOf "
    "of 800 object branches), then a {'type': 'boolean'} one, and time the boolean's answer (0: skip)",
  )
  p.add_argument("--out", default="bench_serve", help="folder for results.json, results.md and the plot")


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


# ------------------------------------------------------------------------------------------------ the run


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
      warm = await serving.request(
        client,
        server_url,
        serving.request_body(0, prompts, args, extra),
        serving.Record(-1, 0.0),
        time.perf_counter(),
      )
      if warm.error:
        raise RuntimeError(f"the warm-up request failed: {warm.error}")
    solo = await serving.sequential(
      client, url, [serving.request_body(i, prompts, args, extra) for i in range(args.solo_requests)]
    )
    failed = [r.error for r in solo if r.error]
    if failed:
      raise RuntimeError(f"a solo request failed: {failed[0]}")
    solo_latency = float(np.mean([r.latency for r in solo]))
    print(f"  {card['id']}: objective {card.get('objective')}, solo latency {1000 * solo_latency:.0f} ms", flush=True)
    fair = await split.fairness(client, url, args.fairness) if args.fairness else None
    levels, baseline_row = [], None
    for level in args.concurrency:
      count = max(args.requests_per_level, level)
      bodies = [serving.request_body(i, prompts, args, extra) for i in range(count)]
      before = await split.counters(client, url)
      if level == 1 and baseline is not None:
        (records, base), rate, load = await serving.alternating(client, (url, baseline), bodies), None, "sequential"
        baseline_row = serving.summarize(base, level, load, rate)
      elif level == 1:
        records, rate, load = await serving.sequential(client, url, bodies), None, "sequential"
      elif args.load == "closed":
        records, rate, load = await serving.closed_loop(client, url, bodies, level), None, "closed"
      else:
        rate, load = level / solo_latency, "poisson"
        records = await serving.open_loop(client, url, bodies, rate, rng)
      after = await split.counters(client, url)
      row = serving.summarize(records, level, load, rate)
      compiled = "mercury_compilations_total"
      row["compilations"] = after[compiled] - before[compiled] if compiled in before and compiled in after else None
      row |= split.engine_split(before, after)
      row["records"] = [dataclasses.asdict(r) for r in records]
      levels.append(row)
      share = ""
      if row["host_share"] is not None:
        share = f", engine {row['step_ms']:.1f} ms/step with {100 * row['host_share']:.1f} % on the host"
      print(
        f"  concurrency {level}: {row['output_tokens_per_s']:.1f} out tok/s, "
        f"latency p50 {serving.ms(row['latency_p50_s'])} ms, achieved {row['achieved_concurrency']:.2f}, "
        f"{row['errors']} errors{share}",
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
    return list(CODE_PROMPTS)
  lines = [line.replace("\\n", "\n") for line in Path(path).read_text().splitlines() if line.strip()]
  if not lines:
    _fail(f"--prompts {path!r} has no prompts")
  return lines


def run_serve(args: argparse.Namespace) -> int:
  """A server under load: latency against throughput at each concurrency.

  Starts a server per ``--model NAME=CHECKPOINT``, measures its solo latency, then each ``--concurrency`` level
  (open-loop Poisson arrivals, or ``--load closed``); writes OUT/results.json, results.md and the plot, and exits 1
  when a server failed or a level had errors.
  """
  names = [name for name, _ in args.model]
  if len(set(names)) != len(names):
    _fail(f"model names repeat: {names}")
  if args.requests_per_level < 1 or args.solo_requests < 1 or args.max_tokens < 1:
    _fail("--requests-per-level, --solo-requests and --max-tokens must be >= 1")
  prompts = _prompts(args.prompts)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = shlex.join(["python", "-m", "mercury_jax.bench", *sys.argv[1:]])
  models: dict[str, dict] = {}
  failed = False
  for name, checkpoint in args.model:
    print(f"{name}: starting the server on {checkpoint}", flush=True)
    extra = tuple(shlex.split(args.server_args))
    server = serving.Server(checkpoint, out / f"server-{name}.log", args.slots, args.max_queue, extra)
    base = None
    if args.baseline_slots:
      base = serving.Server(checkpoint, out / f"server-{name}-baseline.log", args.baseline_slots, args.max_queue, extra)
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
        model["bare"] = split.price_levels(checkpoint, args.slots, model["levels"])
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

  table = serving.markdown_table(models)
  breakdown = split.breakdown_table(models)
  comparison = compare_to_twin(models)
  info = host_info()
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
        f"{serving.ms(row['ttft_p50_s'])} / {serving.ms(base['ttft_p50_s'])} ms"
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
    f"Machine: {info['cpu']}, {info['cpu_count']} cores ({info['platform']}, Python {info['python']})",
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
  (out / "results.json").write_text(json.dumps(finite(results), indent=1))
  written = [out / "results.md", out / "results.json"]
  if any(model.get("levels") for model in models.values()):
    try:
      serving.plot(models, out / "latency_throughput.png")
      written.append(out / "latency_throughput.png")
    except ImportError:  # The measurements are written; only the figure needs the bench extra.
      print("no figure: matplotlib is not installed (pip install -e '.[bench]')")


COMMANDS = {"serve": (add_arguments, run_serve)}
