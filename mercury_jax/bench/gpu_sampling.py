"""Sampling throughput of the bundled models on an accelerator: tokens/s by batch size, compute dtype and attention.

    JAX_PLATFORMS=cuda python -m mercury_jax.bench gpu-sampling --json OUT.json
    python -m mercury_jax.bench gpu-sampling --models default_ar --batch-sizes 1,2 --length 16 --repeats 1  # any host

For each bundled model (``default_bd``: block diffusion, blocks of 8 refined one token a step against the exact
cache; ``default_ar``: its autoregressive twin; ``default``: verified decoding), each compute dtype and each attention
implementation, the model's parameters are restored once and its config's ``model.dtype`` / ``model.attention``
replaced (the weights are the same; bfloat16 computes in bfloat16 with float32 accumulation where XLA chooses it).
Every batch size is generated once untimed (its programs compile), then ``--repeats`` times timed through
``Sampler.generate``, the path of ``python -m mercury_jax.sample``: the short code prompts of ``bench serve``
(``prompts.CODE_PROMPTS``) repeated to fill the batch, ``--length`` new tokens each, temperature 1, one seed per
repeat. Token healing is off (its automaton needs outlines-core, which accelerator images may lack; it adds one
generated position).

Printed per row: generated tokens/s (median over repeats of generated tokens / wall, compile excluded), the mean NFE
of a row, tokens per forward pass and milliseconds per forward pass (wall / the largest row NFE).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import jax

from mercury_jax import sharding as sh, usage
from mercury_jax.bench.prompts import CODE_PROMPTS
from mercury_jax.checkpoint import restore_params
from mercury_jax.config import MeshConfig
from mercury_jax.data.tokenizer import load_tokenizer
from mercury_jax.sampling.registry import BUNDLED_MODELS, default_checkpoint
from mercury_jax.sampling.sampler import Sampler


def _csv(kind):
  return lambda text: [kind(x) for x in text.split(",") if x]


def bench_model(name: str, dtype: str, attention: str, args) -> list[dict]:
  path = default_checkpoint(name)
  mesh = sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  params, cfg = restore_params(path, mesh=mesh)
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype, attention=attention))
  sampler = Sampler(params, cfg, load_tokenizer(path), mesh=mesh)
  rows = []
  for batch in args.batch_sizes:
    prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(batch)]
    generate = lambda seed, prompts=prompts: sampler.generate(  # noqa: E731
      prompts, length=args.length, seed=seed, token_healing=False, temperature=1.0
    )
    compile_s = generate(0)[0].compile_time
    runs = [generate(1 + r) for r in range(args.repeats)]
    walls = [samples[0].wall_time for samples in runs]
    generated = [sum(len(s.tokens) for s in samples) for samples in runs]
    nfe = [max(s.nfe for s in samples) for samples in runs]
    mean_nfe = statistics.mean(statistics.mean(s.nfe for s in samples) for samples in runs)
    row = {
      "model": name,
      "dtype": dtype,
      "attention": attention,
      "batch": batch,
      "length": args.length,
      "tokens_per_s": statistics.median(g / w for g, w in zip(generated, walls, strict=True)),
      "wall_s": statistics.median(walls),
      "nfe": mean_nfe,
      "tokens_per_forward": statistics.mean(g / batch for g in generated) / mean_nfe,
      "ms_per_forward": 1e3 * statistics.median(w / n for w, n in zip(walls, nfe, strict=True)),
      "compile_s": compile_s,
    }
    print(
      f"| {name} | {dtype} | {attention} | {batch} | {row['tokens_per_s']:,.0f} | {row['nfe']:.1f} | "
      f"{row['tokens_per_forward']:.2f} | {row['ms_per_forward']:.2f} | {compile_s:.1f} |",
      flush=True,
    )
    rows.append(row)
  return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--models", type=_csv(str), default=["default_bd", "default_ar", "default"])
  parser.add_argument("--dtypes", type=_csv(str), default=["bfloat16", "float32"])
  parser.add_argument("--attention", type=_csv(str), default=["pallas", "xla"])
  parser.add_argument("--batch-sizes", type=_csv(int), default=[1, 16, 64, 256])
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", type=Path)


def run_gpu_sampling(args: argparse.Namespace) -> None:
  """GPU: the bundled models' tokens/s by batch size, dtype and attention.

  Each bundled model, dtype and attention implementation generates --length tokens per row through
  Sampler.generate at each batch size (compiled once, then --repeats timed runs); prints tokens/s, NFE and ms per
  forward pass.
  """
  unknown = sorted(set(args.models) - set(BUNDLED_MODELS))
  if unknown:
    usage.fail(
      "mercury_jax.bench gpu-sampling",
      f"--models {','.join(unknown)}: not bundled; choose from {', '.join(BUNDLED_MODELS)}",
    )
  device = jax.devices()[0]
  print(f"{device.platform} {device.device_kind}, jax {jax.__version__}")
  print("| model | dtype | attention | batch | tokens/s | NFE | tokens/forward | ms/forward | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for name in args.models:
    for dtype in args.dtypes:
      for attention in args.attention:
        try:
          rows.extend(bench_model(name, dtype, attention, args))
        except Exception as e:  # One failing combination must not cost the rest of a timed device session.
          print(f"| {name} | {dtype} | {attention} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
          rows.append({"model": name, "dtype": dtype, "attention": attention, "error": repr(e)[:2000]})
  if args.json:
    args.json.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__, "rows": rows}, indent=1))


COMMANDS = {"gpu-sampling": (add_arguments, run_gpu_sampling)}
