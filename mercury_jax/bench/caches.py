"""The engine's caches against each other: the exact cache against Fast-dLLM's approximate ones, interleaved.

``exact-cache``::

    python -m mercury_jax.bench exact-cache [--rounds 3] [--batch 1] [--json OUT.json]

Random weights at d_model 256, 8 layers, vocabulary 4096 (the shape of issue 23's measurement): a prompt of 32
tokens, 256 new tokens, blocks of 32, one token per step, so every decoder runs 256 steps. Three engines:

* ``exact``: a block-diffusion model (blocks of 32) with the exact cache: a commit pass of the finished block and a
  block pass per step, ``B`` tokens each;
* ``dual``: the same network as a whole-sequence model with Fast-dLLM's DualCache (approximate): a whole-canvas pass
  at each block's first step, the block alone after that;
* ``twin``: the same network as a causal model, decoded one token per step (blocks of one token).

Rounds rotate the order, so a change of the machine's capacity hits every engine alike; the table gives each one's
median tokens/s and time per forward pass (wall ÷ steps that ran the network), and their ratios to ``dual``. Then a
profile of one exact step: the commit pass, the block pass and a whole step (forward, proposals, rule, commit) each
timed alone in a ``fori_loop``, against the time of the block pass's matmuls at the machine's measured matmul rate.

``approximate-caches``::

    python -m mercury_jax.bench approximate-caches [--checkpoint DIR] [--length 128] [--block 32]

Fast-dLLM's approximate caches on a whole-sequence checkpoint: the engine on each prompt at batch 1 with
``cache="none"`` (every step recomputes the canvas), ``dual`` and ``prefix``, in rounds whose order rotates, and
prints each cache's median wall time over the rounds, its speed-up over ``none`` and the fraction of generated
positions whose token equals the uncached run's (the approximation's effect; 1.0 would be exact).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from mercury_jax import usage
from mercury_jax.bench.throughput import best_seconds, interleaved, matmul_peak, timed
from mercury_jax.config import ModelConfig
from mercury_jax.model import Transformer, count_params
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.caches import Needs
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import Decoding, plan_blocks
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings, SettingError

MODEL = ModelConfig(
  vocab_size=4096, d_model=256, num_layers=8, num_heads=4, num_kv_heads=4, head_dim=64, mlp_dim=704, max_length=512
)
PROMPT, NEW, BLOCK = 32, 256, 32
PROMPTS = (  # approximate-caches: batch 1, one prompt after another
  "def fibonacci(n):",
  "import os\n\ndef list_files(path):",
  "class Stack:\n    def push(self, item):",
  "def parse_header(line):",
  "def read_config(path):",
  "def merge(a, b):",
  "def is_prime(n):",
  "for i in range(10):",
)
APPROXIMATE = ("none", "dual", "prefix")


def _params(cfg: ModelConfig):
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * 4.0, params)


def _canvas(batch: int) -> cv.Canvas:
  rng = np.random.default_rng(0)
  return cv.make_canvas([cv.prefix(rng.integers(5, 4000, PROMPT).tolist(), NEW) for _ in range(batch)])


def _engines(batch: int):
  canvas = _canvas(batch)
  settings = SamplerSettings(rule="confidence", temperature=0.0, eos_id=-1, num_tokens=4096)  # never stops early
  out = {}
  for name, causal, block, cache, whole in (
    ("exact", False, BLOCK, "exact", False),
    ("dual", False, BLOCK, "dual", True),
    ("twin", True, 1, "exact", False),
  ):
    cfg = dataclasses.replace(MODEL, causal=causal)
    plan = plan_blocks(canvas.kinds, block, cache=cache, autoregressive=causal, whole_sequence=whole)
    engine = BlockEngine(Network(cfg), settings, plan)
    steps = jnp.full((batch,), block, jnp.int32)  # one token per step
    run = jax.jit(lambda p, c, e=engine, n=steps: e.advance(p, e.init(p, c, jax.random.key(0), n)))
    out[name] = (engine, run, canvas)
  return out


def _chunk_matmuls(cfg: ModelConfig, tokens: int, passes: int):
  """The seconds per pass of the dense matmuls a chunk of ``tokens`` runs through the network (q, k, v and output
  projections, the SwiGLU MLP and the head, every layer), alone in a ``fori_loop``: the floor a pass cannot beat."""
  keys = jax.random.split(jax.random.key(1), 8)
  d, h, m = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  w = [
    jax.random.normal(k, s, jnp.float32) * 0.02
    for k, s in zip(keys, [(d, 3 * h), (h, d), (d, 2 * m), (m, d), (d, cfg.vocab_size)], strict=False)
  ]

  def run(x):
    def body(i, x):
      for _ in range(cfg.num_layers):
        qkv = x @ w[0]
        x = x + qkv[:, :h] @ w[1]
        gate_up = x @ w[2]
        x = x + jax.nn.silu(gate_up[:, :m]) * gate_up[:, m:] @ w[3]
      return x + (x @ w[4])[:, :d] * 1e-6

    return jax.lax.fori_loop(0, passes, body, x)

  return best_seconds(jax.jit(run), jnp.ones((tokens, d), jnp.float32), repeats=3) / passes


def _profile(engine: BlockEngine, params, state, passes: int = 16) -> dict:
  """Seconds per block pass, per commit and block pass, and per whole step (forward, proposals, rule, commit), each
  alone in a ``fori_loop`` from the state before the first step (the cache carried, so nothing is hoisted)."""
  batch = state.z.shape[0]
  ones = jnp.ones((batch,), bool)

  def forward(fresh: bool):
    def run(p, st):
      def body(i, carry):
        total, cache = carry
        moved = st._replace(fresh=jnp.full_like(st.fresh, fresh), cache=cache)
        needs = Needs(engine.starts(moved), jnp.ones((batch,), jnp.float32), ones, moved.fresh)
        result = engine.cache.forward(p, moved, needs)
        return total + result.logits[0, 0, 0], result.cache

      return jax.lax.fori_loop(0, passes, body, (jnp.zeros((), jnp.float32), st.cache))[0]

    return run

  def steps(p, st):
    def body(i, carry):
      total, cache = carry
      after = engine.step(p, st._replace(fresh=jnp.zeros_like(st.fresh), changed=ones, cache=cache))
      return total + after.score[0, 0], after.cache

    return jax.lax.fori_loop(0, passes, body, (jnp.zeros((), jnp.float32), st.cache))[0]

  timings = {"block_pass_s": forward(False), "commit_and_block_s": forward(True), "step_s": steps}
  return {name: best_seconds(jax.jit(fn), params, state, repeats=3) / passes for name, fn in timings.items()}


def add_exact_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--json", help="write the numbers here too")


def run_exact_cache(args: argparse.Namespace) -> None:
  """The exact cache against Fast-dLLM's dual cache and the AR twin.

  Random weights (d 256, 8 layers), 256 new tokens one per step in blocks of 32; prints tokens/s and ms per forward
  pass of each engine, then a profile of one exact step against the time of its matmuls.
  """
  params = _params(MODEL)
  engines = _engines(args.batch)
  finals = {name: timed(run, params, canvas)[0] for name, (_, run, canvas) in engines.items()}  # compile, warm up
  calls = {name: (run, (params, canvas)) for name, (_, run, canvas) in engines.items()}
  walls = interleaved(calls, args.rounds, warm=False)
  rows = {}
  for name in engines:
    wall = statistics.median(walls[name])
    forwards = int(finals[name].forwards)
    rows[name] = {
      "tokens_per_s": args.batch * NEW / wall,
      "wall_s": wall,
      "forwards": forwards,
      "ms_per_forward": 1e3 * wall / forwards,
      "walls_s": walls[name],
    }
  print(f"| decoder | tokens/s | wall (s) | steps with a pass | ms per pass | x dual per pass |  (batch {args.batch})")
  print("|---|---|---|---|---|---|")
  for name, row in rows.items():
    ratio = row["ms_per_forward"] / rows["dual"]["ms_per_forward"]
    print(
      f"| {name} | {row['tokens_per_s']:.1f} | {row['wall_s']:.3f} | {row['forwards']} | {row['ms_per_forward']:.2f} "
      f"| {ratio:.2f} |"
    )
  engine, _, canvas = engines["exact"]
  start_state = jax.jit(lambda p, c: engine.init(p, c, jax.random.key(0), jnp.full((args.batch,), BLOCK)))(
    params, canvas
  )
  profile = _profile(engine, params, start_state)
  matmul_s = _chunk_matmuls(MODEL, BLOCK * args.batch, 16)
  gflops = matmul_peak(1024) / 1e9
  n = count_params(params) - MODEL.vocab_size * MODEL.d_model  # the embedding is a gather
  block_flops = 2 * n * BLOCK * args.batch
  profile.update(peak_gflops=gflops, block_matmul_s=matmul_s, block_gflop=block_flops / 1e9)
  print(
    f"\nexact step profile (batch {args.batch}): block pass {1e3 * profile['block_pass_s']:.2f} ms, commit + block "
    f"pass {1e3 * profile['commit_and_block_s']:.2f} ms, whole step {1e3 * profile['step_s']:.2f} ms. The block "
    f"pass's matmuls ({block_flops / 1e9:.2f} GFLOP at [{BLOCK * args.batch}, d] shapes) alone take "
    f"{1e3 * matmul_s:.2f} ms ({block_flops / matmul_s / 1e9:.0f} GFLOP/s; a 1024^3 matmul runs at {gflops:.0f}): "
    f"block pass / its matmuls {profile['block_pass_s'] / matmul_s:.2f}, step / block pass "
    f"{profile['step_s'] / profile['block_pass_s']:.2f}"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {"rows": rows, "profile": profile, "batch": args.batch, "model": dataclasses.asdict(MODEL)}, f, indent=1
      )


def add_approximate_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--checkpoint", help="a whole-sequence diffusion checkpoint (default: the bundled model)")
  p.add_argument("--length", type=int, default=128, help="tokens to generate per prompt")
  p.add_argument("--block", type=int, default=32)
  p.add_argument("--steps-per-block", type=int, default=16)
  p.add_argument("--rounds", type=int, default=3)


def run_approximate_caches(args: argparse.Namespace) -> None:
  """Fast-dLLM's dual and prefix caches against no cache: speed, agreement.

  A whole-sequence checkpoint decodes 8 prompts at batch 1 with each cache, in rotating rounds; prints each cache's
  median wall time, its speed-up over none and the share of its tokens equal to the uncached run's.
  """
  sampler = Sampler.from_checkpoint(args.checkpoint)
  settings = sampler.settings(rule="confidence")
  try:  # a checkpoint without the approximate caches: one line, before anything compiles
    sampler.plan(Decoding("dual", args.block))
  except SettingError as e:
    usage.fail("mercury_jax.bench approximate-caches", f"--checkpoint {args.checkpoint}: {e}")
  canvases = [
    cv.Canvas(
      *(np.asarray(a) for a in cv.make_canvas([cv.prefix(sampler.tokenizer.encode(t), args.length)], streams=[i]))
    )
    for i, t in enumerate(PROMPTS)
  ]
  compiled = {}

  def run(cache: str, canvas: cv.Canvas) -> np.ndarray:
    """The tokens of ``canvas``'s positions (the plan's padding dropped)."""
    width = np.shape(canvas.tokens)[1]
    plan = sampler.plan(Decoding(cache, args.block), width)
    if (cache, plan) not in compiled:
      compiled[(cache, plan)] = jax.jit(BlockEngine(sampler.network, settings, plan).sample)
    steps = jnp.full((1,), args.steps_per_block, jnp.int32)
    out = compiled[(cache, plan)](sampler.params, cv.pad_length(canvas, plan.length), jax.random.key(0), steps)
    return np.asarray(jax.block_until_ready(out).tokens)[0, :width]

  every = lambda cache: [run(cache, canvas) for canvas in canvases]  # noqa: E731
  walls = interleaved({cache: (every, (cache,)) for cache in APPROXIMATE}, args.rounds)  # the first call compiles
  tokens = {cache: every(cache) for cache in APPROXIMATE}
  generated = [np.asarray(c.kinds)[0] == cv.TARGET for c in canvases]
  base = statistics.median(walls["none"])
  for cache in APPROXIMATE:
    same = np.mean([np.mean(a[g] == b[g]) for a, b, g in zip(tokens[cache], tokens["none"], generated, strict=True)])
    wall = statistics.median(walls[cache])
    print(f"{cache:7s} {wall:7.3f} s  {base / wall:5.2f}x none  tokens equal to none: {same:.2f}")


COMMANDS = {
  "exact-cache": (add_exact_arguments, run_exact_cache),
  "approximate-caches": (add_approximate_arguments, run_approximate_caches),
}
