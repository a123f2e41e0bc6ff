"""The decoding engine: left-to-right blocks refined in parallel against a key-value cache, one jitted loop.

Every decoder of the project is this engine with a plan (:mod:`~mercury_jax.sampling.plan`), a cache strategy
(:mod:`~mercury_jax.sampling.caches`), a step rule (:mod:`~mercury_jax.sampling.rules`) and hooks
(:mod:`~mercury_jax.sampling.hooks`), behind every entry point (``Sampler.generate`` and ``stream``, the command
line, the server, the benchmarks):

* block diffusion (BD3-LM, Arriola et al. 2025, arXiv 2503.09573) refines a block of ``B`` tokens at a time over the
  exact cache of the blocks before it;
* the autoregressive twin is the engine with blocks of one token and one step per block;
* a whole-sequence checkpoint refines its whole canvas as one block without a cache (MDLM/MD4's refinement), or
  semi-autoregressive blocks of ``block_length`` tokens, or blocks over Fast-dLLM's approximate caches.

A step reads: forward (the cache strategy gives the block's logits) -> propose (a candidate token and a confidence
at every position, :mod:`~mercury_jax.sampling.proposal`, then the hooks) -> rule (which open positions to commit,
which committed ones to re-mask) -> commit (the hooks add forced tokens) -> end of sequence -> advance (a finished
block moves the row to its next one; the hooks enter it).

Layout. Canvases (``mercury_jax.sampling.canvas``: prompts, holes, templates; right-padded rows) are laid into
slots (:class:`~mercury_jax.sampling.plan.BlockPlan`). Each row keeps its own block offset: its ``j``-th step block is
``first + j`` (its first generated position's block), so rows with different prompt lengths share one compilation,
and rotary positions are canvas positions, so a row's tokens do not depend on its batch. A row that has no block
left re-runs its last one.

Rows are independent. Each row has its own block counter, step, step budget (``num_steps`` [b] steps per block, one
more in its first ``extra_steps`` [b] blocks) and sampling knobs (``State.knobs``, traced [b] arrays), and moves to
its next block as soon as its own block is finished; one forward pass serves every row that needs one, and a row
that did not need it keeps the logits it already had. So a row's tokens depend on its own canvas, key and knobs
only, and a serving engine (``mercury_jax.serve``) can :meth:`BlockEngine.insert` a request into a free row and
:meth:`BlockEngine.release` it between steps. The approximate caches refresh every row at once and keep the rows'
blocks in lockstep.

Steps. Within a block the step rules run on ``[batch, B]`` slices with ``num_steps`` steps per block: the confidence
schedule commits ``ceil(open / steps_left)``, the ancestral rule walks the block's time grid from 1 to 0, revision
re-masks only the open block, and the block's last step commits everything. When a step committed and re-masked
nothing, the next step reuses the last logits instead of running the model (MDLM's caching of unchanged inputs; not
with time conditioning). A block with nothing to generate in any row costs no step of the model (the exact cache
still writes the block before it).

End of sequence. With ``settings.eos_to_pad`` (the default), an EOS in a finished block ends its own hole
(``canvas.after_eos``): the hole's later positions become padding, are never generated and are never attended to,
and generation stops once no row has a masked position left, so open-ended generation ends at EOS. Without it an EOS
is a token like any other and the hole is generated to its end.

Randomness. Example ``i`` draws from ``key_i = fold_in(key, streams[i])``; step ``j`` of the block starting at
canvas position ``p`` uses the key ``k = fold_in(key_i, p)`` (``j = 0``) or ``fold_in(fold_in(key_i, p), j)``: the
proposals' Gumbel noise is ``B`` rows drawn from ``k`` (only when some row samples: a row at temperature 0 ignores
it), the ancestral rule's uniforms come from ``fold_in(k, RULE_NOISE)``, a constrained row's class noise from
``fold_in(k, CLASS_NOISE)``. So a row's draws do not depend on its batch.

The loop runs in chunks (:meth:`BlockEngine.advance`, a budget of blocks and steps): the state goes in and out of
each jitted call, so a stream of blocks or of drafts costs no recompilation, and ``generate`` (one chunk to the end)
and ``stream`` (a chunk per block) run the same two programs, :meth:`init` and :meth:`advance`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import ModelConfig
from mercury_jax.constrain import device as constrained
from mercury_jax.kvcache import KVCache, PagedKVCache
from mercury_jax.sampling.caches import Needs, per_row, strategy
from mercury_jax.sampling.canvas import Canvas, SampleOutput, after_eos
from mercury_jax.sampling.hooks import Structured, View, active_hooks
from mercury_jax.sampling.latents import LatentRule
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import Knobs, clean_logits, noise_width, propose_rows, uniform_noise
from mercury_jax.sampling.rules import StepInputs, make_rule
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import BATCH_COUNTERS, Constraint, Healing, State, put, rows
from mercury_jax.sampling.verify import Verifier, empty_draft

RULE_NOISE = 0x7275  # Folded into a step's key for the step rule's own uniforms (the ancestral rule's).


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


class BlockEngine:
  """The engine for one network, settings and plan: :meth:`init`, :meth:`advance`, :meth:`output` (pure functions).

  Args:
    network: The denoiser (:class:`~mercury_jax.sampling.network.Network`), or a model config to build it from.
    settings: Step rule, proposals, EOS handling (static).
    plan: The layout and cache (:func:`~mercury_jax.sampling.plan.plan_blocks`).
  """

  def __init__(self, network: Network | ModelConfig, settings: SamplerSettings, plan: BlockPlan):
    network = Network(network) if isinstance(network, ModelConfig) else network
    if network.causal and not plan.autoregressive:  # A bidirectional network may run its causal head (verified).
      raise ValueError(f"plan.autoregressive={plan.autoregressive} does not fit a causal model")
    self.network, self.settings, self.plan = network, settings, plan
    self.cache = strategy(plan, network)
    self.rule = make_rule(settings)
    self.verifier = Verifier(self) if plan.draft else None
    self.latents = None  # the continuous family's rule over latents (settings.rule == "ode")
    if settings.rule == "ode":
      if plan.cache not in ("exact", "none") or plan.draft or not network.latent_dim:
        raise ValueError(f"rule 'ode' decodes a continuous checkpoint with cache 'exact' or 'none' (plan: {plan})")
      self.latents = LatentRule(settings, plan.block, network.latent_dim)

  # ------------------------------------------------------------------------------------------------ rows

  def starts(self, st: State) -> jax.Array:
    """[b] the first slot of each row's step block."""
    return jnp.minimum(st.first + st.block, st.last) * self.plan.block

  def unfinished(self, st: State) -> jax.Array:
    """[b] bool: the row still has a masked position."""
    return jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)

  def done(self, st: State) -> jax.Array:
    """[] bool: nothing is left to generate."""
    return ~jnp.any(self.unfinished(st) & (st.block < self.plan.blocks))

  # ------------------------------------------------------------------------------------------------ state

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
    """Lays the canvases into slots and runs the prefill (exact cache): the state before the first step.

    Args:
      params: The network's parameters.
      canvas: The rows, ``plan.length`` positions or fewer.
      key: The PRNG key; row ``i`` draws from ``fold_in(key, canvas.streams[i])``.
      num_steps: Steps per block: one for every row ([]) or one per row ([b]).
      knobs: The sampling knobs (traced), per row ([b] each) or for every row ([] each); default: the settings'
        own, as constants.
      prefill: How many slots the exact cache's prefill runs over (static; default every slot). The cache must
        hold every slot before each row's first generated block but one (the first step's commit pass writes that
        one), so a prompt that lies within its first generated block needs none (0: no prefill at all);
        :func:`prefill_slots` gives the bucket a batch needs.
      tables: The rows' automata (:func:`mercury_jax.constrain.device.tables`): a constrained row's hole (it must
        have one) is generated as a valid prefix of its automaton's language, complete when the hole has room; its
        ``min_length`` is ignored (the automaton says where text ends).
      healing: Token healing (:class:`~mercury_jax.sampling.state.Healing` with ``slot`` holding each row's healed
        canvas position, -1 for none): that position may only take the ``allowed`` tokens.
      extra_steps: The first ``extra_steps`` step blocks of a row take one step more than ``num_steps`` ([] or [b];
        default 0): what is left of a total budget (``settings.steps_per_block``).
    """
    plan, settings, block = self.plan, self.settings, self.plan.block
    tokens, kinds = jnp.asarray(canvas.tokens, jnp.int32), jnp.asarray(canvas.kinds, jnp.int32)
    batch, length = tokens.shape
    lay = lambda a, fill: jnp.pad(a, ((0, 0), (block, plan.slots - block - length)), constant_values=fill)  # noqa: E731
    kinds = lay(kinds, K.PAD)
    target = kinds == K.TARGET
    slots = jnp.arange(plan.slots)
    has_target = target.any(axis=1)
    first = jnp.where(has_target, jnp.argmax(target, axis=1) // block, 1).astype(jnp.int32)
    last = jnp.where(has_target, (plan.slots - 1 - jnp.argmax(target[:, ::-1], axis=1)) // block, 1)
    rank = jnp.cumsum(target, axis=-1, dtype=jnp.int32) - 1
    z = jnp.where(target, settings.mask_id, lay(tokens, settings.pad_id))
    eos_banned = target & (rank < settings.min_length)
    constraint = None
    if tables is not None:
      constraint, z, eos_banned = Structured(plan, settings).start(tables, target, eos_banned, z, first)
    if healing is not None:
      healing = Healing(
        jnp.asarray(healing.allowed, bool), jnp.where(healing.slot >= 0, healing.slot + block, -1).astype(jnp.int32)
      )
    trace = ()
    if settings.trace:
      trace = (
        jnp.full((settings.trace, batch, plan.slots), settings.pad_id, jnp.int32),
        jnp.full((settings.trace, batch), -1, jnp.int32),  # -1: no step was recorded in this frame
        jnp.zeros((settings.trace, batch), jnp.int32),
      )
    knobs = Knobs.of(settings, batch) if knobs is None else knobs
    per_row = lambda a, dtype: jnp.broadcast_to(jnp.asarray(a, dtype), (batch,))  # noqa: E731
    no = jnp.zeros((batch,), jnp.int32)
    st = State(
      z=z,
      target=target,
      generate=target,
      segments=(kinds != K.PAD).astype(jnp.int32),
      positions=jnp.broadcast_to(jnp.maximum(slots - block, 0), (batch, plan.slots)).astype(jnp.int32),
      eos_banned=eos_banned,
      score=jnp.zeros((batch, plan.slots), jnp.float32),
      first=first,
      last=last.astype(jnp.int32),
      example_keys=jax.vmap(lambda stream: jax.random.fold_in(key, stream))(jnp.asarray(canvas.streams, jnp.int32)),
      block=no,
      step=no,
      fresh=jnp.ones((batch,), bool),
      changed=jnp.ones((batch,), bool),
      logits=jnp.zeros((batch, block, self.network.vocab_size), jnp.float32),
      proposal=jnp.zeros((batch, plan.draft - 1 if plan.draft else block), jnp.int32),
      cache=self.cache.empty(batch),
      num_steps=jnp.maximum(per_row(num_steps, jnp.int32), 1),
      extra_steps=per_row(0 if extra_steps is None else extra_steps, jnp.int32),
      knobs=Knobs(
        *(per_row(v, d) for v, d in zip(knobs, (jnp.float32, jnp.int32, jnp.float32, jnp.float32), strict=True))
      ),
      nfe=no,
      forwards=jnp.zeros((), jnp.int32),
      commit_passes=jnp.zeros((), jnp.int32),
      iterations=jnp.zeros((), jnp.int32),
      recorded=no,
      trace=trace,
      constraint=constraint,
      healing=healing,
      draft=empty_draft(batch, plan.draft, self.network.vocab_size) if plan.draft else None,
      latent=self.latents.empty(batch) if self.latents is not None else None,
    )
    size = plan.slots if prefill is None else prefill
    return st._replace(cache=self.cache.prefill(params, st, size)) if size else st

  def insert(self, st: State, row: State, slot: jax.Array, table: jax.Array | None = None) -> State:
    """``st`` with the one-row state ``row`` (an :meth:`init` of one canvas) in row ``slot``; the batch counters
    stay ``st``'s. A serving engine's admission: prefill a request alone, then insert it. Into a paged cache
    (:class:`~mercury_jax.kvcache.PagedKVCache`), the row's keys and values go to the pages ``table``."""

    def put_at(axis):
      return lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=axis)

    fields = {}
    for name in State._fields:
      if name in BATCH_COUNTERS:
        continue
      mine, theirs = getattr(st, name), getattr(row, name)
      if name == "cache" and isinstance(mine, PagedKVCache):
        fields[name] = mine.insert(slot, table, theirs)
      elif name == "cache" and isinstance(mine, KVCache):  # [layers, b, ...] keys and values, [b, S] segments
        fields[name] = KVCache(
          put_at(1)(mine.keys, theirs.keys),
          put_at(1)(mine.values, theirs.values),
          put_at(0)(mine.segments, theirs.segments),
        )
      elif name == "trace":
        fields[name] = jax.tree.map(put_at(1), mine, theirs)  # [frames, b, ...]
      elif name == "constraint" and mine is not None:
        fields[name] = Constraint(
          jax.tree.map(put_at(0), mine.tables, theirs.tables),
          put_at(0)(mine.dfa, theirs.dfa),
          put_at(0)(mine.end, theirs.end),
          mine.passes,
        )
      else:
        fields[name] = jax.tree.map(put_at(0), mine, theirs)
    return st._replace(**fields)

  def release(self, st: State, slot: jax.Array) -> State:
    """``st`` with row ``slot`` given up: it has nothing left to generate, takes no more steps, and its hooks let it
    go (its constraint no longer runs); a paged cache's row gives up its pages."""
    st = st._replace(generate=st.generate.at[slot].set(False))
    if isinstance(st.cache, PagedKVCache):  # Its pages go back to the pool: the row reads and writes the sink.
      st = st._replace(cache=st.cache.forget(slot))
    for hook in active_hooks(st, self.plan, self.settings):
      st = hook.release(st, slot)
    return st

  # ------------------------------------------------------------------------------------------------ the loop

  def _step_keys(self, st: State, position: jax.Array) -> jax.Array:
    keys = jax.vmap(jax.random.fold_in)(st.example_keys, position)
    stepped = jax.vmap(jax.random.fold_in)(keys, st.step)
    data = lambda k: jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k  # noqa: E731
    chosen = jnp.where((st.step == 0)[:, None], data(keys), data(stepped))
    return jax.random.wrap_key_data(chosen) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else chosen

  def _body(self, params, st: State) -> State:
    if self.verifier is not None:  # Verified decoding's step: verify the drafts, commit, draft the next ones.
      return self.verifier.step(params, st)
    plan, settings, block, mask_id = self.plan, self.settings, self.plan.block, self.settings.mask_id
    hooks = active_hooks(st, plan, settings)
    starts = self.starts(st)
    z_b, generate_b = rows(st.z, starts, block), rows(st.generate, starts, block)
    open_ = generate_b & (z_b == mask_id)  # [b, B]
    has_open = jnp.any(open_, axis=-1)  # [b]
    unfinished = self.unfinished(st)

    # Forward: a row wants fresh logits at its block's first step and after a step that changed its block (every
    # step over latents); at its block's first step it also wants the finished block before it written into the
    # cache (exact cache).
    moving = self.network.time_conditioning or self.latents is not None
    wants_logits = jnp.where(st.fresh, has_open, (st.changed | moving) & has_open)
    previous_live = jnp.any(rows(st.segments, starts - block, block) != 0, axis=-1)
    wants_commit = st.fresh & previous_live & unfinished
    num_steps = st.num_steps + (st.block < st.extra_steps).astype(jnp.int32)  # [b] this block's steps
    steps_left = num_steps - st.step  # [b]
    t = (1.0 - st.step / num_steps).astype(jnp.float32)
    s = (1.0 - (st.step + 1) / num_steps).astype(jnp.float32)
    keys = self._step_keys(st, starts - block)  # the block's first canvas position
    latent = None
    if self.latents is not None:
      latent, st = self.latents.start(st, keys, open_, num_steps)
    needs = Needs(starts, t, wants_logits, wants_commit, latent)
    forward = self.cache.forward(params, st, needs)
    if self.latents is not None:  # classifier-free guidance (when on): the proposals and the ODE both see it
      forward = forward._replace(logits=self._guided(params, st._replace(cache=forward.cache), needs, forward.logits))

    # Propose. The Gumbel noise is drawn only when some row samples (a row at temperature 0 ignores it), the rule's
    # own uniforms from a key of their own, so neither depends on the other rows' knobs.
    sampled = jnp.any((st.knobs.temperature > 0.0) & has_open)
    width = noise_width(self.network.vocab_size)
    noise = jax.lax.cond(
      sampled,
      lambda: uniform_noise(keys, (block, width)),
      lambda: jnp.full((z_b.shape[0], block, width), 0.5, jnp.float32),
    )
    u = jnp.zeros(z_b.shape, jnp.float32)
    if settings.rule == "ancestral":
      u = uniform_noise(jax.vmap(lambda k: jax.random.fold_in(k, RULE_NOISE))(keys), (block,))
    view = View(starts, z_b, open_, has_open, keys, noise)
    logits = forward.logits
    for hook in hooks:
      logits = hook.logits(st, view, logits)
    eos_banned = rows(st.eos_banned, starts, block)
    x0, confidence = self.network.map_rows(  # row by row where the network is (batch invariance)
      lambda logits, noise, eos_banned, knobs: propose_rows(logits, noise, eos_banned, settings, knobs),
      logits,
      noise,
      eos_banned,
      st.knobs,
    )
    for hook in hooks:
      x0, confidence, st = hook.propose(st, view, logits, x0, confidence)
    heun = jnp.zeros_like(has_open)
    if self.latents is not None:  # The latents take one solver step towards the restricted distribution.
      st, heun = self._move_latents(params, st, view, hooks, forward, latent, x0, num_steps, t, wants_logits)

    # Rule and commit.
    committed = generate_b & ~open_ & has_open[:, None]  # revision: the open block only
    out = self.rule(
      StepInputs(
        x0=x0,
        confidence=confidence,
        open=open_,
        committed=committed,
        score=rows(st.score, starts, block),
        k=(open_.sum(axis=-1, dtype=jnp.int32) + steps_left - 1) // steps_left,
        steps_left=steps_left,
        block_steps=num_steps,
        t=t,
        s=s,
        u=u,
        threshold=st.knobs.threshold,
      )
    )
    is_last = (st.step >= num_steps - 1)[:, None]
    commit = (out.commit | is_last) & open_
    remask = out.remask & committed & ~is_last
    z_b = jnp.where(remask, mask_id, jnp.where(commit, x0, z_b))
    for hook in hooks:
      z_b, forced, st = hook.after_commit(st, view, z_b)
      commit |= forced
      confidence = jnp.where(forced, 1.0, confidence)
    z = put(st.z, starts, z_b)
    score = put(st.score, starts, jnp.where(commit, confidence, rows(st.score, starts, block)))
    finished = ~jnp.any(generate_b & (z_b == mask_id), axis=-1)  # [b] the row's block is done (or had nothing to do)

    # End of sequence: an EOS in a finished block ends its hole; the hole's later positions become dead padding.
    segments, generate = st.segments, st.generate
    if settings.eos_to_pad:
      slot_ids = jnp.arange(plan.slots)
      has_eos = finished & jnp.any(generate_b & (z_b == settings.eos_id), axis=-1)  # [b]

      def end_holes(z, segments, generate):
        known = slot_ids[None, :] < (starts + block)[:, None]
        dead = after_eos(z, st.target, settings.eos_id, known=known) & has_eos[:, None]
        return jnp.where(dead, settings.pad_id, z), jnp.where(dead, 0, segments), generate & ~dead

      z, segments, generate = jax.lax.cond(jnp.any(has_eos), end_holes, lambda *a: a, z, segments, generate)

    trace = st.trace
    if trace:
      canvases, commits, remasks = trace
      batch_rows = jnp.arange(z.shape[0])
      frame = jnp.minimum(st.recorded, settings.trace - 1)  # [b]: each row records its own steps
      keep = (st.recorded < settings.trace) & has_open
      shown = z
      if self.latents is not None:  # Nothing is committed before a block's end: a frame shows the step's draft.
        shown = put(z, starts, jnp.where(open_ & (rows(z, starts, block) == mask_id), x0, rows(z, starts, block)))
      trace = (
        canvases.at[frame, batch_rows].set(jnp.where(keep[:, None], shown, canvases[frame, batch_rows])),
        commits.at[frame, batch_rows].set(
          jnp.where(keep, commit.sum(axis=-1, dtype=jnp.int32), commits[frame, batch_rows])
        ),
        remasks.at[frame, batch_rows].set(
          jnp.where(keep, remask.sum(axis=-1, dtype=jnp.int32), remasks[frame, batch_rows])
        ),
      )

    # Advance: a finished block moves its row on (the approximate caches refresh every row at once: lockstep).
    advance = finished
    if plan.cache in ("dual", "prefix"):
      advance = jnp.broadcast_to(jnp.all(finished), finished.shape)
    for hook in hooks:
      z, score, st = hook.enter(st, advance, z, score)
    needed = ((forward.ran & wants_logits) | (forward.committed & wants_commit)) & unfinished
    # The ode rule's other passes: guidance's unconditional one, Heun's second (guided: two).
    guided = self.latents is not None and settings.guidance != 1.0
    extra = int(guided) * (forward.ran & wants_logits & unfinished).astype(jnp.int32)
    extra += (1 + int(guided)) * heun.astype(jnp.int32)
    return st._replace(
      z=z,
      generate=generate,
      segments=segments,
      score=score,
      block=st.block + advance.astype(jnp.int32),
      step=jnp.where(advance, 0, st.step + 1),
      fresh=advance,
      changed=jnp.any(commit | remask, axis=-1),
      logits=forward.logits,
      proposal=x0,
      cache=forward.cache,
      nfe=st.nfe + needed.astype(jnp.int32) + extra.astype(jnp.int32),
      forwards=st.forwards + (forward.ran | forward.committed).astype(jnp.int32) + jnp.max(extra).astype(jnp.int32),
      commit_passes=st.commit_passes + forward.committed.astype(jnp.int32),
      iterations=st.iterations + 1,
      recorded=st.recorded + has_open.astype(jnp.int32),
      trace=trace,
    )

  def _move_latents(self, params, st: State, view: View, hooks, forward, latent, x0, num_steps, t, wants_logits):
    """The ``ode`` rule's solver step (:meth:`LatentRule.move`): the denoiser's distribution is the step's logits
    after the hooks, cleaned as the proposals' are, and restricted along a constrained row's valid proposal."""
    block, settings = self.plan.block, self.settings
    eos_banned = rows(st.eos_banned, view.starts, block)
    allowed = None
    for hook in hooks:
      if isinstance(hook, Structured):
        allowed = hook.allowed_along(st, view, x0)

    table = self.network.latent_table(params)

    def expected(logits, eos_banned, allowed):  # of one group of rows (Network.map_rows)
      clean = clean_logits(logits, eos_banned, settings)
      if allowed is not None:
        restricted = jnp.where(allowed, clean, -jnp.inf)
        clean = jnp.where(jnp.any(restricted > -jnp.inf, axis=-1, keepdims=True), restricted, clean)
      return jax.nn.softmax(clean, axis=-1) @ table

    def distribution(logits):  # the expected latent [b, B, d] under the step's distribution
      for hook in hooks:
        logits = hook.logits(st, view, logits)
      return self.network.map_rows(expected, logits, eos_banned, allowed)  # allowed: None, or [b, B, vocab]

    written = st._replace(cache=forward.cache)

    def again(inputs):  # Heun's second pass: the block alone, nothing committed (the cache is not changed).
      needs = Needs(view.starts, t, wants_logits, jnp.zeros_like(wants_logits), inputs)
      logits = self._guided(params, written, needs, self.cache.forward(params, written, needs).logits)
      return distribution(logits)

    return self.latents.move(st, latent, distribution(forward.logits), num_steps, again)

  def _guided(self, params, st: State, needs: Needs, logits: jax.Array) -> jax.Array:
    """Classifier-free guidance of a continuous checkpoint's block logits (``settings.guidance = w``, 1: off):
    ``l_u + w (l_c - l_u)``, with ``l_u`` the block's logits with the context hidden
    (:meth:`~mercury_jax.sampling.caches.Strategy.unconditional`), run only when some row wants logits."""
    w = self.settings.guidance
    if w == 1.0:
      return logits

    def run():
      unconditional = self.cache.unconditional(params, st, needs)
      return unconditional + w * (logits - unconditional)

    return per_row(needs.logits, jax.lax.cond(jnp.any(needs.logits), run, lambda: logits), logits)

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

    return jax.lax.while_loop(cond, lambda st: self._body(params, st), st)

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
    return out._replace(accepted=st.draft.accepted) if st.draft is not None else out

  def sample(
    self,
    params,
    canvas: Canvas,
    key: jax.Array,
    num_steps: jax.Array,
    knobs: Knobs | None = None,
    tables: constrained.Tables | None = None,
    healing: Healing | None = None,
    extra_steps: jax.Array | None = None,
  ) -> SampleOutput:
    """The whole generation as one function: prefill, every block, output (see :meth:`init`)."""
    state = self.init(params, canvas, key, num_steps, knobs, tables=tables, healing=healing, extra_steps=extra_steps)
    st = self.advance(params, state)
    return self.output(st, jnp.shape(canvas.tokens)[1])
