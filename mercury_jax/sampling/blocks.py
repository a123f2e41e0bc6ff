"""The block engine: left-to-right blocks refined in parallel against a key-value cache, one jitted program.

Block diffusion (BD3-LM, Arriola et al. 2025, arXiv 2503.09573) refines a block of ``B`` tokens at a time; the
block attends to the keys and values of everything before it, which are computed once. The same engine decodes the
autoregressive twin (blocks of one token, one step per block) and gives bidirectional (whole-sequence) checkpoints
Fast-dLLM's approximate caches (Wu et al. 2025, arXiv 2505.22618): block-diffusion models, the twin and cached
whole-sequence decoding share this one loop, behind every entry point (``Sampler.generate`` and ``stream``, the
command line, the benchmark). Only whole-sequence checkpoints without a cache keep the whole-canvas loop of
``mercury_jax.sampling.loop``.

Layout. Canvases (``mercury_jax.sampling.canvas``: prompts, holes, templates; right-padded rows) are laid into
*slots*: slot ``p + B`` holds canvas position ``p`` (one block of padding in front, so that every block has a block
before it), and blocks are the slot ranges ``[k B, (k + 1) B)``. Each row keeps its own block offset: its ``j``-th
step block is ``first + j`` (its first generated position's block), so rows with different prompt lengths share one
compilation, each row writes its chunk at its own cache slots, and rotary positions are canvas positions, so a row's
tokens do not depend on its batch. A row that has no block left re-runs its last one, which rewrites the same keys
and values.

Caches (``BlockPlan.cache``):

* ``exact`` (block-diffusion and autoregressive models): a prefill over every slot writes the prompt's clean keys and
  values once and gives the first block's first logits (the masked slots it also writes are rewritten before anything
  reads them). Every step of block ``k`` runs ``[block k-1 (clean) ; block k (noisy)]`` in one forward pass: the
  first one writes block ``k-1``'s clean keys and values (the commit pass, fused), the later ones write the same
  values again. One static chunk and no conditional around the cache: on XLA:CPU a ``lax.cond`` choosing between a
  ``2B``- and a ``B``-token pass copied the whole cache at every step, which cost more than the ``B`` extra tokens
  (``BUILD_NOTES.md``). The chunk sees the cache through the block-causal mask in slot space, which is exactly
  BD3-LM's training mask.
  The autoregressive twin runs ``[block k-1]`` (one token) and reads the next token's distribution from it.
* ``none``: the same steps without a cache: every forward pass runs the whole context (``x_t ⊕ x_0`` through the
  ``block_diffusion`` mask; the causal model over the canvas; a whole-sequence checkpoint over the canvas). The
  reference the exact cache must reproduce.
* ``dual`` (bidirectional models; approximate): the first step of a block runs the whole canvas and caches every
  position's keys and values; the block's other steps run the block alone against that cache (Fast-dLLM's
  DualCache: prefix and suffix are both stale until the next block).
* ``prefix`` (bidirectional models; approximate): like ``dual`` but each step recomputes the block and everything
  after it (Fast-dLLM's PrefixCache). Shapes are static: a ``lax.switch`` picks the shortest of a few chunk lengths
  (the longest suffix, then halving) that covers every row's suffix.

Rows are independent. Each row has its own block counter, step, step budget (``num_steps`` [b]) and sampling knobs
(``State.knobs``: temperature, top-k, top-p, threshold as traced [b] arrays), and moves to its next block as soon as
its own block is finished; one forward pass serves every row that needs one, and a row that did not need it gets the
logits it already had (same inputs, same program). So a row's tokens depend on its own canvas, key and knobs only,
and a serving engine (``mercury_jax.serve``) can :meth:`BlockEngine.insert` a request into a free row and
:meth:`BlockEngine.release` it between steps. The approximate caches refresh every row at once and keep the rows'
blocks in lockstep.

Steps. Within a block the existing step rules (``mercury_jax.sampling.rules``) run unchanged on ``[batch, B]``
slices with ``num_steps`` steps per block: the confidence schedule commits ``ceil(open / steps_left)``, the
ancestral rule walks the block's time grid from 1 to 0, revision re-masks only the open block, and the block's last
step commits everything. When a step committed and re-masked nothing, the next step reuses the last logits instead
of running the model (MDLM's caching of unchanged inputs; not with time conditioning). A block with nothing to
generate in any row costs no step, and no forward pass unless the block before it must still be written.

End of sequence. When a block is finished, an EOS in it ends its own hole (``canvas.after_eos``): the hole's later
positions become padding, are never generated and are never attended to; generation stops once no row has a masked
position left, so open-ended generation ends at EOS.

Structured output. With ``tables`` (``mercury_jax.constrain.device``), a constrained row carries its automaton's
state from block to block (``State.dfa``, the state before its step block). At every step its proposals become the
most probable valid string of the block (a dynamic program over positions × states), which the step rule then
commits from as usual; tokens that are the only one their state allows are committed without the model, when the
row enters a block and after every commit, so a block of fixed text costs at most its fused commit pass. Rows
without a constraint are untouched, and nothing of this runs when no row is constrained. Token healing is a
constraint too (``Automaton.free``): a healed row is let go (``tables.on`` cleared) at the end of the block where its
prefix got written, and decodes unconstrained from then on.

Randomness. Example ``i`` draws from ``key_i = fold_in(key, streams[i])``; step ``j`` of the block starting at
canvas position ``p`` uses the key ``k = fold_in(key_i, p)`` (``j = 0``) or ``fold_in(fold_in(key_i, p), j)``: the
proposals' Gumbel noise is ``B`` rows drawn from ``k`` (only when some row samples: a row at temperature 0 ignores
it), the ancestral rule's uniforms come from ``fold_in(k, RULE_NOISE)``, a constrained row's class noise from
``fold_in(k, CLASS_NOISE)``. So the twin draws exactly as the
stand-alone decoder it replaced did (kept as the tests' reference), and a row's draws do not depend on its batch.

The loop runs in chunks (:meth:`BlockEngine.advance`, a budget of blocks and steps): the state goes in and out of
each jitted call, so a stream of blocks or of drafts costs no recompilation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import ModelConfig
from mercury_jax.constrain import device as constrained
from mercury_jax.model import Transformer
from mercury_jax.sampling.canvas import Canvas, SampleOutput, after_eos
from mercury_jax.sampling.proposal import Knobs, clean_logits, noise_width, propose_rows, uniform_noise
from mercury_jax.sampling.rules import StepInputs, make_rule
from mercury_jax.sampling.settings import SamplerSettings

CACHES = ("exact", "none", "dual", "prefix")
RULE_NOISE = 0x7275  # Folded into a step's key for the step rule's own uniforms (the ancestral rule's).
CLASS_NOISE = 0x636C  # Folded into a step's key for a constrained row's class scores (``constrain.device``).


@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """Everything static about one engine run (hashable: a compilation key); it depends on the canvas length only.

  Attributes:
    block: Block size B (1 for the autoregressive twin).
    slots: Slots per row: one block of padding, then the canvas rounded up to the block.
    cache: ``exact``, ``none``, ``dual`` or ``prefix`` (module docstring).
    autoregressive: Decode a causal model: the distribution of block ``k`` comes from block ``k - 1``.
    whole_sequence: A bidirectional checkpoint trained on whole sequences (no block mask): its caches are
      approximate (``dual``, ``prefix``) and ``none`` runs the whole canvas bidirectionally at every step.
  """

  block: int
  slots: int
  cache: Literal["exact", "none", "dual", "prefix"] = "exact"
  autoregressive: bool = False
  whole_sequence: bool = False

  def __post_init__(self):
    if self.block < 1 or self.slots % self.block or self.slots < 2 * self.block:
      raise ValueError(f"block={self.block} must be >= 1 and slots={self.slots} a multiple of it, >= 2 blocks")
    if self.cache not in CACHES:
      raise ValueError(f"cache={self.cache!r} must be one of {CACHES}")
    if self.autoregressive and (self.block != 1 or self.cache not in ("exact", "none")):
      raise ValueError("the autoregressive twin decodes blocks of 1 token with cache 'exact' or 'none'")
    if self.whole_sequence and self.cache == "exact":
      raise ValueError("a whole-sequence checkpoint has no exact cache; use 'dual' or 'prefix' (approximate) or 'none'")
    if not self.whole_sequence and self.cache in ("dual", "prefix"):
      raise ValueError(f"cache={self.cache!r} is the approximate cache of whole-sequence checkpoints")

  @property
  def tail(self) -> int:
    """The prefix cache's longest chunk: from a block's start to the last slot, at most ``slots - block``."""
    return self.slots - self.block

  @property
  def suffix_sizes(self) -> tuple[int, ...]:
    """The prefix cache's chunk lengths, longest first: ``tail``, then halving, in whole blocks. A step runs the
    shortest that covers every row's block and suffix, so later blocks cost less."""
    sizes, size = [], self.tail
    while size >= self.block and len(sizes) < 4:
      sizes.append(-(-size // self.block) * self.block)
      size //= 2
    return tuple(sorted(set(sizes), reverse=True))


def plan_blocks(
  kinds: np.ndarray, block: int, *, cache: str = "exact", autoregressive: bool = False, whole_sequence: bool = False
) -> BlockPlan:
  """The :class:`BlockPlan` of a batch of canvases (host side: it is static under ``jax.jit``).

  Args:
    kinds: int [batch, length], the canvases' kinds (rows without a ``TARGET`` are batch padding).
    block: Block size.
    cache: See :data:`CACHES`.
    autoregressive: Whether the model is the autoregressive twin.
    whole_sequence: Whether the model is a bidirectional whole-sequence checkpoint.

  Raises:
    ValueError: A bad block size or cache, or an autoregressive row whose first position is to be generated.
  """
  kinds = np.asarray(kinds)
  if block < 1:
    raise ValueError(f"block={block} must be >= 1")
  target = kinds == K.TARGET
  if autoregressive and (target.any(axis=1) & (np.argmax(target, axis=1) == 0)).any():
    raise ValueError("the autoregressive twin needs a known first token in every row (a prompt, or BOS)")
  return BlockPlan(block, block + -(-kinds.shape[1] // block) * block, cache, autoregressive, whole_sequence)


def _rows(a: jax.Array, starts: jax.Array, size: int) -> jax.Array:
  """``a[r, starts[r] : starts[r] + size]`` for every row ``r`` of ``a`` [b, S, ...]."""
  return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size, axis=0))(a, starts)


def _put(a: jax.Array, starts: jax.Array, piece: jax.Array) -> jax.Array:
  """``a`` with ``piece[r]`` written at ``starts[r]`` of every row ``r``."""
  return jax.vmap(lambda x, s, p: jax.lax.dynamic_update_slice_in_dim(x, p, s, axis=0))(a, starts, piece)


class State(NamedTuple):
  """The loop state carried between chunks (a pytree; arrays are per row unless noted)."""

  z: jax.Array  # [b, S] tokens in slots (the mask id at open positions)
  target: jax.Array  # [b, S] the canvas's TARGET slots (holes)
  generate: jax.Array  # [b, S] TARGET slots still to generate (not after an EOS of their hole)
  segments: jax.Array  # [b, S] 1 for live slots, 0 for padding and positions after an EOS
  positions: jax.Array  # [b, S] rotary positions (canvas positions)
  eos_banned: jax.Array  # [b, S] min_length
  score: jax.Array  # [b, S] confidence of each generated token when it was committed
  first: jax.Array  # [b] the row's first block with a position to generate
  last: jax.Array  # [b] its last one
  example_keys: jax.Array  # [b] PRNG keys
  block: jax.Array  # [b] the row's step block index ``j`` (it works on block ``min(first + j, last)``)
  step: jax.Array  # [b] step within the block
  fresh: jax.Array  # [b] bool: the block's first step is next
  changed: jax.Array  # [b] bool: the block changed since its last forward pass
  logits: jax.Array  # [b, B, vocab] the last forward pass's logits of the block
  proposal: jax.Array  # [b, B] the last step's proposed tokens in its block (a draft's undecided positions)
  cache: Any  # the model's key-value cache (``()`` without one); leaves are [layers, b, ...]
  num_steps: jax.Array  # [b] steps per block
  knobs: Knobs  # [b] each: temperature, top-k, top-p, threshold
  nfe: jax.Array  # [b] forward passes the row needed while it had a masked position (prefill included)
  forwards: jax.Array  # [] forward passes run (prefill included)
  first_passes: jax.Array  # [] of which a block's first pass (the fused commit, or the approximate caches' refresh)
  iterations: jax.Array  # [] loop iterations (steps, forward or not)
  recorded: jax.Array  # [b] steps in which the row had an open position (frames of its trace)
  trace: tuple[jax.Array, ...]  # (canvases, commits, remasks) in slot space, or ()
  tables: constrained.Tables | None  # the rows' automata (structured output), or None: no row is constrained
  dfa: jax.Array  # [b] the automaton state before the row's step block (0 for unconstrained rows)


class BlockEngine:
  """The engine for one model, settings and plan: :meth:`init`, :meth:`advance`, :meth:`output` (pure functions).

  Args:
    model_cfg: The model's config.
    settings: Step rule, proposals, EOS handling (static).
    plan: The layout and cache (see :func:`plan_blocks`).
  """

  def __init__(self, model_cfg: ModelConfig, settings: SamplerSettings, plan: BlockPlan):
    if plan.autoregressive != model_cfg.causal:
      raise ValueError(f"plan.autoregressive={plan.autoregressive} does not fit model.causal={model_cfg.causal}")
    self.model_cfg, self.settings, self.plan = model_cfg, settings, plan
    self.model = Transformer(model_cfg)
    self.rule = make_rule(settings)

  # ------------------------------------------------------------------------------------------- forward passes

  @property
  def _cache_slots(self) -> int:
    plan = self.plan
    return plan.slots + (plan.tail if plan.cache == "prefix" else 0)

  def _apply(self, params, cache, tokens, positions, segments, index, mask, t=None):
    """One decoding forward pass over a chunk at cache slots ``index ...`` (scalar or per row): ``(logits, cache)``.

    ``t`` [b] reaches only a time-conditioned model (a bidirectional checkpoint under an approximate cache; the
    prefill runs at t = 0, clean).
    """
    if self.model_cfg.time_conditioning:
      t = jnp.zeros((tokens.shape[0],), jnp.float32) if t is None else t
    else:
      t = None
    logits, variables = self.model.apply(
      {"params": params, "cache": cache},
      tokens,
      t,
      segment_ids=segments,
      positions=positions,
      decode=True,
      mask=mask,
      diffusion_block=self.plan.block if mask == "block_causal" else None,
      cache_index=index,
      mutable=["cache"],
    )
    return logits, variables["cache"]

  def _cached_mask(self) -> str:
    if self.plan.autoregressive:
      return "causal"
    return "block_causal" if self.plan.cache == "exact" else "bidirectional"

  def starts(self, st: State) -> jax.Array:
    """[b] the first slot of each row's step block."""
    return jnp.minimum(st.first + st.block, st.last) * self.plan.block

  def _chunk(self, st: State, starts: jax.Array, size: int, padded: bool = False):
    """``(tokens, positions, segments)`` of slots ``[starts[r], starts[r] + size)`` of each row."""
    arrays = (st.z, st.positions, st.segments)
    if padded:  # The prefix cache's chunk runs past the last slot: padding there.
      arrays = tuple(jnp.pad(a, ((0, 0), (0, self.plan.tail))) for a in arrays)
    return tuple(_rows(a, starts, size) for a in arrays)

  def _full(self, params, st: State, t: jax.Array | None = None, **kw) -> jax.Array:
    """Logits of the whole canvas without a cache (``kw``: the mask)."""
    t_in = t if self.model_cfg.time_conditioning else None
    return self.model.apply({"params": params}, st.z, t_in, segment_ids=st.segments, positions=st.positions, **kw)

  def forward(self, params, st: State, t: jax.Array):
    """The logits ``[b, B, vocab]`` of every row's step block at time ``t`` [b] and the updated cache."""
    plan, block = self.plan, self.plan.block
    starts = self.starts(st)
    if plan.cache == "none":
      if plan.autoregressive:
        return _rows(self._full(params, st), starts - 1, 1), st.cache
      if plan.whole_sequence:
        return _rows(self._full(params, st, t), starts, block), st.cache
      twice = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731  x_t ⊕ x_0
      logits = self.model.apply(
        {"params": params},
        twice(st.z),
        None,
        segment_ids=twice(st.segments),
        positions=twice(st.positions),
        mask="block_diffusion",
        diffusion_block=block,
        logits_length=plan.slots,
      )
      return _rows(logits, starts, block), st.cache
    mask = self._cached_mask()
    if plan.autoregressive:
      return self._apply(params, st.cache, *self._chunk(st, starts - 1, 1), starts - 1, mask)

    if plan.cache == "exact":  # [block k-1 clean ; block k noisy]: the commit pass of block k-1, fused.
      chunk = self._chunk(st, starts - block, 2 * block)
      logits, cache = self._apply(params, st.cache, *chunk, starts - block, mask, t)
      return logits[:, block:], cache

    def first_step():
      logits, cache = self._apply(params, st.cache, st.z, st.positions, st.segments, 0, mask, t)  # refresh all
      return _rows(logits, starts, block), cache

    def suffix(size: int):
      def run():
        logits, cache = self._apply(params, st.cache, *self._chunk(st, starts, size, padded=True), starts, mask, t)
        return logits[:, :block], cache

      return run

    def later_step():
      if plan.cache == "prefix":  # The block and everything after it: the shortest chunk that covers every row's.
        sizes = plan.suffix_sizes
        need = jnp.max(plan.slots - starts)
        return jax.lax.switch(jnp.sum(jnp.asarray(sizes) >= need) - 1, [suffix(size) for size in sizes])
      return self._apply(params, st.cache, *self._chunk(st, starts, block), starts, mask, t)

    return jax.lax.cond(jnp.any(st.fresh), first_step, later_step)  # the approximate caches run in lockstep

  # ------------------------------------------------------------------------------------------------ the loop

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
  ) -> State:
    """Lays the canvases into slots and runs the prefill (``exact`` cache): the state before the first step.

    Args:
      params: The model's parameters.
      canvas: The rows, ``slots - block`` positions or fewer.
      key: The PRNG key; row ``i`` draws from ``fold_in(key, canvas.streams[i])``.
      num_steps: Steps per block: one for every row ([]) or one per row ([b]).
      knobs: The sampling knobs (traced), per row ([b] each) or for every row ([] each); default: the settings'
        own, as constants.
      prefill: How many slots the exact cache's prefill runs over (static; default every slot): a serving engine
        prefills a prompt over a bucket that covers its first block, not over the whole context.
      tables: The rows' automata (:func:`mercury_jax.constrain.device.tables`): a constrained row's hole (it must
        have one) is generated as a valid prefix of its automaton's language, complete when the hole has room
        (:mod:`mercury_jax.constrain.device`); its ``min_length`` is ignored (the automaton says where text ends).
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
    dfa = jnp.zeros((batch,), jnp.int32)
    if tables is not None:  # Budget: the automaton can accept within the hole; the first block's forced tokens.
      tables = jax.tree.map(jnp.asarray, tables)
      room = target.sum(axis=1, dtype=jnp.int32)
      least = jnp.take_along_axis(tables.distance, tables.start[:, None], axis=1)[:, 0]
      tables = tables._replace(budgeted=tables.on & (least <= room))
      eos_banned &= ~(tables.on & ~tables.free.any(axis=1))[:, None]  # A healed row keeps min_length.
      dfa = jnp.where(tables.on, tables.start, 0)
      z = self._force(tables, dfa, z, target, first * block)[0]
    segments = (kinds != K.PAD).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.maximum(slots - block, 0), (batch, plan.slots)).astype(jnp.int32)
    example_keys = jax.vmap(lambda stream: jax.random.fold_in(key, stream))(jnp.asarray(canvas.streams, jnp.int32))
    cache, nfe, forwards = (), jnp.zeros((batch,), jnp.int32), jnp.zeros((), jnp.int32)
    logits = jnp.zeros((batch, block, self.model_cfg.vocab_size), jnp.float32)
    if plan.cache != "none":
      abstract = jax.eval_shape(
        lambda: self.model.init(jax.random.key(0), jnp.zeros((batch, self._cache_slots), jnp.int32), decode=True)
      )["cache"]
      cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    if plan.cache == "exact":
      # Every slot, clean and block-causal (causal for the twin): the prompts' keys and values, and the first open
      # block's logits, which are its first step's, as the fused pass would give them. ``prefill`` slots suffice
      # when they cover every row's first block.
      size = plan.slots if prefill is None else prefill
      cut = lambda a: a[:, :size]  # noqa: E731
      out, cache = self._apply(params, cache, cut(z), cut(positions), cut(segments), 0, self._cached_mask())
      start = first * block
      logits = _rows(out, start - 1, 1) if plan.autoregressive else _rows(out, start, block)
      nfe, forwards = nfe + 1, forwards + 1
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
    return State(
      z=z,
      target=target,
      generate=target,
      segments=segments,
      positions=positions,
      eos_banned=eos_banned,
      score=jnp.zeros((batch, plan.slots), jnp.float32),
      first=first,
      last=last.astype(jnp.int32),
      example_keys=example_keys,
      block=no,
      step=no,
      fresh=per_row(plan.cache != "exact", bool),  # The exact cache's prefill ran the first block's first pass.
      changed=per_row(plan.cache != "exact", bool),
      logits=logits,
      proposal=jnp.zeros((batch, block), jnp.int32),
      cache=cache,
      num_steps=jnp.maximum(per_row(num_steps, jnp.int32), 1),
      knobs=Knobs(
        per_row(knobs.temperature, jnp.float32),
        per_row(knobs.top_k, jnp.int32),
        per_row(knobs.top_p, jnp.float32),
        per_row(knobs.threshold, jnp.float32),
      ),
      nfe=nfe,
      forwards=forwards,
      first_passes=jnp.zeros((), jnp.int32),
      iterations=jnp.zeros((), jnp.int32),
      recorded=no,
      trace=trace,
      tables=tables,
      dfa=dfa,
    )

  def insert(self, st: State, row: State, slot: jax.Array) -> State:
    """``st`` with the one-row state ``row`` (an :meth:`init` of one canvas) in row ``slot``; the batch counters
    (``forwards``, ...) stay ``st``'s. A serving engine's admission: prefill a request alone, then insert it."""
    put = lambda axis: lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=axis)  # noqa: E731
    fields = {}
    for name in State._fields:
      if name in ("forwards", "first_passes", "iterations"):
        continue
      if name == "cache":
        fields[name] = jax.tree.map(put(1), st.cache, row.cache)  # [layers, b, ...]
      elif name == "trace":
        fields[name] = jax.tree.map(put(1), st.trace, row.trace)  # [frames, b, ...]
      else:
        fields[name] = jax.tree.map(put(0), getattr(st, name), getattr(row, name))
    return st._replace(**fields)

  def release(self, st: State, slot: jax.Array) -> State:
    """``st`` with row ``slot`` given up: it has nothing left to generate, so it takes no more steps."""
    return st._replace(generate=st.generate.at[slot].set(False))

  def unfinished(self, st: State) -> jax.Array:
    """[b] bool: the row still has a masked position."""
    return jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)

  def _force(self, tables, dfa, z, target, starts):
    """``(z, forced, end)``: the forced tokens of every row's block at ``starts`` committed (``constrain.device``)."""
    block = self.plan.block
    z_b, forced, end = constrained.force(
      tables, dfa, _rows(z, starts, block), _rows(target, starts, block), self.settings.mask_id
    )
    return _put(z, starts, z_b), forced, end

  def _constrain(self, st: State, logits, x0, confidence, z_b, starts, keys, noise, has_open):
    """Constrained rows' proposals: the best valid string of their block (``constrain.device.propose``)."""
    settings, block, tables = self.settings, self.plan.block, st.tables
    hole = _rows(st.target, starts, block)
    end = self.plan.slots - jnp.argmax(st.target[:, ::-1], axis=1)  # [b] one past the hole's last slot
    remaining = end[:, None] - (starts[:, None] + jnp.arange(block)[None, :]) - 1

    def run():
      clean = clean_logits(logits, _rows(st.eos_banned, starts, block), settings)
      class_keys = jax.vmap(lambda k: jax.random.fold_in(k, CLASS_NOISE))(keys)
      # Drawn [classes, B]: a draw is a prefix of a longer one along its first axis, so a row's noise does not
      # depend on the capacity its batch pads the classes to.
      class_noise = jnp.swapaxes(uniform_noise(class_keys, (tables.table.shape[2], block)), 1, 2)
      y, found = constrained.propose(
        tables, st.dfa, clean, st.knobs, z_b, hole, remaining, noise, class_noise, settings.mask_id
      )
      use = found[:, None] & hole
      conf = confidence
      if settings.confidence == "prob":
        log_z = jax.nn.logsumexp(clean, axis=-1)
        conf = jnp.where(use, jnp.exp(jnp.take_along_axis(clean, y[..., None], axis=-1)[..., 0] - log_z), conf)
      return jnp.where(use, y, x0), conf

    return jax.lax.cond(jnp.any(tables.on & has_open), run, lambda: (x0, confidence))

  def _step_keys(self, st: State, position: jax.Array) -> jax.Array:
    keys = jax.vmap(jax.random.fold_in)(st.example_keys, position)
    stepped = jax.vmap(jax.random.fold_in)(keys, st.step)
    data = lambda k: jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k  # noqa: E731
    chosen = jnp.where((st.step == 0)[:, None], data(keys), data(stepped))
    return jax.random.wrap_key_data(chosen) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else chosen

  def _body(self, params, st: State) -> State:
    plan, settings, block, mask_id = self.plan, self.settings, self.plan.block, self.settings.mask_id
    starts = self.starts(st)
    piece = lambda a: _rows(a, starts, block)  # noqa: E731
    z_b, generate_b = piece(st.z), piece(st.generate)
    open_ = generate_b & (z_b == mask_id)  # [b, B]
    has_open = jnp.any(open_, axis=-1)  # [b]
    unfinished = self.unfinished(st)
    first_run = has_open
    if plan.cache == "exact":  # Block k-1 reaches the cache through this block's first pass when it holds live tokens.
      first_run |= jnp.any(_rows(st.segments, starts - block, block) != 0, axis=-1) & unfinished
    needs = jnp.where(st.fresh, first_run, (st.changed | self.model_cfg.time_conditioning) & has_open)  # [b]
    # One pass for the batch when any row needs one: a row that did not gets the logits it already had (same inputs,
    # same program), so its tokens never depend on its neighbours.
    run = jnp.any(needs)
    steps_left = st.num_steps - st.step  # [b]
    t = (1.0 - st.step / st.num_steps).astype(jnp.float32)
    s = (1.0 - (st.step + 1) / st.num_steps).astype(jnp.float32)
    logits, cache = jax.lax.cond(run, lambda: self.forward(params, st, t), lambda: (st.logits, st.cache))

    keys = self._step_keys(st, starts - block)  # the block's first canvas position
    # The proposals' Gumbel noise, drawn only when some row samples (a row at temperature 0 ignores it), and the
    # rule's own uniforms from a key of their own, so neither depends on the other rows' knobs.
    sampled = jnp.any((st.knobs.temperature > 0.0) & has_open)
    width = noise_width(self.model_cfg.vocab_size)
    zeros = jnp.full((z_b.shape[0], block, width), 0.5, jnp.float32)
    noise = jax.lax.cond(sampled, lambda: uniform_noise(keys, (block, width)), lambda: zeros)
    u = jnp.zeros(z_b.shape, jnp.float32)
    if settings.rule == "ancestral":
      u = uniform_noise(jax.vmap(lambda k: jax.random.fold_in(k, RULE_NOISE))(keys), (block,))
    x0, confidence = propose_rows(logits, noise, piece(st.eos_banned), settings, st.knobs)
    if st.tables is not None:
      x0, confidence = self._constrain(st, logits, x0, confidence, z_b, starts, keys, noise, has_open)
    committed = generate_b & ~open_ & has_open[:, None]  # revision: the open block only
    inputs = StepInputs(
      x0=x0,
      confidence=confidence,
      open=open_,
      committed=committed,
      score=piece(st.score),
      k=(open_.sum(axis=-1, dtype=jnp.int32) + steps_left - 1) // steps_left,
      steps_left=steps_left,
      window_steps=st.num_steps,
      t=t,
      s=s,
      u=u,
      threshold=st.knobs.threshold,
    )
    out = self.rule(inputs)
    is_last = (st.step >= st.num_steps - 1)[:, None]
    commit = (out.commit | is_last) & open_
    remask = out.remask & committed & ~is_last
    z_b = jnp.where(remask, mask_id, jnp.where(commit, x0, z_b))
    end_state = st.dfa
    if st.tables is not None:  # Forced tokens the commits exposed, without the model; the state after the block.
      z_b, forced, end_state = jax.lax.cond(
        jnp.any(st.tables.on),
        lambda: constrained.force(st.tables, st.dfa, z_b, piece(st.target), mask_id),
        lambda: (z_b, jnp.zeros_like(open_), st.dfa),
      )
      commit |= forced
      confidence = jnp.where(forced, 1.0, confidence)
    z = _put(st.z, starts, z_b)
    score = _put(st.score, starts, jnp.where(commit, confidence, piece(st.score)))
    finished = ~jnp.any(generate_b & (z_b == mask_id), axis=-1)  # [b] the row's block is done (or had nothing to do)

    # A finished block: an EOS in it ends its hole; the hole's later positions become dead padding.
    slots = jnp.arange(plan.slots)
    has_eos = finished & jnp.any(generate_b & (z_b == settings.eos_id), axis=-1)  # [b]

    def end_holes(z, segments, generate):
      known = slots[None, :] < (starts + block)[:, None]
      dead = after_eos(z, st.target, settings.eos_id, known=known) & has_eos[:, None]
      return jnp.where(dead, settings.pad_id, z), jnp.where(dead, 0, segments), generate & ~dead

    z, segments, generate = jax.lax.cond(jnp.any(has_eos), end_holes, lambda *a: a, z, st.segments, st.generate)

    trace = st.trace
    if trace:
      canvases, commits, remasks = trace
      rows = jnp.arange(z.shape[0])
      frame = jnp.minimum(st.recorded, settings.trace - 1)  # [b]: each row records its own steps
      keep = (st.recorded < settings.trace) & has_open
      trace = (
        canvases.at[frame, rows].set(jnp.where(keep[:, None], z, canvases[frame, rows])),
        commits.at[frame, rows].set(jnp.where(keep, commit.sum(axis=-1, dtype=jnp.int32), commits[frame, rows])),
        remasks.at[frame, rows].set(jnp.where(keep, remask.sum(axis=-1, dtype=jnp.int32), remasks[frame, rows])),
      )
    advance = finished
    if plan.cache in ("dual", "prefix"):  # The approximate caches refresh every row at once: blocks in lockstep.
      advance = jnp.broadcast_to(jnp.all(finished), finished.shape)
    dfa, tables = st.dfa, st.tables
    if tables is not None:  # The next block starts where this one ended; its forced tokens go in now.
      dfa = jnp.where(advance & tables.on, end_state, st.dfa)
      # A healed row whose prefix is written is let go: from its next block on it decodes unconstrained.
      free = jnp.take_along_axis(tables.free, jnp.maximum(dfa, 0)[:, None], axis=1)[:, 0] & (dfa >= 0)
      released = advance & tables.on & free
      tables = tables._replace(on=tables.on & ~released)
      dfa = jnp.where(released, 0, dfa)
      upcoming = jnp.minimum(st.first + st.block + advance.astype(jnp.int32), st.last) * block
      forced_z = jax.lax.cond(
        jnp.any(tables.on & advance), lambda: self._force(tables, dfa, z, st.target, upcoming)[0], lambda: z
      )
      score = jnp.where(advance[:, None] & (forced_z != z), 1.0, score)
      z = jnp.where(advance[:, None], forced_z, z)
    return st._replace(
      z=z,
      generate=generate,
      segments=segments,
      score=score,
      block=st.block + advance.astype(jnp.int32),
      step=jnp.where(advance, 0, st.step + 1),
      fresh=advance,
      changed=jnp.any(commit | remask, axis=-1),
      logits=logits,
      proposal=x0,
      cache=cache,
      nfe=st.nfe + (run & needs & unfinished).astype(jnp.int32),
      forwards=st.forwards + run.astype(jnp.int32),
      first_passes=st.first_passes + (run & jnp.any(st.fresh & needs)).astype(jnp.int32),
      iterations=st.iterations + 1,
      recorded=st.recorded + has_open.astype(jnp.int32),
      trace=trace,
      tables=tables,
      dfa=dfa,
    )

  def advance(self, params, st: State, max_blocks: jax.Array | None = None, max_steps: jax.Array | None = None):
    """Runs steps until nothing is masked, or some row finished ``max_blocks`` more blocks, or ``max_steps`` more
    steps ran (each budget optional; traced scalars, so one compilation serves every budget)."""
    first_block, first_iteration = st.block, st.iterations

    def cond(st: State):
      going = ~self.done(st)
      if max_blocks is not None:
        going &= jnp.all(st.block - first_block < max_blocks)
      if max_steps is not None:
        going &= st.iterations - first_iteration < max_steps
      return going

    return jax.lax.while_loop(cond, lambda st: self._body(params, st), st)

  def done(self, st: State) -> jax.Array:
    """[] bool: nothing is left to generate."""
    return ~jnp.any(self.unfinished(st) & (st.block < self.plan.slots // self.plan.block))

  def to_canvas(self, slots_array: jax.Array, length: int) -> jax.Array:
    """``[..., S]`` slot values at canvas positions ``[..., length]``."""
    return slots_array[..., self.plan.block : self.plan.block + length]

  def output(self, st: State, length: int) -> SampleOutput:
    """The :class:`SampleOutput` at canvas positions (``length``: the canvas length).

    ``steps`` counts the forward passes run; the trace holds one frame per step that had a masked position to work
    on, and ``commits`` is -1 in frames past the last one.
    """
    tokens = self.to_canvas(st.z, length)
    trace = ()
    if st.trace:
      canvases, commits, remasks = st.trace
      trace = (self.to_canvas(canvases, length), commits, remasks)
    return SampleOutput(tokens, st.nfe, st.forwards, *trace)

  def sample(
    self,
    params,
    canvas: Canvas,
    key: jax.Array,
    num_steps: jax.Array,
    knobs: Knobs | None = None,
    tables: constrained.Tables | None = None,
  ) -> SampleOutput:
    """The whole generation as one program: prefill, every block, output (``knobs``, ``tables``: see :meth:`init`)."""
    st = self.advance(params, self.init(params, canvas, key, num_steps, knobs, tables=tables))
    return self.output(st, jnp.shape(canvas.tokens)[1])
