"""The decoding engine: left-to-right windows refined in parallel against a key-value cache, one jitted loop.

Every decoder of the project is this engine with a plan (:mod:`~mercury_jax.sampling.plan`), a cache strategy
(:mod:`~mercury_jax.sampling.caches`), a step rule (:mod:`~mercury_jax.sampling.step`) and hooks
(:mod:`~mercury_jax.sampling.hooks`), behind every entry point (``Sampler.generate`` and ``stream``, the command
line, the server, the benchmarks, ahead-of-time compilation):

* block diffusion (BD3-LM, Arriola et al. 2025, arXiv 2503.09573) refines a block of ``B`` tokens at a time over the
  exact cache of the blocks before it (:mod:`~mercury_jax.sampling.refine`);
* the autoregressive twin is the engine with blocks of one token and one step per block;
* verified decoding drafts by diffusion and accepts what the network's own next-token head accepts
  (:mod:`~mercury_jax.sampling.verify`), over blocks of one token;
* a whole-sequence checkpoint refines its whole canvas as one block without a cache (MDLM/MD4's refinement), or
  semi-autoregressive blocks, or blocks over Fast-dLLM's approximate caches;
* a continuous checkpoint moves a block's latents along the probability-flow ODE (:mod:`~mercury_jax.sampling.latents`).

A step (:meth:`BlockEngine.step`) reads: the rule says what it needs of the network, the cache strategy runs it,
the rule decides (commit, re-mask, accept, with its hooks), and one tail writes the window, ends holes at EOS,
records the trace, counts the passes and moves rows on.

Layout. Canvases (``mercury_jax.sampling.canvas``: prompts, holes, templates; right-padded rows) are laid into
slots (:class:`~mercury_jax.sampling.plan.BlockPlan`). Each row keeps its own block offset: its ``j``-th step block is
``first + j`` (its first generated position's block), so rows with different prompt lengths share one compilation,
and rotary positions are canvas positions, so a row's tokens do not depend on its batch. A row that has no block
left re-runs its last one.

Rows are independent. Each row has its own block counter, step, step budget (``num_steps`` [b] steps per block, one
more in its first ``extra_steps`` [b] blocks) and sampling knobs (``State.knobs``, traced [b] arrays), and moves to
its next block as soon as its own block is finished; one forward pass serves every row that needs one, and a row
that did not need it keeps the logits it already had. So a row's tokens depend on its own canvas, key and knobs
only, and a serving engine (``mercury_jax.serve``) can :meth:`BlockEngine.insert` a request into a free row,
:meth:`BlockEngine.step_rows` a batch bucket of the rows and :meth:`BlockEngine.release` a row between steps (the
programs of JetStream's engine API). The approximate caches refresh every row at once and keep the rows' blocks in
lockstep. A block with nothing to generate in any row costs no step of the model (the exact cache still writes the
block before it).

End of sequence. With ``settings.eos_to_pad`` (the default), an EOS in a finished block ends its own hole
(``canvas.after_eos``): the hole's later positions become padding, are never generated and are never attended to,
and generation stops once no row has a masked position left, so open-ended generation ends at EOS. Without it an EOS
is a token like any other and the hole is generated to its end.

Randomness. Example ``i`` draws from ``key_i = fold_in(key, streams[i])``; a step folds the position its rule names
(:meth:`~mercury_jax.sampling.step.StepRule.key_position`) into it, then the step within the block when it is not
the first, so a row's draws do not depend on its batch.

The loop runs in chunks (:meth:`BlockEngine.advance`, a budget of blocks and steps): the state goes in and out of
each jitted call, so a stream of blocks or of drafts costs no recompilation, and ``generate`` (one chunk to the end)
and ``stream`` (a chunk per block) run the same two programs, :meth:`init` and :meth:`advance`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import ModelConfig
from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.caches import strategy
from mercury_jax.sampling.canvas import Canvas, SampleOutput, after_eos
from mercury_jax.sampling.hooks import Hooks, Structured, View
from mercury_jax.sampling.latents import Flow
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.refine import Refine
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import (
  Healing,
  State,
  constrain_rows,
  insert_row,
  put,
  put_rows,
  rows,
  select_rows,
  take_rows,
)
from mercury_jax.sampling.step import Decision, StepRule
from mercury_jax.sampling.verify import Verify


def prefill_slots(kinds, plan: BlockPlan) -> int:
  """The slots the exact cache's prefill must cover for these canvases (int [batch, length] kinds, host side): those
  before each row's first generated block but one, rounded up to a power of two of blocks (a few compilations serve
  every prompt length), at most every slot; 0 when every prompt lies within its first generated block."""
  kinds = np.asarray(kinds)
  target = kinds == K.TARGET
  if not target.any():
    return 0
  first = (plan.block + np.argmax(target, axis=1)[target.any(axis=1)]) // plan.block  # each row's first block
  blocks = int(first.max()) - 1  # slots [0, blocks * B) must be in the cache before the first step
  if blocks <= 1:  # Only the padding block in front: nothing to write.
    return 0
  return min(plan.block * (1 << (blocks - 1).bit_length()), plan.slots)


class Start(NamedTuple):
  """What a decode starts from: :meth:`BlockEngine.init`'s arguments after the parameters, as one value (a compiled
  prefill's, :meth:`~mercury_jax.sampling.programs.Programs.prefill`)."""

  canvas: Canvas
  key: jax.Array
  num_steps: jax.Array
  knobs: Knobs | None = None
  tables: constrained.Tables | None = None
  healing: Healing | None = None
  extra_steps: jax.Array | None = None


