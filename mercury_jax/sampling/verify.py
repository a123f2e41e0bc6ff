"""Verified parallel decoding: the engine's step for a network that drafts by diffusion and verifies autoregressively.

TiDAR (Liu et al. 2025, "Think in Diffusion, Talk in Autoregression", arXiv 2511.08923) trains one network with a
causal clean half (next-token logits) and a draft half of blocks of ``k`` masks (``objectives.verified``). Decoding
runs one forward pass per step over a chunk (``caches.verify_inputs``; its mask ``masks.verify_chunk``): the last
committed token and the ``k - 1`` drafts of the previous step, causal over the cache (their next-token logits verify
the drafts, and their keys and values are written), and ``k`` pre-draft blocks, one per outcome: block ``a`` holds the
masks of the ``k`` positions that follow the committed token and the first ``a`` drafts, and sees exactly those.

Acceptance is speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318),
per row. ``p`` is the next-token distribution after the row's temperature, top-k and top-p (and the constraint,
min_length and healing masks), ``q`` the distribution its draft was drawn from. Draft ``d`` is accepted with
probability ``min(1, p(d) / q(d))``; at the first rejection the position takes a token drawn from the normalised
residual ``max(0, p - q)``; when every draft is accepted, the position after them takes a token drawn from ``p``. Each
committed token is then distributed exactly as the network's own autoregressive distribution, whatever the drafts
(a poor drafter only lowers the tokens per forward). At temperature 0 ``p`` and ``q`` are the one-hot argmaxes:
a draft is accepted while it equals the argmax, and the rejected position takes the argmax, so the output is the
network's greedy autoregressive decoding token for token. Fixed text (a template's) and padding in the window are
accepted as they are.

A step commits ``a + 1`` tokens (``a`` accepted drafts, one token of the network's own), or fewer when an EOS
ends the row's hole (``settings.eos_to_pad``); the next drafts are pre-draft block ``a`` (its first position is the
committed token's, so ``k - 1`` drafts). Keys and values written for rejected drafts lie at or after the next
step's first slot, whose chunk overwrites them before anything reads them.

Randomness: the step of a row whose first uncommitted slot is ``e`` draws from ``fold_in(key_i, e)`` (acceptance
uniforms, the residual's and the drafts' Gumbel noise, each from its own fold), so a row's tokens do not depend on
its batch.

Structured output: the automaton's state is walked along the drafts; ``p`` at each position and every draft's ``q``
are restricted to the tokens the state allows (and, for a budgeted row, that can still reach acceptance within the
hole), so every accepted token is valid and the result is the constrained autoregressive distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.constrain import device as constrained
from mercury_jax.sampling.canvas import after_eos
from mercury_jax.sampling.proposal import (
  clean_logits,
  greedy_tokens,
  noise_width,
  sample_tokens,
  tempered,
  uniform_noise,
)
from mercury_jax.sampling.state import Draft, State, put, rows

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


def _allowed(tables: constrained.Tables, state: jax.Array, remaining: jax.Array) -> jax.Array:
  """``[b, vocab]`` bool: the tokens automaton state ``state`` [b] allows with ``remaining`` [b] positions left after
  this one in the hole (a budgeted row's next state must still reach acceptance); every token where the state is
  unknown or dead (a position verification never reaches)."""
  nxt = jax.vmap(lambda table, classes, s: table[s][classes])(tables.table, tables.classes, jnp.maximum(state, 0))
  far = jnp.take_along_axis(tables.distance, jnp.maximum(nxt, 0), axis=1)  # [b, vocab]
  ok = (nxt >= 0) & (~tables.budgeted[:, None] | (far <= remaining[:, None]))
  return jnp.where(((state >= 0) & tables.on)[:, None], ok, True)


class Verifier:
  """The verified step of :class:`~mercury_jax.sampling.engine.BlockEngine` (module docstring)."""

  def __init__(self, engine):
    self.engine = engine
    self.plan, self.settings, self.k = engine.plan, engine.settings, engine.plan.draft

  def _masked(self, st: State, logits: jax.Array, slots: jax.Array) -> jax.Array:
    """Cleaned logits [b, n, vocab] of the positions at ``slots`` [b, n]: excluded ids, min_length, healing."""
    eos_banned = jnp.take_along_axis(st.eos_banned, slots, axis=1)
    clean = clean_logits(logits, eos_banned, self.settings)
    if st.healing is not None:
      here = slots == st.healing.slot[:, None]
      clean = jnp.where(here[..., None] & ~st.healing.allowed[:, None, :], -jnp.inf, clean)
    return clean

  def _probs(self, clean: jax.Array, knobs) -> jax.Array:
    """:func:`knob_probs`, row by row when the network is (``Network.map_rows``: a row's softmax must not round by
    its batch)."""
    return self.engine.network.map_rows(knob_probs, clean, knobs)

  def _draw(self, probs: jax.Array, uniforms: jax.Array) -> jax.Array:
    return self.engine.network.map_rows(draw, probs, uniforms)

  def _remaining(self, st: State, slots: jax.Array) -> jax.Array:
    end = self.plan.slots - jnp.argmax(st.target[:, ::-1], axis=1)  # [b] one past the hole's last slot
    return end[:, None] - slots - 1

  def step(self, params, st: State) -> State:
    engine, plan, settings, k = self.engine, self.plan, self.settings, self.k
    mask_id, d = settings.mask_id, st.draft
    batch = st.z.shape[0]
    starts = engine.starts(st)  # [b] the first uncommitted slot
    active = engine.unfinished(st)
    ar_logits, block_logits, cache = engine.cache.window(params, st, starts, mask_id, active)
    slots = starts[:, None] + jnp.arange(k)[None, :]  # [b, k] the slots p verifies: starts .. starts + k - 1
    z_w, generate_w = rows(st.z, starts, k), rows(st.generate, starts, k)
    open_w = generate_w & (z_w == mask_id)  # still to generate; the others are fixed text or padding
    inputs = jnp.where(open_w[:, : k - 1] & (jnp.arange(k - 1) < d.count[:, None]), d.tokens, z_w[:, : k - 1])

    # p at every verified position, the automaton walked along the drafts.
    clean = self._masked(st, ar_logits, slots)
    states = None
    if st.constraint is not None:
      c = st.constraint
      tables = c.view()
      hole = rows(st.target, starts, k)
      states = [c.dfa]
      for i in range(k - 1):
        moved = constrained.step(tables, states[-1], inputs[:, i])
        states.append(jnp.where(hole[:, i], moved, states[-1]))
      states = jnp.stack(states, axis=1)  # [b, k] the state before each verified position
      remaining = self._remaining(st, slots)
      allowed = jax.vmap(lambda s, r: _allowed(tables, s, r), in_axes=1, out_axes=1)(states, remaining)
      clean = jnp.where(allowed, clean, -jnp.inf)
    p = self._probs(clean, st.knobs)  # [b, k, vocab]

    # Accept the longest run of drafts that passes min(1, p/q); fixed text passes as it is.
    base = jax.vmap(jax.random.fold_in)(st.example_keys, starts)
    fold = lambda tag: jax.vmap(lambda key: jax.random.fold_in(key, tag))(base)  # noqa: E731
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,), jnp.float32))(fold(ACCEPT_NOISE))
    has_draft = jnp.arange(k - 1)[None, :] < d.count[:, None]
    p_d = jnp.take_along_axis(p[:, : k - 1], d.tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(d.probs, d.tokens[..., None], axis=-1)[..., 0]
    passed = ~open_w[:, : k - 1] | (has_draft & (u * q_d < p_d))
    a = jnp.sum(jnp.cumprod(passed, axis=1), axis=1)  # [b] accepted drafts, 0 .. k - 1

    # The network's own token at position a: from the residual max(0, p - q) after a rejected draft, else from p.
    pick = lambda x: x[jnp.arange(batch), a]  # noqa: E731  [b, k, ...] -> [b, ...]: row r's entry a[r]
    p_a = pick(p)
    q_a = pick(jnp.pad(d.probs, ((0, 0), (0, 1), (0, 0))))
    rejected = (a < k - 1) & jnp.take_along_axis(jnp.pad(has_draft, ((0, 0), (0, 1))), a[:, None], axis=1)[:, 0]

    def own_token(p_a, q_a, rejected, uniforms):
      residual = jnp.maximum(p_a - q_a, 0.0)
      mass = residual.sum(axis=-1, keepdims=True)
      own = jnp.where((rejected[:, None] & (mass > 0.0)), residual / jnp.maximum(mass, 1e-30), p_a)
      return draw(own[:, None], uniforms)[:, 0]

    noise = uniform_noise(fold(RESIDUAL_NOISE), (1, noise_width(p.shape[-1])))
    own_token = self.engine.network.map_rows(own_token, p_a, q_a, rejected, noise)
    index = jnp.arange(k)[None, :]
    chosen = jnp.where(index < a[:, None], jnp.pad(inputs, ((0, 0), (0, 1))), own_token[:, None])  # [b, k]
    new = jnp.where(open_w, chosen, z_w)

    # Commit a + 1 tokens (fewer when an EOS ends the hole); a finished row commits nothing.
    eos = open_w & (new == settings.eos_id) & (index <= a[:, None])
    count = jnp.where(active, a + 1, 0)
    has_eos = active & jnp.any(eos, axis=1) if settings.eos_to_pad else jnp.zeros((batch,), bool)
    count = jnp.where(has_eos, jnp.argmax(eos, axis=1) + 1, count)
    committed = index < count[:, None]
    z = put(st.z, starts, jnp.where(committed, new, z_w))
    p_new = jnp.take_along_axis(p, new[..., None], axis=-1)[..., 0]
    score = put(st.score, starts, jnp.where(committed & open_w, p_new, rows(st.score, starts, k)))
    segments, generate = st.segments, st.generate
    if settings.eos_to_pad:
      known = jnp.arange(plan.slots)[None, :] < (starts + count)[:, None]
      dead = after_eos(z, st.target, settings.eos_id, known=known) & has_eos[:, None]
      z, segments, generate = jnp.where(dead, settings.pad_id, z), jnp.where(dead, 0, segments), generate & ~dead

    constraint = st.constraint
    after = starts + count  # [b] the next step's first uncommitted slot
    if constraint is not None:
      last = jnp.maximum(count - 1, 0)
      before = jnp.take_along_axis(states, last[:, None], axis=1)[:, 0]
      token = jnp.take_along_axis(new, last[:, None], axis=1)[:, 0]
      in_hole = jnp.take_along_axis(rows(st.target, starts, k), last[:, None], axis=1)[:, 0]
      moved = jnp.where(in_hole, constrained.step(constraint.view(), before, token), before)
      dfa = jnp.where((count > 0) & constraint.on, moved, constraint.dfa)
      constraint = constraint._replace(dfa=dfa, end=dfa, passes=constraint.passes + 1)

    # The next drafts: pre-draft block a, after its first position (the token committed now).
    drafts, probs = self._draft(
      st._replace(z=z, generate=generate, constraint=constraint), pick(block_logits)[:, 1:], after, fold(DRAFT_NOISE)
    )
    keep = active & ~has_eos & (count == a + 1)
    # Drafts this step accepted and committed (fixed text passes, but is not a draft; an EOS cuts the rest).
    drafted = jnp.sum(open_w & committed & (index < a[:, None]), axis=1)
    draft = Draft(
      jnp.where(active[:, None], drafts, d.tokens),
      jnp.where(active[:, None, None], probs, d.probs),
      jnp.where(keep, k - 1, jnp.where(active, 0, d.count)),
      d.accepted + (jax.nn.one_hot(drafted, k, dtype=jnp.int32) * active[:, None]),
    )
    trace = st.trace
    if trace:
      canvases, commits, remasks = trace
      batch_rows = jnp.arange(batch)
      frame = jnp.minimum(st.recorded, settings.trace - 1)
      keep_frame = (st.recorded < settings.trace) & active
      trace = (
        canvases.at[frame, batch_rows].set(jnp.where(keep_frame[:, None], z, canvases[frame, batch_rows])),
        commits.at[frame, batch_rows].set(jnp.where(keep_frame, count, commits[frame, batch_rows])),
        remasks,
      )
    return st._replace(
      z=z,
      generate=generate,
      segments=segments,
      score=score,
      block=st.block + count,
      changed=count > 0,
      proposal=draft.tokens,
      cache=cache,
      nfe=st.nfe + active.astype(jnp.int32),
      forwards=st.forwards + 1,
      commit_passes=st.commit_passes + 1,
      iterations=st.iterations + 1,
      recorded=st.recorded + active.astype(jnp.int32),
      trace=trace,
      constraint=constraint,
      draft=draft,
    )

  def _draft(self, st: State, logits: jax.Array, starts: jax.Array, key: jax.Array):
    """``(tokens [b, k - 1], q [b, k - 1, vocab])``: drafts for the slots ``starts .. starts + k - 2`` from the
    pre-draft logits, the automaton walked along them; fixed text keeps its token (with q one-hot on it)."""
    k, mask_id = self.k, self.settings.mask_id
    slots = starts[:, None] + jnp.arange(k - 1)[None, :]
    z_w = jnp.take_along_axis(st.z, slots, axis=1)
    known = ~(jnp.take_along_axis(st.generate, slots, axis=1) & (z_w == mask_id))
    clean = self._masked(st, logits, slots)
    noise = uniform_noise(key, (k - 1, noise_width(logits.shape[-1])))
    vocab = logits.shape[-1]
    if st.constraint is None:
      q = self._probs(clean, st.knobs)
      tokens = self._draw(q, noise)
    else:
      c = st.constraint
      tables = c.view()
      hole = jnp.take_along_axis(st.target, slots, axis=1)
      remaining = self._remaining(st, slots)
      state, tokens, qs = c.dfa, [], []
      for i in range(k - 1):
        allowed = _allowed(tables, state, remaining[:, i])
        q_i = self._probs(jnp.where(allowed, clean[:, i], -jnp.inf)[:, None], st.knobs)[:, 0]
        t_i = jnp.where(known[:, i], z_w[:, i], self._draw(q_i[:, None], noise[:, i : i + 1])[:, 0])
        state = jnp.where(hole[:, i], constrained.step(tables, state, t_i), state)
        tokens.append(t_i)
        qs.append(q_i)
      tokens, q = jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)
    tokens = jnp.where(known, z_w, tokens)
    q = jnp.where(known[..., None], jax.nn.one_hot(tokens, vocab), q)
    return tokens.astype(jnp.int32), q
