"""Verified parallel decoding: the step rule of a network that drafts by diffusion and verifies autoregressively.

TiDAR (Liu et al. 2025, "Think in Diffusion, Talk in Autoregression", arXiv 2511.08923) trains one network with a
causal clean half (next-token logits) and a draft half of blocks of ``k`` masks (``objectives.verified``). Decoding
runs one forward pass per step over a chunk (the :class:`~mercury_jax.sampling.caches.Verified` cache strategy; its
mask ``masks.verify_chunk``): the last committed token and the ``k - 1`` drafts of the previous step, causal over the
cache (their next-token logits verify the drafts, and their keys and values are written), and ``k`` pre-draft blocks,
one per outcome: block ``a`` holds the masks of the ``k`` positions that follow the committed token and the first
``a`` drafts, and sees exactly those.

Acceptance is speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318),
per row. ``p`` is the next-token distribution after the row's temperature, top-k and top-p (and the hooks'
restrictions: the constraint, min_length, healing), ``q`` the distribution its draft was drawn from. Draft ``d`` is
accepted with probability ``min(1, p(d) / q(d))``; at the first rejection the position takes a token drawn from the
normalised residual ``max(0, p - q)``; when every draft is accepted, the position after them takes a token drawn from
``p``. Each committed token is then distributed exactly as the network's own autoregressive distribution, whatever
the drafts (a poor drafter only lowers the tokens per forward). At temperature 0 ``p`` and ``q`` are the one-hot
argmaxes: a draft is accepted while it equals the argmax, and the rejected position takes the argmax, so the output
is the network's greedy autoregressive decoding token for token. Fixed text (a template's) and padding in the window
are accepted as they are.

A step commits ``a + 1`` tokens (``a`` accepted drafts, one token of the network's own), or fewer when an EOS ends
the row's hole; the next drafts are pre-draft block ``a`` (its first position is the committed token's, so ``k - 1``
drafts). Keys and values written for rejected drafts lie at or after the next step's first slot, whose chunk
overwrites them before anything reads them. The plan's blocks are one token, so the engine moves a row on by the
tokens it committed.

Randomness: the step of a row whose first uncommitted slot is ``e`` draws from ``fold_in(key_i, e)`` (acceptance
uniforms, the residual's and the drafts' Gumbel noise, each from its own fold), so a row's tokens do not depend on
its batch.

Structured output: the automaton's state is walked along the drafts (the hooks' ``allowed``); ``p`` at each position
and every draft's ``q`` are restricted to the tokens the state allows (and, for a budgeted row, that can still reach
acceptance within the hole), so every accepted token is valid and the result is the constrained autoregressive
distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.sampling.caches import Forward, Needs
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
from mercury_jax.sampling.state import Draft, State, put, rows
from mercury_jax.sampling.step import Decision, StepRule, no_tokens

ACCEPT_NOISE, RESIDUAL_NOISE, DRAFT_NOISE = 0x6163, 0x7265, 0x6472  # Folded into a step's key for each use.


def empty_draft(batch: int, k: int, vocab: int) -> Draft:
  """No drafts yet (the first step verifies nothing)."""
  return Draft(
    jnp.zeros((batch, k - 1), jnp.int32),
    jnp.zeros((batch, k - 1, vocab), jnp.float32),
    jnp.zeros((batch,), jnp.int32),
    jnp.zeros((batch, k), jnp.int32),
  )


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


def _own_token(p_a: jax.Array, q_a: jax.Array, rejected: jax.Array, uniforms: jax.Array) -> jax.Array:
  """[b] the network's own token: from the normalised residual ``max(0, p - q)`` after a rejected draft, else from
  ``p``."""
  residual = jnp.maximum(p_a - q_a, 0.0)
  mass = residual.sum(axis=-1, keepdims=True)
  own = jnp.where((rejected[:, None] & (mass > 0.0)), residual / jnp.maximum(mass, 1e-30), p_a)
  return draw(own[:, None], uniforms)[:, 0]


class Verify(StepRule):
  """The verified step (module docstring)."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings, network: Network):
    self.plan, self.settings, self.network = plan, settings, network
    self.k = self.width = plan.draft

  def empty(self, batch: int) -> dict:
    vocab = self.network.vocab_size
    return {"proposal": no_tokens(batch, self.k - 1), "draft": empty_draft(batch, self.k, vocab)}

  def key_position(self, starts: jax.Array) -> jax.Array:
    return starts  # the first uncommitted slot

  def needs(self, st: State, view: View) -> tuple[Needs, State]:
    active = jnp.any(st.generate & (st.z == self.settings.mask_id), axis=-1)
    return Needs(view.starts, None, active, active), st

  def _clean(self, st: State, view: View, logits: jax.Array, hooks: Hooks) -> jax.Array:
    """Cleaned logits [b, n, vocab] at the view's slots: the hooks' restrictions of a position (token healing),
    min_length and the excluded ids."""
    eos_banned = jnp.take_along_axis(st.eos_banned, view.slots, axis=1)
    return clean_logits(hooks.logits(st, view, logits), eos_banned, self.settings)

  def _probs(self, clean: jax.Array, knobs) -> jax.Array:
    """:func:`knob_probs`, row by row where the network is (a row's softmax must not round by its batch)."""
    return self.network.map_rows(knob_probs, clean, knobs)

  def decide(self, params, st: State, view: View, needs: Needs, forward: Forward, hooks: Hooks) -> Decision:
    k, settings, d = self.k, self.settings, st.draft
    batch = view.z.shape[0]
    active = jnp.any(st.generate & (st.z == settings.mask_id), axis=-1)
    has_draft = jnp.arange(k - 1)[None, :] < d.count[:, None]
    inputs = jnp.where(view.open[:, : k - 1] & has_draft, d.tokens, view.z[:, : k - 1])

    # p at every verified position, restricted along the drafts.
    clean = self._clean(st, view, forward.logits, hooks)
    allowed = hooks.allowed(st, view.slots, jnp.pad(inputs, ((0, 0), (0, 1))), True)
    p = self._probs(clean if allowed is None else jnp.where(allowed, clean, -jnp.inf), st.knobs)  # [b, k, vocab]

    # Accept the longest run of drafts that passes min(1, p/q); fixed text passes as it is.
    fold = lambda tag: jax.vmap(lambda key: jax.random.fold_in(key, tag))(view.keys)  # noqa: E731
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,), jnp.float32))(fold(ACCEPT_NOISE))
    p_d = jnp.take_along_axis(p[:, : k - 1], d.tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(d.probs, d.tokens[..., None], axis=-1)[..., 0]
    passed = ~view.open[:, : k - 1] | (has_draft & (u * q_d < p_d))
    a = jnp.sum(jnp.cumprod(passed, axis=1), axis=1)  # [b] accepted drafts, 0 .. k - 1

    # The network's own token at position a: from the residual max(0, p - q) after a rejected draft, else from p.
    pick = lambda x: x[jnp.arange(batch), a]  # noqa: E731  [b, k, ...] -> [b, ...]: row r's entry a[r]
    rejected = (a < k - 1) & jnp.take_along_axis(jnp.pad(has_draft, ((0, 0), (0, 1))), a[:, None], axis=1)[:, 0]
    noise = uniform_noise(fold(RESIDUAL_NOISE), (1, noise_width(p.shape[-1])))
    q_a = pick(jnp.pad(d.probs, ((0, 0), (0, 1), (0, 0))))
    own = self.network.map_rows(_own_token, pick(p), q_a, rejected, noise)
    index = jnp.arange(k)[None, :]
    chosen = jnp.where(index < a[:, None], jnp.pad(inputs, ((0, 0), (0, 1))), own[:, None])  # [b, k]
    new = jnp.where(view.open, chosen, view.z)

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

    # The next drafts: pre-draft block a, after its first position (the token committed now). After an EOS they are
    # no drafts (count 0): what lies after it is about to become padding.
    written = st._replace(z=put(st.z, view.starts, z_w))
    tokens, probs = self._draft(written, pick(forward.drafts)[:, 1:], view.starts + count, fold(DRAFT_NOISE), hooks)
    drafted = jnp.sum(view.open & committed & (index < a[:, None]), axis=1)  # fixed text passes but is no draft
    draft = Draft(
      jnp.where(active[:, None], tokens, d.tokens),
      jnp.where(active[:, None, None], probs, d.probs),
      jnp.where(active & ~ended & (count == a + 1), k - 1, jnp.where(active, 0, d.count)),
      d.accepted + (jax.nn.one_hot(drafted, k, dtype=jnp.int32) * active[:, None]),
    )
    p_new = jnp.take_along_axis(p, new[..., None], axis=-1)[..., 0]
    return Decision(
      st=st._replace(draft=draft),
      z=z_w,
      commit=committed,
      remask=jnp.zeros_like(committed),
      confidence=jnp.where(view.open, p_new, rows(st.score, view.starts, k)),
      finished=count,
      worked=active,
      proposal=draft.tokens,
    )

  def _draft(self, st: State, logits: jax.Array, starts: jax.Array, key: jax.Array, hooks: Hooks):
    """``(tokens [b, k - 1], q [b, k - 1, vocab])``: drafts for the slots ``starts .. starts + k - 2`` from the
    pre-draft logits, each restricted by the hooks after the drafts before it; fixed text keeps its token (with q
    one-hot on it)."""
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
      tokens, qs = z_w, []
      for i in range(k - 1):
        allowed = hooks.allowed(st, slots, tokens, True)[:, i]  # after the drafts before position i
        q_i = self._probs(jnp.where(allowed, clean[:, i], -jnp.inf)[:, None], st.knobs)[:, 0]
        t_i = jnp.where(known[:, i], z_w[:, i], self.network.map_rows(draw, q_i[:, None], noise[:, i : i + 1])[:, 0])
        tokens = tokens.at[:, i].set(t_i)
        qs.append(q_i)
      q = jnp.stack(qs, axis=1)
    tokens = jnp.where(known, z_w, tokens)
    q = jnp.where(known[..., None], jax.nn.one_hot(tokens, vocab), q)
    return tokens.astype(jnp.int32), q
