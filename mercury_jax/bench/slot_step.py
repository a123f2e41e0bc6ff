"""The serving engine's step per batch bucket: batched against batch-invariant, interleaved in one run; and the bare
cost of a prefill per prefill bucket.

    python -m mercury_jax.bench slot-step --model mercury_jax/assets/default_bd [--tiles 0,8,32] [--prefills]

Every row of ``--slots`` holds a request (a 40-token prompt, 200 tokens to generate); each timed call is one
``SlotEngine`` step over the first ``n`` rows for every batch bucket ``n`` (the engine's ``step`` program, as the
server runs it), so nothing but the network and the engine's step is timed (no HTTP, no client on the same cores:
``python -m mercury_jax.bench serve`` measures those). The engines run in turn within each round (a CPU host's speed
drifts for minutes at a time), and a cell is the fastest of ``--repeats`` steps, then the median over rounds.
``--tiles``: the batch-invariant engines' ``invariant_tile`` (0: the plan's default). Prints a markdown table of ms
per step.

``--prefills`` also times, on the server's engine (the first of ``--tiles``), one admission per prefill bucket: a
prompt that fills the bucket, prefilled and inserted into a row alone, from the command to its state computed (the
host's preparation of its arrays included). :func:`bare_costs` gives both, for ``python -m mercury_jax.bench serve
--price``, which prices a server's device work from the steps and prefills its ``/metrics`` counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from mercury_jax.bench.throughput import timed
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.text import Row
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.slots import SlotEngine

SERVER_PREFILL_CHUNK = 512  # python -m mercury_jax.serve's default --prefill-chunk: its prefill buckets.


def _engine(sampler: Sampler, slots: int, tile: int | None, structured: bool = True) -> SlotEngine:
  """A warm engine with every row busy, as the server builds it (``tile`` None: batched); ``structured``: with the
  server's default constraint capacity (no request here is constrained), else with none."""
  kwargs = {"batch_invariant": False} if tile is None else {"invariant_tile": tile}
  if not structured:
    kwargs["capacity"] = None
  engine = SlotEngine(sampler, ServeConfig(slots=slots, prefill_chunk=SERVER_PREFILL_CHUNK, **kwargs))
  engine.warm_up()
  command, rng = engine.admission.command(), np.random.default_rng(0)
  for slot in range(slots):
    engine.admission.admit(command, slot, Row.completion(tuple(int(x) for x in rng.integers(5, 400, 40)), 200))
  engine.run(command)
  return engine


def _step_ms(engine: SlotEngine, rows: int, repeats: int) -> float:
  """The fastest of ``repeats`` steps of the engine's ``step`` program over its first ``rows`` rows, in ms."""
  live, params, best = np.arange(rows, dtype=np.int32), engine.sampler.params, float("inf")
  step = engine.sampler.programs.step(engine.engine)  # the program the engine's ``run`` calls (compiled and cached)
  for _ in range(repeats):
    (engine.state, _), seconds = timed(step, params, engine.state, live)
    best = min(best, seconds)
  return 1e3 * best


def _prefill_ms(engine: SlotEngine, size: int, repeats: int) -> float:
  """The fastest of ``repeats`` admissions into row 0 of a prompt that fills the prefill bucket of ``size`` slots
  (row 0 released before each)."""
  request, best = Row.completion(tuple(range(5, 5 + max(1, size - 2 * engine.block))), 1), float("inf")
  assert engine.admission.buckets[engine.admission.bucket(request)] == size, (size, engine.admission.buckets)
  for _ in range(repeats):
    release = engine.admission.command()
    engine.admission.give_back(release, 0)
    engine.run(release)
    jax.block_until_ready(engine.state)
    command = engine.admission.command()
    engine.admission.admit(command, 0, request)
    began = time.perf_counter()
    engine.run(command)
    jax.block_until_ready(engine.state)
    best = min(best, time.perf_counter() - began)
  return 1e3 * best


def bare_costs(
  sampler: Sampler, slots: int, *, rounds: int = 4, repeats: int = 3, tile: int = 0
) -> tuple[dict[int, float], dict[int, float]]:
  """``({rows: ms per step}, {slots: ms per prefill})`` for every batch bucket and prefill bucket of a server with
  ``slots`` slots (its default flags: batch-invariant, structured output's tables, prefill chunks of
  :data:`SERVER_PREFILL_CHUNK`): the median of ``rounds`` x ``repeats`` single timings (not the fastest: a price to
  compare with a server's mean times on a host whose load comes and goes)."""
  engine = _engine(sampler, slots, tile)
  steps = {n: [] for n in engine.row_buckets}
  prefills = {size: [] for size in engine.admission.buckets}
  for _ in range(rounds):
    for _ in range(repeats):
      for n in steps:
        steps[n].append(_step_ms(engine, n, 1))
      for size in prefills:
        prefills[size].append(_prefill_ms(engine, size, 1))
  return {n: statistics.median(v) for n, v in steps.items()}, {s: statistics.median(v) for s, v in prefills.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", required=True, help="a checkpoint directory (the bundled ones: mercury_jax/assets/...)")
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--tiles", default="0", help="comma-separated invariant_tile values (0: the plan's default)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=4)
  p.add_argument(
    "--no-structured", action="store_true", help="engines without structured output's tables (the server has them)"
  )
  p.add_argument("--prefills", action="store_true", help="also time one prefill per prefill bucket (the server's)")


def run_slot_step(args: argparse.Namespace) -> None:
  """The serving engine's step per batch bucket, batched and batch-invariant.

  One ``SlotEngine`` step over the first n rows of --slots busy rows, for every batch bucket n and every engine
  (batched, and batch-invariant at each of --tiles), interleaved; prints a markdown table.
  """
  sampler = Sampler.from_checkpoint(args.model)
  names = {"batched": None, **{f"invariant, tile {int(t) or 'auto'}": int(t) for t in args.tiles.split(",")}}
  engines = {name: _engine(sampler, args.slots, tile, not args.no_structured) for name, tile in names.items()}
  buckets = engines["batched"].row_buckets
  times = {name: {n: [] for n in buckets} for name in engines}
  for _ in range(args.rounds):
    for n in buckets:
      for name, engine in engines.items():
        times[name][n].append(_step_ms(engine, n, args.repeats))
  tiles = {name: engine.invariant_tile or "-" for name, engine in engines.items()}
  print(f"{args.model}: ms per step by batch bucket (rows), median of {args.rounds} rounds of best-of-{args.repeats}")
  print("| engine | tile | " + " | ".join(str(n) for n in buckets) + " |")
  print("|---|---|" + "---|" * len(buckets))
  for name in engines:
    cells = " | ".join(f"{statistics.median(times[name][n]):.2f}" for n in buckets)
    print(f"| {name} | {tiles[name]} | {cells} |")
  if args.prefills:
    engine = engines[next(name for name in engines if name != "batched")]
    sizes = {size: [] for size in engine.admission.buckets}
    for _ in range(args.rounds):
      for size in sizes:
        sizes[size].append(_prefill_ms(engine, size, args.repeats))
    print(f"\nms per prefill by prefill bucket (slots), {next(n for n in engines if n != 'batched')}")
    print("| " + " | ".join(str(size) for size in sizes) + " |")
    print("|" + "---|" * len(sizes))
    print("| " + " | ".join(f"{statistics.median(v):.2f}" for v in sizes.values()) + " |")


COMMANDS = {"slot-step": (add_arguments, run_slot_step)}
