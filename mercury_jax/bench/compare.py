"""``python -m mercury_jax.bench compare``: speed against quality, diffusion or verified decoding against the twin.

Examples::

  python -m mercury_jax.bench compare --diffusion runs/default --autoregressive runs/default_ar --data data/stdlib
  python -m mercury_jax.bench compare --diffusion runs/tiny --autoregressive runs/tiny_ar --data data/stdlib --smoke

On one machine, in one run: the diffusion model, at each of its temperatures (``--temperatures``, default 1), with
the confidence rule at each step budget and with the threshold rule at each tau (step budget = the generation
length), and its autoregressive twin with key-value-cache decoding (temperature 1, and greedy), all on the same
prompts (documented functions from the validation split, see ``mercury_jax.bench.prompts``), at batch 1 and 16
(``--batch-sizes``). Every example draws from its own stream (its prompt index) with one seed, so every batch size
sees the same samples.

Each prompt generates ``min(length, context - prompt)`` tokens: the canvas never exceeds the shorter of the two
models' contexts, and prompts that would leave fewer than ``min(length, context / 2)`` positions are skipped rather
than cut (a cut prompt loses its ``def`` line). Canvases are padded to a multiple of ``LENGTH_BUCKET`` positions
(within the context), as the sampling command line runs them.

Both models run through the engine the command line and the Python API use: one
:class:`~mercury_jax.sampling.sampler.Sampler` per model, whose ``run`` compiles once per (settings, shape). Every
setting samples the whole tempered distribution (no top-p or top-k from a checkpoint's defaults).

Converted public checkpoints (``python -m mercury_jax.convert``: a diffusion model and, with ``--family
autoregressive``, its parent) carry their own tokenizer: leave ``--data`` out and name the prompts' corpus::

  python -m mercury_jax.bench compare --diffusion models/fast-dllm-v2 --autoregressive models/qwen2.5 \\
    --corpus python-stdlib

The two tokenizers must be one (``mercury_jax.bench.models``); each model keeps its own mask, EOS and padding ids.

Timing: a shared host's capacity can change 2x for minutes at a time, so absolute numbers from different runs do
not compare. Each executable is compiled (timed separately) and run once untimed; then every round runs each setting
once on the same prompt batch, in an order rotated from round to round, and times one matmul as a load probe.
Speed-ups are medians of per-round ratios, so a change in capacity between rounds cancels.

OUT_DIR receives ``results.json`` (every row, the machine, the load probe), ``results.md`` and two PNG plots
(matplotlib, from the ``bench`` extra; skipped with a note without it). Bad input gets one line on stderr and exit
code 2.

Without a subcommand, ``python -m mercury_jax.bench [FLAGS]`` runs this one (the command line before the bench had
subcommands).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from mercury_jax import files, usage
from mercury_jax.bench import prompts as bench_prompts, quality, report as bench_report, verified as bench_verified
from mercury_jax.bench.models import load_models
from mercury_jax.bench.overhead import engine_overhead
from mercury_jax.bench.rounds import (
  Runner,
  cache_speedups,
  completions,
  grid,
  make_batches,
  measure,
  measure_units,
  summarise,
)
from mercury_jax.bench.throughput import machine_info
from mercury_jax.data.hf_files import SPECIAL_TOKENS_FILE, TOKENIZER_JSON
from mercury_jax.progress import Progress
from mercury_jax.sampling.plan import Decoding
from mercury_jax.sampling.registry import default_checkpoint
from mercury_jax.sampling.sampler import Sampler

STEPS = (4, 8, 16, 32, 64, 128, 256)
TAUS = (0.5, 0.7, 0.9, 0.95)
AR_TEMPERATURES = (1.0, 0.0)
_fail = functools.partial(usage.fail, "mercury_jax.bench compare")  # usage errors: one line, exit code 2


def sample_quality(prompt_ids, prompt_texts, completion_ids, ar: Sampler) -> dict[str, Any]:
  """Quality of one setting's completions, judged by the twin; generative perplexity is NaN when every completion is
  empty."""
  texts = [ar.tokenizer.decode(c) for c in completion_ids]
  scored = any(completion_ids)
  return {
    "gen_ppl": quality.generative_perplexity(ar.params, ar.cfg, prompt_ids, completion_ids) if scored else float("nan"),
    "unigram_entropy": quality.unigram_entropy(completion_ids),
    "distinct_2": quality.distinct_n(completion_ids, 2),
    "distinct_3": quality.distinct_n(completion_ids, 3),
    "parse_rate": quality.parse_rate(prompt_texts, texts),
    "mean_tokens": float(np.mean([len(c) for c in completion_ids])),
    "example": texts[0][:400],
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Runs the benchmark described by parsed CLI arguments and writes OUT_DIR; returns the results."""
  machine = machine_info()
  tokenizer, samplers = load_models(args.diffusion, args.autoregressive, args.data, args.verified)
  ar = samplers["autoregressive"]
  context = min(s.max_length for s in samplers.values())
  room = min(args.length, context // 2)
  prompts, spec = bench_prompts.select_prompts(
    args.data, args.prompts, lambda text: len(tokenizer.encode(text)) <= context - room, args.corpus
  )
  prompt_ids = [tokenizer.encode(p.text) for p in prompts]
  temperatures = args.temperatures if "diffusion" in samplers else ()
  drafts = args.draft_lengths if "verified" in samplers else None
  continuous = "diffusion" in samplers and samplers["diffusion"].cfg.objective.continuous
  settings = grid(
    args.length,
    args.steps,
    args.taus,
    temperatures,
    args.ar_temperatures,
    caches=args.caches,
    drafts=drafts,
    continuous=continuous,
    levers=args.levers,
  )
  for cache in args.caches:  # Reject a cache the diffusion model does not have before anything is timed.
    samplers["diffusion"].plan(Decoding(cache))
  if "verified" in samplers:  # A draft length the model cannot take, before anything is timed.
    for draft in args.draft_lengths:
      samplers["verified"].plan(Decoding(decode="verified", draft_length=draft))
  batches = {b: make_batches(prompt_ids, args.length, context, b, tokenizer.pad_id) for b in args.batch_sizes}
  runner = Runner(samplers, args.seed)
  units = measure_units(settings, batches, args.repeats)
  with Progress(units, "mercury_jax.bench compare", "calls") as progress:  # Compilations count as calls.
    calls, gflops = measure(runner, settings, batches, len(prompts), args.repeats, progress)
  kinds = np.concatenate([np.asarray(c.kinds) for c in batches[args.batch_sizes[0]]])[: len(prompts)]
  reference = settings.index(next(s for s in settings if s.model == "autoregressive" and s.temperature == 1.0))
  twin_at = {s.temperature: i for i, s in enumerate(settings) if s.model == "autoregressive"}
  rows, quality_cache, first_samples = [], {}, {}
  verified_rows = []
  for batch in args.batch_sizes:
    for i, setting in enumerate(settings):
      own = samplers[setting.model].tokenizer  # Its own EOS and padding (one text vocabulary for all models).
      done = completions(calls[(i, batch)], kinds, own.eos_id, own.pad_id)
      cache_key = json.dumps(done)
      if cache_key not in quality_cache:
        quality_cache[cache_key] = sample_quality(prompt_ids, [p.text for p in prompts], done, ar)
      executable = runner.executable(setting, batches[batch][0])
      ref = twin_at.get(setting.temperature, reference) if setting.model == "verified" else reference
      row = summarise(setting, batch, calls[(i, batch)], calls[(ref, batch)], runner.compile_s[executable])
      first_samples.setdefault(i, done)
      rows.append({**row, **quality_cache[cache_key], "same_samples_as_first_batch": done == first_samples[i]})
      if setting.model == "verified":
        verified_rows.append({**row, **bench_verified.acceptance(calls[(i, batch)])})
  cache_speedups(rows, settings, calls, args.batch_sizes)
  overhead = None
  first = next((s for s in settings if s.model == "diffusion" and s.cache == "auto"), None)
  if first is not None:
    overhead = {
      "setting": first.name,
      **engine_overhead(samplers["diffusion"], batches[min(args.batch_sizes)][0], first.steps, runner.settings(first)),
    }
  verified = None
  if verified_rows:
    twin = next(s for s in settings if s.model == "autoregressive")
    by_lever = {s.lever: s for s in settings if s.model == "verified"}  # one cost per lever (T does not change it)
    memo: dict = {}  # the twin's and the chunks' figures, once per batch
    cost = lambda b, s: bench_verified.costs(  # noqa: E731
      samplers["verified"], ar, batches[b][0], runner.settings(s), runner.settings(twin), memo
    )
    costs = [{"lever": lever, **cost(b, s)} for b in args.batch_sizes for lever, s in by_lever.items()]
    verified = {"rows": verified_rows, "costs": costs}
  tol = bench_report.Tolerances(args.ppl_tolerance, args.entropy_tolerance, args.parse_tolerance)
  result = {
    "machine": machine,
    "args": {k: v for k, v in vars(args).items() if k != "func"},
    "canvas": {
      "prompts": len(prompts),
      "prompt_source": f"documented functions of the validation split of {spec!r}",
      "tokenizer": f"the sentencepiece one of --data {args.data!r}" if args.data else "the checkpoints' own",
      "length": args.length,
      "canvas_length": int(batches[args.batch_sizes[0]][0].tokens.shape[1]),
      "rule": f"each prompt generates min({args.length}, {context} - prompt) tokens; prompts over "
      f"{context - room} tokens skipped",
      "seed": args.seed,
      "repeats": args.repeats,
    },
    "prompts": [{"key": p.key, "line": p.line, "tokens": len(ids)} for p, ids in zip(prompts, prompt_ids, strict=True)],
    "load": {
      "matmul_gflops_median": float(np.median(gflops)),
      "matmul_gflops_min": float(np.min(gflops)),
      "matmul_gflops_max": float(np.max(gflops)),
      "per_round": gflops,
    },
    "matched_quality": tol.describe(),
    "rows": rows,
    "overhead": overhead,
    "verified": verified,
  }
  result["headline"] = bench_report.headlines(rows, tol)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  text = bench_report.markdown(result)
  if verified:
    text += "\n".join(bench_verified.markdown(verified)) + "\n"
  (out / "results.json").write_text(json.dumps(bench_report.finite(result), indent=2) + "\n")
  (out / "results.md").write_text(text)
  result["plots"] = bench_report.plots(rows, out)
  if verified and isinstance(result["plots"], list):
    result["plots"].append(bench_verified.plot(verified, out))
  result["markdown"] = text
  return result


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(",") if v)


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--diffusion", help="the diffusion model: train workdir or exported checkpoint (default: the bundled default)"
  )
  p.add_argument(
    "--autoregressive", help="the autoregressive twin, same tokenizer and data (default: the bundled default_ar)"
  )
  p.add_argument(
    "--verified",
    help="a verified checkpoint (objective.name = 'verified'), same tokenizer: its verified-decoding rows at each "
    "--draft-lengths and each of the twin's temperatures, against the twin",
  )
  p.add_argument(
    "--draft-lengths", type=_ints, default=(0,), help="verified draft lengths, comma-separated (0: the trained one)"
  )
  p.add_argument(
    "--levers",
    type=lambda text: tuple(v for v in text.split(",") if v),
    default=("auto",),
    help="verified decoding's levers, each alone or together, comma-separated: "
    + ", ".join(bench_verified.LEVERS)
    + " (default auto: the device's draft tree, lookups and pre-draft blocks)",
  )
  p.add_argument("--no-diffusion", action="store_true", help="leave the diffusion model's rows out")
  p.add_argument(
    "--data",
    help="the prepared data directory both were trained on (default: the --diffusion checkpoint's folder when it "
    "carries the corpus's metadata.json, as the bundled models do: prompts then come from that corpus as installed "
    "here); leave it out for converted checkpoints, which carry their own tokenizer, and give --corpus",
  )
  p.add_argument("--out", default="runs/bench", help="where results.json, results.md and the plots go")
  p.add_argument(
    "--corpus",
    help="read the prompts' corpus from here instead of the one named in DATA/metadata.json (a corpus spec: "
    "python-stdlib, a glob, ...); without --data, the checkpoints' own tokenizer encodes them",
  )
  p.add_argument("--smoke", action="store_true", help="a tiny grid for tests and CI (overrides the grid flags)")
  p.add_argument("--prompts", type=int, default=64, help="how many prompts")
  p.add_argument("--length", type=int, default=256, help="tokens to generate per prompt (cut to the context)")
  p.add_argument(
    "--steps",
    type=_ints,
    default=STEPS,
    help="confidence-rule (a continuous checkpoint: ODE) step budgets, comma-separated",
  )
  p.add_argument("--taus", type=_floats, default=TAUS, help="threshold-rule taus, comma-separated")
  p.add_argument(
    "--temperatures", type=_floats, default=(1.0,), help="the diffusion sampler's temperatures, comma-separated"
  )
  p.add_argument("--ar-temperatures", type=_floats, default=AR_TEMPERATURES, help="the twin's (1 = reference)")
  p.add_argument("--batch-sizes", type=_ints, default=(1, 16), help="comma-separated")
  p.add_argument(
    "--caches",
    type=lambda text: tuple(v for v in text.split(",") if v),
    default=(),
    help="also run every diffusion setting (first temperature) with these caches, e.g. 'none' for the uncached "
    "reference of a block-diffusion model or 'dual,prefix' (approximate) for a whole-sequence one",
  )
  p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts per batch size")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ppl-tolerance", type=float, default=0.10, help="matched: gen ppl <= (1 + this) x AR's")
  p.add_argument("--entropy-tolerance", type=float, default=0.10, help="matched: entropy >= AR's - this (nats)")
  p.add_argument("--parse-tolerance", type=float, default=0.05, help="matched: parse rate >= AR's - this")


