"""``python -m mercury_jax.bench --diffusion DIR --autoregressive DIR --data DATA_DIR``: speed vs quality, both models.

Examples::

  python -m mercury_jax.bench --diffusion runs/default --autoregressive runs/default_ar --data data/stdlib
  python -m mercury_jax.bench --diffusion runs/tiny --autoregressive runs/tiny_ar --data data/stdlib --smoke

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

  python -m mercury_jax.bench --diffusion models/fast-dllm-v2 --autoregressive models/qwen2.5 --corpus python-stdlib

The two tokenizers must be one (``mercury_jax.bench.models``); each model keeps its own mask, EOS and padding ids.

Timing: a shared host's capacity can change 2x for minutes at a time, so absolute numbers from different runs do
not compare. Each executable is compiled (timed separately) and run once untimed; then every round runs each setting
once on the same prompt batch, in an order rotated from round to round, and times one matmul as a load probe.
Speed-ups are medians of per-round ratios, so a change in capacity between rounds cancels.

OUT_DIR receives ``results.json`` (every row, the machine, the load probe), ``results.md`` and two PNG plots
(matplotlib, from the ``bench`` extra; skipped with a note without it). Bad input gets one line on stderr and exit
code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import files, kinds as K, usage
from mercury_jax.bench import prompts as bench_prompts, quality, report as bench_report, verified as bench_verified
from mercury_jax.bench.models import load_models
from mercury_jax.bench.overhead import engine_overhead
from mercury_jax.bench.throughput import time_call
from mercury_jax.data.hf_files import SPECIAL_TOKENS_FILE, TOKENIZER_JSON
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.canvas import SampleOutput
from mercury_jax.sampling.plan import Decoding, bucketed_length
from mercury_jax.sampling.registry import default_checkpoint
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings

STEPS = (4, 8, 16, 32, 64, 128, 256)
TAUS = (0.5, 0.7, 0.9, 0.95)
AR_TEMPERATURES = (1.0, 0.0)
PROBE_SIZE = 1024  # The load probe: one f32 matmul of this size per round.


@dataclasses.dataclass(frozen=True)
class Setting:
  """One way of generating: a diffusion step rule with its budget, or the twin's KV-cache decoding."""

  model: str  # "diffusion", "autoregressive" or "verified"
  rule: str  # "confidence", "threshold", "ode" (a continuous checkpoint), "kv-cache" or "verified"
  steps: int  # Step budget; 0 for the autoregressive twin (one token per forward pass).
  tau: float | None = None
  temperature: float = 1.0
  cache: str = "auto"  # The Sampler's cache (``none``: the uncached reference; ``dual``/``prefix``: approximate).
  draft: int = 0  # verified: the draft length (0: the checkpoint's)
  lever: str = "auto"  # verified: the draft tree, lookups, pre-draft blocks and length (``bench.verified.LEVERS``)

  @property
  def name(self) -> str:
    if self.model == "verified":
      how = "greedy" if self.temperature == 0 else f"T={self.temperature:g}"
      lever = "" if self.lever == "auto" else f" {self.lever}"
      return f"verified{f' k={self.draft}' if self.draft else ''}{lever} {how}"
    if self.model == "autoregressive":
      return f"AR {'greedy' if self.temperature == 0 else f'T={self.temperature:g}'}"
    name = f"{self.rule} steps={self.steps}" if self.tau is None else f"threshold tau={self.tau:g}"
    name = name if self.temperature == 1.0 else f"{name} T={self.temperature:g}"
    return name if self.cache == "auto" else f"{name} cache={self.cache}"


def grid(
  length: int,
  steps,
  taus,
  temperatures,
  ar_temperatures,
  caches=(),
  drafts=None,
  continuous: bool = False,
  *,
  levers=("auto",),
) -> list[Setting]:
  """The settings measured: at each diffusion temperature, confidence at each step budget and threshold at each tau
  (budget ``length``; a ``continuous`` checkpoint: its ODE rule at each step budget); each of those at the first
  temperature again with every cache of ``caches``; then the twin at each of its temperatures; then, with ``drafts``
  (draft lengths, 0: the checkpoint's), verified decoding at each draft length, each of ``levers``
  (``bench.verified.LEVERS``) and each of the twin's temperatures (no diffusion rows when ``temperatures`` is
  empty)."""
  settings = []
  for temperature in temperatures:
    if continuous:
      settings += [Setting("diffusion", "ode", s, None, temperature) for s in steps]
      continue
    settings += [Setting("diffusion", "confidence", s, None, temperature) for s in steps]
    settings += [Setting("diffusion", "threshold", length, t, temperature) for t in taus]
  first = [s for s in settings if s.temperature == temperatures[0]]
  settings += [dataclasses.replace(s, cache=cache) for cache in caches for s in first]
  settings += [Setting("autoregressive", "kv-cache", 0, None, t) for t in ar_temperatures]
  verified = [
    Setting("verified", "verified", 0, None, t, draft=d, lever=lever)
    for d in drafts or ()
    for lever in levers
    for t in ar_temperatures
  ]
  return settings + verified


