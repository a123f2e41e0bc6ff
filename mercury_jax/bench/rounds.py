"""The settings ``python -m mercury_jax.bench compare`` measures and their interleaved timing.

:func:`grid` lists the settings (each diffusion step rule and budget, each cache, the twin, verified decoding);
:func:`measure` times every setting once per round on the same prompt batch, in an order rotated from round to round,
with one matmul after each round as a load probe; :func:`summarise` turns a setting's calls into its row, its speed-up
the median over rounds of its tokens/s over the twin's in the same round (so a change of the host's capacity between
rounds cancels).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.bench import verified as bench_verified
from mercury_jax.bench.throughput import time_call
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.canvas import SampleOutput
from mercury_jax.sampling.plan import bucketed_length
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings

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
  *,
  caches=(),
  drafts=None,
  continuous: bool = False,
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


def generated(canvas: cv.Canvas, tokens, pad_id: int, rows: int | None = None) -> np.ndarray:
  """``[rows, length]`` bool: the canvas's target positions that hold a generated token (not padding) in ``tokens``,
  a decode's output for the canvas's first ``rows`` rows (default all), possibly wider than the canvas."""
  rows = canvas.tokens.shape[0] if rows is None else rows
  width = canvas.tokens.shape[1]
  return (np.asarray(canvas.kinds)[:rows] == K.TARGET) & (np.asarray(tokens)[:rows, :width] != pad_id)


def measure(
  runner: Runner, settings: list[Setting], batches: dict[int, list[cv.Canvas]], rows: int, repeats: int, progress=None
):
  """Interleaved timing: ``calls[(setting index, batch)]`` and the load probe's GFLOP/s after each round.

  ``progress`` (a :class:`~mercury_jax.progress.Progress` of :func:`measure_units` units) counts each compilation
  and each timed call."""
  probe_input = jnp.ones((PROBE_SIZE, PROBE_SIZE), jnp.float32)
  probe = jax.jit(lambda x: x @ x)
  time_call(probe, probe_input)
  calls: dict[tuple[int, int], list[dict[str, Any]]] = {}
  gflops, round_index = [], 0
  tick = progress.update if progress is not None else lambda: None
  for batch, chunks in batches.items():
    for i, setting in enumerate(settings):
      runner.executable(setting, chunks[0])
      tick()
      calls[(i, batch)] = []
    for _ in range(repeats):
      for chunk_index, canvas in enumerate(chunks):
        real = min(batch, rows - chunk_index * batch)
        order = [(round_index + k) % len(settings) for k in range(len(settings))]
        for i in order:
          out, wall = runner.call(settings[i], canvas)
          tick()
          pad_id = runner.samplers[settings[i].model].tokenizer.pad_id  # Each model pads with its own id.
          made = generated(canvas, out.tokens, pad_id, real)
          calls[(i, batch)].append(
            {
              "round": round_index,
              "wall": wall,
              "tokens": out.tokens[:real],
              "nfe": out.nfe[:real],
              "generated": made.sum(axis=-1),
              "accepted": None if out.accepted is None else np.asarray(out.accepted)[:real],
              "sources": None if out.sources is None else np.asarray(out.sources)[:real],
            }
          )
        gflops.append(2 * PROBE_SIZE**3 / time_call(probe, probe_input) / 1e9)
        round_index += 1
  return calls, gflops


def measure_units(settings: list[Setting], batches: dict[int, list[cv.Canvas]], repeats: int) -> int:
  """The units :func:`measure` counts: a compilation per setting and batch size, then every timed call."""
  return sum(len(settings) * (1 + repeats * len(chunks)) for chunks in batches.values())


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


def cache_speedups(rows: list[dict[str, Any]], settings: list[Setting], calls: dict, batch_sizes) -> None:
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
