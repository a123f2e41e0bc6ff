"""Verified parallel decoding: the step rule of a network that drafts by diffusion and verifies autoregressively.

TiDAR (Liu et al. 2025, "Think in Diffusion, Talk in Autoregression", arXiv 2511.08923) trains one network with a
causal clean half (next-token logits) and a draft half of blocks of ``k`` masks (``objectives.verified``). Decoding
runs one forward pass per step over a chunk (the :class:`~mercury_jax.sampling.caches.Verified` cache strategy; its
mask ``masks.verify_chunk``): the nodes of a static draft tree (:mod:`~mercury_jax.sampling.drafts`: the last
committed token, the drafter's chain of ``k - 1`` drafts, its next likeliest tokens, the prompt-lookup chain), each
seeing the cache and its ancestors (their next-token logits verify the children), and pre-draft blocks of ``k``
masks after the outcomes the tree pre-drafts, each seeing the path to its outcome node.

Acceptance walks the tree from the root, one depth at a time, keeping the set of nodes whose path holds the tokens
accepted so far (duplicate candidates merge: a lookup chain that agrees with the drafter's draft continues below
it). At a depth, the children of that set are tried in the tree's order against ``r``, the verifier's distribution
``p`` after the accepted path (the row's temperature, top-k and top-p, and the hooks' restrictions: the constraint,
min_length, healing), as SpecInfer's multi-step speculative sampling (Miao et al. 2023, arXiv 2305.09781) does:
a child ``c`` proposed from ``q_c`` is accepted with probability ``min(1, r(c) / q_c(c))``; after a rejection
``r <- norm(max(0, r - q_c))``; the first accepted child moves the walk one depth down (``r`` becomes ``p`` there); when
every child is rejected, or none is left, the position takes a token drawn from ``r``. The drafter's chain is the
one sampled proposal (drawn from its ``q``, tried first); the alternatives and lookups are deterministic proposals
(``q_c`` is one-hot on ``c``): accepted with probability ``r(c)``, and after a rejection ``r`` is ``r`` with ``c``
removed, renormalised (the limiting case of recursive rejection sampling without replacement, arXiv 2402.14160).

Why it is exact: one speculative step (proposal ``X ~ q``, independent of the step's uniform) outputs ``X`` with
probability ``min(p, q)(X)`` and otherwise continues; if the continuation outputs a token distributed as
``norm(max(0, p - q))`` whatever ``X`` was, the output is distributed as ``p`` (Leviathan et al. 2023, arXiv
2211.17192; Chen et al. 2023, arXiv 2302.01318). A deterministic proposal is the case ``q = one-hot``, and the
continuation is again such a step or the final draw, so by induction on the children every depth's token is drawn
from ``p`` given the path, i.e. from the network's own autoregressive distribution. This needs each proposal fixed
before the step's uniforms and a sampled proposal tried once, with its own ``q``: the candidates come from the last
step and the row's text (never from this step's noise); the chain's draft at a depth is tried at most once (a second
chain node of the same depth, below a duplicate, is skipped); and the adaptive length (``draft_confidence``) stops
the chain by the drafter's top probability, a property of ``q``, never of the drawn token (a token-dependent cut
would bias it). The deterministic candidates may depend on the drawn token (the alternatives exclude it): the
continuation after its rejection is exact for any fixed candidates. ``tests/test_verified_decoding.py`` checks the
marginals of thousands of chains against a known Markov chain, for chains, trees, lookups and adaptive lengths.

At temperature 0 ``p`` and the chain's ``q`` are one-hot argmaxes: a candidate is accepted exactly when it is the
argmax, and the walk follows every path that agrees with the argmax, so it accepts the longest such path and the
output is the network's greedy autoregressive decoding token for token. Fixed text (a template's) and padding in the
window are accepted as they are.

A step commits ``a + 1`` tokens (``a`` accepted candidates, one token of the network's own), or fewer when an EOS
ends the row's hole. Keys and values: the chunk computes every node's at the rotary position of its depth, over the
cache and its ancestors, exactly as the committed path's own pass would; the rule gathers the accepted path's and
writes them to consecutive slots from the root's (the rejected nodes' are never written; slots past the path are
written with whatever follows and are rewritten by the next step's chunk before anything reads them). The next
step's chain is the pre-draft block after the accepted outcome node (its first position is the committed token's),
when the tree pre-drafts that outcome; else the next step verifies the lookup chain alone. The plan's blocks are one
token, so the engine moves a row on by the tokens it committed.

Randomness: the step of a row whose first uncommitted slot is ``e`` draws from ``fold_in(key_i, e)`` (acceptance
uniforms, the residual's and the drafts' Gumbel noise, each from its own fold), so a row's tokens do not depend on
its batch.

Structured output: the automaton's state is walked along every root-to-leaf path of the tree (the hooks'
``allowed``); ``p`` at each node is restricted to the tokens the state allows after the node's path (and, for a
budgeted row, that can still reach acceptance within the hole), and so are the chain's drafts, so every accepted
token is valid and the result is the constrained autoregressive distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.sampling.caches import Forward, Needs
from mercury_jax.sampling.drafts import CHAIN, LOOKUP, Candidates, Topology, candidates, empty_draft
from mercury_jax.sampling.hooks import Hooks, View
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import (
  clean_logits,
  greedy_tokens,
  noise_width,
  sample_tokens,
  tempered,
  uniform_noise,
)
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import Draft, State, put, rows, select_rows
from mercury_jax.sampling.step import Decision, StepRule, no_tokens
from mercury_jax.sampling.walk import Walk, accept

ACCEPT_NOISE, RESIDUAL_NOISE, DRAFT_NOISE = 0x6163, 0x7265, 0x6472  # Folded into a step's key for each use.


def knob_probs(clean: jax.Array, knobs) -> jax.Array:
  """``[b, n, vocab]`` the distribution each row samples from: the cleaned logits after its temperature, top-k and
  top-p, or the one-hot argmax at temperature 0 (the engine's two-level argmax, so greedy ties break as the
  autoregressive decoder's do)."""
  greedy = jax.nn.one_hot(greedy_tokens(clean), clean.shape[-1])
  sampled = (knobs.temperature > 0.0)[:, None, None]
  return jnp.where(sampled, jax.nn.softmax(tempered(clean, knobs), axis=-1), greedy)


def draw(probs: jax.Array, uniforms: jax.Array) -> jax.Array:
  """``[b, n]`` one token per position from ``probs`` [b, n, vocab] (two-level Gumbel-max over its logs)."""
  return sample_tokens(jnp.where(probs > 0.0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf), uniforms)


class Verify(StepRule):
  """The verified step (module docstring)."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings, network: Network):
    self.plan, self.settings, self.network = plan, settings, network
    self.tree: Topology = plan.tree
    self.k, self.width = plan.draft, self.tree.width

  def empty(self, batch: int) -> dict:
    vocab = self.network.vocab_size
    return {"proposal": no_tokens(batch, self.k - 1), "draft": empty_draft(batch, self.tree, vocab)}

  def key_position(self, starts: jax.Array) -> jax.Array:
    return starts  # the first uncommitted slot

  def needs(self, st: State, view: View) -> tuple[Needs, State]:
    active = jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)
    nodes = candidates(self.tree, st, view.starts, self.settings.draft_confidence, self.settings.mask_id)
    return Needs(view.starts, None, active, active, nodes=nodes), st

  def _clean(self, st: State, view: View, logits: jax.Array, hooks: Hooks) -> jax.Array:
    """Cleaned logits [b, n, vocab] at the view's slots: the hooks' restrictions of a position (token healing),
    min_length and the excluded ids."""
    eos_banned = jnp.take_along_axis(st.eos_banned, view.slots, axis=1)
    return clean_logits(hooks.logits(st, view, logits), eos_banned, self.settings)

  def _probs(self, clean: jax.Array, knobs) -> jax.Array:
    """:func:`knob_probs`, row by row where the network is (a row's softmax must not round by its batch)."""
    return self.network.map_rows(knob_probs, clean, knobs)

  def _node_probs(self, st: State, view: View, logits: jax.Array, nodes: Candidates, hooks: Hooks) -> jax.Array:
    """``p`` [b, N, vocab]: the verifier's distribution of the token after each node, restricted along its path."""
    slots = view.starts[:, None] + jnp.asarray(self.tree.depths)[None, :]  # the slot each node's logits predict
    z_n = jnp.take_along_axis(st.z, slots, axis=1)
    open_n = jnp.take_along_axis(st.generate, slots, axis=1) & (z_n == self.settings.mask_id)
    clean = self._clean(st, View(view.starts, slots, z_n, open_n, jnp.any(open_n, axis=1), view.keys), logits, hooks)
    allowed = self._allowed(st, view.starts, nodes.tokens, hooks)
    return self._probs(clean if allowed is None else jnp.where(allowed, clean, -jnp.inf), st.knobs)

  def _allowed(self, st: State, starts: jax.Array, tokens: jax.Array, hooks: Hooks) -> jax.Array | None:
    """[b, N, vocab] what the hooks allow after each node's path (one walk of each root-to-leaf path), or None."""
    found: dict[int, jax.Array] = {}
    for path in self.tree.leaves:
      slots = starts[:, None] + jnp.arange(len(path))[None, :]
      along = jnp.stack([tokens[:, n] for n in path[1:]] + [jnp.zeros_like(starts)], axis=1)
      allowed = hooks.allowed(st, slots, along, True)
      if allowed is None:
        return None
      found.update({n: allowed[:, i] for i, n in enumerate(path) if n not in found})
    return jnp.stack([found[n] for n in range(self.tree.nodes)], axis=1)

  def decide(self, params, st: State, view: View, needs: Needs, forward: Forward, hooks: Hooks) -> Decision:
    tree, settings, d = self.tree, self.settings, st.draft
    active, index = needs.commit, jnp.arange(self.width)[None, :]
    fold = lambda tag: jax.vmap(lambda key: jax.random.fold_in(key, tag))(view.keys)  # noqa: E731

    # Walk the tree against p; the position after the accepted path takes a token of the residual.
    p = self._node_probs(st, view, forward.logits, needs.nodes, hooks)  # [b, N, vocab]
    u = jax.vmap(lambda key: jax.random.uniform(key, (tree.nodes,), jnp.float32))(fold(ACCEPT_NOISE))
    walk = accept(tree, p, d.probs, needs.nodes, fixed=~view.open[:, : tree.depth], u=u, active=active)
    noise = uniform_noise(fold(RESIDUAL_NOISE), (1, noise_width(p.shape[-1])))
    own = self.network.map_rows(draw, walk.residual[:, None], noise)[:, 0]
    a = walk.accepted
    path = jnp.pad(walk.tokens, ((0, 0), (0, self.width - tree.depth)))
    new = jnp.where(view.open, jnp.where(index < a[:, None], path, own[:, None]), view.z)  # [b, W]

    # Commit a + 1 tokens, up to an EOS that ends the hole; a finished row commits nothing.
    count = jnp.where(active, a + 1, 0)
    ended = jnp.zeros_like(active)
    if settings.eos_to_pad:
      eos = view.open & (new == settings.eos_id) & (index <= a[:, None])
      ended = active & jnp.any(eos, axis=1)
      count = jnp.where(ended, jnp.argmax(eos, axis=1) + 1, count)
    committed = index < count[:, None]
    z_w = jnp.where(committed, new, view.z)
    st = hooks.consume(st, view, z_w, count)
    cache = self._write_path(st.cache, forward.kv, walk.path, view.starts, active)

    # The next drafts: the pre-draft block after the outcome node (after an EOS, none: what follows becomes padding).
    written = st._replace(z=put(st.z, view.starts, z_w))
    keep = active & ~ended & (count == a + 1) & walk.predrafted
    draft = self._next(written, forward.drafts, walk, view.starts + count, fold(DRAFT_NOISE), hooks)
    draft = _tally(draft, d, walk, view.open & committed & (index < a[:, None]), active, keep)
    # Each committed token's score: its probability under p after the path before it.
    after = jnp.take_along_axis(p, walk.path[:, :, None], axis=1)  # [b, D + 1, vocab]
    after = jnp.pad(after, ((0, 0), (0, self.width - after.shape[1]), (0, 0)))
    p_new = jnp.take_along_axis(after, new[..., None], axis=-1)[..., 0]  # [b, W]
    return Decision(
      st=st._replace(draft=draft),
      z=z_w,
      commit=committed,
      remask=jnp.zeros_like(committed),
      confidence=jnp.where(view.open, p_new, rows(st.score, view.starts, self.width)),
      finished=count,
      worked=active,
      proposal=draft.tokens,
      cache=cache,
    )

  def _write_path(self, cache, kv, path: jax.Array, starts: jax.Array, active: jax.Array):
    """``cache`` with the accepted path's keys and values (the nodes ``path`` [b, D + 1], root first) at the slots
    from the root's on; an inert row's slots are written back as they are."""
    taken = type(kv)(_gather(kv.keys, path), _gather(kv.values, path), jnp.take_along_axis(kv.segments, path, axis=1))
    kept = cache.rows(starts - 1, path.shape[1])
    return cache.write(select_rows(active, taken, kept), starts - 1)

  def _next(self, st: State, drafts: jax.Array, walk: Walk, starts: jax.Array, key: jax.Array, hooks: Hooks) -> Draft:
    """The next step's chain, alternatives and drafter probabilities, from the outcome's pre-draft block (none when
    the tree pre-drafts nothing)."""
    if not self.tree.outcomes:
      return empty_draft(starts.shape[0], self.tree, drafts.shape[-1])
    block = jnp.take_along_axis(drafts, walk.block[:, None, None, None], axis=1)[:, 0]  # [b, k, vocab]
    tokens, probs, alternatives, confidence = self._draft(st, block[:, 1:], starts, key, hooks)
    return Draft(tokens, probs, jnp.zeros_like(starts), None, alternatives, confidence, None)

  def _draft(self, st: State, logits: jax.Array, starts: jax.Array, key: jax.Array, hooks: Hooks):
    """``(tokens [b, k - 1], q [b, k - 1, vocab], alternatives [b, k - 1, R], confidence [b, k - 1, 1 + R])``:
    drafts for the slots ``starts .. starts + k - 2`` from the pre-draft logits, each restricted by the hooks after
    the drafts before it, with the drafter's next likeliest tokens; fixed text keeps its token (q one-hot on it)."""
    k, vocab = self.k, logits.shape[-1]
    slots = starts[:, None] + jnp.arange(k - 1)[None, :]
    z_w = jnp.take_along_axis(st.z, slots, axis=1)
    known = ~(jnp.take_along_axis(st.generate, slots, axis=1) & (z_w == self.settings.mask_id))
    clean = self._clean(st, View(starts, slots, z_w, ~known, jnp.any(~known, axis=1), key), logits, hooks)
    noise = uniform_noise(key, (k - 1, noise_width(vocab)))
    if hooks.allowed(st, slots, z_w, True) is None:  # nothing restricts a draft by the ones before it
      q = self._probs(clean, st.knobs)
      tokens = self.network.map_rows(draw, q, noise)
    else:
      tokens, qs, cleans = z_w, [], []
      for i in range(k - 1):
        allowed = hooks.allowed(st, slots, tokens, True)[:, i]  # after the drafts before position i
        cleans.append(jnp.where(allowed, clean[:, i], -jnp.inf))
        q_i = self._probs(cleans[-1][:, None], st.knobs)[:, 0]
        t_i = jnp.where(known[:, i], z_w[:, i], self.network.map_rows(draw, q_i[:, None], noise[:, i : i + 1])[:, 0])
        tokens = tokens.at[:, i].set(t_i)
        qs.append(q_i)
      q, clean = jnp.stack(qs, axis=1), jnp.stack(cleans, axis=1)
    tokens = jnp.where(known, z_w, tokens).astype(jnp.int32)
    q = jnp.where(known[..., None], jax.nn.one_hot(tokens, vocab), q)
    alternatives, confidence = self._ranked(clean, tokens, known)
    return tokens, q, alternatives, confidence

  def _ranked(self, clean: jax.Array, tokens: jax.Array, known: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drafter's ``R`` likeliest tokens other than each draft, and its probabilities (the chain's: its top one),
    by the untempered cleaned distribution; a fixed position's are its token, with probability 1."""
    r = self.tree.alternatives
    drafter = self.network.map_rows(lambda c: jax.nn.softmax(c, axis=-1), clean)  # [b, k - 1, vocab]
    top_p, top = jax.lax.top_k(drafter, r + 1)  # [b, k - 1, R + 1]
    other = top != tokens[..., None]
    order = jnp.argsort(~other, axis=-1, stable=True)[..., :r]  # the first R that are not the draft
    alternatives = jnp.take_along_axis(top, order, axis=-1)
    confidence = jnp.concatenate([top_p[..., :1], jnp.take_along_axis(top_p, order, axis=-1)], axis=-1)
    alternatives = jnp.where(known[..., None], tokens[..., None], alternatives).astype(jnp.int32)
    return alternatives, jnp.where(known[..., None], 1.0, confidence)


def _gather(a: jax.Array, path: jax.Array) -> jax.Array:
  """``a`` [layers, b, N, ...] at each row's nodes ``path`` [b, n]: [layers, b, n, ...]."""
  index = path[None].reshape(1, *path.shape, *(1,) * (a.ndim - 3))
  return jnp.take_along_axis(a, index, axis=2)


def _tally(draft: Draft, old: Draft, walk: Walk, taken: jax.Array, active: jax.Array, keep: jax.Array) -> Draft:
  """The next :class:`Draft` (``draft``: the new chain) with its count and the row's counters: the histogram of
  candidates accepted per step, and the accepted candidates by source (``taken`` [b, W]: the committed positions
  that were candidates, not fixed text)."""
  width = old.accepted.shape[1]
  accepted = jnp.sum(taken, axis=1)
  source = jnp.pad(walk.sources, ((0, 0), (0, width - walk.sources.shape[1])))[:, :width]
  kinds = jnp.stack([source == CHAIN, source > 0, source == LOOKUP], axis=-1) & taken[..., None]  # [b, W, 3]
  row = lambda new, was: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, was)  # noqa: E731
  return Draft(
    row(draft.tokens, old.tokens),
    row(draft.probs, old.probs),
    jnp.where(keep, old.probs.shape[1], jnp.where(active, 0, old.count)),
    old.accepted + jax.nn.one_hot(accepted, width, dtype=jnp.int32) * active[:, None],
    row(draft.alternatives, old.alternatives),
    row(draft.confidence, old.confidence),
    old.sources + jnp.sum(kinds, axis=1, dtype=jnp.int32) * active[:, None],
  )