def make_batches(prompt_ids: list[list[int]], length: int, context: int, batch: int, pad_id: int) -> list[cv.Canvas]:
  """All prompts as canvases of ``batch`` rows (streams = prompt index; the last batch padded with empty rows).

  The canvas is padded to the length the ``Sampler`` runs it at (:func:`~mercury_jax.sampling.sampler.bucketed_length`);
  the padding is never generated.
  """
  examples = [cv.prefix(p, min(length, context - len(p))) for p in prompt_ids]  # Each at most ``context`` long.
  longest = max(len(p) + min(length, context - len(p)) for p in prompt_ids)
  full = cv.make_canvas(examples, length=bucketed_length(longest, context))
  chunks = []
  for start in range(0, len(prompt_ids), batch):
    part = cv.Canvas(*(np.asarray(a)[start : start + batch] for a in full))
    chunks.append(cv.pad_batch(part, batch, pad_id))
  return chunks


class Runner:
  """Both models' samplers and the seed: ``executable`` compiles a setting for a canvas shape (once, timed) and runs
  it once untimed; ``call`` returns the output and wall seconds."""

  def __init__(self, samplers: dict[str, Sampler], seed: int):
    self.samplers, self.seed = samplers, seed
    self.compile_s: dict[tuple, float] = {}

  def settings(self, setting: Setting) -> SamplerSettings:
    """The ``SamplerSettings`` of a setting, with its model's ids and schedule; every setting samples its whole
    tempered distribution (no top-p or top-k, whatever a checkpoint's ``[sampling]`` defaults say)."""
    knobs = {"rule": setting.rule, "threshold": setting.tau} if setting.model == "diffusion" else {}
    if setting.model == "verified":
      knobs = {"decode": "verified", "draft_length": setting.draft, **bench_verified.LEVERS[setting.lever]}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    return self.samplers[setting.model].settings(temperature=setting.temperature, top_p=1.0, top_k=0, **knobs)

  def executable(self, setting: Setting, canvas: cv.Canvas) -> tuple:
    """The key of ``setting``'s executable for ``canvas``'s shape in ``compile_s``; compiles it the first time."""
    settings = self.settings(setting)
    key = (setting.model, settings, setting.cache, np.shape(canvas.tokens))
    if key not in self.compile_s:  # The call compiles (timed apart from the run), then runs once untimed.
      run = self.samplers[setting.model].run(canvas, setting.steps or None, self.seed, settings, cache=setting.cache)
      self.compile_s[key] = run[2]
    return key

  def call(self, setting: Setting, canvas: cv.Canvas) -> tuple[SampleOutput, float]:
    """Runs ``setting`` on ``canvas`` (compiled by :meth:`executable`): the output (numpy) and wall seconds."""
    self.executable(setting, canvas)
    sampler = self.samplers[setting.model]
    out, wall, _ = sampler.run(canvas, setting.steps or None, self.seed, self.settings(setting), cache=setting.cache)
    return out._replace(tokens=out.tokens[:, : np.shape(canvas.tokens)[1]]), wall  # Drop the Sampler's bucket.


def measure(runner: Runner, settings: list[Setting], batches: dict[int, list[cv.Canvas]], rows: int, repeats: int):
  """Interleaved timing: ``calls[(setting index, batch)]`` and the load probe's GFLOP/s after each round."""
  probe_input = jnp.ones((PROBE_SIZE, PROBE_SIZE), jnp.float32)
  probe = jax.jit(lambda x: x @ x)
  time_call(probe, probe_input)
  calls: dict[tuple[int, int], list[dict[str, Any]]] = {}
  gflops, round_index = [], 0
  for batch, chunks in batches.items():
    for i, setting in enumerate(settings):
      runner.executable(setting, chunks[0])
      calls[(i, batch)] = []
    for _ in range(repeats):
      for chunk_index, canvas in enumerate(chunks):
        real = min(batch, rows - chunk_index * batch)
        order = [(round_index + k) % len(settings) for k in range(len(settings))]
        for i in order:
          out, wall = runner.call(settings[i], canvas)
          pad_id = runner.samplers[settings[i].model].tokenizer.pad_id  # Each model pads with its own id.
          generated = (np.asarray(canvas.kinds)[:real] == K.TARGET) & (out.tokens[:real] != pad_id)
          calls[(i, batch)].append(
            {
              "round": round_index,
              "wall": wall,
              "tokens": out.tokens[:real],
              "nfe": out.nfe[:real],
              "generated": generated.sum(axis=-1),
              "accepted": None if out.accepted is None else np.asarray(out.accepted)[:real],
              "sources": None if out.sources is None else np.asarray(out.sources)[:real],
            }
          )
        gflops.append(2 * PROBE_SIZE**3 / time_call(probe, probe_input) / 1e9)
        round_index += 1
  return calls, gflops


