"""Needle-in-a-haystack retrieval through the engine: the rate at which a model answers a ``kv-retrieval`` query
(:mod:`mercury_jax.data.retrieval`) whose needle lies at a random depth of a long prompt, and that rate by depth.

The prompts go through :meth:`Sampler.generate <mercury_jax.sampling.sampler.Sampler.generate>` (the engine's
prefill, chunked with ``prefill_chunk``, and its decode; greedy, no token healing) in batches of equal shape, so the
engine compiles once for all of them. A trial retrieves when the first generated token is the needle's value.
:func:`with_context` stretches a checkpoint's rotary positions to a longer context (RoPE scaling, no new weights).

``needle`` asks one checkpoint::

    python -m mercury_jax.bench needle --checkpoint tests/fixtures/needle --trials 64 --prefill-chunk 512
    python -m mercury_jax.bench needle --checkpoint runs/2k --context 8192 --rope yarn   # a 2 K model at 8 K

It prints the rate and the rate by depth; ``--json FILE`` writes every trial (depth, distance, answer, generated
text, compile seconds). Bad input gets one line on stderr and exit code 2.

``needle-recipe`` is issue 26's recipe, end to end: train a tiny model to retrieve at 2 K, extend it to 8 K with
RoPE scaling (with and without a short continued run at 8 K), and print the retrieval rate by depth::

    python -m mercury_jax.bench needle-recipe --workdir runs/needle        # the whole recipe (~40 min on 2 CPU cores)
    python -m mercury_jax.bench needle-recipe --workdir runs/needle --export tests/fixtures/needle   # and ship it
    python -m mercury_jax.bench needle-recipe --workdir runs/needle --skip-train   # only the measurements

Steps (every one a command of the package, so each can be rerun alone; a rerun skips prepared data and resumes
or skips the runs):

1. ``prepare --corpus kv-retrieval`` at 64, 2,048 and 8,192 tokens (one tokenizer, trained on the first).
2. ``train --config tiny_retrieval`` at 64 tokens (the warm-up that learns the lookup), then at 2,048 from it
   (``--init-from``).
3. The 2 K model asked ``--trials`` needles at 2 K, and at 8 K with each RoPE scaling of ``--scalings`` (default
   :data:`RECIPE_SCALINGS`: ``none``, ``linear``, ``ntk``, ``yarn``, the table BUILD_NOTES reports; ``needle``'s
   ``--rope`` offers every scaling of :mod:`mercury_jax.rope`): the weights unchanged, the positions stretched 4x
   (:func:`with_context`).
4. ``train --config tiny_retrieval_8k`` (YaRN, a short run at 8 K from the 2 K model), asked the same 8 K needles.
5. With ``--export``: the 8 K model written as a params-only bfloat16 checkpoint (``export.export``).

Every measurement goes through the engine as ``needle`` does, with the prefill in chunks of ``--prefill-chunk``
tokens, greedy, in batches of ``--batch`` prompts.
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

from mercury_jax import files, usage
from mercury_jax.bench.recipes import run_module
from mercury_jax.bench.throughput import timed
from mercury_jax.config import Config
from mercury_jax.data import retrieval

DEPTH_BINS = 8
SCALINGS = ("as-trained", "none", "linear", "ntk", "yarn", "llama3")  # ``needle --rope``
RECIPE_SCALINGS = ("none", "linear", "ntk", "yarn")  # the recipe's 2 K model at 8 K (BUILD_NOTES' table)
CONTEXT, TRAINED = 8192, 2048  # the recipe's contexts
DATA = {  # the recipe's data folders, name: (seq_len, spec)
  "kv64": (64, "kv-retrieval:records=32000"),
  "kv2k": (TRAINED, "kv-retrieval:records=2400,seed=1"),
  "kv8k": (CONTEXT, "kv-retrieval:records=128,seed=2"),
}
WARMUP = ["model.max_length=64", "data.batch_size=64", "train.steps=500", "optim.learning_rate=1e-2",
          "optim.warmup_steps=30", "train.log_every=50", "train.eval_every=250", "checkpoint.every=250"]  # fmt: skip
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

_fail = functools.partial(usage.fail, "mercury_jax.bench needle")


def _depths(text: str) -> tuple[float, float]:
  low, sep, high = text.partition(",")
  try:
    lo, hi = float(low), float(high)
  except ValueError:
    lo = hi = math.nan
  if not sep or not 0.0 <= lo < hi <= 1.0:
    raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH with 0 <= LOW < HIGH <= 1, e.g. 0,0.5")
  return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def retrieval_limit(cfg: Config) -> int:
  """The longest context a checkpoint is asked at: 16x what it was trained on."""
  return 16 * (cfg.model.rope_original_length or cfg.model.max_length)


def run_needle(args: argparse.Namespace) -> None:
  """Needle in a haystack: a checkpoint's retrieval rate by depth.

  --trials kv-retrieval needles at random --depths of --context-token prompts (RoPE scaled with --rope), greedy;
  prints the rate and a table by depth.
  """
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


# ---------------------------------------------------------------------------------------------------- recipe


def prepare(root: Path) -> dict[str, Path]:
  """The three data folders (step 1), prepared once."""
  paths = {name: root / "data" / name for name in DATA}
  tokenizer = paths["kv64"] / files.TOKENIZER_FILE
  for name, (seq_len, spec) in DATA.items():
    if (paths[name] / files.METADATA_FILE).is_file():
      continue
    extra = [] if name == "kv64" else ["--tokenizer", str(tokenizer)]
    cmd = ["mercury_jax.prepare", "--corpus", spec, "--out", str(paths[name]), "--seq-len", str(seq_len), *extra]
    run_module(cmd, root / f"prepare_{name}.log")
  return paths


def train(root: Path, data: dict[str, Path]) -> dict[str, float]:
  """The three runs (steps 2 and 4); returns each one's wall seconds. A run found in its workdir resumes (and ends
  at once when it is finished); ``--init-from`` only starts a new one."""
  runs = {
    "warmup": ("tiny_retrieval", data["kv64"], None, WARMUP),
    "2k": ("tiny_retrieval", data["kv2k"], "warmup", []),
    "8k": ("tiny_retrieval_8k", data["kv8k"], "2k", []),
  }
  seconds = {}
  for name, (config, path, init, sets) in runs.items():
    workdir = root / "runs" / name
    cmd = ["mercury_jax.train", "--config", config, "--workdir", str(workdir), "--set", f"data.path={path}"]
    cmd += [a for s in sets for a in ("--set", s)]
    cmd += ["--init-from", str(root / "runs" / init)] if init else []
    seconds[name] = run_module(cmd, root / f"train_{name}.log")
  return seconds


def measure(root: Path, trials: int, chunk: int, batch: int, seed: int, scalings=RECIPE_SCALINGS) -> dict[str, dict]:
  """Steps 3 and 4: each model and context's retrieval, ``{label: {"rate", "by_depth", "seconds"}}``."""
  import jax

  from mercury_jax.checkpoint import restore_params
  from mercury_jax.data.tokenizer import load_tokenizer
  from mercury_jax.sampling.sampler import Sampler

  tokenizer = load_tokenizer(root / "runs" / "2k")
  base, base_cfg = restore_params(root / "runs" / "2k")
  long, long_cfg = restore_params(root / "runs" / "8k")
  cases = [("2k model at 2K", base, base_cfg, TRAINED)]
  cases += [(f"2k model at 8K, {s}", base, with_context(base_cfg, CONTEXT, s), CONTEXT) for s in scalings]
  cases += [("8k model (yarn + continued run) at 8K", long, long_cfg, CONTEXT)]
  results = {}
  for label, params, cfg, length in cases:
    prompts = needles(trials, length - 2, seed)  # two tokens to generate: the value and EOS
    ask = lambda p, c, n: run(Sampler(p, c, tokenizer), n, prefill_chunk=chunk, batch=batch)  # noqa: E731
    out, seconds = timed(ask, params, cfg, prompts)
    depth = by_depth(out)
    results[label] = {"rate": rate(out), "by_depth": depth, "seconds": seconds, "trials": len(out)}
    cells = " ".join(f"{r:.2f}" for _, r, _ in depth)
    print(f"{label:42s} {rate(out):6.1%}  by depth (8 bins): {cells}  ({seconds:.0f} s)", flush=True)
    jax.clear_caches()
  return results


