"""The acceptance walk of a verified step over its draft tree (:mod:`~mercury_jax.sampling.verify` says why it is
exact): multi-step speculative sampling, one depth at a time, with duplicate candidates merged."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.sampling.drafts import CHAIN, Candidates, Topology


class Walk(NamedTuple):
  """What the walk accepted, per row."""

  accepted: jax.Array  # [b] int32: a, the depth of the accepted path (its candidates)
  tokens: jax.Array  # [b, D] int32: the accepted token of each depth (the first ``a`` are the path's)
  path: jax.Array  # [b, D + 1] int32: a node of the path at each depth, the root first (repeating its last)
  residual: jax.Array  # [b, vocab]: the distribution the position after the path draws from
  sources: jax.Array  # [b, D] int32: the source of the path's node at each depth (-3 past the path)
  block: jax.Array  # [b] int32: the pre-draft block after the outcome (its index among ``outcomes``)
  predrafted: jax.Array  # [b] bool: the outcome has one


def residual(r: jax.Array, q: jax.Array) -> jax.Array:
  """``norm(max(0, r - q))`` over the last axis: what a rejection of a proposal from ``q`` leaves to draw from
  (``r`` itself where nothing is left, which a rejection never leaves)."""
  rest = jnp.maximum(r - q, 0.0)
  mass = jnp.sum(rest, axis=-1, keepdims=True)
  return jnp.where(mass > 0.0, rest / jnp.maximum(mass, 1e-30), r)


def _pick(a: jax.Array, index: jax.Array) -> jax.Array:
  """``a[r, index[r]]`` for every row: [b, n, ...], [b] -> [b, ...]."""
  return jnp.take_along_axis(a, index.reshape(-1, *(1,) * (a.ndim - 1)), axis=1)[:, 0]


def _level(tree: Topology, level: int, state, q_chain, nodes: Candidates, *, fixed, u):
  """Tries the children of the walk's set at depth ``level``, in the tree's order: ``(taken [b], token [b], r)``."""
  cur, alive, r = state
  taken = jnp.zeros_like(alive)
  token = jnp.zeros(alive.shape, jnp.int32)
  chain_tried = jnp.zeros_like(alive)
  vocab = r.shape[-1]
  for n in tree.levels[level - 1]:
    t = nodes.tokens[:, n]
    candidate = alive & cur[:, tree.parents[n]] & nodes.live[:, n] & ~taken
    if tree.sources[n] == CHAIN:  # the drawn draft of this depth: tried once, with the q it was drawn from
      candidate &= ~chain_tried
      chain_tried |= candidate
      q = q_chain[:, level - 1]
    else:  # a deterministic candidate
      q = jax.nn.one_hot(t, vocab, dtype=r.dtype)
    q_t = jnp.take_along_axis(q, t[:, None], axis=1)[:, 0]
    r_t = jnp.take_along_axis(r, t[:, None], axis=1)[:, 0]
    ok = fixed[:, level - 1] | (u[:, n] * q_t < r_t)
    rejected = candidate & ~ok
    r = jnp.where(rejected[:, None], residual(r, q), r)
    token = jnp.where(candidate & ok, t, token)
    taken |= candidate & ok
  return taken, token, r


def accept(tree: Topology, p, q_chain, nodes: Candidates, *, fixed, u, active) -> Walk:
  """The walk (:mod:`~mercury_jax.sampling.verify`).

  Args:
    tree: The step's draft tree.
    p: [b, N, vocab] the verifier's distribution after each node.
    q_chain: [b, k - 1, vocab] the distributions the chain's drafts were drawn from.
    nodes: The candidates (:class:`~mercury_jax.sampling.drafts.Candidates`).
    fixed: [b, D] the slot of each depth holds fixed text (or padding): its candidates pass as they are.
    u: [b, N] uniforms, one per node.
    active: [b] the row has something to generate.
  """
  batch, count, _ = p.shape
  node_sources = jnp.asarray(tree.sources, jnp.int32)
  cur = jnp.broadcast_to(jnp.arange(count)[None, :] == 0, (batch, count))
  rep = jnp.zeros((batch,), jnp.int32)
  alive, r, accepted = active, p[:, 0], jnp.zeros((batch,), jnp.int32)
  tokens, path, sources = [], [rep], []
  for level in range(1, tree.depth + 1):
    taken, token, r = _level(tree, level, (cur, alive, r), q_chain, nodes, fixed=fixed, u=u)
    members = [taken & cur[:, tree.parents[n]] & nodes.live[:, n] & (nodes.tokens[:, n] == token)
               for n in tree.levels[level - 1]]  # fmt: skip
    here = jnp.stack(members, axis=1)  # [b, nodes of this depth]: the new set
    first = jnp.asarray(tree.levels[level - 1], jnp.int32)[jnp.argmax(here, axis=1)]
    alive &= taken
    placed = jnp.zeros_like(cur).at[:, jnp.asarray(tree.levels[level - 1])].set(here)
    cur = jnp.where(alive[:, None], placed, cur)
    rep = jnp.where(alive, first, rep)
    r = jnp.where(alive[:, None], _pick(p, rep), r)
    accepted += alive.astype(jnp.int32)
    tokens.append(token)
    path.append(rep)
    sources.append(jnp.where(alive, node_sources[rep], -3))
  if tree.outcomes:
    outcome = cur[:, jnp.asarray(tree.outcomes)]  # [b, P]: the outcome nodes in the final set
    block, predrafted = jnp.argmax(outcome, axis=1).astype(jnp.int32), jnp.any(outcome, axis=1)
  else:
    block, predrafted = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)
  stack = lambda xs: jnp.stack(xs, axis=1) if xs else jnp.zeros((batch, 0), jnp.int32)  # noqa: E731
  return Walk(accepted, stack(tokens), stack(path), r, stack(sources), block, predrafted)
