"""Issue 27's schedule comparison: the continuous objective under each noise schedule against block diffusion.

Every model is trained from the same seed on the same prepared data for the same steps (so the same tokens), then
scored on the held-out split by ``mercury_jax.evaluate`` (the continuous bound, and the block-diffusion ELBO): one
table in bits per character, one JSON file per run.

  python -m mercury_jax.prepare --corpus python-stdlib --out RUNS/data
  python launch/bench_continuous.py --data RUNS/data --out RUNS/continuous --steps 600

``--shape`` picks the model size (``tiny``: the tiny presets' shape; ``default``: the bundled models' shape).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True, help="a directory written by `python -m mercury_jax.prepare`")
  parser.add_argument("--out", required=True, help="one workdir per variant and results.json go here")
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--shape", choices=("tiny", "default"), default="tiny")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
  parser.add_argument("--t-samples", type=int, default=4, help="independent noise draws per held-out sequence")
  args = parser.parse_args(argv)

  from mercury_jax.checkpoint import restore_params
  from mercury_jax.config import load_config
  from mercury_jax.evaluate import evaluate_params
  from mercury_jax.train import train

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
    cfg = load_config(preset, sets)
    start = time.perf_counter()
    train(cfg, out / name, log=False)
    seconds = time.perf_counter() - start
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
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
