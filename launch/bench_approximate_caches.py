"""Fast-dLLM's approximate caches on a whole-sequence checkpoint: speed and agreement with the uncached engine.

    python launch/bench_approximate_caches.py [--checkpoint DIR] [--length 128] [--block 32] [--steps-per-block 16]

Runs the engine on each prompt at batch 1 with ``cache="none"`` (every step recomputes the canvas), ``dual``
and ``prefix``, in rounds whose order rotates (so a change in the machine's capacity hits every cache alike), and
prints each cache's median wall time over the rounds, its speed-up over ``none`` and the fraction of generated
positions whose token equals the uncached run's (the approximation's effect; 1.0 would be exact).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.plan import Decoding
from mercury_jax.sampling.sampler import Sampler

PROMPTS = (
  "def fibonacci(n):",
  "import os\n\ndef list_files(path):",
  "class Stack:\n    def push(self, item):",
  "def parse_header(line):",
  "def read_config(path):",
  "def merge(a, b):",
  "def is_prime(n):",
  "for i in range(10):",
)
CACHES = ("none", "dual", "prefix")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", help="a whole-sequence diffusion checkpoint (default: the bundled model)")
  p.add_argument("--length", type=int, default=128, help="tokens to generate per prompt")
  p.add_argument("--block", type=int, default=32)
  p.add_argument("--steps-per-block", type=int, default=16)
  p.add_argument("--rounds", type=int, default=3)
  args = p.parse_args()
  sampler = Sampler.from_checkpoint(args.checkpoint)
  settings = sampler.settings(rule="confidence")
  canvases = [
    cv.Canvas(
      *(np.asarray(a) for a in cv.make_canvas([cv.prefix(sampler.tokenizer.encode(t), args.length)], streams=[i]))
    )
    for i, t in enumerate(PROMPTS)
  ]
  compiled = {}

  def run(cache: str, canvas: cv.Canvas) -> np.ndarray:
    plan = sampler.plan(Decoding(cache, args.block), np.shape(canvas.tokens)[1])
    canvas = cv.pad_length(canvas, plan.length)
    if (cache, plan) not in compiled:
      compiled[(cache, plan)] = jax.jit(BlockEngine(sampler.network, settings, plan).sample)
    steps = jnp.full((1,), args.steps_per_block, jnp.int32)
    out = compiled[(cache, plan)](sampler.params, canvas, jax.random.key(0), steps)
    return np.asarray(jax.block_until_ready(out).tokens)[0]

  for cache in CACHES:  # compile and warm up
    for canvas in canvases:
      run(cache, canvas)
  walls, tokens = {c: [] for c in CACHES}, {}
  for r in range(args.rounds):
    for cache in CACHES[r % 3 :] + CACHES[: r % 3]:
      start = time.perf_counter()
      tokens[cache] = [run(cache, canvas) for canvas in canvases]
      walls[cache].append(time.perf_counter() - start)
  generated = [np.asarray(c.kinds)[0] == cv.TARGET for c in canvases]
  base = statistics.median(walls["none"])
  for cache in CACHES:
    same = np.mean([np.mean(a[g] == b[g]) for a, b, g in zip(tokens[cache], tokens["none"], generated, strict=True)])
    wall = statistics.median(walls[cache])
    print(f"{cache:7s} {wall:7.3f} s  {base / wall:5.2f}x none  tokens equal to none: {same:.2f}")


if __name__ == "__main__":
  main()