def completions(calls: list[dict[str, Any]], kinds: np.ndarray, eos_id: int, pad_id: int) -> list[list[int]]:
  """Each prompt's generated tokens up to its first EOS (padding dropped), from one pass over the prompts."""
  tokens = np.concatenate([c["tokens"] for c in calls])[: len(kinds)]  # Calls hold real rows only, pass by pass.
  result = []
  for row, row_kinds in zip(tokens, kinds, strict=True):
    ids = [int(t) for t in row[row_kinds == K.TARGET] if t != pad_id]
    result.append(ids[: ids.index(eos_id)] if eos_id in ids else ids)
  return result


def summarise(setting: Setting, batch: int, calls: list, reference: list, compile_s: float) -> dict[str, Any]:
  """A row's speed figures from its timed calls; ``reference`` holds the AR twin's calls of the same rounds."""
  walls = np.array([c["wall"] for c in calls])
  tokens = np.array([c["generated"].sum() for c in calls], np.float64)
  nfe = np.concatenate([c["nfe"] for c in calls]).astype(np.float64)
  ref = {c["round"]: c["generated"].sum() / c["wall"] for c in reference}
  ratios = [tokens[j] / walls[j] / ref[c["round"]] for j, c in enumerate(calls) if ref[c["round"]] > 0]
  return {
    "name": setting.name,
    **dataclasses.asdict(setting),
    "batch": batch,
    "calls": len(calls),
    "tokens_per_s": float(tokens.sum() / walls.sum()),
    "speedup_vs_ar": float(np.median(ratios)) if ratios else float("nan"),
    "nfe": float(nfe.mean()),
    "tokens_per_forward": float(tokens.sum() / nfe.sum()),
    "latency_p50_s": float(np.percentile(walls, 50)),
    "latency_p95_s": float(np.percentile(walls, 95)),
    "compile_s": compile_s,
  }


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


def machine_info() -> dict[str, Any]:
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device": jax.devices()[0].device_kind,
    "devices": jax.device_count(),
    "cpu_count": os.cpu_count(),
    "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "load_average": list(os.getloadavg()),
    "platform": platform.platform(),
    "python": platform.python_version(),
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
    args.caches,
    drafts,
    continuous,
    levers=args.levers,
  )
  for cache in args.caches:  # Reject a cache the diffusion model does not have before anything is timed.
    samplers["diffusion"].plan(Decoding(cache))
  if "verified" in samplers:  # A draft length the model cannot take, before anything is timed.
    for draft in args.draft_lengths:
      samplers["verified"].plan(Decoding(decode="verified", draft_length=draft))
  batches = {b: make_batches(prompt_ids, args.length, context, b, tokenizer.pad_id) for b in args.batch_sizes}
  runner = Runner(samplers, args.seed)
  calls, gflops = measure(runner, settings, batches, len(prompts), args.repeats)
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
  _cache_speedups(rows, settings, calls, args.batch_sizes)
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
  (out / "results.json").write_text(json.dumps(_finite(result), indent=2) + "\n")
  (out / "results.md").write_text(text)
  result["plots"] = bench_report.plots(rows, out)
  if verified and isinstance(result["plots"], list):
    result["plots"].append(bench_verified.plot(verified, out))
  result["markdown"] = text
  return result


def _cache_speedups(rows: list[dict[str, Any]], settings: list[Setting], calls: dict, batch_sizes) -> None:
  """Adds to each diffusion row that has an uncached twin (same setting, ``cache="none"``) ``speedup_vs_no_cache``:
  the median over rounds of its tokens/s ÷ the twin's in the same round."""
  index = {(s, b): i for i, s in enumerate(settings) for b in batch_sizes}
  for row in rows:
    if row["model"] != "diffusion" or row["cache"] != "auto":
      continue
    setting = next(s for s in settings if s.name == row["name"])
    uncached = dataclasses.replace(setting, cache="none")
    if (uncached, row["batch"]) not in index:
      continue
    mine, theirs = (
      calls[(index[(setting, row["batch"])], row["batch"])],
      calls[(index[(uncached, row["batch"])], row["batch"])],
    )
    speed = lambda c: c["generated"].sum() / c["wall"]  # noqa: E731
    other = {c["round"]: speed(c) for c in theirs}
    ratios = [speed(c) / other[c["round"]] for c in mine if other.get(c["round"], 0) > 0]
    row["speedup_vs_no_cache"] = float(np.median(ratios)) if ratios else float("nan")


def _finite(value: Any) -> Any:
  """``value`` with NaN and infinities replaced by None, so the JSON is strict."""
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_finite(v) for v in value]
  return None if isinstance(value, float) and not np.isfinite(value) else value


_Parser = functools.partial(usage.Parser, command="mercury_jax.bench")  # usage errors: one line, exit code 2
_fail = functools.partial(usage.fail, "mercury_jax.bench")


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(",") if v)


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mercury_jax.bench", description=__doc__.splitlines()[0])
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
  return p


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


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
  main()
