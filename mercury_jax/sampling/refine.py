"""The discrete family's step rule: one refinement step of a row's block (:class:`Refine`).

Within a block the step rules run on ``[batch, B]`` slices with ``num_steps`` steps per block: the confidence
schedule commits ``ceil(open / steps_left)``, the ancestral rule walks the block's time grid from 1 to 0, revision
re-masks only the open block, and the block's last step commits everything (:mod:`~mercury_jax.sampling.rules`
picks the positions). A step proposes a token and a confidence at every position
(:mod:`~mercury_jax.sampling.proposal`, then the hooks), the rule commits and re-masks, and the hooks add the tokens
the commits forced. When a step committed and re-masked nothing, the next step reuses the last logits instead of
running the model (MDLM's caching of unchanged inputs; not with time conditioning).

Randomness: step ``j`` of the block starting at canvas position ``p`` uses the key ``k = fold_in(key_i, p)``
(``j = 0``) or ``fold_in(fold_in(key_i, p), j)``: the proposals' Gumbel noise is ``B`` rows drawn from ``k`` (only
when some row samples: a row at temperature 0 ignores it), the ancestral rule's uniforms come from
``fold_in(k, RULE_NOISE)``, a constrained row's class noise from ``fold_in(k, CLASS_NOISE)``. So a row's draws do
not depend on its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.sampling.caches import Forward, Needs
from mercury_jax.sampling.hooks import Hooks, View
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import noise_width, propose_rows, uniform_noise
from mercury_jax.sampling.rules import StepInputs, make_rule
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import State, rows
from mercury_jax.sampling.step import Decision, StepRule, no_tokens

RULE_NOISE = 0x7275  # Folded into a step's key for the step rule's own uniforms (the ancestral rule's).


class Refine(StepRule):
  """The refinement of a block by the discrete step rules (module docstring)."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings, network: Network):
    self.plan, self.settings, self.network = plan, settings, network
    self.width = plan.block
    self.rule = make_rule(settings)
    self.moving = network.time_conditioning  # every step changes the inputs: no logits are reused

  def empty(self, batch: int) -> dict:
    return {"proposal": no_tokens(batch, self.width)}

  def key_position(self, starts: jax.Array) -> jax.Array:
    return starts - self.plan.block  # the block's first canvas position

  def block_steps(self, st: State) -> jax.Array:
    """[b] this block's steps (one more in the row's first ``extra_steps`` blocks)."""
    return st.num_steps + (st.block < st.extra_steps).astype(jnp.int32)

  def needs(self, st: State, view: View) -> tuple[Needs, State]:
    """Fresh logits at a block's first step and after a step that changed it; at its first step also the finished
    block before it written into the cache (exact cache)."""
    block = self.plan.block
    wants_logits = jnp.where(st.fresh, view.has_open, (st.changed | self.moving) & view.has_open)
    previous_live = jnp.any(rows(st.segments, view.starts - block, block) != 0, axis=-1)
    unfinished = jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)
    steps = self.block_steps(st)
    t = (1.0 - st.step / steps).astype(jnp.float32)
    return Needs(view.starts, t, wants_logits, st.fresh & previous_live & unfinished), st

  def propose(self, st: State, view: View, logits: jax.Array, hooks: Hooks):
    """``(view with the proposals' noise, logits after the hooks, x0, confidence, st)``. The Gumbel noise is drawn
    only when some row samples (a row at temperature 0 ignores it)."""
    block, settings = self.plan.block, self.settings
    sampled = jnp.any((st.knobs.temperature > 0.0) & view.has_open)
    width = noise_width(self.network.vocab_size)
    noise = jax.lax.cond(
      sampled,
      lambda: uniform_noise(view.keys, (block, width)),
      lambda: jnp.full((view.z.shape[0], block, width), 0.5, jnp.float32),
    )
    view = view._replace(noise=noise)
    logits = hooks.logits(st, view, logits)
    eos_banned = rows(st.eos_banned, view.starts, block)
    x0, confidence = self.network.map_rows(  # row by row where the network is (batch invariance)
      lambda logits, noise, eos_banned, knobs: propose_rows(logits, noise, eos_banned, settings, knobs),
      logits,
      noise,
      eos_banned,
      st.knobs,
    )
    x0, confidence, st = hooks.propose(st, view, logits, x0, confidence)
    return view, logits, x0, confidence, st

  def settle(self, st: State, view: View, hooks: Hooks, x0: jax.Array, confidence: jax.Array) -> Decision:
    """The rule's commits and re-masks of the proposals ``x0``, and the tokens the hooks force after them."""
    block, mask_id = self.plan.block, self.settings.mask_id
    steps = self.block_steps(st)
    steps_left = steps - st.step
    u = jnp.zeros(view.z.shape, jnp.float32)
    if self.settings.rule == "ancestral":
      u = uniform_noise(jax.vmap(lambda k: jax.random.fold_in(k, RULE_NOISE))(view.keys), (block,))
    committed = view.z != mask_id
    committed &= rows(st.generate, view.starts, block) & view.has_open[:, None]  # revision: the open block only
    out = self.rule(
      StepInputs(
        x0=x0,
        confidence=confidence,
        open=view.open,
        committed=committed,
        score=rows(st.score, view.starts, block),
        k=(view.open.sum(axis=-1, dtype=jnp.int32) + steps_left - 1) // steps_left,
        steps_left=steps_left,
        block_steps=steps,
        t=(1.0 - st.step / steps).astype(jnp.float32),
        s=(1.0 - (st.step + 1) / steps).astype(jnp.float32),
        u=u,
        threshold=st.knobs.threshold,
      )
    )
    is_last = (st.step >= steps - 1)[:, None]
    commit = (out.commit | is_last) & view.open
    remask = out.remask & committed & ~is_last
    z_w = jnp.where(remask, mask_id, jnp.where(commit, x0, view.z))
    z_w, forced, st = hooks.after_commit(st, view, z_w)
    generate_w = rows(st.generate, view.starts, block)
    finished = ~jnp.any(generate_w & (z_w == mask_id), axis=-1)  # the block is done (or had nothing to do)
    return Decision(
      st=st,
      z=z_w,
      commit=commit | forced,
      remask=remask,
      confidence=jnp.where(forced, 1.0, confidence),
      finished=finished.astype(jnp.int32),
      worked=view.has_open,
      proposal=x0,
    )

  def decide(self, params, st: State, view: View, needs: Needs, forward: Forward, hooks: Hooks) -> Decision:
    view, _, x0, confidence, st = self.propose(st, view, forward.logits, hooks)
    return self.settle(st._replace(logits=forward.logits), view, hooks, x0, confidence)

  def enter(self, st: State, hooks: Hooks, advance: jax.Array, z: jax.Array, score: jax.Array):
    return hooks.enter(st, advance, z, score)
