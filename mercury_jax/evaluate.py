"""``python -m mercury_jax.evaluate --checkpoint DIR --data DATA_DIR``: held-out likelihood in comparable units.

For a diffusion model: the negative ELBO (an upper bound on the NLL) in nats per token, estimated with a fixed number
of independent t draws per sequence (each draw antithetic across the batch) and reported with its Monte Carlo
standard error. For the autoregressive twin: the exact next-token NLL. Both are also given in bits per character
of the split's text (so models with different tokenizers compare) and as a perplexity (bound).

Bits per character = summed nats ÷ (characters × ln 2), over exactly the tokens the objective scores, and the
characters of exactly those tokens (``Tokenizer.characters_per_token``). Diffusion scores every target token; the
autoregressive twin cannot score the first token of a record (it has no context), so neither that token's loss nor
its characters count, and the two models' figures are fair to each other.

For a ``verified`` model (TiDAR: one network drafts and verifies) the top-level figures are its verifier's: the exact
next-token NLL of the clean half, over the same scored tokens and characters as the twin's, so the two compare
directly. ``draft`` holds the drafter's figures over every target token: ``all_mask_*``, the one-step drafting
cross-entropy with every token of a block masked (deterministic; what the default recipe trains; not a bound), and
``elbo_*``, the block negative ELBO with t drawn per block from ``[t_min, 1]`` (``--t-samples`` draws; an upper bound
on the NLL of the model that decodes a block by iterative unmasking).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from mercury_jax import distributed, kinds as K, sharding as sh, usage
from mercury_jax.checkpoint import restore_params
from mercury_jax.config import Config
from mercury_jax.data import pipeline
from mercury_jax.objectives import autoregressive as ar_objective
from mercury_jax.trainer import Trainer


def evaluate_params(
  params,
  cfg: Config,
  data_dir: str | Path,
  *,
  split: str = "validation",
  t_samples: int = 8,
  batch_size: int | None = None,
  seed: int = 0,
  max_batches: int | None = None,
) -> dict[str, Any]:
  """Scores ``params`` on one exact pass over ``split`` (or its first ``max_batches`` batches)."""
  if t_samples < 1:
    raise ValueError(f"t_samples={t_samples} must be >= 1")
  meta = pipeline.read_metadata(data_dir)
  if meta["splits"].get(split, {}).get("records", 0) == 0:
    raise ValueError(f"split {split!r} of {str(data_dir)!r} has no records")
  batch_size = batch_size or cfg.data.batch_size
  mesh = sh.make_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  params = jax.device_put(params, trainer.state_shardings["params"])
  local = pipeline.eval_batches(
    data_dir,
    split,
    seq_len=cfg.model.max_length,
    global_batch_size=batch_size,
    num_batches=None,
    document_segments=cfg.data.document_segments,
  )
  batches = [pipeline.to_global(b, mesh, trainer.rules) for b in local[:max_batches]]
  tokenizer = pipeline.load_data_tokenizer(data_dir)
  covered = min(meta["splits"][split]["records"], len(batches) * batch_size)
  if cfg.objective.verified:
    return _evaluate_verified(
      trainer, params, batches, local[:max_batches], tokenizer, t_samples=t_samples, seed=seed
    ) | {
      "split": split,
      "records": covered,
    }
  autoregressive = cfg.objective.autoregressive
  draws = 1 if autoregressive else t_samples
  per_draw = [
    trainer.nats_per_token(params, batches, jax.random.fold_in(jax.random.key(seed), d)) for d in range(draws)
  ]
  nats = float(np.mean(per_draw))
  stderr = float(np.std(per_draw, ddof=1) / math.sqrt(draws)) if draws > 1 else 0.0
  tokens, characters = _scored_counts(local[:max_batches], tokenizer, autoregressive)
  bits_per_char = nats * tokens / (characters * math.log(2))
  return {
    "objective": cfg.objective.name,
    "bound": not autoregressive,
    "split": split,
    "records": covered,
    "scored_tokens": tokens,
    "characters": characters,
    "t_samples": draws,
    "nats_per_token": nats,
    "nats_per_token_stderr": stderr,
    "bits_per_char": bits_per_char,
    "bits_per_char_stderr": stderr * tokens / (characters * math.log(2)),
    "perplexity": math.exp(min(nats, 50.0)),
  }


def _evaluate_verified(trainer: Trainer, params, batches, local_batches, tokenizer, *, t_samples: int, seed: int):
  """A verified model's verifier (top level, as the twin's) and drafter (``draft``) figures (module docstring)."""
  key = jax.random.key(seed)
  one_pass = trainer.eval_sums(params, batches, key, draft="all_mask")  # The verifier and the one-step drafter.
  elbo = [trainer.eval_sums(params, batches, jax.random.fold_in(key, d), draft="elbo") for d in range(t_samples)]
  ar_tokens, ar_chars = _scored_counts(local_batches, tokenizer, autoregressive=True)
  draft_tokens, draft_chars = _scored_counts(local_batches, tokenizer, autoregressive=False)
  bits = lambda nats, tokens, chars: nats * tokens / (chars * math.log(2))  # noqa: E731
  nats = one_pass["ar_loss_sum"] / max(one_pass["ar_tokens"], 1.0)
  drafting = one_pass["draft_loss_sum"] / max(one_pass["draft_tokens"], 1.0)
  per_draw = [d["draft_loss_sum"] / max(d["draft_tokens"], 1.0) for d in elbo]
  bound = float(np.mean(per_draw))
  stderr = float(np.std(per_draw, ddof=1) / math.sqrt(t_samples)) if t_samples > 1 else 0.0
  return {
    "objective": "verified",
    "bound": False,
    "scored_tokens": ar_tokens,
    "characters": ar_chars,
    "t_samples": 1,
    "nats_per_token": nats,
    "nats_per_token_stderr": 0.0,
    "bits_per_char": bits(nats, ar_tokens, ar_chars),
    "bits_per_char_stderr": 0.0,
    "perplexity": math.exp(min(nats, 50.0)),
    "draft": {
      "draft_length": trainer.cfg.objective.draft_length,
      "scored_tokens": draft_tokens,
      "characters": draft_chars,
      "all_mask_nats_per_token": drafting,
      "all_mask_bits_per_char": bits(drafting, draft_tokens, draft_chars),
      "elbo_t_samples": t_samples,
      "elbo_nats_per_token": bound,
      "elbo_nats_per_token_stderr": stderr,
      "elbo_bits_per_char": bits(bound, draft_tokens, draft_chars),
      "elbo_bits_per_char_stderr": bits(stderr, draft_tokens, draft_chars),
    },
  }


def _scored_counts(local_batches, tokenizer, autoregressive: bool) -> tuple[int, int]:
  """Tokens the objective scores and their characters, over every process's batches."""
  chars = tokenizer.characters_per_token()
  tokens = characters = 0
  for batch in local_batches:
    if autoregressive:
      scored = np.asarray(ar_objective.scored(batch["kinds"]))
    else:
      scored = batch["kinds"] == K.TARGET
    ids = np.clip(batch["tokens"][scored], 0, len(chars) - 1)
    tokens, characters = tokens + int(scored.sum()), characters + int(chars[ids].sum())
  counts = np.asarray([tokens, characters], np.int64)
  if jax.process_count() > 1:
    counts = np.asarray(multihost_utils.process_allgather(counts)).reshape(-1, 2).sum(axis=0)
  return int(counts[0]), int(counts[1])