def _bundled_defaults(args: argparse.Namespace) -> None:
  """Fills ``--diffusion``/``--autoregressive`` with the bundled ``default_bd`` and ``default_ar`` (and, when no model
  flag is given, ``--verified`` with the bundled ``default``) and ``--data`` with the first model's folder (a bundle
  exported with ``--data`` carries the corpus metadata and the tokenizer). Without that, ``--corpus`` leaves
  ``--data`` unset: the checkpoints' own tokenizer (a converted checkpoint's) then encodes the prompts."""
  wanted = [("diffusion", "default_bd"), ("autoregressive", "default_ar")]
  if not (args.diffusion or args.autoregressive or args.verified):  # No model flag: the bundled three.
    wanted.append(("verified", "default"))
  if args.no_diffusion:
    args.diffusion, wanted = None, wanted[1:]
  for flag, name in wanted:
    if getattr(args, flag) is None:
      path = default_checkpoint(name)
      if path is None:
        _fail(f"no --{flag} given and the bundled model {name!r} is missing from mercury_jax/assets/{name}/")
      setattr(args, flag, str(path))
  if args.data is None:
    flag, given = next((f, getattr(args, f)) for f in ("diffusion", "verified", "autoregressive") if getattr(args, f))
    folder = Path(given)
    if (folder / files.METADATA_FILE).is_file() and (folder / files.TOKENIZER_FILE).is_file():
      args.data = str(folder)
    elif args.corpus is None:  # With --corpus, the checkpoints' own tokenizers (bench.models).
      if (folder / TOKENIZER_JSON).is_file() and (folder / SPECIAL_TOKENS_FILE).is_file():
        _fail(f"--{flag} {given!r} carries its own tokenizer but no corpus; name the prompts' corpus with --corpus")
      _fail(
        f"no --data given and --{flag} {given!r} carries no corpus metadata; pass --data DATA_DIR (or --corpus to "
        "use the checkpoints' own tokenizer)"
      )