def step_rule(plan: BlockPlan, settings: SamplerSettings, network: Network, cache) -> StepRule:
  """The rule a plan decodes with: verification for a verified plan, the ODE for ``settings.rule == "ode"``, the
  discrete refinement otherwise."""
  if plan.draft:
    return Verify(plan, settings, network)
  if settings.rule == "ode":
    return Flow(plan, settings, network, cache)
  return Refine(plan, settings, network)


class BlockEngine:
  """The engine for one network, settings and plan: its programs are pure functions of the state.

  Args:
    network: The denoiser (:class:`~mercury_jax.sampling.network.Network`), or a model config to build it from.
    settings: Step rule, proposals, EOS handling (static).
    plan: The layout and cache (:func:`~mercury_jax.sampling.plan.plan_for`).
  """

  def __init__(self, network: Network | ModelConfig, settings: SamplerSettings, plan: BlockPlan):
    network = Network(network) if isinstance(network, ModelConfig) else network
    if network.causal and not plan.autoregressive:  # A bidirectional network may run its causal head (verified).
      raise ValueError(f"plan.autoregressive={plan.autoregressive} does not fit a causal model")
    self.network, self.settings, self.plan = network, settings, plan
    self.cache = strategy(plan, network, settings.mask_id)
    self.rule = step_rule(plan, settings, network, self.cache)

  # ------------------------------------------------------------------------------------------------ rows

  def starts(self, st: State) -> jax.Array:
    """[b] the first slot of each row's step window."""
    return jnp.minimum(st.first + st.block, st.last) * self.plan.block

  def unfinished(self, st: State) -> jax.Array:
    """[b] bool: the row still has a masked position."""
    return jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)

  def done(self, st: State) -> jax.Array:
    """[] bool: nothing is left to generate."""
    return ~jnp.any(self.unfinished(st) & (st.block < self.plan.blocks))

  # ------------------------------------------------------------------------------------------------ programs

  def init(
    self,
    params,
    canvas: Canvas,
    key: jax.Array,
    num_steps: jax.Array,
    knobs: Knobs | None = None,
    *,
    prefill: int | None = None,
    tables: constrained.Tables | None = None,
    healing: Healing | None = None,
    extra_steps: jax.Array | None = None,
  ) -> State:
    """Lays the canvases into slots and runs the prefill (exact cache): the state before the first step (JetStream's
    prefill).

    Args:
      params: The network's parameters.
      canvas: The rows, ``plan.length`` positions or fewer.
      key: The PRNG key; row ``i`` draws from ``fold_in(key, canvas.streams[i])``.
      num_steps: Steps per block: one for every row ([]) or one per row ([b]).
      knobs: The sampling knobs (traced), per row ([b] each) or for every row ([] each); default: the settings'
        own, as constants.
      prefill: How many slots the exact cache's prefill covers (static; default every slot): every slot before each
        row's first generated block but one (the first step's commit pass writes that one); :func:`prefill_slots`
        gives the bucket a batch needs (0: no prefill at all).
      tables: The rows' automata (:func:`mercury_jax.sampling.automata.tables`): a constrained row's hole (it must
        have one) is generated as a valid prefix of its automaton's language, complete when the hole has room; its
        ``min_length`` is ignored (the automaton says where text ends).
      healing: Token healing (:class:`~mercury_jax.sampling.state.Healing` with ``slot`` holding each row's healed
        canvas position, -1 for none): that position may only take the ``allowed`` tokens.
      extra_steps: The first ``extra_steps`` step blocks of a row take one step more than ``num_steps`` ([] or [b];
        default 0): what is left of a total budget (``settings.steps_per_block``).
    """
    st = constrain_rows(self._layout(canvas, key, num_steps, knobs, extra_steps))
    if tables is not None:
      constraint, z, eos_banned = Structured(self.plan, self.settings).start(
        tables, st.target, st.eos_banned, st.z, st.first
      )
      st = st._replace(constraint=constraint, z=z, eos_banned=eos_banned)
    if healing is not None:
      slot = jnp.where(healing.slot >= 0, healing.slot + self.plan.block, -1).astype(jnp.int32)
      st = st._replace(healing=Healing(jnp.asarray(healing.allowed, bool), slot))
    size = self.plan.slots if prefill is None else prefill
    return st._replace(cache=self.cache.prefill(params, st, size)) if size else st

  def _layout(self, canvas: Canvas, key, num_steps, knobs: Knobs | None, extra_steps) -> State:
    """The state of the canvases laid into slots, before the hooks and the prefill."""
    plan, settings, block = self.plan, self.settings, self.plan.block
    tokens, kinds = jnp.asarray(canvas.tokens, jnp.int32), jnp.asarray(canvas.kinds, jnp.int32)
    batch, length = tokens.shape
    lay = lambda a, fill: jnp.pad(a, ((0, 0), (block, plan.slots - block - length)), constant_values=fill)  # noqa: E731
    kinds = lay(kinds, K.PAD)
    target = kinds == K.TARGET
    has_target = target.any(axis=1)
    first = jnp.where(has_target, jnp.argmax(target, axis=1) // block, 1).astype(jnp.int32)
    last = jnp.where(has_target, (plan.slots - 1 - jnp.argmax(target[:, ::-1], axis=1)) // block, 1)
    rank = jnp.cumsum(target, axis=-1, dtype=jnp.int32) - 1
    trace = ()
    if settings.trace:
      frames = (settings.trace, batch)
      trace = (
        jnp.full((*frames, plan.slots), settings.pad_id, jnp.int32),
        jnp.full(frames, -1, jnp.int32),
        jnp.zeros(frames, jnp.int32),
      )  # fmt: skip  (-1: no step was recorded in the frame)
    knobs = Knobs.of(settings, batch) if knobs is None else knobs
    per_row = lambda a, dtype: jnp.broadcast_to(jnp.asarray(a, dtype), (batch,))  # noqa: E731
    no, dtypes = jnp.zeros((batch,), jnp.int32), (jnp.float32, jnp.int32, jnp.float32, jnp.float32)
    zero = jnp.zeros((), jnp.int32)
    return State(
      z=jnp.where(target, settings.mask_id, lay(tokens, settings.pad_id)),
      target=target,
      generate=target,
      segments=(kinds != K.PAD).astype(jnp.int32),
      positions=jnp.broadcast_to(jnp.maximum(jnp.arange(plan.slots) - block, 0), (batch, plan.slots)).astype(jnp.int32),
      eos_banned=target & (rank < settings.min_length),
      score=jnp.zeros((batch, plan.slots), jnp.float32),
      first=first,
      last=last.astype(jnp.int32),
      example_keys=jax.vmap(lambda stream: jax.random.fold_in(key, stream))(jnp.asarray(canvas.streams, jnp.int32)),
      block=no,
      step=no,
      fresh=jnp.ones((batch,), bool),
      changed=jnp.ones((batch,), bool),
      logits=jnp.zeros((batch, block, self.network.vocab_size), jnp.float32),
      cache=self.cache.empty(batch),
      num_steps=jnp.maximum(per_row(num_steps, jnp.int32), 1),
      extra_steps=per_row(0 if extra_steps is None else extra_steps, jnp.int32),
      knobs=Knobs(*(per_row(v, d) for v, d in zip(knobs, dtypes, strict=True))),
      nfe=no,
      forwards=zero,
      commit_passes=zero,
      iterations=zero,
      recorded=no,
      trace=trace,
      constraint=None,
      healing=None,
      **self.rule.empty(batch),
    )

  def insert(self, st: State, row: State, slot: jax.Array, table: jax.Array | None = None) -> State:
    """``st`` with the one-row state ``row`` (an :meth:`init` of one canvas) in row ``slot`` (JetStream's insert);
    a paged cache (:class:`~mercury_jax.kvcache.PagedKVCache`) puts the row's keys and values on the pages ``table``."""
    return insert_row(st, row, slot, table)

  def release(self, st: State, slot: jax.Array) -> State:
    """``st`` with row ``slot`` given up: it has nothing left to generate, takes no more steps, its cache holds
    nothing (a paged cache's pages go back to the pool: the row reads and writes the sink) and its hooks let it go."""
    st = st._replace(generate=st.generate.at[slot].set(False))
    if st.cache:
      st = st._replace(cache=st.cache.forget(slot))
    return Hooks(st, self.plan, self.settings).release(st, slot)

  def step(self, params, st: State) -> State:
    """One step of every row: the rule's needs, the cache strategy's pass, the rule's decision, the shared tail."""
    view = self._view(st)
    hooks = Hooks(st, self.plan, self.settings)
    needs, st = self.rule.needs(st, view)
    forward = self.cache.forward(params, st, needs)
    decision = self.rule.decide(params, st, view, needs, forward, hooks)
    unfinished = self.unfinished(st)
    needed = ((forward.ran & needs.logits) | (forward.committed & needs.commit)) & unfinished
    st = self._commit(decision, view, hooks)
    return st._replace(
      cache=forward.cache if decision.cache is None else decision.cache,
      nfe=st.nfe + needed.astype(jnp.int32) + decision.extra,
      forwards=st.forwards + (forward.ran | forward.committed).astype(jnp.int32) + jnp.max(decision.extra),
      commit_passes=st.commit_passes + forward.committed.astype(jnp.int32),
    )

  def _view(self, st: State) -> View:
    """Every row's window as the rule sees it, with the step's keys."""
    width, mask_id = self.rule.width, self.settings.mask_id
    starts = self.starts(st)
    z_w = rows(st.z, starts, width)
    open_ = rows(st.generate, starts, width) & (z_w == mask_id)
    keys = jax.vmap(jax.random.fold_in)(st.example_keys, self.rule.key_position(starts))
    stepped = jax.vmap(jax.random.fold_in)(keys, st.step)
    typed = jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data if typed else lambda k: k
    chosen = jnp.where((st.step == 0)[:, None], data(keys), data(stepped))
    keys = jax.random.wrap_key_data(chosen) if typed else chosen
    slots = starts[:, None] + jnp.arange(width)[None, :]
    return View(starts, slots, z_w, open_, jnp.any(open_, axis=-1), keys)

  def _commit(self, d: Decision, view: View, hooks: Hooks) -> State:
    """The shared tail of every rule: write the window and its scores, end the holes of finished windows at an EOS,
    record the trace, move rows on (the approximate caches: all together) and let the hooks enter the next block."""
    plan, settings, st, starts = self.plan, self.settings, d.st, view.starts
    z = put(st.z, starts, d.z)
    score = put(st.score, starts, jnp.where(d.commit, d.confidence, rows(st.score, starts, self.rule.width)))
    segments, generate = st.segments, st.generate
    if settings.eos_to_pad:
      final = jnp.arange(self.rule.width)[None, :] < (d.finished * plan.block)[:, None]  # the window's final part
      has_eos = jnp.any(final & rows(generate, starts, self.rule.width) & (d.z == settings.eos_id), axis=-1)
      known = jnp.arange(plan.slots)[None, :] < (starts + d.finished * plan.block)[:, None]

      def end_holes(z, segments, generate):
        dead = after_eos(z, st.target, settings.eos_id, known=known) & has_eos[:, None]
        return jnp.where(dead, settings.pad_id, z), jnp.where(dead, 0, segments), generate & ~dead

      z, segments, generate = jax.lax.cond(jnp.any(has_eos), end_holes, lambda *a: a, z, segments, generate)
    trace = self._record(st, z, view, d) if st.trace else st.trace
    advance = d.finished > 0
    if self.cache.lockstep:
      advance = jnp.broadcast_to(jnp.all(advance), advance.shape)
    z, score, st = self.rule.enter(st, hooks, advance, z, score)
    return st._replace(
      z=z,
      generate=generate,
      segments=segments,
      score=score,
      block=st.block + jnp.where(advance, d.finished, 0),
      step=jnp.where(advance, 0, st.step + 1),
      fresh=advance,
      changed=jnp.any(d.commit | d.remask, axis=-1),
      proposal=d.proposal,
      iterations=st.iterations + 1,
      recorded=st.recorded + d.worked.astype(jnp.int32),
      trace=trace,
    )

  def _record(self, st: State, z: jax.Array, view: View, d: Decision) -> tuple[jax.Array, ...]:
    """The trace with this step's frame: each row records its own steps (one frame per step it worked)."""
    canvases, commits, remasks = st.trace
    batch_rows = jnp.arange(z.shape[0])
    frame = jnp.minimum(st.recorded, self.settings.trace - 1)  # [b]
    keep = (st.recorded < self.settings.trace) & d.worked
    shown = z
    if d.preview is not None:  # Nothing is committed before a block's end: a frame shows the step's draft.
      window = rows(z, view.starts, self.rule.width)
      shown = put(z, view.starts, jnp.where(view.open & (window == self.settings.mask_id), d.preview, window))
    count = lambda mask: mask.sum(axis=-1, dtype=jnp.int32)  # noqa: E731
    return (
      canvases.at[frame, batch_rows].set(jnp.where(keep[:, None], shown, canvases[frame, batch_rows])),
      commits.at[frame, batch_rows].set(jnp.where(keep, count(d.commit), commits[frame, batch_rows])),
      remasks.at[frame, batch_rows].set(jnp.where(keep, count(d.remask), remasks[frame, batch_rows])),
    )

  def advance(self, params, st: State, max_blocks: jax.Array | None = None, max_steps: jax.Array | None = None):
    """Runs steps until nothing is masked, or some row that had something left finished ``max_blocks`` more blocks,
    or ``max_steps`` more steps ran (each budget optional; traced scalars, so one compilation serves every budget).
    Rows with nothing left never end a chunk, so a stream of a batch of mixed lengths stops once per block."""
    first_block, first_iteration = st.block, st.iterations
    active = self.unfinished(st)

    def cond(st: State):
      going = ~self.done(st)
      if max_blocks is not None:
        going &= ~jnp.any(active & (st.block - first_block >= max_blocks))
      if max_steps is not None:
        going &= st.iterations - first_iteration < max_steps
      return going

    return jax.lax.while_loop(cond, lambda st: self.step(params, st), st)

  def step_rows(self, params, st: State, live: jax.Array) -> tuple[State, jax.Array]:
    """One step of the rows ``live`` [n] alone (a serving engine's batch bucket, JetStream's generate): they are
    taken out of the batch, stepped and put back. A row with nothing to generate pads the bucket (a free row, or one
    still prefilling in chunks): it comes out as it went in and writes nothing into a paged pool. Returns the state
    and the news of the step (:func:`news`), one int32 array for one host copy."""
    part = take_rows(st, live)
    worked = self.starts(part)
    moved = self.advance(params, part, max_steps=jnp.ones((), jnp.int32))
    moved = select_rows(jnp.any(part.generate, axis=-1), moved, part)
    return put_rows(st, live, moved), news(self, moved, worked)

  def fill(self, params, st: State, slot: jax.Array, start: jax.Array, size: int) -> State:
    """Row ``slot`` with one chunk of its chunked prefill written: slots ``[start, start + size)``."""
    part = take_rows(st, slot[None])
    part = part._replace(cache=self.cache.fill(params, part, start, size))
    return put_rows(st, slot[None], part)

  def arm(self, st: State, slot: jax.Array) -> State:
    """Row ``slot``, inert while its prompt was prefilled in chunks, with its holes to generate again."""
    return st._replace(generate=st.generate.at[slot].set(st.target[slot]))

  def to_canvas(self, slots_array: jax.Array, length: int) -> jax.Array:
    """``[..., S]`` slot values at canvas positions ``[..., length]``."""
    return slots_array[..., self.plan.block : self.plan.block + length]

  def output(self, st: State, length: int) -> SampleOutput:
    """The :class:`SampleOutput` at canvas positions (``length``: the canvas length).

    ``forwards`` counts the steps that ran the network; the trace holds one frame per step that had a masked
    position to work on, and ``commits`` is -1 in frames past the last one.
    """
    tokens = self.to_canvas(st.z, length)
    trace = ()
    if st.trace:
      canvases, commits, remasks = st.trace
      trace = (self.to_canvas(canvases, length), commits, remasks)
    out = SampleOutput(tokens, st.nfe, st.forwards, *trace)
    return out._replace(accepted=st.draft.accepted, sources=st.draft.sources) if st.draft is not None else out

  def sample(self, params, canvas: Canvas, key: jax.Array, num_steps: jax.Array, knobs=None, **options):
    """The whole generation as one function: prefill, every block, the :class:`SampleOutput` (``options``:
    :meth:`init`'s keywords)."""
    st = self.advance(params, self.init(params, canvas, key, num_steps, knobs, **options))
    return self.output(st, jnp.shape(canvas.tokens)[1])


def width(plan: BlockPlan) -> int:
  """The tokens a step can commit in a row from its window's first slot: the block, or verified decoding's (the draft
  tree's depth + 1, at least the draft length)."""
  return plan.tree.width if plan.tree is not None else plan.block


def news(engine: BlockEngine, st: State, worked: jax.Array) -> jax.Array:
  """int32 [b, 3 W + 4]: what the host reads back after a step that worked from slots ``worked`` [b] (``W``:
  :func:`width`): the tokens of the worked window and of the next one, the step's proposals, then ``worked``, the
  next window's first slot, whether the row still has a masked position, and its forward passes
  (:class:`~mercury_jax.serve.commands.View` unpacks it)."""
  size, starts = width(engine.plan), engine.starts(st)
  at = lambda first: jnp.take_along_axis(st.z, first[:, None] + jnp.arange(size)[None, :], axis=1)  # noqa: E731
  proposal = jnp.pad(st.proposal, ((0, 0), (0, size - st.proposal.shape[1])))  # verified: k - 1 drafts at starts
  scalars = (worked, starts, engine.unfinished(st), st.nfe)
  columns = [at(worked), at(starts), proposal, *(jnp.asarray(a)[:, None] for a in scalars)]  # [b, W] and [b, 1]
  return jnp.concatenate([c.astype(jnp.int32) for c in columns], axis=1)
