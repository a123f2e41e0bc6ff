"""Structured output: the constrained engine's cost per step, and block diffusion vs its AR twin on one schema.

    python -m mercury_jax.bench structured --model diffusion=RUNS/bd --model twin=RUNS/ar [--rounds 3] [--out DIR]

Part 1, for each model: the time per step (one iteration of the engine's loop) of a constrained batch divided by
that of the same batch unconstrained: the same prefilled canvas, greedy, threshold rule, ``--iterations`` steps
timed from the same state, at batch 1 (each bench schema alone) and batch 16 (the suite's first 16 schemas
together). Rounds alternate constrained and free runs, so a drift in the machine's capacity hits both alike; each
figure is the median over rounds. Compilation is excluded. The forward passes each run needed in those steps are
printed too (a constrained block whose tokens are all forced needs fewer).

Part 2: the ``invoice`` schema through every model (the same engine, the same automaton): output tokens per second
at batch 1, forward passes per output, and the share of outputs that are complete and validate with ``jsonschema``.

The automata's sizes (states, classes, edges, bytes on the device) are printed too. Results go to
``DIR/results.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

from mercury_jax.bench.throughput import time_call, timed
from mercury_jax.constrain.suite import SCHEMAS
from mercury_jax.sampling import automata as constrained, canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.jobs import Budget
from mercury_jax.sampling.plan import Decoding
from mercury_jax.sampling.programs import without_knobs
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler

BENCH_SCHEMAS = ("invoice", "person", "tool_call", "nested_config")  # part 1 at batch 1
PROMPT = "record = "
LENGTH = 128


def _per_step(sampler: Sampler, names: list[str], rounds: int, iterations: int, block_length: int) -> dict:
  """Median over rounds of (time per loop iteration constrained) / (time per iteration free), and the forward passes
  each ran in its ``iterations`` iterations from the same prefilled canvas (greedy, threshold rule)."""
  automata = [sampler.constraint(json_schema=SCHEMAS[n]) for n in names]
  canvas = cv.make_canvas([cv.prefix(sampler.tokenizer.encode(PROMPT), LENGTH)] * len(names))
  settings = without_knobs(sampler.settings(rule="threshold", temperature=0.0))
  # A whole-sequence model's constrained decoding walks blocks.
  plan = sampler.plan(Decoding(block_length=block_length), canvas.tokens.shape[1], whole_canvas=False)
  canvas = cv.pad_length(canvas, plan.length)
  steps = jnp.asarray(sampler.steps_per_block(Budget(), canvas.kinds, plan.block, settings)[:, 0])
  engine = BlockEngine(sampler.network, settings, plan)
  capacity = constrained.capacity_of(automata)
  tables = jax.tree.map(jnp.asarray, constrained.tables(automata, capacity, sampler.cfg.model.vocab_size))
  knobs = Knobs.of(sampler.settings(temperature=0.0), len(names))
  runs = {}
  for label, t in (("constrained", tables), ("free", None)):
    init = jax.jit(lambda p, c, t: engine.init(p, c, jax.random.key(0), steps, knobs, tables=t))
    state = jax.block_until_ready(init(sampler.params, canvas, t))
    advance = jax.jit(lambda p, st: engine.advance(p, st, max_steps=jnp.int32(iterations)))
    after = jax.block_until_ready(advance(sampler.params, state))  # compiles
    runs[label] = (advance, state, int(after.iterations), int(after.forwards - state.forwards))
  ratios = []
  for _ in range(rounds):
    seconds = {
      label: time_call(advance, sampler.params, state) / done for label, (advance, state, done, _) in runs.items()
    }
    ratios.append(seconds["constrained"] / seconds["free"])
  return {
    "ratio": statistics.median(ratios),
    "ms_per_step_free": 1e3 * seconds["free"],
    "iterations": {k: v[2] for k, v in runs.items()},
    "forwards": {k: v[3] for k, v in runs.items()},
  }


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", action="append", required=True, help="NAME=CHECKPOINT (repeat)")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--iterations", type=int, default=32, help="loop iterations timed per run in part 1")
  p.add_argument("--samples", type=int, default=8, help="outputs per model in part 2")
  p.add_argument("--block-length", type=int, default=0, help="block of whole-sequence checkpoints (uncached)")
  p.add_argument("--out", help="folder for results.json")


def run_structured(args: argparse.Namespace) -> None:
  """Structured output: a constrained step's cost, and valid JSON per model.

  Part 1: time per engine step constrained / free, at batch 1 per bench schema and at batch 16; part 2: output
  tokens/s, forward passes and the share of valid outputs of every --model on one JSON schema.
  """
  import jsonschema

  models = {}
  for spec in args.model:
    name, _, path = spec.partition("=")
    models[name] = Sampler.from_checkpoint(path)
  results = {"sizes": {}, "per_step": {}, "invoice": {}}
  first = next(iter(models.values()))
  for name, schema in SCHEMAS.items():
    a, seconds = timed(first.constraint, json_schema=schema)
    results["sizes"][name] = {
      "states": a.num_states,
      "classes": a.num_classes,
      "edges": a.num_edges,
      "bytes": a.nbytes,
      "compile_ms": round(1e3 * seconds, 1),
    }
  print("| schema | states | classes | edges | bytes | compile ms |\n|---|---|---|---|---|---|")
  for name, r in results["sizes"].items():
    print(f"| {name} | {r['states']} | {r['classes']} | {r['edges']} | {r['bytes']:,} | {r['compile_ms']} |")

  for model, sampler in models.items():
    bench = [n for n in BENCH_SCHEMAS if n in SCHEMAS]
    row = {f"b1:{n}": _per_step(sampler, [n], args.rounds, args.iterations, args.block_length) for n in bench}
    row["b16"] = _per_step(sampler, list(SCHEMAS)[:16], args.rounds, args.iterations, args.block_length)
    results["per_step"][model] = row
    print(f"\n{model}: time per step (loop iteration), constrained / free, median of {args.rounds} rounds")
    for key, r in row.items():
      print(
        f"  {key}: {r['ratio']:.3f}  (free {r['ms_per_step_free']:.2f} ms/step; forwards in "
        f"{r['iterations']['free']} steps: constrained {r['forwards']['constrained']}, free {r['forwards']['free']})"
      )

  schema = SCHEMAS["invoice"]
  print("\n| model | output tokens/s (batch 1) | forward passes per output | tokens per forward | valid |")
  print("|---|---|---|---|---|")
  for model, sampler in models.items():
    kw = {"block_length": args.block_length} if args.block_length and not sampler.autoregressive else {}
    automaton = sampler.constraint(json_schema=schema)
    sampler.generate(PROMPT, length=LENGTH, constraint=automaton, temperature=1.0, seed=0, **kw)  # compile
    tokens = walls = forwards = valid = 0
    for i in range(args.samples):
      samples, seconds = timed(
        sampler.generate, PROMPT, length=LENGTH, constraint=automaton, temperature=1.0, seed=i, **kw
      )
      sample, walls = samples[0], walls + seconds
      tokens, forwards = tokens + len(sample.tokens), forwards + sample.nfe
      try:
        jsonschema.validate(json.loads(sample.text), schema)
        valid += bool(sample.complete)
      except (ValueError, jsonschema.ValidationError):
        pass
    r = {
      "tokens_per_s": tokens / walls,
      "forwards_per_output": forwards / args.samples,
      "tokens_per_forward": tokens / forwards,
      "valid": valid / args.samples,
    }
    results["invoice"][model] = r
    print(
      f"| {model} | {r['tokens_per_s']:.0f} | {r['forwards_per_output']:.1f} | {r['tokens_per_forward']:.2f} | "
      f"{100 * r['valid']:.0f} % |"
    )
  if args.out:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "results.json").write_text(json.dumps(results, indent=2))


COMMANDS = {"structured": (add_arguments, run_structured)}
