"""How much of the engine's wall time is anything but its forward passes.

``ratio = wall time of one generation ÷ (prefill + first passes × their cost + other passes × their cost)``, where
the counts are those the engine reports for that generation (``State.forwards``; ``State.commit_passes``, the steps
that opened a block: the exact cache's commit pass and block pass, or an approximate cache's refresh) and each cost
is measured alone: the engine's own cache strategy (``forward``) on the generation's final state, run ``n`` times in a
``fori_loop`` over different blocks (so XLA cannot hoist it), each pass writing into the cache the loop carries (as
in the engine), divided by ``n``. A ratio of 1 means the loop, the step rules, the proposals and the bookkeeping cost
nothing next to the model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.bench.throughput import median_seconds, time_call
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.caches import Needs
from mercury_jax.sampling.drafts import Candidates
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.jobs import Budget
from mercury_jax.sampling.plan import Decoding
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings


def engine_overhead(
  sampler: Sampler,
  canvas: cv.Canvas,
  steps: int | None,
  settings: SamplerSettings,
  *,
  cache: str = "auto",
  repeats: int = 5,
  passes: int = 32,
  timer: bool = False,
) -> dict[str, Any]:
  """The overhead ratio (module docstring) of ``sampler``'s engine on one canvas batch (one device); with ``timer``,
  also ``"timer"``: a function that times one more run of the later passes (seconds a pass), so that two engines'
  passes can be timed interleaved."""
  decoding = Decoding.of(settings, cache)
  canvas = cv.Canvas(*(np.asarray(a) for a in canvas))
  plan = sampler.plan(decoding, np.shape(canvas.tokens)[1])
  canvas = cv.pad_length(canvas, plan.length, sampler.tokenizer.pad_id)
  whole_canvas = plan.whole_sequence and plan.block >= plan.length
  budgets = sampler.steps_per_block(Budget(steps), canvas.kinds, 0 if whole_canvas else plan.block, settings)
  engine = BlockEngine(sampler.network, settings, plan)
  params, key = sampler.params, jax.random.key(0)
  per_block, extra = jnp.asarray(budgets[:, 0]), jnp.asarray(budgets[:, 1])
  init = jax.jit(lambda p, c, k, n, e: engine.init(p, c, k, n, extra_steps=e))
  whole = jax.jit(lambda p, c, k, n, e: engine.advance(p, engine.init(p, c, k, n, extra_steps=e)))
  final = whole(params, canvas, key, per_block, extra)
  wall = median_seconds(whole, params, canvas, key, per_block, extra, repeats=repeats)
  prefill = 0.0
  if plan.cache == "exact":
    prefill = median_seconds(init, params, canvas, key, per_block, extra, repeats=repeats)
  blocks = int((final.last - final.first).min()) + 1  # step blocks every row has
  if plan.draft:  # Every step runs the same chunk (its first passes are the cost of the others).
    final = final._replace(commit_passes=jnp.zeros_like(final.commit_passes))

  def probe(fresh: bool):
    def run(p, st):
      def body(i, carry):  # The pass writes into the cache it carries on, as in the engine.
        total, cache = carry
        batch = st.z.shape[0]
        moved = st._replace(
          block=jnp.full_like(st.block, i % blocks), fresh=jnp.full_like(st.fresh, fresh), cache=cache
        )
        starts = engine.starts(moved)
        ones = jnp.ones((batch,), bool)
        needs = Needs(starts, jnp.ones((batch,), jnp.float32), ones, ones if plan.draft else moved.fresh)
        if plan.draft:  # The whole tree: every node live (the chunk a step with every candidate runs).
          nodes = jnp.ones((batch, plan.tree.nodes), bool)
          needs = needs._replace(nodes=Candidates(jnp.where(nodes, 5, 0).astype(jnp.int32), nodes))
        out = engine.cache.forward(p, moved, needs)
        return total + out.logits[0, 0, 0], out.cache

      return jax.lax.fori_loop(0, passes, body, (jnp.zeros((), jnp.float32), st.cache))

    return jax.jit(run)

  first_fn, later_fn = probe(True), probe(False)
  first_cost, later_cost = (median_seconds(f, params, final, repeats=repeats) / passes for f in (first_fn, later_fn))
  forwards, first = int(final.forwards), int(final.commit_passes)
  later = forwards - first
  predicted = prefill + first * first_cost + later * later_cost
  timed = {"timer": lambda: time_call(later_fn, params, final) / passes} if timer else {}
  return {
    **timed,
    "cache": plan.cache,
    "block": plan.block,
    "steps_per_block": int(np.max(per_block)),
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
