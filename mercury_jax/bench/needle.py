"""Needle-in-a-haystack retrieval through the engine: the rate at which a model answers a ``kv-retrieval`` query
(:mod:`mercury_jax.data.retrieval`) whose needle lies at a random depth of a long prompt, and that rate by depth.

The prompts go through :meth:`Sampler.generate <mercury_jax.sampling.sampler.Sampler.generate>` (the engine's
prefill, chunked with ``prefill_chunk``, and its decode; greedy, no token healing) in batches of equal shape, so the
engine compiles once for all of them. A trial retrieves when the first generated token is the needle's value.
:func:`with_context` stretches a checkpoint's rotary positions to a longer context (RoPE scaling, no new weights).

    python -m mercury_jax.bench.needle --checkpoint tests/fixtures/needle --trials 64 --prefill-chunk 512
    python -m mercury_jax.bench.needle --checkpoint runs/2k --context 8192 --rope yarn   # a 2 K model at 8 K
    python launch/needle.py   # the recipe: train at 2 K, extend to 8 K, report these rates

The command prints the rate and the rate by depth; ``--json FILE`` writes every trial (depth, distance, answer,
generated text, compile seconds). Bad input gets one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mercury_jax import usage
from mercury_jax.config import Config
from mercury_jax.data import retrieval

DEPTH_BINS = 8
SCALINGS = ("as-trained", "none", "linear", "ntk", "yarn", "llama3")
MAX_TRIALS = 4096
MAX_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Trial:
  """One needle prompt and what the model answered.

  Attributes:
    depth: Where the needle lies in the haystack, 0 (start) to 1 (end).
    distance: Tokens from the needle's key to the query's key (the end of the prompt).
    answer: The needle's value.
    text: What the model generated.
    compile_time: Seconds the engine spent compiling for the batch of this trial.
  """

  depth: float
  distance: int
  answer: str
  text: str
  compile_time: float

  @property
  def retrieved(self) -> bool:
    return self.text.split()[:1] == self.answer.split()


def needles(
  count: int, length: int, seed: int, keys: int = retrieval.RetrievalSpec.keys, depths: tuple[float, float] = (0, 1)
) -> list[retrieval.Needle]:
  """``count`` prompts of ``length`` tokens, each with its needle at a depth drawn uniformly from ``depths``."""
  rng = np.random.default_rng(seed)
  return [retrieval.needle(rng, length, float(rng.uniform(*depths)), keys) for _ in range(count)]


def run(sampler, prompts: Sequence[retrieval.Needle], *, prefill_chunk: int = 0, batch: int = 8) -> list[Trial]:
  """Asks ``sampler`` every needle, ``batch`` prompts per ``generate`` call (the last batch is filled up with
  copies of its first prompt, so every call has one shape and the engine compiles once).

  Args:
    sampler: A :class:`~mercury_jax.sampling.sampler.Sampler` whose context holds a prompt and two tokens.
    prompts: The needles (:func:`needles`).
    prefill_chunk: The engine's prefill chunk (``SamplerSettings.prefill_chunk``; 0: one pass).
    batch: Prompts per call.
  """
  trials = []
  for start in range(0, len(prompts), batch):
    group = list(prompts[start : start + batch])
    texts = [n.prompt for n in group] + [group[0].prompt] * (batch - len(group))
    samples = sampler.generate(texts, length=2, temperature=0.0, prefill_chunk=prefill_chunk, token_healing=False)
    for needle, sample in zip(group, samples, strict=False):
      length = len(sampler.tokenizer.encode(needle.prompt))
      distance = length - 1 - needle.position
      trials.append(Trial(needle.depth, distance, needle.answer, sample.text, sample.compile_time))
  return trials


def rate(trials: Sequence[Trial]) -> float:
  """The fraction of trials that retrieved their needle."""
  return sum(t.retrieved for t in trials) / max(len(trials), 1)


def by_depth(trials: Sequence[Trial], bins: int = DEPTH_BINS) -> list[tuple[float, float, int]]:
  """``(bin start, retrieval rate, trials)`` for ``bins`` equal depth bins."""
  out = []
  for b in range(bins):
    inside = [t for t in trials if b <= t.depth * bins < b + 1 or (b == bins - 1 and t.depth == 1.0)]
    out.append((b / bins, rate(inside) if inside else float("nan"), len(inside)))
  return out


def with_context(cfg: Config, length: int, scaling: str = "yarn", trained: int | None = None) -> Config:
  """``cfg`` run at a context of ``length`` tokens: its rotary positions stretched by ``length / trained`` with
  ``scaling`` (``mercury_jax.rope``: ``linear``, ``ntk``, ``yarn``, ``llama3``; ``none`` keeps them as trained).

  Args:
    cfg: The checkpoint's config.
    length: The new context.
    scaling: The RoPE scaling.
    trained: The context the weights were trained at; default ``cfg.model.max_length`` (an unscaled checkpoint) or
      its ``rope_original_length`` (a scaled one).
  """
  model = cfg.model
  trained = trained or model.rope_original_length or model.max_length
  if scaling == "none":
    rope = {"rope_scaling": "none", "rope_factor": 1.0, "rope_original_length": 0}
  else:
    rope = {"rope_scaling": scaling, "rope_factor": length / trained, "rope_original_length": trained}
  return dataclasses.replace(cfg, model=dataclasses.replace(model, max_length=length, **rope))


# ----------------------------------------------------------------------------------------------- command line

_fail = functools.partial(usage.fail, "mercury_jax.bench.needle")


def _depths(text: str) -> tuple[float, float]:
  low, sep, high = text.partition(",")
  try:
    lo, hi = float(low), float(high)
  except ValueError:
    lo = hi = math.nan
  if not sep or not 0.0 <= lo < hi <= 1.0:
    raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH with 0 <= LOW < HIGH <= 1, e.g. 0,0.5")
  return lo, hi


def build_parser() -> argparse.ArgumentParser:
  p = usage.Parser(
    prog="python -m mercury_jax.bench.needle", command="mercury_jax.bench.needle", description=__doc__.splitlines()[0]
  )
  p.add_argument("--checkpoint", required=True, help="a train workdir or an exported checkpoint")
  p.add_argument("--context", type=int, help="the context to test at (default: the checkpoint's max_length)")
  p.add_argument(
    "--rope",
    choices=SCALINGS,
    default="as-trained",
    help="RoPE scaling to --context (default: the checkpoint's own; none: the positions as trained)",
  )
  p.add_argument("--trials", type=int, default=64, help=f"needles to ask, 1 to {MAX_TRIALS} (default 64)")
  p.add_argument("--depths", type=_depths, default=(0.0, 1.0), help="depths drawn uniformly in LOW,HIGH (default 0,1)")
  p.add_argument("--seed", type=int, default=0, help="seed of the needle prompts (default 0)")
  p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill chunk (0: one pass; default 512)")
  p.add_argument("--batch", type=int, default=8, help=f"prompts per generate call, 1 to {MAX_BATCH} (default 8)")
  p.add_argument("--json", type=Path, metavar="FILE", help="write every trial here")
  return p


def retrieval_limit(cfg: Config) -> int:
  """The longest context a checkpoint is asked at: 16x what it was trained on."""
  return 16 * (cfg.model.rope_original_length or cfg.model.max_length)


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  if not 1 <= args.trials <= MAX_TRIALS:
    _fail(f"--trials {args.trials} must lie in [1, {MAX_TRIALS}]")
  if not 1 <= args.batch <= MAX_BATCH:
    _fail(f"--batch {args.batch} must lie in [1, {MAX_BATCH}]")
  if args.prefill_chunk < 0 or args.seed < 0:
    _fail(f"--prefill-chunk {args.prefill_chunk} and --seed {args.seed} must be >= 0")
  from mercury_jax.sampling.sampler import Sampler
  from mercury_jax.sampling.settings import SettingError

  try:
    sampler = Sampler.from_checkpoint(args.checkpoint)
  except (FileNotFoundError, ValueError) as e:
    _fail(e)
  cfg = sampler.cfg
  context = args.context or cfg.model.max_length
  minimum = 2 * retrieval.RetrievalSpec.keys + 4
  if args.context is not None and not minimum <= context <= retrieval_limit(cfg):
    _fail(f"--context {context} must lie in [{minimum}, {retrieval_limit(cfg)}]")
  if args.rope != "as-trained" or context != cfg.model.max_length:
    cfg = with_context(cfg, context, cfg.model.rope_scaling if args.rope == "as-trained" else args.rope)
    sampler = Sampler(sampler.params, cfg, sampler.tokenizer)
  prompts = needles(args.trials, context - 2, args.seed, depths=args.depths)  # the value and EOS fill the context
  try:
    trials = run(sampler, prompts, prefill_chunk=args.prefill_chunk, batch=args.batch)
  except (SettingError, ValueError) as e:
    _fail(e)
  rope = cfg.model.rope_scaling
  print(
    f"{len(trials)} needles at depths {args.depths[0]:g}-{args.depths[1]:g} of {context}-token contexts "
    f"(RoPE {rope}, prefill chunk {args.prefill_chunk}): retrieved {rate(trials):.1%}"
  )
  print("| depth | needles | retrieved |")
  print("|---|---|---|")
  for start, value, count in by_depth(trials):
    if count:
      print(f"| {start:.3f} | {count} | {value:.1%} |")
  if args.json:
    rows = [{**dataclasses.asdict(t), "retrieved": t.retrieved} for t in trials]
    args.json.write_text(json.dumps({"context": context, "rope": rope, "rate": rate(trials), "trials": rows}) + "\n")


if __name__ == "__main__":
  main()
