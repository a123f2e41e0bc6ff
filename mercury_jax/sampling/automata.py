"""The device half of structured output: constrained proposals for a block, inside the jitted loop.

A left-to-right decoder masks the next token's logits with an automaton state. A diffusion model commits tokens at
many positions of a block at once, in any order, so a mask per position is not enough: the tokens chosen at two
masked positions must also fit each other. DINGO (Suresh et al. 2025, arXiv 2505.23061) answers this with a dynamic
program over the block's positions and the automaton's states: the most probable string under the per-position
distributions that is still a valid prefix of the language. This module is that program, batched (each row its own
automaton, padded to one :class:`Capacity`) and jit-able:

* :func:`force` walks a block left to right from the state the committed text before it reached: a committed
  position moves along its token, and a masked position whose state allows a single token (a schema's fixed keys and
  punctuation, ``Automaton.forced``) is committed to it, without the model. It stops at the first masked position
  with a real choice; its end state is the state after the block when nothing in it is masked.
* :func:`best_classes` is the max-product (log-space) program: per position, ``best[s']`` is the best score of a
  path that reaches state ``s'`` after the position. A committed position allows only its own token, a masked one
  any token, a position outside the hole leaves the state alone. Tokens with identical transitions share a class,
  so the program runs over the automaton's edges ``(state, class) -> state`` (a few thousand) rather than
  ``states x vocab``, and a masked position scores a class by its best token (greedy) or, when sampling, by the
  class's tempered log-mass plus a Gumbel draw (perturb-and-MAP: at a single position this samples exactly from the
  model's distribution restricted to the allowed tokens). A back-pointer walk gives each position's class, and
  :func:`propose` picks the token inside it: the best one, or one drawn from the class.
* The budget: when the automaton can still accept within the hole (``distance[start] <= hole length``), a state
  after position ``i`` must reach acceptance within the hole's remaining positions, so text never runs out of room
  mid-structure. When it cannot, the row gets the most probable valid prefix and ends incomplete.

EOS is a token of the automaton: it is allowed in accepting states only and leads to ``Automaton.DONE``, where
anything goes (those positions become padding when the block is finished).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.limits import Capacity
from mercury_jax.sampling.proposal import Knobs, filter_rows, sample_tokens

if TYPE_CHECKING:
  from mercury_jax.constrain.automaton import Automaton

UNKNOWN = -2  # A walk's state after a masked position (-1 is a forbidden token's).
FAR = 2**30  # The distance of padding states: never within a budget.
MIN_CAPACITY = (16, 16, 256)  # The smallest (states, classes, edges) a batch is padded to.


class Tables(NamedTuple):
  """A batch's automata as device arrays, each row its own ([b] leading axis everywhere).

  Rows without a constraint have ``on`` False and are never touched. Edges are ``(src, cls) -> dst`` for every
  allowed entry of ``table``, sorted by ``dst`` (padding edges have ``edge_ok`` False).
  """

  on: jax.Array  # [b] bool: the row is constrained
  start: jax.Array  # [b] int32: the initial state
  budgeted: jax.Array  # [b] bool: the automaton can accept within the row's hole (set by the engine's init)
  classes: jax.Array  # [b, vocab] int32: token -> class
  table: jax.Array  # [b, S, C] int32: next state, -1 forbidden
  distance: jax.Array  # [b, S] int32: fewest tokens to acceptance
  forced: jax.Array  # [b, S] int32: the only token allowed, or -1
  src: jax.Array  # [b, E] int32
  cls: jax.Array  # [b, E] int32
  dst: jax.Array  # [b, E] int32
  edge_ok: jax.Array  # [b, E] bool


def _round_up(n: int, least: int) -> int:
  """``n`` rounded up to a power of two or 1.5 times one (at most a third wasted), at least ``least``."""
  power = 1 << max(n - 1, 0).bit_length()
  return max(least, power * 3 // 4 if n <= power * 3 // 4 else power)


def capacity_of(automata: Sequence[Automaton | None]) -> Capacity:
  """The smallest sizes of the form ``2^k`` or ``1.5 * 2^k`` (at least :data:`MIN_CAPACITY`) that hold every
  automaton of a batch: few compilations, little padding."""
  present = [a for a in automata if a is not None]
  most = lambda f: max((f(a) for a in present), default=0)  # noqa: E731
  return Capacity(
    _round_up(most(lambda a: a.num_states), MIN_CAPACITY[0]),
    _round_up(most(lambda a: a.num_classes), MIN_CAPACITY[1]),
    _round_up(most(lambda a: a.num_edges), MIN_CAPACITY[2]),
  )


def fits(automaton: Automaton, capacity: Capacity) -> str | None:
  """Why ``automaton`` does not fit ``capacity`` (one line), or None when it does."""
  sizes = (automaton.num_states, automaton.num_classes, automaton.num_edges)
  for name, size, most in zip(("states", "classes", "edges"), sizes, capacity, strict=True):
    if size > most:
      return f"the constraint compiles to {size} automaton {name}, more than the {most} this engine holds"
  return None


def tables(automata: Sequence[Automaton | None], capacity: Capacity, vocab: int) -> Tables:
  """Host arrays of a batch's automata, padded to ``capacity``; a None row is unconstrained.

  Args:
    automata: One per row.
    capacity: See :func:`capacity_of` (every automaton must fit it).
    vocab: The model's vocabulary; ids beyond the tokenizer's take the class of the mask id (forbidden everywhere
      but in ``DONE``).
  """
  b, (S, C, E) = len(automata), capacity
  out = Tables(
    on=np.zeros((b,), bool),
    start=np.zeros((b,), np.int32),
    budgeted=np.zeros((b,), bool),
    classes=np.zeros((b, vocab), np.int32),
    table=np.full((b, S, C), -1, np.int32),
    distance=np.full((b, S), FAR, np.int32),
    forced=np.full((b, S), -1, np.int32),
    src=np.zeros((b, E), np.int32),
    cls=np.zeros((b, E), np.int32),
    dst=np.zeros((b, E), np.int32),
    edge_ok=np.zeros((b, E), bool),
  )
  for row, a in enumerate(automata):
    if a is None:
      continue
    problem = fits(a, capacity)
    if problem:
      raise ValueError(problem)
    n, k = a.table.shape
    size = min(vocab, a.classes.shape[0])
    out.on[row], out.start[row] = True, a.start
    out.classes[row, :size] = a.classes[:size]
    out.classes[row, size:] = a.classes[a.mask_id]  # the mask's class: allowed nowhere but in DONE
    out.table[row, :n, :k] = a.table
    out.distance[row, :n] = a.distance
    out.forced[row, :n] = a.forced
    src, cls = np.nonzero(a.table >= 0)
    dst = a.table[src, cls]
    order = np.argsort(dst, kind="stable")
    m = len(order)
    out.src[row, :m], out.cls[row, :m], out.dst[row, :m] = src[order], cls[order], dst[order]
    out.dst[row, m:] = S - 1  # padding edges sort last
    out.edge_ok[row, :m] = True
  return out


def _per_row(a: jax.Array, index: jax.Array) -> jax.Array:
  """``a[r, index[r]]`` for every row ``r`` (a gather that keeps the rows' sharding)."""
  return jnp.take_along_axis(a, index[:, None], axis=1)[:, 0]


def step(tables: Tables, state: jax.Array, token: jax.Array) -> jax.Array:
  """[b] the state after ``token`` [b] from ``state`` [b]; -1 for a forbidden token, :data:`UNKNOWN` stays."""
  nxt = jax.vmap(lambda table, classes, s, t: table[s, classes[t]])(
    tables.table, tables.classes, jnp.maximum(state, 0), token
  )
  return jnp.where(state >= 0, nxt, jnp.where(state == UNKNOWN, UNKNOWN, -1))


def force(tables: Tables, state: jax.Array, z: jax.Array, hole: jax.Array, mask_id: int):
  """Commits a block's forced tokens: ``(z, forced, end)``.

  Args:
    tables: The batch's automata.
    state: [b] the state before the block.
    z: [b, B] the block's tokens (``mask_id`` where masked).
    hole: [b, B] bool: the constrained positions (the row's hole); the others leave the state alone.
    mask_id: The mask token.

  Returns:
    ``z`` with forced tokens committed where the state is known, the [b, B] bool positions so committed, and the
    [b] state after the block (:data:`UNKNOWN` when a masked position is left in it).
  """

  def visit(s, inputs):
    z_i, hole_i = inputs
    forced = _per_row(tables.forced, jnp.maximum(s, 0))
    take = hole_i & (z_i == mask_id) & (s >= 0) & (forced >= 0)
    z_i = jnp.where(take, forced, z_i)
    moved = jnp.where(z_i == mask_id, UNKNOWN, step(tables, s, jnp.maximum(z_i, 0)))
    return jnp.where(hole_i, moved, s), (z_i, take)

  end, (z_t, taken) = jax.lax.scan(visit, state, (z.T, hole.T))
  return z_t.T, taken.T, jnp.where(tables.on, end, UNKNOWN)


class Block(NamedTuple):
  """The block a constrained program runs over, every row's."""

  state: jax.Array  # [b] the automaton state before the block
  z: jax.Array  # [b, B] the block's tokens (``mask_id`` where masked)
  hole: jax.Array  # [b, B] bool: the constrained positions
  remaining: jax.Array  # [b, B] int32: hole positions after each position (the budget)
  mask_id: int  # the mask token


def best_classes(tables: Tables, block: Block, scores: jax.Array):
  """The max-product program over one block: each position's class on the best valid path, and whether one exists.

  Args:
    tables: The batch's automata.
    block: The block.
    scores: [b, B, C] float32 class scores of the masked positions.

  Returns:
    ``(classes, found)``: int32 [b, B] (-1 outside the hole and before the batch's first masked position) and
    bool [b].
  """
  state, z, hole, remaining, mask_id = block
  b, length = z.shape
  S, C, E = tables.table.shape[1], tables.table.shape[2], tables.src.shape[1]
  # Per row: the edges' best score into each state (``dst`` is sorted), and the first edge that reaches it.
  best_into = jax.vmap(lambda c, d: jax.ops.segment_max(c, d, S, indices_are_sorted=True))
  first_into = jax.vmap(lambda e, d: jax.ops.segment_min(e, d, S, indices_are_sorted=True))
  committed_cls = jnp.take_along_axis(tables.classes, jnp.maximum(z, 0), axis=1)  # [b, B]
  # The program starts at the batch's first masked position: before it every row's tokens are decided, and a plain
  # walk gives their states (a block fills mostly left to right, so later steps run fewer positions).
  masked = hole & (z == mask_id)
  first = jnp.where(jnp.any(masked, axis=1), jnp.argmax(masked, axis=1), length)
  lo = jnp.min(jnp.where(tables.on, first, length))

  def walk(i, s):
    return jnp.where(hole[:, i], step(tables, s, jnp.maximum(z[:, i], 0)), s)

  start = jax.lax.fori_loop(0, lo, walk, state)
  best0 = jnp.where(jnp.arange(S)[None, :] == start[:, None], 0.0, -jnp.inf)  # [b, S]

  def visit(i, carry):
    best, args = carry
    one_hot = jnp.where(jnp.arange(C)[None, :] == committed_cls[:, i, None], 0.0, -jnp.inf)
    cs = jnp.where((z[:, i] == mask_id)[:, None], scores[:, i], one_hot)  # [b, C]
    cand = jnp.take_along_axis(best, tables.src, 1) + jnp.take_along_axis(cs, tables.cls, 1)  # [b, E]
    cand = jnp.where(tables.edge_ok, cand, -jnp.inf)
    new = best_into(cand, tables.dst)  # [b, S]
    won = (cand == jnp.take_along_axis(new, tables.dst, 1)) & (cand > -jnp.inf)
    arg = first_into(jnp.where(won, jnp.arange(E)[None, :], E), tables.dst)  # [b, S]
    within = tables.distance <= remaining[:, i, None]
    new = jnp.where(tables.budgeted[:, None] & ~within, -jnp.inf, new)
    inside = hole[:, i, None]
    return jnp.where(inside, new, best), args.at[i].set(jnp.where(inside, arg, -1))

  no_args = jnp.full((length, b, S), -1, jnp.int32)
  best, args = jax.lax.fori_loop(lo, length, visit, (best0, no_args))  # args [B, b, S]
  end = jnp.argmax(best, axis=-1).astype(jnp.int32)
  found = jnp.max(best, axis=-1) > -jnp.inf

  def back(k, carry):
    s, classes = carry
    i = length - 1 - k
    edge = _per_row(args[i], s)
    inside, e = edge >= 0, jnp.clip(edge, 0, E - 1)
    cls = jnp.where(inside, _per_row(tables.cls, e), -1)
    return jnp.where(inside, _per_row(tables.src, e), s), classes.at[:, i].set(cls)

  _, classes = jax.lax.fori_loop(0, length - lo, back, (end, jnp.full((b, length), -1, jnp.int32)))
  return classes, found


def _class_scores(logits: jax.Array, classes: jax.Array, num_classes: int, lse: bool = False):
  """``(max, log-sum-exp or None)`` of the logits [b, B, V] of each class at each position, [b, B, C] each."""

  def one(x, ids):  # [V] logits of one position, [V] classes
    top = jax.ops.segment_max(x, ids, num_classes)
    if not lse:
      return top, None
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jax.ops.segment_sum(jnp.exp(x - safe[ids]), ids, num_classes)
    return top, jnp.where(total > 0, safe + jnp.log(total), -jnp.inf)

  return jax.vmap(jax.vmap(one, in_axes=(0, None)))(logits, classes)


def propose(
  tables: Tables, block: Block, clean: jax.Array, knobs: Knobs, noise: jax.Array, class_noise: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Constrained proposals for a block: ``(x0, found)``, tokens [b, B] on the best valid path, and [b] whether the
  row has one (rows without a constraint or a path keep their unconstrained proposals).

  Args:
    tables, block: See :func:`best_classes`.
    clean: [b, B, V] float32, the cleaned logits (``proposal.clean_logits``).
    knobs: The rows' sampling knobs; a row at temperature 0 takes the best path, a sampling row perturbs the class
      scores with Gumbel noise and draws its token inside the chosen class, honouring top-k/top-p where some of
      the class survives them.
    noise: [b, B, noise_width(V)] uniforms of the proposals' two-level Gumbel draw.
    class_noise: [b, B, C] uniforms for the class scores.
  """
  C = tables.table.shape[2]
  sampled = knobs.temperature > 0.0  # [b]
  anyone = jnp.any(sampled & tables.on)  # the sampling half runs only when some constrained row samples
  scaled = clean / jnp.where(sampled, knobs.temperature, 1.0)[:, None, None]

  def sampled_scores():  # a class's tempered log-mass plus a Gumbel draw; a greedy row's best token
    top, mass = _class_scores(scaled, tables.classes, C, lse=True)  # a greedy row's ``scaled`` is ``clean``
    return jnp.where(sampled[:, None, None], mass - jnp.log(-jnp.log(class_noise)), top)

  scores = jax.lax.cond(anyone, sampled_scores, lambda: _class_scores(clean, tables.classes, C)[0])
  classes, found = best_classes(tables, block, scores)
  inside = tables.classes[:, None, :] == classes[:, :, None]  # [b, B, V]
  best = jnp.argmax(jnp.where(inside, clean, -jnp.inf), axis=-1).astype(jnp.int32)

  def draw():  # inside the chosen class, top-k/top-p applied where some of the class survives them
    filtered = (knobs.top_k > 0) | (knobs.top_p < 1.0)
    narrowed = jax.lax.cond(
      jnp.any(filtered & sampled),
      lambda: jnp.where(filtered[:, None, None], filter_rows(scaled, knobs), scaled),
      lambda: scaled,
    )
    narrowed = jnp.where(inside, narrowed, -jnp.inf)
    kept = jnp.any(narrowed > -jnp.inf, axis=-1, keepdims=True)
    narrowed = jnp.where(kept, narrowed, jnp.where(inside, scaled, -jnp.inf))
    drawn = sample_tokens(jnp.where(jnp.any(narrowed > -jnp.inf, -1, keepdims=True), narrowed, 0.0), noise)
    return jnp.where(sampled[:, None], drawn, best)

  x0 = jax.lax.cond(anyone, draw, lambda: best)
  return x0, found & tables.on
