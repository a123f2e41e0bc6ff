"""Experiments on the training objectives and the networks they train, each whose numbers BUILD_NOTES quotes.

``continuous``: issue 27's schedule comparison, the continuous objective under each noise schedule against block
diffusion. Every model is trained from the same seed on the same prepared data for the same steps (so the same
tokens), then scored on the held-out split by ``mercury_jax.evaluate`` (the continuous bound, and the
block-diffusion ELBO): one table in bits per character, one JSON file per run::

    python -m mercury_jax.prepare --corpus python-stdlib --out RUNS/data
    python -m mercury_jax.bench continuous --data RUNS/data --out RUNS/continuous --steps 600

``--shape`` picks the model size (``tiny``: the tiny presets' shape; ``default``: the bundled models' shape).

``noise-profile``: where a continuous checkpoint's denoiser is good, its cross-entropy by noise level, and its
schedule's draws::

    python -m mercury_jax.bench noise-profile --checkpoint runs/default_continuous --data data/code

For each sigma of ``--sigmas``, every block of ``--batches`` held-out batches is noised to that one level (clean
blocks before it, as the block-causal variant trains and samples) and the training cross-entropy of the clean tokens
is averaged over target tokens (no self-conditioning: half the training steps run without it). Near ``sigma_min`` it
says how well the model reads a block's own latents; at ``sigma_max``, where the latents carry nothing, how well it
reads the context (compare the whole validation split's unigram entropy, printed first, and the twin's NLL). Then
the fraction of the learned schedule's training draws above each sigma (its inverse CDF at 2,000 even quantiles).

``draft-masking``: all-mask drafting against a mask-rate range, at the tiny size: which should a verified model train
with? ::

    python -m mercury_jax.bench draft-masking --data DATA_DIR --runs RUNS_DIR [--steps 800] [--prompts 32]

Trains ``configs/tiny_verified.toml`` twice on the same data, steps and seed: every draft target masked (TiDAR's
choice, ``draft_mask_min = draft_mask_max = 1``) and mask rates drawn from U[0.1, 1] per (sequence, block). Then, for
each: the next-token head's and the drafter's held-out figures (``evaluate``'s, on the first 16 validation batches),
verified decoding's tokens per forward (greedy and T = 1) on documented-function prompts, and ``--decode diffusion``
at one and at two tokens per step, judged by a fixed twin (``--judge``, default the bundled ``default_ar``: generative
perplexity).

``diffusion-heads``: which network should serve pure block diffusion (``--decode diffusion``), a verified
checkpoint's draft half or a block-diffusion checkpoint trained for refinement? ::

    python -m mercury_jax.bench diffusion-heads --verified models/verified --diffusion models/bd --twin models/ar \
        --data DATA_DIR [--prompts 64] [--length 64] [--steps 64,32] [--json OUT.json]

Both decode the same documented-function prompts of the validation split (``mercury_jax.bench.prompts``) through
``Sampler.generate`` at temperature 1, with the threshold rule at each total step budget; the twin judges the
samples (generative perplexity, unigram entropy, parse rate: ``mercury_jax.bench.compare.sample_quality``). The
verified checkpoint's own ``--decode verified`` row (exactly its next-token head) is the reference.

The experiments that train run ``python -m mercury_jax.train`` as a child process (its log beside the run), the
command a user would run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import files, kinds as K, usage
from mercury_jax.bench import prompts as bench_prompts, quality
from mercury_jax.bench.compare import sample_quality
from mercury_jax.bench.recipes import run_module
from mercury_jax.checkpoint import restore_params
from mercury_jax.data import pipeline
from mercury_jax.model import Transformer
from mercury_jax.objectives import continuous as continuous_objective
from mercury_jax.sampling.sampler import Sampler, default_checkpoint

VARIANTS = {  # name -> (preset, overrides)
  "continuous-fixed": ("tiny_continuous", {"objective.sigma_schedule": "fixed"}),
  "continuous-warped": ("tiny_continuous", {"objective.sigma_schedule": "warped"}),
  "continuous-gumbel": ("tiny_continuous", {"objective.sigma_schedule": "gumbel"}),
  "block-diffusion": ("tiny_bd", {}),
}
DEFAULT_SHAPE = {  # configs/default.toml's network
  "model.d_model": "256",
  "model.num_layers": "6",
  "model.num_heads": "4",
  "model.num_kv_heads": "4",
  "model.head_dim": "64",
  "model.mlp_dim": "704",
  "model.latent_dim": "64",
}


def _train(config: str, values: dict[str, str], workdir: Path) -> float:
  """``python -m mercury_jax.train`` of preset ``config`` with ``values`` set, into ``workdir``; its seconds."""
  sets = [part for key, value in values.items() for part in ("--set", f"{key}={value}")]
  workdir.parent.mkdir(parents=True, exist_ok=True)
  log = workdir.parent / f"{workdir.name}.train.log"
  return run_module(["mercury_jax.train", "--config", config, "--workdir", str(workdir), *sets], log)


def add_continuous_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--data", required=True, help="a directory written by `python -m mercury_jax.prepare`")
  parser.add_argument("--out", required=True, help="one workdir per variant and results.json go here")
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--shape", choices=("tiny", "default"), default="tiny")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
  parser.add_argument("--t-samples", type=int, default=4, help="independent noise draws per held-out sequence")


def run_continuous(args: argparse.Namespace) -> None:
  """Issue 27: the continuous objective's noise schedules against block diffusion.

  Each variant trained from the same seed on the same data for --steps steps, then scored on the held-out split;
  prints bits per character and writes OUT/results.json.
  """
  from mercury_jax.evaluate import evaluate_params

  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {}
  for name in args.variants.split(","):
    preset, overrides = VARIANTS[name]
    sets = {
      "data.path": args.data,
      "train.steps": str(args.steps),
      "train.eval_every": str(args.steps),
      "train.log_every": "50",
      "checkpoint.every": str(args.steps),
      **overrides,
    }
    if args.shape == "default":
      sets.update({k: v for k, v in DEFAULT_SHAPE.items() if k != "model.latent_dim" or "continuous" in name})
    seconds = _train(preset, sets, out / name)
    params, stored = restore_params(out / name)
    result = evaluate_params(params, stored, args.data, t_samples=args.t_samples)
    result.update(variant=name, train_seconds=seconds, steps=args.steps, shape=args.shape)
    results[name] = result
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(
      f"{name:20s} {result['bits_per_char']:.4f} ± {result['bits_per_char_stderr']:.4f} bits/char  "
      f"{result['nats_per_token']:.4f} nats/token  trained in {seconds:.0f} s",
      flush=True,
    )
  (out / "results.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------- noise profile


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--data", required=True)
  parser.add_argument("--batches", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--sigmas", default="1,2,4,8,16,32,64,100")


def run_noise_profile(args: argparse.Namespace) -> None:
  """A continuous checkpoint's cross-entropy by noise level.

  Every block of --batches held-out batches noised to each of --sigmas; prints the cross-entropy at each and the
  share of the schedule's training draws above each sigma.
  """
  params, cfg = restore_params(args.checkpoint)
  if cfg.objective.name != "continuous":
    usage.fail(
      "mercury_jax.bench noise-profile",
      f"--checkpoint {args.checkpoint}: objective {cfg.objective.name!r}, not a continuous checkpoint",
    )
  objective = dataclasses.replace(cfg.objective, self_conditioning=0.0)
  model = Transformer(cfg.model)
  split = pipeline.eval_batches(
    args.data, "validation", seq_len=cfg.model.max_length, global_batch_size=args.batch_size, num_batches=None
  )
  batches = split[: args.batches]
  blocks = cfg.model.max_length // (objective.block_size or cfg.model.max_length)

  @jax.jit
  def cross_entropy(params, tokens, kinds, u, key):
    segments = K.segment_ids(kinds)

    def logits_fn(x, t, **overrides):
      return model.apply({"params": params}, x, None, **{"segment_ids": segments, **overrides})

    out = continuous_objective.loss(logits_fn, tokens, kinds, key, objective, training=True, u=u)
    return out["loss_sum"] / out["tokens"]

  targets = np.concatenate([b["tokens"][b["kinds"] == K.TARGET] for b in split])
  counts = np.bincount(targets, minlength=cfg.model.vocab_size).astype(np.float64)
  freq = counts[counts > 0] / counts.sum()
  print(f"{args.checkpoint}: the validation split's unigram entropy {-(freq * np.log(freq)).sum():.3f} nats/token")
  sigmas = [float(s) for s in args.sigmas.split(",")]
  for sigma in sigmas:
    u = math.log(sigma / objective.sigma_min) / math.log(objective.sigma_max / objective.sigma_min)
    levels = jnp.full((args.batch_size, blocks), min(max(u, 0.0), 1.0), jnp.float32)
    values = [
      float(cross_entropy(params, jnp.asarray(b["tokens"]), jnp.asarray(b["kinds"]), levels, jax.random.key(i)))
      for i, b in enumerate(batches)
    ]
    print(f"sigma {sigma:7.2f}: cross-entropy {np.mean(values):.3f} nats/token")
  schedules = model.apply({"params": params}, split[0]["tokens"], latent_params=True)  # as the objective reads them
  drawn = np.asarray(
    continuous_objective.sigma_of(
      continuous_objective.inverse_cdf(jnp.linspace(5e-4, 1 - 5e-4, 2000), schedules, objective), objective
    )
  )
  print(f"the {objective.sigma_schedule} schedule's training draws: " + ", ".join(
    f"P(sigma > {s:g}) = {np.mean(drawn > s):.3f}" for s in sigmas[1:]
  ))  # fmt: skip


# ------------------------------------------------------------------------------------------------- draft masking


DRAFT_MASKING = {"all-mask": ("1.0", "1.0"), "range 0.1-1": ("0.1", "1.0")}


def add_masking_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--data", required=True)
  p.add_argument("--runs", required=True)
  p.add_argument("--corpus", default="python-stdlib", help="where the prompts come from")
  p.add_argument("--steps", type=int, default=800)
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--judge", help="an autoregressive checkpoint with the data's tokenizer (default: default_ar)")
  p.add_argument("--json")


def run_draft_masking(args: argparse.Namespace) -> None:
  """Verified drafting: all-mask against a mask-rate range, at the tiny size.

  Trains tiny_verified both ways on the same data, steps and seed; prints each one's held-out figures, verified
  decoding's tokens per forward and --decode diffusion's generative perplexity under a fixed twin.
  """
  from mercury_jax.evaluate import main as evaluate_main

  judge = Sampler.from_checkpoint(args.judge or default_checkpoint("default_ar"))
  tokenizer = pipeline.load_data_tokenizer(args.data)
  prompts, _ = bench_prompts.select_prompts(
    args.data, args.prompts, lambda text: len(tokenizer.encode(text)) <= 256 - args.length, args.corpus
  )
  texts = [x.text for x in prompts]
  ids = [tokenizer.encode(t) for t in texts]
  rows = []
  for name, (low, high) in DRAFT_MASKING.items():
    workdir = Path(args.runs) / name.replace(" ", "_")
    overrides = {
      "data.path": args.data, "model.max_length": "256", "train.steps": str(args.steps), "train.eval_every": "0",
      "objective.draft_mask_min": low, "objective.draft_mask_max": high, "checkpoint.every": str(args.steps),
    }  # fmt: skip
    if not (workdir / files.CHECKPOINTS).exists():
      _train("tiny_verified", overrides, workdir)
    out = workdir / "eval.json"
    evaluate_main(["--checkpoint", str(workdir), "--data", args.data, "--max-batches", "16", "--json", str(out)])
    held_out = json.loads(out.read_text())
    sampler = Sampler.from_checkpoint(workdir)
    row = {
      "variant": name,
      "ar_bits_per_char": held_out["bits_per_char"],
      "draft_all_mask_bits_per_char": held_out["draft"]["all_mask_bits_per_char"],
      "draft_elbo_bits_per_char": held_out["draft"]["elbo_bits_per_char"],
    }
    for temperature in (0.0, 1.0):
      samples = sampler.generate(texts, length=args.length, temperature=temperature, seed=0, token_healing=False)
      row[f"verified_tpf_T{temperature:g}"] = sum(len(s.tokens) for s in samples) / sum(s.nfe for s in samples)
    for per_step in (1, 2):
      steps = args.length // per_step + 1
      samples = sampler.generate(
        texts, length=args.length, temperature=1.0, seed=0, decode="diffusion", steps=steps, token_healing=False
      )
      eos = tokenizer.eos_id
      done = [s.tokens[: s.tokens.index(eos)] if eos in s.tokens else s.tokens for s in samples]
      row[f"diffusion_gen_ppl_{per_step}_per_step"] = quality.generative_perplexity(judge.params, judge.cfg, ids, done)
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- diffusion heads


def add_heads_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--verified", required=True)
  p.add_argument("--diffusion", required=True)
  p.add_argument("--twin", required=True)
  p.add_argument("--data", required=True)
  p.add_argument("--corpus")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--steps", default="64,32")
  p.add_argument("--json")


def run_diffusion_heads(args: argparse.Namespace) -> None:
  """Pure block diffusion: a verified network's draft half against a BD network.

  Both decode the same prompts at T = 1 at each --steps budget (the verified network's own verified decoding is the
  reference); the twin judges the samples; prints one markdown row per setting.
  """
  tokenizer = pipeline.load_data_tokenizer(args.data)
  verified, diffusion, twin = (Sampler.from_checkpoint(x) for x in (args.verified, args.diffusion, args.twin))
  room = min(verified.max_length, diffusion.max_length) - args.length
  prompts, _ = bench_prompts.select_prompts(
    args.data, args.prompts, lambda text: len(tokenizer.encode(text)) <= room, args.corpus
  )
  texts = [x.text for x in prompts]
  ids = [tokenizer.encode(t) for t in texts]
  runs = [("verified network, --decode verified (its next-token head)", verified, {"decode": "verified"})]
  for steps in (int(s) for s in args.steps.split(",")):
    runs.append(
      (f"verified network, --decode diffusion, steps {steps}", verified, {"decode": "diffusion", "steps": steps})
    )
    runs.append((f"block-diffusion network, steps {steps}", diffusion, {"steps": steps}))
  rows = []
  for name, sampler, knobs in runs:
    samples = sampler.generate(texts, length=args.length, temperature=1.0, seed=0, token_healing=False, **knobs)
    completions = []
    for s in samples:
      tokens = s.tokens[: s.tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in s.tokens else s.tokens
      completions.append(tokens)
    judged = sample_quality(ids, texts, completions, twin)
    tpf = sum(len(s.tokens) for s in samples) / max(sum(s.nfe for s in samples), 1)
    row = {
      "setting": name,
      "tokens_per_forward": tpf,
      **{k: judged[k] for k in ("gen_ppl", "unigram_entropy", "parse_rate")},
    }
    rows.append(row)
    print(
      f"| {name} | {tpf:.2f} | {row['gen_ppl']:.1f} | {row['unigram_entropy']:.2f} | {row['parse_rate']:.2f} |",
      flush=True,
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)


COMMANDS = {
  "continuous": (add_continuous_arguments, run_continuous),
  "noise-profile": (add_profile_arguments, run_noise_profile),
  "draft-masking": (add_masking_arguments, run_draft_masking),
  "diffusion-heads": (add_heads_arguments, run_diffusion_heads),
}
