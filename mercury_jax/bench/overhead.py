"""How much of the block engine's wall time is anything but its forward passes.

``ratio = wall time of one generation ÷ (prefill + first passes × their cost + other passes × their cost)``, where
the counts are those the engine reports for that generation (``State.forwards``, ``State.first_passes``) and each
cost is measured alone: the engine's own forward function on the generation's final state, run ``n`` times in a
``fori_loop`` over different blocks (so XLA cannot hoist it), each pass writing its keys and values into the cache
the loop carries (as in the engine), divided by ``n``. A ratio of 1 means the loop, the step
rules, the proposals and the bookkeeping cost nothing next to the model.
"""

from __future__ import annotations

import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.bench.throughput import time_call
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.blocks import BlockEngine
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings


def _median_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  return statistics.median(time_call(fn, *args) for _ in range(repeats))


def engine_overhead(
  sampler: Sampler,
  canvas: cv.Canvas,
  steps: int | None,
  settings: SamplerSettings,
  *,
  cache: str = "auto",
  repeats: int = 5,
  passes: int = 32,
) -> dict[str, Any]:
  """The overhead ratio (module docstring) of ``sampler``'s block engine on one canvas batch (one device).

  Raises:
    ValueError: The model runs the whole-canvas loop for this cache, not the block engine.
  """
  kind, block = sampler.decoder(cache, settings.block_length)
  if kind == "loop":
    raise ValueError("the overhead probe measures the block engine; this model and cache run the whole-canvas loop")
  canvas = cv.Canvas(*(np.asarray(a) for a in canvas))
  canvas, plan, per_block = sampler.engine_layout(canvas, canvas.kinds.shape[1], kind, block, steps, settings)
  engine = BlockEngine(sampler.cfg.model, settings, plan)
  params, key, per_block = sampler.params, jax.random.key(0), jnp.int32(per_block)
  init = jax.jit(engine.init)
  whole = jax.jit(lambda p, c, k, n: engine.advance(p, engine.init(p, c, k, n)))
  final = whole(params, canvas, key, per_block)
  wall = _median_seconds(whole, params, canvas, key, per_block, repeats=repeats)
  prefill = _median_seconds(init, params, canvas, key, per_block, repeats=repeats)
  blocks = int((final.last - final.first).min()) + 1  # step blocks every row has

  def probe(fresh: bool):
    def run(p, st):
      def body(i, carry):  # The pass writes its keys and values into the cache it carries on, as in the engine.
        total, cache = carry
        block, opens = jnp.full_like(st.block, i % blocks), jnp.full_like(st.fresh, fresh)
        moved = st._replace(block=block, fresh=opens, cache=cache)
        logits, cache = engine.forward(p, moved, jnp.ones((st.z.shape[0],), jnp.float32))
        return total + logits[0, 0, 0], cache

      return jax.lax.fori_loop(0, passes, body, (jnp.zeros((), jnp.float32), st.cache))

    return _median_seconds(jax.jit(run), params, final, repeats=repeats) / passes

  first_cost, later_cost = probe(True), probe(False)
  forwards, first = int(final.forwards), int(final.first_passes)
  later = forwards - first - (1 if plan.cache == "exact" else 0)
  predicted = (prefill if plan.cache == "exact" else 0.0) + first * first_cost + later * later_cost
  return {
    "cache": plan.cache,
    "block": block,
    "steps_per_block": int(per_block),
    "wall_s": wall,
    "prefill_s": prefill,
    "first_pass_s": first_cost,
    "pass_s": later_cost,
    "forwards": forwards,
    "first_passes": first,
    "other_passes": later,
    "predicted_s": predicted,
    "ratio": wall / predicted if predicted > 0 else float("nan"),
  }
