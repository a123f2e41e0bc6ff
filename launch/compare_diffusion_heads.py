"""Which network should serve pure block diffusion (``--decode diffusion``): a verified checkpoint's draft half, or a
block-diffusion checkpoint trained for refinement?

    python launch/compare_diffusion_heads.py --verified models/verified --diffusion models/bd --twin models/ar \
        --data DATA_DIR [--prompts 64] [--length 64] [--steps 64,32] [--json OUT.json]

Both decode the same documented-function prompts of the validation split (``mercury_jax.bench.prompts``) through
``Sampler.generate`` at temperature 1, with the threshold rule at each total step budget; the twin judges the
samples (generative perplexity, unigram entropy, parse rate: ``mercury_jax.bench.cli.sample_quality``). The verified
checkpoint's own ``--decode verified`` row (exactly its next-token head) is the reference.
"""

from __future__ import annotations

import argparse
import json

from mercury_jax.bench import prompts as bench_prompts
from mercury_jax.bench.cli import sample_quality
from mercury_jax.data import pipeline
from mercury_jax.sampling.sampler import Sampler


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--verified", required=True)
  p.add_argument("--diffusion", required=True)
  p.add_argument("--twin", required=True)
  p.add_argument("--data", required=True)
  p.add_argument("--corpus")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--steps", default="64,32")
  p.add_argument("--json")
  args = p.parse_args()
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
    quality = sample_quality(ids, texts, completions, twin)
    tpf = sum(len(s.tokens) for s in samples) / max(sum(s.nfe for s in samples), 1)
    row = {
      "setting": name,
      "tokens_per_forward": tpf,
      **{k: quality[k] for k in ("gen_ppl", "unigram_entropy", "parse_rate")},
    }
    rows.append(row)
    print(
      f"| {name} | {tpf:.2f} | {row['gen_ppl']:.1f} | {row['unigram_entropy']:.2f} | {row['parse_rate']:.2f} |",
      flush=True,
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