def _scalings(text: str) -> tuple[str, ...]:
  chosen = tuple(s for s in text.split(",") if s)
  unknown = [s for s in chosen if s not in SCALINGS[1:]]
  if not chosen or unknown:
    raise argparse.ArgumentTypeError(f"{text!r}: choose comma-separated from {','.join(SCALINGS[1:])}")
  return chosen


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--workdir", default="runs/needle", help="data, runs, logs and results.json go here")
  p.add_argument("--trials", type=int, default=64, help="needles per measurement")
  p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill chunk (0: one pass)")
  p.add_argument("--batch", type=int, default=8, help="prompts per generate call")
  p.add_argument("--seed", type=int, default=0, help="seed of the needle prompts")
  p.add_argument("--skip-train", action="store_true", help="measure existing runs only")
  p.add_argument("--export", metavar="DIR", help="write the 8 K model here (params-only, bfloat16)")
  p.add_argument(
    "--scalings",
    type=_scalings,
    default=RECIPE_SCALINGS,
    help=f"the 2 K model's RoPE scalings at 8 K, comma-separated (default {','.join(RECIPE_SCALINGS)})",
  )


def run_recipe(args: argparse.Namespace) -> None:
  """Issue 26's recipe: train the needle model at 2 K, extend it to 8 K, measure.

  Prepares the kv-retrieval data, trains at 64 then 2,048 tokens and a short 8 K run (each step a package command,
  resumable), then asks the 2 K model at 2 K and at 8 K with each of --scalings, and the 8 K model.
  """
  root = Path(args.workdir)
  root.mkdir(parents=True, exist_ok=True)
  seconds = {}
  if not args.skip_train:
    seconds = train(root, prepare(root))
    print("training seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), flush=True)
  results = measure(root, args.trials, args.prefill_chunk, args.batch, args.seed, args.scalings)
  (root / "results.json").write_text(json.dumps({"train_seconds": seconds, "retrieval": results}, indent=2) + "\n")
  if args.export:
    from mercury_jax.export import export

    print(f"exported {export(root / 'runs' / '8k', args.export, dtype='bfloat16', force=True)}")


COMMANDS = {"needle": (add_arguments, run_needle), "needle-recipe": (add_recipe_arguments, run_recipe)}

if __name__ == "__main__":  # ``python -m mercury_jax.bench.needle``, the command before the bench had subcommands
  parser = usage.Parser(prog="python -m mercury_jax.bench needle", command="mercury_jax.bench needle")
  add_arguments(parser)
  run_needle(parser.parse_args())
