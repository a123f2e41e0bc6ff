"""What a verified step verifies: a static draft tree (:class:`Topology`) and its candidates, from the drafter and
from the row's own text.

A tree's node 0 is the last committed token (the root); every other node is a candidate for the position after its
parent's, at the depth below it. Each node takes its candidate from one *source*:

* the drafter's chain (:data:`CHAIN`): the ``k - 1`` drafts the previous step drew from the pre-draft block of its
  outcome, depth ``d`` taking draft ``d`` (TiDAR's chain; the sampled proposals of speculative sampling);
* the drafter's alternatives (rank ``r >= 1``): the ``r``-th most likely token of the same pre-draft position other
  than the chain's draft, a deterministic candidate (Medusa's top-k products, arXiv 2401.10774: every depth draws
  from the drafter's marginal there, whatever the parent);
* the row's own text (:data:`LOOKUP`, prompt-lookup decoding; lookahead decoding's n-gram pool, arXiv 2402.02057):
  where the row's last ``n`` committed tokens occurred before (``n`` in :data:`NGRAMS`, the longest match first, its
  most recent occurrence), the tokens that followed them, a chain of ``lookup`` nodes under the root
  (:func:`lookup`). A match that ends ``p`` tokens before the row's end continues with period ``p``, so a run of
  repeated text proposes its continuation.

A tree is written as the rank paths it adds to the chain (:func:`parse_tree`): ``"1,2,10"`` adds the first two
alternatives at depth 1 and, under the first, the chain's draft at depth 2 (a Cartesian product pruned by hand, as
Medusa's trees are). ``none`` has no drafter nodes (lookups alone). The nodes are laid out by depth, and within a
depth the chain's first, then the alternatives, then the lookup chain's: the order in which acceptance tries them
(:mod:`~mercury_jax.sampling.verify`).

Pre-draft blocks (``blocks``): the chunk drafts the next step's chain after the *outcome nodes* alone, the chain's
nodes at the depths listed (``all``: every depth ``0 .. k - 1``, TiDAR's chunk; the likeliest outcomes make a
cheaper chunk), or every node of the tree (``tree``: the alternatives and the lookup chain too). A step whose outcome
has no pre-draft block leaves the next step no drafter candidates: it verifies the lookup chain alone (or nothing)
and pre-drafts again. At T = 1 a tree's alternatives are accepted about as often as the chain's draft, so without
their blocks many steps end where nothing was drafted (``docs/bench/levers/README.md``, "T = 1").

Per-row adaptive length (``confidence`` > 0): a drafter node takes part only where the drafter's own probability of
its candidate reaches the bar, the chain's by the drafter's top probability at its depth (a property of the
distribution the draft was drawn from, never of the drawn token, which would bias speculative sampling); a node
whose parent is out is out too. A batch whose deepest live node lies above the tree's depth runs a shallower chunk
(:attr:`Topology.cuts`), unless the network must be batch-invariant (a server's buckets).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.kernels import masks
from mercury_jax.sampling.settings import (
  AUTO,
  EVERY_NODE,
  MAX_LOOKUP,
  MAX_RANK,
  SettingError,
  parse_blocks,
  parse_tree,
)
from mercury_jax.sampling.state import Draft, State, rows

ROOT, CHAIN, LOOKUP = -1, 0, -2  # A node's source; r >= 1: the drafter's r-th alternative.
NGRAMS = (3, 2, 1)  # Lookup match lengths, the longest first.


@dataclasses.dataclass(frozen=True)
class Drafting:
  """What a request asks of the draft tree (``SamplerSettings``' ``draft_tree``, ``draft_lookup`` and
  ``draft_blocks``): names and numbers, resolved into a :class:`Topology` by :func:`topology`."""

  tree: str = AUTO
  lookup: int = -1  # -1: the device's default
  blocks: str = AUTO


DEVICE_DEFAULT = Drafting()  # Every knob ``auto``: the device's defaults.
# The device defaults (:func:`resolve`), chosen by the measured chunk cost (docs/results/verified.md, "Engine levers"):
# a CPU pays per chunk position, a GPU barely. On a CPU the lookup chain alone (a 9-position chunk, no drafter) was
# the fastest greedy setting at batch 1 and level at T = 1 with the cheapest drafter chunk (blocks "0,1"), and beat
# the default before it (the chain, a lookup of 4, every block) at both: 1.76 / 0.84 x the twin against 1.05 / 0.57.
DEFAULTS = {"cpu": Drafting("none", 8, "none"), "gpu": Drafting("wide", 8, "all")}


def resolve(drafting: Drafting, backend: str | None = None) -> Drafting:
  """``drafting`` with every ``auto`` replaced by the default of ``backend`` (default: JAX's)."""
  backend = backend or jax.default_backend()
  default = DEFAULTS["cpu" if backend == "cpu" else "gpu"]
  return Drafting(
    default.tree if drafting.tree == AUTO else drafting.tree,
    default.lookup if drafting.lookup < 0 else drafting.lookup,
    default.blocks if drafting.blocks == AUTO else drafting.blocks,
  )


@dataclasses.dataclass(frozen=True)
class Topology:
  """A verified step's static draft tree (hashable: part of the plan, a compilation key).

  Attributes:
    k: The drafter's block (the plan's draft length): chain drafts at depths ``1 .. k - 1``, pre-draft blocks of
      ``k`` masks.
    parents: Each node's parent (node 0, the root: -1), the nodes in depth order.
    sources: Each node's source: :data:`ROOT`, :data:`CHAIN`, :data:`LOOKUP` or an alternative's rank.
    outcomes: The nodes with a pre-draft block after them, in depth order.
  """

  k: int
  parents: tuple[int, ...]
  sources: tuple[int, ...]
  outcomes: tuple[int, ...]

  @classmethod
  def chain(cls, k: int) -> Topology:
    """TiDAR's chunk: the chain of ``k - 1`` drafts, a pre-draft block after every node."""
    return build(k, (), 0, None)

  @property
  def mask(self) -> masks.Tree:
    return masks.Tree(self.parents, self.outcomes, self.k)

  @property
  def nodes(self) -> int:
    return len(self.parents)

  @property
  def depths(self) -> tuple[int, ...]:
    return self.mask.depths

  @property
  def depth(self) -> int:
    """The deepest node's depth D: a step accepts at most D candidates."""
    return max(self.depths)

  @property
  def width(self) -> int:
    """The tokens a step can commit (``D + 1``), at least ``k`` (a stream's proposals are the chain's ``k - 1``)."""
    return max(self.depth + 1, self.k)

  @property
  def reach(self) -> int:
    """Slots the chunk covers from the root's: the nodes' and the pre-draft blocks'."""
    ends = [self.depths[o] + 1 + self.k for o in self.outcomes]
    return max([self.depth + 1, *ends])

  @property
  def alternatives(self) -> int:
    """R: the highest alternative rank of any node."""
    return max([s for s in self.sources if s > 0], default=0)

  @property
  def lookup(self) -> int:
    """L: the lookup chain's length."""
    return sum(s == LOOKUP for s in self.sources)

  @property
  def levels(self) -> tuple[tuple[int, ...], ...]:
    """The nodes of each depth ``1 .. D``, in the order acceptance tries them."""
    return tuple(tuple(i for i, d in enumerate(self.depths) if d == depth) for depth in range(1, self.depth + 1))

  @property
  def leaves(self) -> tuple[tuple[int, ...], ...]:
    """Each leaf's path from the root (node indices)."""
    parents, out = self.parents, []
    for leaf in sorted(set(range(self.nodes)) - set(parents)):
      path = [leaf]
      while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
      out.append(tuple(reversed(path)))
    return tuple(out)

  @property
  def cuts(self) -> tuple[int, ...]:
    """The depths a chunk may stop at: the root alone (no candidate in any row: the root and its pre-draft block),
    or the whole tree. (A CPU pays for every position; on this tree the pre-draft blocks are most of them, so a cut
    between the two saves little and costs another compiled pass.)"""
    return tuple(sorted({0, self.depth}))

  def cut(self, depth: int) -> Topology:
    """The tree of the nodes at most ``depth`` deep (a prefix: the nodes are in depth order) and their outcomes."""
    keep = sum(d <= depth for d in self.depths)
    outcomes = tuple(o for o in self.outcomes if o < keep)
    return Topology(self.k, self.parents[:keep], self.sources[:keep], outcomes)


def build(k: int, paths, lookup: int, blocks: tuple[int, ...] | str | None, chain: bool = True) -> Topology:
  """The topology of the chain of ``k - 1`` drafts (unless not ``chain``), the rank ``paths`` added to it, a lookup
  chain of ``lookup`` nodes and pre-draft blocks after the chain's nodes at the depths ``blocks`` (None: all), or
  after every node (``EVERY_NODE``)."""
  every = {(): ROOT}
  if chain:
    every.update({(0,) * d: CHAIN for d in range(1, k)})
  every.update({tuple(path): path[-1] for path in paths})
  every.update({(LOOKUP,) * d: LOOKUP for d in range(1, lookup + 1)})
  order = sorted(every, key=lambda path: (len(path), [MAX_RANK + 1 if r == LOOKUP else r for r in path]))
  index = {path: i for i, path in enumerate(order)}
  parents = tuple(index[path[:-1]] if path else -1 for path in order)
  if blocks == EVERY_NODE:
    outcomes = tuple(range(len(order)))
  else:
    depths = range(k) if blocks is None else blocks
    outcomes = tuple(index[(0,) * d] for d in depths if chain and (0,) * d in index)
  return Topology(k, parents, tuple(every[path] for path in order), outcomes)


def topology(k: int, drafting: Drafting, backend: str | None = None) -> Topology:
  """The plan's tree for a draft length ``k`` and a request's :class:`Drafting` (``auto`` resolved for
  ``backend``); :class:`SettingError` naming the setting for a tree, lookup or block list that does not fit ``k``."""
  drafting = resolve(drafting, backend)
  paths = parse_tree(drafting.tree)
  chain = drafting.tree != "none"
  for path in paths:
    if len(path) > k - 1 or max(path) > MAX_RANK:
      shown = "".join(map(str, path))
      raise SettingError("draft_tree", drafting.tree, f"has path {shown!r} deeper than the {k - 1} drafts of k={k}")
  if not 0 <= drafting.lookup <= MAX_LOOKUP:
    raise SettingError("draft_lookup", drafting.lookup, f"must lie in [0, {MAX_LOOKUP}] (0: off; -1: the device's)")
  blocks = parse_blocks(drafting.blocks)
  if isinstance(blocks, tuple) and any(d > k - 1 for d in blocks):
    raise SettingError("draft_blocks", drafting.blocks, f"must name chain depths in [0, {k - 1}] for k={k}")
  if not chain and blocks != ():
    blocks = ()  # No drafter node, no pre-draft block.
  return build(k, paths, drafting.lookup, blocks, chain)


# ---------------------------------------------------------------------------------------------- candidates


def lookup(z: jax.Array, segments: jax.Array, starts: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
  """Prompt-lookup candidates: ``(tokens [b, length], found [b] bool)`` for the slots ``starts ..``.

  The row's committed text is its slots before ``starts`` (prompt, fixed text and committed tokens, live segments).
  For ``n`` in :data:`NGRAMS` (the longest first) the most recent earlier occurrence of its last ``n`` tokens, ending
  at ``j < starts - 1``, gives the candidates ``z[j + 1 + (i mod p)]``, ``p = starts - 1 - j``: what followed the
  occurrence, repeated with the period of the match. O(slots) per row, on the device.
  """
  batch, slots = z.shape
  last = starts - 1  # [b] the last committed slot
  index = jnp.arange(slots)[None, :]
  live = segments != 0
  best = jnp.full((batch,), -1, jnp.int32)
  for n in NGRAMS:
    tail = jnp.take_along_axis(z, jnp.maximum(last[:, None] - jnp.arange(n)[None, :], 0), axis=1)  # [b, n]
    tail_live = jnp.all(jnp.take_along_axis(live, jnp.maximum(last[:, None] - jnp.arange(n), 0), axis=1), axis=1)
    match = (index >= n - 1) & (index < last[:, None])
    for t in range(n):  # z[j - t] == the t-th last token, for every end j at once
      shifted, shifted_live = (jnp.pad(a, ((0, 0), (t, 0)))[:, :slots] for a in (z, live))
      match &= (shifted == tail[:, t : t + 1]) & shifted_live
    end = jnp.max(jnp.where(match, index, -1), axis=1)
    best = jnp.where((best < 0) & tail_live & (last >= n), end, best)
  period = jnp.maximum(last - best, 1)
  at = best[:, None] + 1 + jnp.arange(length)[None, :] % period[:, None]
  tokens = jnp.take_along_axis(z, jnp.clip(at, 0, slots - 1), axis=1)
  return tokens.astype(jnp.int32), best >= 0


class Candidates(NamedTuple):
  """A step's tree nodes before the pass (:func:`candidates`)."""

  tokens: jax.Array  # [b, N] int32: each node's token (the mask id where the node is out)
  live: jax.Array  # [b, N] bool: the node takes part (its parent does, and its source has a candidate)


def candidates(topo: Topology, st: State, starts: jax.Array, cutoff: float, mask_id: int) -> Candidates:
  """Each node's candidate (module docstring): from ``st.draft`` (the chain, its alternatives and the drafter's
  probabilities) and :func:`lookup`. A node at a slot of fixed text (or padding past the hole) holds that token and
  takes part whenever its parent does: it passes as it is."""
  d = st.draft
  window = rows(st.z, starts, topo.depth)  # [b, D]: the slots of depths 1 .. D
  known = ~(rows(st.generate, starts, topo.depth) & (window == mask_id))
  found = None
  if topo.lookup:
    looked, found = lookup(st.z, st.segments, starts, topo.lookup)
  drafted = d.count > 0
  tokens = [jnp.take_along_axis(st.z, starts[:, None] - 1, axis=1)[:, 0]]
  live = [jnp.ones_like(drafted)]
  for node, (parent, source, depth) in enumerate(zip(topo.parents, topo.sources, topo.depths, strict=True)):
    if not node:
      continue
    if source == LOOKUP:
      token, ok = looked[:, depth - 1], found
    else:  # the chain (rank 0) or an alternative; its probability (the chain's: the top one) reaches the bar
      token = d.tokens[:, depth - 1] if source == CHAIN else d.alternatives[:, depth - 1, source - 1]
      ok = drafted & (d.confidence[:, depth - 1, source] >= cutoff)
    fixed = known[:, depth - 1]
    tokens.append(jnp.where(fixed, window[:, depth - 1], token))
    live.append(live[parent] & (ok | fixed))
  live = jnp.stack(live, axis=1)
  return Candidates(jnp.where(live, jnp.stack(tokens, axis=1), mask_id).astype(jnp.int32), live)


def chunk_inputs(st: State, starts: jax.Array, topo: Topology, nodes: Candidates):
  """``(tokens, positions, segments)`` [b, size] of the chunk whose root is slot ``starts - 1``: the nodes (their
  candidates, at the slots of their depths), then the pre-draft blocks, each the ``k`` slots after its outcome
  node's as they stand (masked where still to generate)."""
  window = topo.reach
  z, positions, segments = (rows(a, starts - 1, window) for a in (st.z, st.positions, st.segments))
  depths = np.asarray(topo.depths)
  blocks = np.asarray([topo.depths[o] + 1 + u for o in topo.outcomes for u in range(topo.k)], np.int32)
  lay = lambda a, first: jnp.concatenate([first, a[:, blocks]], axis=1)  # noqa: E731
  return lay(z, nodes.tokens), lay(positions, positions[:, depths]), lay(segments, segments[:, depths])


def empty_draft(batch: int, topo: Topology, vocab: int) -> Draft:
  """No drafts yet (the first step verifies the lookups, or nothing)."""
  k, r = topo.k, topo.alternatives
  return Draft(
    jnp.zeros((batch, k - 1), jnp.int32),
    jnp.zeros((batch, k - 1, vocab), jnp.float32),
    jnp.zeros((batch,), jnp.int32),
    jnp.zeros((batch, topo.width), jnp.int32),
    jnp.zeros((batch, k - 1, r), jnp.int32),
    jnp.zeros((batch, k - 1, 1 + r), jnp.float32),
    jnp.zeros((batch, 3), jnp.int32),
  )
