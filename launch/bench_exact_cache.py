"""The engine's exact cache against Fast-dLLM's approximate dual cache and the AR twin, at one shape, interleaved.

    python launch/bench_exact_cache.py [--rounds 3] [--batch 1] [--json OUT.json]

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from mercury_jax.config import ModelConfig
from mercury_jax.model import Transformer, count_params
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.caches import Needs
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.settings import SamplerSettings

MODEL = ModelConfig(
  vocab_size=4096, d_model=256, num_layers=8, num_heads=4, num_kv_heads=4, head_dim=64, mlp_dim=704, max_length=512
)
PROMPT, NEW, BLOCK = 32, 256, 32


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


def _peak_gflops() -> float:
  x = jnp.ones((1024, 1024), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * 1024**3 / min(times) / 1e9


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

  jitted = jax.jit(run)
  x = jnp.ones((tokens, d), jnp.float32)
  jax.block_until_ready(jitted(x))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(jitted(x))
    times.append(time.perf_counter() - start)
  return min(times) / passes


def _profile(engine: BlockEngine, params, state, passes: int = 16) -> dict:
  """Seconds per block pass, per commit and block pass, and per whole step (forward, proposals, rule, commit), each
  alone in a ``fori_loop`` from the state before the first step (the cache carried, so nothing is hoisted)."""
  batch = state.z.shape[0]
  ones = jnp.ones((batch,), bool)

  def timed(fn):
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(params, state))
    best = []
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(jitted(params, state))
      best.append(time.perf_counter() - start)
    return min(best) / passes

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

  return {"block_pass_s": timed(forward(False)), "commit_and_block_s": timed(forward(True)), "step_s": timed(steps)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--json", help="write the numbers here too")
  args = p.parse_args()
  params = _params(MODEL)
  engines = _engines(args.batch)
  finals = {}
  for name, (_, run, canvas) in engines.items():  # compile and warm up
    finals[name] = jax.block_until_ready(run(params, canvas))
  walls = {name: [] for name in engines}
  names = list(engines)
  for r in range(args.rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      engine, run, canvas = engines[name]
      start = time.perf_counter()
      jax.block_until_ready(run(params, canvas))
      walls[name].append(time.perf_counter() - start)
  rows = {}
  for name in names:
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
  gflops = _peak_gflops()
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


if __name__ == "__main__":
  main()
