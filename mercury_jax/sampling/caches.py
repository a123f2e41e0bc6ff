"""The engine's key-value caches as small strategies: ``empty``, ``prefill``, ``forward``.

A strategy turns the loop state into the logits of every row's step block. :meth:`forward` gets what the step needs
(:class:`Needs`: which rows want logits, which want their finished block written into the cache) and returns the
block's logits, the cache and whether it ran the network; it never puts a cache through a conditional it could
avoid (on XLA:CPU a ``lax.cond`` whose branches both return the cache copied it at every step).

* :class:`Exact` (block-diffusion and autoregressive models). The prefill writes the prompt's clean keys and values
  (its masked slots wait in segment 0). A block's first step runs the *commit pass*: the finished block ``k - 1``
  alone (``B`` tokens, block-causal over the cache), whose keys and values are written into the cache with one
  dynamic update after the conditional; every step then runs the *block pass*: block ``k`` alone (``B`` tokens)
  over the cache. So a block of ``s`` steps costs ``(s + 1) B`` tokens, and block ``k``'s logits always come from
  the same program, whatever other rows need: a row's tokens do not depend on its batch. This is BD3-LM's sampling
  (Arriola et al. 2025, arXiv 2503.09573): each block sees the clean keys and values of the blocks before it. The
  autoregressive twin runs one pass per token: the last committed token, whose keys and values it writes and whose
  output is the next token's distribution.
* :class:`NoCache`: every pass runs the whole context: ``x_t ⊕ x_0`` through the ``block_diffusion`` mask, the
  causal model over the canvas, a whole-sequence checkpoint over the canvas. The reference the exact cache
  reproduces, and the whole-canvas refinement of whole-sequence checkpoints (one block the size of the canvas).
* :class:`Dual` (bidirectional models; approximate): a block's first step runs the whole canvas and caches every
  slot; its other steps run the block alone over that cache (Fast-dLLM's DualCache, Wu et al. 2025,
  arXiv 2505.22618: prefix and suffix are both stale until the next block).
* A shifted-logits checkpoint (``Network.shift``: Dream, Fast-dLLM v2) predicts slot ``i`` from the output at
  ``i - 1``: every block pass then runs from the slot before the block (``B + 1`` tokens, that slot's keys and values
  the same as cached), and the whole-context passes read one slot earlier.
* :class:`Prefix` (bidirectional models; approximate): like :class:`Dual`, but the later steps recompute the block
  and everything after it (Fast-dLLM's PrefixCache); a ``lax.switch`` picks the shortest of a few chunk lengths that
  covers every row's suffix.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.model import KVCache
from mercury_jax.sampling.drafts import Candidates, chunk_inputs
from mercury_jax.sampling.network import LatentInputs, Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.state import State, chunk, put, rows, select_rows


class Needs(NamedTuple):
  """What one step asks of the network (per row)."""

  starts: jax.Array  # [b] first slot of each row's step block
  t: jax.Array  # [b] float32 diffusion time of the step
  logits: jax.Array  # [b] bool: the row needs fresh logits of its block
  commit: jax.Array  # [b] bool: the row's finished previous block must reach the cache (exact cache)
  latent: LatentInputs | None = None  # the step block's noisy latents ([b, B, ...]; the continuous family)
  nodes: Candidates | None = None  # verified: the draft tree's candidates (``drafts.candidates``)


def spread(latent: LatentInputs | None, starts: jax.Array, slots: int, offset: int = 0) -> LatentInputs | None:
  """A step block's latent inputs ``[b, B, ...]`` placed at slots ``starts + offset`` of ``slots`` positions (noise
  level 0, a clean token, everywhere else): the inputs of a pass over a whole context."""
  if latent is None:
    return None

  def place(a):
    return put(jnp.zeros((a.shape[0], slots, *a.shape[2:]), a.dtype), starts + offset, a)

  return LatentInputs(*(None if a is None else place(a) for a in latent))


class Forward(NamedTuple):
  """What a strategy's :meth:`~Strategy.forward` gives the step rule.

  A batched ``lax.cond`` runs a pass when any row wants it; the rows that did not want it keep what they had
  (:func:`~mercury_jax.sampling.state.select_rows`), so a row's result never depends on what the other rows of its
  batch do (the server's batch buckets rely on it: a recomputed block rounds otherwise than the prefill that first
  wrote it).
  """

  logits: jax.Array  # [b, W, vocab] the window's logits (verified: each tree node's next-token logits, [b, N, vocab])
  cache: object
  ran: jax.Array  # [] bool: a pass that gives logits ran
  committed: jax.Array  # [] bool: a commit pass ran
  drafts: jax.Array | None = None  # verified: [b, P, k, vocab] the pre-draft blocks' logits
  kv: object = None  # verified: the tree nodes' keys and values (a KVCache of N slots), for the rule to write


class Strategy:
  """The shared part of the caches: the plan, the network and the mask id.

  Attributes:
    lockstep: The strategy refreshes every row at once, so the rows' blocks move on together (the approximate
      caches).
  """

  lockstep = False

  def __init__(self, plan: BlockPlan, network: Network, mask_id: int):
    self.plan, self.network, self.mask_id = plan, network, mask_id

  def empty(self, batch: int):
    """The cache of ``batch`` rows before the prefill (``()`` without one)."""
    return ()

  def prefill(self, params, st: State, size: int):
    """The cache after the prefill over slots ``[0, size)``."""
    return st.cache

  def forward(self, params, st: State, needs: Needs) -> Forward:
    raise NotImplementedError

  def unconditional(self, params, st: State, needs: Needs) -> jax.Array:
    """``[b, B, vocab]`` the step block's logits with every clean position outside it hidden (classifier-free
    guidance's unconditional pass; the block's own fixed positions stay): the block as the first of a document."""
    raise ValueError(f"the {type(self).__name__} cache has no unconditional pass")

  def over(self, params, st: State, at: jax.Array, size: int, t=None, *, pad: int = 0, **kwargs):
    """The network over slots ``[at[r], at[r] + size)`` of every row ``r`` (``pad`` padding slots appended first: a
    chunk may run past the last slot), against ``kwargs["cache"]`` when given (``Network.chunk``'s keywords)."""
    tokens, positions, segments = chunk(st, at, size, pad=pad)
    starts = {"starts": at} if kwargs.get("cache") is not None else {}
    return self.network.chunk(params, tokens, t, segments=segments, positions=positions, **starts, **kwargs)


class NoCache(Strategy):
  def _full(self, params, st: State, needs: Needs) -> jax.Array:
    plan, net, block = self.plan, self.network, self.plan.block
    if plan.autoregressive:
      logits = net.logits(params, st.z, segments=st.segments, positions=st.positions, mask="causal")
      return rows(logits, needs.starts - 1, 1)
    if plan.whole_sequence:  # The canvas alone: the padding block in front is never attended to.
      canvas = lambda a: a[:, block:]  # noqa: E731
      length = plan.slots - block
      logits = net.logits(
        params,
        canvas(st.z),
        needs.t,
        segments=canvas(st.segments),
        positions=canvas(st.positions),
        mask=None,
        latent=spread(needs.latent, needs.starts - block, length),
      )
      return rows(logits, needs.starts - block, block)
    twice = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731  x_t ⊕ x_0
    mask = "verified" if plan.causal_context else "block_diffusion"
    args = dict(segments=twice(st.segments), positions=twice(st.positions), mask=mask, diffusion_block=block)
    if needs.latent is not None:  # The block's latents in the noisy half; its clean half is the committed tokens.
      args["latent"] = spread(needs.latent, needs.starts, 2 * plan.slots)
    if net.shift:  # Slot i reads the output at i - 1: in its own noisy block, or the clean slot before its block.
      raw = net.chunk(params, twice(st.z), **args, return_kv=False)  # [b, 2 * slots, vocab]
      slot = jnp.arange(plan.slots)
      logits = raw[:, jnp.maximum(jnp.where(slot % block == 0, plan.slots + slot - 1, slot - 1), 0)]
    else:
      logits = net.logits(params, twice(st.z), **args, logits_length=plan.slots)
    return rows(logits, needs.starts, block)

  def forward(self, params, st: State, needs: Needs) -> Forward:
    run = jnp.any(needs.logits)
    logits = jax.lax.cond(run, lambda: self._full(params, st, needs), lambda: st.logits)
    return Forward(select_rows(needs.logits, logits, st.logits), st.cache, run, jnp.zeros((), bool))

  def unconditional(self, params, st: State, needs: Needs) -> jax.Array:
    inside = (jnp.arange(self.plan.slots)[None, :] - needs.starts[:, None]) // self.plan.block == 0
    return self._full(params, st._replace(segments=jnp.where(inside, st.segments, 0)), needs)


class Exact(Strategy):
  def empty(self, batch: int):
    return self.network.empty_cache(batch, self.plan.slots)

  def _mask(self) -> tuple[str, int | None]:
    """The mask of the prefill and the commit pass: causal for the twin and for a verified checkpoint's clean half
    (``plan.causal_context``), block-causal for a block-diffusion checkpoint."""
    plan = self.plan
    return ("causal", None) if plan.autoregressive or plan.causal_context else ("block_causal", plan.block)

  def prefill(self, params, st: State, size: int):
    """The cache with the keys and values of slots ``[0, size)``: one pass, or ``plan.prefill_chunk`` slots at a time
    (:meth:`fill`)."""
    chunk = self.plan.prefill_chunk
    if not chunk or size <= chunk:
      return self.fill(params, st, jnp.zeros((), jnp.int32), size, first=True)
    starts = jnp.minimum(jnp.arange(-(-size // chunk), dtype=jnp.int32) * chunk, size - chunk)  # the last ends at size
    return jax.lax.fori_loop(
      0, starts.shape[0], lambda i, cache: self.fill(params, st._replace(cache=cache), starts[i], chunk), st.cache
    )

  def fill(self, params, st: State, start: jax.Array, size: int, *, first: bool = False):
    """The cache with the keys and values of slots ``[start, start + size)`` of every row (``start``: [] int32,
    traced), computed against what the cache holds before ``start``: the prefill's pass, or one chunk of it. The
    chunk's slots see what they would see in one pass over ``[0, start + size)`` (the block-causal mask lets a slot
    see its own block's later slots, which lie in the chunk or past ``start + size`` either way). ``first``: ``start``
    is 0, so the pass need not read the cache."""
    mask, block = self._mask()
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)  # noqa: E731
    waiting = jnp.where(st.target, 0, st.segments)  # Masked slots wait in segment 0 until they are committed.
    _, kv = self.network.chunk(
      params,
      cut(st.z),
      segments=cut(waiting),
      positions=cut(st.positions),
      mask=mask,
      diffusion_block=block,
      cache=None if first else st.cache,
      starts=None if first else start,
      logits_length=0,
    )
    return st.cache.write_prefix(kv) if first else st.cache.write(kv, start)

  def forward(self, params, st: State, needs: Needs) -> Forward:
    net, block = self.network, self.plan.block
    mask, diffusion_block = self._mask()

    def over_cache(cache, at, size, t=None, mask=mask, **kw):
      block_of = block if mask == "block_causal" else diffusion_block
      return self.over(params, st, at, size, t, mask=mask, diffusion_block=block_of, cache=cache, **kw)

    previous = needs.starts - block
    if self.plan.autoregressive:  # One pass: the last committed token, written, gives the next distribution.
      wants = needs.logits | needs.commit
      run = jnp.any(wants)
      kept = (st.logits, st.cache.rows(previous, 1))
      logits, kv = jax.lax.cond(run, lambda: over_cache(st.cache, previous, 1), lambda: kept)
      logits, kv = select_rows(wants, logits, kept[0]), select_rows(wants, kv, kept[1])
      return Forward(logits, st.cache.write(kv, previous), run, run)
    commit = jnp.any(needs.commit)
    kept = st.cache.rows(previous, block)  # Writing back what is there: one program either way.
    kv = jax.lax.cond(
      commit,
      lambda: over_cache(st.cache, previous, block, logits_length=0)[1],  # the commit pass: the context mask
      lambda: kept,
    )
    cache = st.cache.write(select_rows(needs.commit, kv, kept), previous)
    run = jnp.any(needs.logits)
    shift = net.shift  # A shifted-logits model reads the block's distributions one slot earlier (Network.shift).
    logits = jax.lax.cond(  # the block pass: the block sees itself whole and the cache before it
      run,
      lambda: over_cache(
        cache,
        needs.starts - shift,
        block + shift,
        needs.t,
        mask="block_causal",
        logits_length=block,
        return_kv=False,
        latent=needs.latent,
      ),
      lambda: st.logits,
    )
    return Forward(select_rows(needs.logits, logits, st.logits), cache, run, commit)

  def unconditional(self, params, st: State, needs: Needs) -> jax.Array:
    block = self.plan.block
    hidden = st.cache._replace(segments=jnp.zeros_like(st.cache.segments))  # no cached key is visible
    return self.over(
      params, st, needs.starts, block, needs.t, mask="block_causal", diffusion_block=block, cache=hidden,
      logits_length=block, return_kv=False, latent=needs.latent,
    )  # fmt: skip


class Verified(Exact):
  """The exact cache of verified decoding (:mod:`~mercury_jax.sampling.verify`): the prefill of the twin, then one
  chunk per step over the cache: the draft tree's nodes (the last committed token and its candidates) and the
  pre-draft blocks (``masks.verify_chunk`` of the plan's :class:`~mercury_jax.sampling.drafts.Topology`). The nodes'
  keys and values go back to the rule, which writes the accepted path's (:class:`Forward`'s ``kv``)."""

  def forward(self, params, st: State, needs: Needs) -> Forward:
    """The chunk whose root is slot ``needs.starts - 1`` (:func:`~mercury_jax.sampling.drafts.chunk_inputs`): the
    nodes' next-token logits ``[b, N, vocab]``, the pre-draft blocks' ``[b, P, k, vocab]`` and the nodes' keys and
    values. A batch whose live nodes all lie above a cut of the tree (``Topology.cuts``) runs the shallower chunk
    of that cut (the deeper nodes' logits are zeros: they are out in every row), unless the network is batch-invariant
    (a row's numbers must not depend on its bucket)."""
    tree, starts = self.plan.tree, needs.starts
    inputs = chunk_inputs(st, starts, tree, needs.nodes)
    cuts = (tree.depth,) if getattr(self.network, "batch_invariant", False) else tree.cuts
    batch, nodes, blocks = inputs[0].shape[0], tree.nodes, tree.mask.size - tree.nodes
    vocab = self.network.vocab_size

    def run(depth: int):
      part = tree.cut(depth)
      columns = np.concatenate([np.arange(part.nodes), nodes + np.arange(part.mask.size - part.nodes)])
      tokens, positions, segments = (a[:, columns] for a in inputs)
      logits, kv = self.network.chunk(
        params, tokens, segments=segments, positions=positions, mask="verify_chunk", diffusion_block=part.mask,
        cache=st.cache, starts=starts - 1,
      )  # fmt: skip
      logits = jnp.concatenate([_grow(logits[:, : part.nodes], 1, nodes), _grow(logits[:, part.nodes :], 1, blocks)], 1)
      return logits, KVCache(*(_grow(a[..., : part.nodes, :, :], 2, nodes) for a in (kv.keys, kv.values)),
                             _grow(kv.segments[:, : part.nodes], 1, nodes))  # fmt: skip

    if len(cuts) == 1:
      logits, kv = run(cuts[0])
    else:  # the shallowest cut that holds every working row's deepest live node
      depths = jnp.where(needs.nodes.live & needs.commit[:, None], jnp.asarray(tree.depths), 0)
      branch = jnp.sum(jnp.asarray(cuts) < jnp.max(depths))
      logits, kv = jax.lax.switch(branch, [lambda d=d: run(d) for d in cuts])
    ran = jnp.ones((), bool)
    drafts = logits[:, nodes:].reshape(batch, len(tree.outcomes), tree.k, vocab)
    return Forward(logits[:, :nodes], st.cache, ran, ran, drafts, kv)


def _grow(a: jax.Array, axis: int, size: int) -> jax.Array:
  """``a`` padded with zeros to ``size`` along ``axis``."""
  return jnp.pad(a, [(0, size - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])


class Dual(Strategy):
  lockstep = True

  def empty(self, batch: int):
    return self.network.empty_cache(batch, self.plan.slots)

  def _refresh(self, params, st: State, needs: Needs):
    """The whole canvas, every slot's keys and values cached."""
    logits, kv = self.network.chunk(
      params, st.z, needs.t, segments=st.segments, positions=st.positions, mask="bidirectional"
    )
    return rows(logits, needs.starts - self.network.shift, self.plan.block), kv

  def _block(self, params, st: State, needs: Needs, size: int, pad: int = 0) -> jax.Array:
    """The block's logits from a chunk of ``size`` slots from its start (and the slot before it, for a shifted model)
    over the cache; ``pad`` padding slots are appended first (a chunk may run past the last slot)."""
    shift = self.network.shift
    return self.over(
      params, st, needs.starts - shift, size + shift, needs.t, pad=pad, mask="bidirectional", cache=st.cache,
      logits_length=self.plan.block, return_kv=False,
    )  # fmt: skip

  def _later(self, params, st: State, needs: Needs):
    return self._block(params, st, needs, self.plan.block), st.cache

  def forward(self, params, st: State, needs: Needs) -> Forward:
    run = jnp.any(needs.logits)
    refresh = jnp.any(st.fresh)  # The approximate caches keep the rows' blocks in lockstep.
    branch = jnp.where(run, jnp.where(refresh, 1, 2), 0)
    logits, cache = jax.lax.switch(
      branch,
      [
        lambda: (st.logits, st.cache),
        lambda: self._refresh(params, st, needs),
        lambda: self._later(params, st, needs),
      ],
    )
    return Forward(logits, cache, run, run & refresh)


class Prefix(Dual):
  def _later(self, params, st: State, needs: Needs):
    plan = self.plan

    def suffix(size: int):
      return lambda: self._block(params, st, needs, size, plan.tail + self.network.shift)

    sizes = plan.suffix_sizes
    need = jnp.max(plan.slots - needs.starts)
    logits = jax.lax.switch(jnp.sum(jnp.asarray(sizes) >= need) - 1, [suffix(size) for size in sizes])
    return logits, st.cache


STRATEGIES = {"exact": Exact, "none": NoCache, "dual": Dual, "prefix": Prefix}


def strategy(plan: BlockPlan, network: Network, mask_id: int) -> Strategy:
  """The cache strategy of ``plan``."""
  return (Verified if plan.draft else STRATEGIES[plan.cache])(plan, network, mask_id)