def run_compare(args: argparse.Namespace) -> None:
  """Speed against quality: diffusion or verified decoding against the AR twin.

  Every diffusion setting (step rule and budget, temperature, cache) and the twin generate for the same prompts at
  each batch size, timed in interleaved rounds; writes OUT/results.json, results.md and the plots.
  """
  _bundled_defaults(args)
  if args.smoke:
    args.prompts, args.length, args.steps, args.taus, args.batch_sizes, args.repeats = 2, 16, (4,), (0.9,), (1, 2), 1
    args.ar_temperatures = (1.0,)
  if 1.0 not in args.ar_temperatures:
    _fail("--ar-temperatures must include 1 (the reference for matched quality)")
  unknown = [lever for lever in args.levers if lever not in bench_verified.LEVERS]
  if unknown or not args.levers:
    _fail(f"--levers {','.join(args.levers)!r} must name some of {', '.join(bench_verified.LEVERS)}")
  if not args.temperatures or min(args.temperatures + args.ar_temperatures) < 0:
    _fail(f"--temperatures {args.temperatures} and --ar-temperatures {args.ar_temperatures} must be >= 0 (0: greedy)")
  for flag, values in (
    ("--prompts", [args.prompts]),
    ("--length", [args.length]),
    ("--repeats", [args.repeats]),
    ("--steps", args.steps),
    ("--batch-sizes", args.batch_sizes),
  ):
    if not values or min(values) < 1:
      _fail(f"{flag} must be positive (got {values})")
  try:
    result = run(args)
  except ValueError as e:
    _fail(str(e))
  print(result["markdown"], end="")
  plots = result["plots"]
  print(
    f"wrote {args.out}/results.json, results.md"
    + (f", {', '.join(plots)}" if isinstance(plots, list) else f"; {plots}")
  )


COMMANDS = {"compare": (add_arguments, run_compare)}