def main(argv: list[str] | None = None) -> None:
  parser = usage.Parser(prog="python -m mercury_jax.evaluate", description=__doc__.split("\n")[0], command="evaluate")
  parser.add_argument("--checkpoint", required=True, help="a train workdir, checkpoint folder or exported model")
  parser.add_argument("--data", required=True, help="a directory written by `python -m mercury_jax.prepare`")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--t-samples", type=int, default=8, help="independent t draws per sequence (diffusion)")
  parser.add_argument("--batch-size", type=int, help="global batch (default: the model's training batch)")
  parser.add_argument("--max-batches", type=int, help="score only the first N batches of the split")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", metavar="FILE", help="also write the result to FILE")
  distributed.add_arguments(parser)
  args = parser.parse_args(argv)
  try:
    distributed.initialize(args)
    params, cfg = restore_params(args.checkpoint)
    meta = pipeline.read_metadata(args.data)
    if meta["seq_len"] != cfg.model.max_length or meta["vocab_size"] > cfg.model.vocab_size:
      raise ValueError(
        f"data at {args.data!r} (seq_len {meta['seq_len']}, vocab {meta['vocab_size']}) does not fit "
        f"the model (max_length {cfg.model.max_length}, vocab {cfg.model.vocab_size})"
      )
    result = evaluate_params(
      params,
      cfg,
      args.data,
      split=args.split,
      t_samples=args.t_samples,
      batch_size=args.batch_size,
      seed=args.seed,
      max_batches=args.max_batches,
    )
  except (ValueError, FileNotFoundError) as e:
    usage.fail("evaluate", e)
  result["checkpoint"] = str(args.checkpoint)
  text = json.dumps(result, indent=2)
  if args.json and distributed.is_primary():
    tmp = Path(args.json).with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(args.json)
  print(text)


if __name__ == "__main__":
  main()
