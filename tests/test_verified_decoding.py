"""Verified decoding (``sampling/verify.py``): greedy equals the network's own autoregressive greedy decoding token
for token, and sampling is distributed exactly as its next-token head, whatever the drafter."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from test_engine import _canvas  # four rows: prompts of 3, 7 and 1 tokens, and a two-hole template

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.model import DRAFT_PARAMS, KVCache, Transformer, param_shardings
from mercury_jax.sampling import canvas as cv, drafts, walk
from mercury_jax.sampling.drafts import Drafting, topology
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.settings import SamplerSettings

EOS = 3
VOCAB = 64


def _model_cfg() -> ModelConfig:
  return ModelConfig(
    vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=64,
    attention="xla",
  )  # fmt: skip


def _params(cfg: ModelConfig, seed: int = 0, scale: float = 8.0):
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * scale, params)


# Draft trees beside the drafter's chain: alternatives (a Cartesian product), a lookup chain, pre-draft blocks for
# the two likeliest outcomes and an adaptive length; the lookup chain alone (no drafter candidate).
TREE = Drafting("1,2,10", 3, "0,1")
# The same tree pre-drafting after every node: a step that ends on an alternative or a lookup still drafts next.
TREE_BLOCKS = Drafting("1,2,10", 3, "tree")
LOOKUPS = Drafting("none", 5, "none")


def _decode(network, params, canvas, draft: int, *, seed=0, mesh=None, shardings=None, tree=None, **knobs):
  settings = SamplerSettings(objective=ObjectiveConfig(), num_tokens=network.vocab_size, **knobs).validate()
  tree = topology(draft, tree, "cpu") if tree is not None else None
  plan = plan_blocks(canvas.kinds, 1, autoregressive=True, draft=draft, causal_context=True, tree=tree)
  engine = BlockEngine(network, settings, plan)
  if mesh is None:
    return jax.jit(engine.sample)(params, canvas, jax.random.key(seed), jnp.int32(1))
  fn = jit_on_mesh(engine.sample, mesh, sh.RULES, shardings, scalars=1, accepted=bool(draft))
  return fn(params, canvas, jax.random.key(seed), jnp.int32(1))


@pytest.mark.parametrize(
  "draft, tree, width",
  [(2, None, 2), (4, None, 4), (4, TREE_BLOCKS, 4), (4, LOOKUPS, 6)],
  ids=["chain2", "chain4", "tree", "lookups"],
)
def test_greedy_equals_the_networks_autoregressive_greedy_decoding(draft, tree, width):
  """The random model's greedy text repeats itself, so the lookups are accepted too."""
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg)
  ar = _decode(cfg, params, canvas, 0, temperature=0.0)
  knobs = {"draft_confidence": 0.05} if tree is TREE_BLOCKS else {}
  verified = _decode(cfg, params, canvas, draft, temperature=0.0, tree=tree, **knobs)
  np.testing.assert_array_equal(np.asarray(verified.tokens), np.asarray(ar.tokens))
  # Every step commits at least one token of its own: never more forward passes than the one-token decoder.
  assert (np.asarray(verified.nfe) <= np.asarray(ar.nfe)).all()
  accepted = np.asarray(verified.accepted)
  assert accepted.shape == (4, width) and (accepted.sum(axis=1) == np.asarray(verified.nfe)).all()
  if tree is LOOKUPS:
    assert accepted[:, 1:].sum() > 0 and np.asarray(verified.nfe).sum() < np.asarray(ar.nfe).sum()


def test_a_draft_only_mlp_changes_what_is_accepted_and_not_the_text():
  """The engine's drafts run through ``model.draft_mlp`` (they are [MASK] inputs): a random one changes the accepted
  counts, while greedy output stays the network's own autoregressive greedy text without it."""
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg)
  grown = dataclasses.replace(cfg, draft_mlp=16, draft_token=ObjectiveConfig().mask_id)
  extra = _params(grown, seed=1)["blocks"]
  extra["draft_mlp"]["down"] = jax.random.normal(jax.random.key(2), extra["draft_mlp"]["down"].shape)
  with_mlp = {**params, "blocks": {**params["blocks"], **{k: extra[k] for k in DRAFT_PARAMS}}}
  ar = _decode(cfg, params, canvas, 0, temperature=0.0)
  base = _decode(cfg, params, canvas, 4, temperature=0.0)
  verified = _decode(grown, with_mlp, canvas, 4, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(verified.tokens), np.asarray(ar.tokens))
  assert not np.array_equal(np.asarray(verified.accepted), np.asarray(base.accepted))


def test_greedy_on_a_2x2x2_mesh_equals_one_device():
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg)
  single = _decode(cfg, params, canvas, 4, temperature=0.0, tree=TREE)
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(Transformer(cfg), mesh, sh.RULES)
  params = jax.device_put(params, shardings)
  out = _decode(cfg, params, canvas, 4, mesh=mesh, shardings=shardings, temperature=0.0, tree=TREE)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_array_equal(np.asarray(out.accepted), np.asarray(single.accepted))


def test_a_row_samples_the_same_tokens_alone_or_in_a_batch():
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg, scale=2.0)  # flatter: sampled tokens differ from the greedy ones
  batch = _decode(cfg, params, canvas, 4, seed=3, temperature=1.0)
  one = cv.Canvas(canvas.tokens[2:3], canvas.kinds[2:3], canvas.streams[2:3])
  alone = _decode(cfg, params, one, 4, seed=3, temperature=1.0)
  length = np.asarray(alone.tokens).shape[1]
  np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[2, :length])


# ---------------------------------------------------------------------------------------------- exactness

SMALL = 12  # ids 0-4 are the specials (pad, unk, bos, eos, mask); 3 (EOS) is a token here, 5-11 the others
TOKENS = [3, *range(5, SMALL)]


class MarkovNetwork:
  """A network with a known next-token head: token ``x`` is followed by ``T[x]`` (a Markov chain over ``TOKENS``).
  Its drafter gives a pre-draft block's position ``u`` the chain's ``u + 1``-step distribution from the block's last
  clean token (``good``: the exact marginals) or fixed random logits (a bad drafter)."""

  vocab_size = SMALL
  causal = False
  time_conditioning = False

  def __init__(self, transition: np.ndarray, drafter: str):
    self.log_t = jnp.log(jnp.asarray(transition, jnp.float32))
    self.drafter = drafter
    self.noise = jax.random.normal(jax.random.key(7), (SMALL,)) * 3.0

  def map_rows(self, fn, *args):  # Network.map_rows: a batched pass is fine here
    return fn(*args)

  def empty_cache(self, batch: int, slots: int) -> KVCache:
    zeros = jnp.zeros((1, batch, slots, 1, 1))
    return KVCache(zeros, zeros, jnp.zeros((batch, slots), jnp.int32))

  def chunk(self, params, tokens, t=None, *, segments, positions, mask, diffusion_block=None, cache=None, starts=None,
            logits_length=None, return_kv=True):  # fmt: skip
    batch, length = tokens.shape
    kv = KVCache(jnp.zeros((1, batch, length, 1, 1)), jnp.zeros((1, batch, length, 1, 1)), segments)
    logits = self.log_t[jnp.clip(tokens, 0, SMALL - 1)]  # next-token logits of each token
    if mask == "verify_chunk":
      tree = diffusion_block  # a masks.Tree: its nodes, then a pre-draft block after each outcome node
      k, n, outcomes = tree.block, tree.nodes, len(tree.outcomes)
      last = tokens[:, list(tree.outcomes)]  # a block's last clean token is its outcome node's
      powers = [self.log_t]
      for _ in range(k - 1):
        powers.append(jnp.log(jnp.exp(powers[-1]) @ jnp.exp(self.log_t)))
      if self.drafter == "good":
        blocks = jnp.stack([powers[u][last] for u in range(k)], axis=2)  # [b, outcome, u, vocab]
      else:
        blocks = jnp.broadcast_to(self.noise, (batch, outcomes, k, SMALL))
      logits = jnp.concatenate([logits[:, :n], blocks.reshape(batch, outcomes * k, SMALL)], axis=1)
    if logits_length is not None:
      logits = logits[:, :logits_length]
    return (logits, kv) if return_kv else logits


def _transition(seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  t = np.zeros((SMALL, SMALL))
  t[:, TOKENS] = rng.dirichlet(np.full(len(TOKENS), 0.7), size=SMALL)
  return t


def _filtered(t: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """Each row of ``t`` as the sampler sees it: tempered, top-k, then top-p (the most likely token always kept)."""
  out = np.zeros_like(t)
  for x in range(SMALL):
    row = np.where(t[x] > 0, t[x] ** (1.0 / temperature), 0.0)
    row /= row.sum()
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(SMALL, bool)
    keep[order[:top_k] if top_k else order] = True
    kept = np.where(keep, row, 0.0) / np.where(keep, row, 0.0).sum()
    ranked = kept[order]
    nucleus = (np.cumsum(ranked) - ranked) < top_p
    final = np.zeros(SMALL, bool)
    final[order[nucleus & (ranked > 0)]] = True
    out[x] = np.where(final, row, 0.0) / np.where(final, row, 0.0).sum()
  return out


PROMPT = [5, 6, 7, 8, 9, 5]  # the chain starts at 5; the lookups find the earlier 5 (and the chains' own repeats)
EXACT_TREES = {
  "chain": None,
  "tree": TREE,
  "tree_blocks": TREE_BLOCKS,
  "lookups": Drafting("none", 4, "none"),
  "adaptive": Drafting("1,01", 2),
}


def _deviation(drafter, temperature, top_k, top_p, tree, confidence=0.0) -> tuple[float, float]:
  """``(largest |share - marginal| in standard errors, tokens per forward)`` of 8192 Markov chains of 8 tokens
  decoded through the verified engine with the tree ``tree`` (:data:`EXACT_TREES`)."""
  transition, chains, length, draft = _transition(1), 8192, 8, 4
  network = MarkovNetwork(transition, drafter)
  canvas = cv.make_canvas([cv.prefix(PROMPT, length)] * chains, streams=range(chains))
  knobs = dict(eos_to_pad=False, draft_confidence=confidence)
  settings = SamplerSettings(objective=ObjectiveConfig(), num_tokens=SMALL, **knobs).validate()
  topo = topology(draft, EXACT_TREES[tree], "cpu") if EXACT_TREES[tree] else None
  plan = plan_blocks(canvas.kinds, 1, autoregressive=True, draft=draft, causal_context=True, tree=topo)
  engine = BlockEngine(network, settings, plan)
  values, types = (temperature, top_k, top_p, 0.9), (np.float32, np.int32, np.float32, np.float32)
  knobs = Knobs(*(np.full((chains,), v, d) for v, d in zip(values, types, strict=True)))
  out = jax.jit(engine.sample)(None, canvas, jax.random.key(11), jnp.int32(1), knobs)
  tokens = np.asarray(out.tokens)[:, len(PROMPT) :]
  p = _filtered(transition, temperature, top_k, top_p)
  marginal, worst = np.eye(SMALL)[PROMPT[-1]], 0.0
  for position in range(length):
    marginal = marginal @ p
    counts = np.bincount(tokens[:, position], minlength=SMALL) / chains
    se = np.sqrt(marginal * (1 - marginal) / chains)
    gap = np.abs(counts - marginal)
    worst = max(worst, float(np.max(np.where(se > 0, gap / np.maximum(se, 1e-12), np.where(gap > 1e-9, np.inf, 0)))))
  return worst, length / np.asarray(out.nfe).mean()


@pytest.mark.parametrize(
  "drafter, temperature, top_k, top_p, tree, confidence",
  [
    ("good", 1.0, 0, 1.0, "chain", 0.0),
    ("bad", 1.0, 0, 1.0, "chain", 0.0),
    ("good", 0.7, 4, 0.9, "chain", 0.0),
    ("bad", 1.3, 0, 0.8, "chain", 0.0),
    ("good", 1.0, 0, 1.0, "tree_blocks", 0.0),
    ("bad", 0.7, 4, 0.9, "tree", 0.0),
    ("good", 1.3, 0, 0.8, "lookups", 0.0),
    ("good", 1.0, 0, 1.0, "adaptive", 0.35),
  ],
)
def test_sampled_tokens_follow_the_next_token_distribution(drafter, temperature, top_k, top_p, tree, confidence):
  """Each generated position's token shares, over 8192 chains, lie within 5 standard errors of the chain's marginal
  under the filtered next-token head, whatever the drafter, the tree, the lookups or the adaptive length."""
  worst, tpf = _deviation(drafter, temperature, top_k, top_p, tree, confidence)
  assert worst <= 5.0, worst
  if tree == "chain" and drafter == "good":
    assert tpf > 1.5, tpf  # the marginals are accepted often (they are not the conditionals)
  elif tree == "chain":
    assert tpf < 1.25, tpf  # a bad drafter is rejected: towards one token per forward
  elif tree == "tree_blocks" and drafter == "good":
    # More candidates per depth, and a drafted chain after whichever node a step ends on: the same tree with blocks
    # after the chain's depths 0 and 1 only made 1.83 tokens per forward, the chain about 1.6.
    assert tpf > 1.95, tpf


def test_the_exactness_check_fails_when_a_rejection_leaves_the_distribution_as_it_was(monkeypatch):
  """The check above can fail: without the residual update (after a rejection the next candidate and the own token
  see ``p`` again), the shares move many standard errors away from the marginals."""
  monkeypatch.setattr(walk, "residual", lambda r, q: r)
  worst, _ = _deviation("bad", 1.0, 0, 1.0, "tree")
  assert worst > 10.0, worst


def test_lookup_proposes_what_followed_the_last_tokens_most_recently():
  """Longest match first, most recent occurrence, continued with the match's period; a padding slot never
  matches."""
  m = 4
  rows_ = [
    [0, 5, 6, 7, 8, 5, 6, 9, 5, 6, m, m, m, m],  # "5 6" last after slot 6 (slot 2 before it): 9 5 6, period 3
    [0, 5, 6, 7, 5, 6, 7, 5, 6, 9, 9, 5, 6, m],  # "9 5 6" is new; "5 6" after slot 8... most recent: 9 9 5 6
    [0, 7, 7, 7, 7, m, m, m, m, m, m, m, m, m],  # "7 7 7" ends at slot 3: period 1
    [0, 5, 6, 7, 8, 9, 10, m, m, m, m, m, m, m],  # nothing repeats
  ]
  z = jnp.asarray(rows_, jnp.int32)
  segments = jnp.asarray(np.asarray(rows_) != 0, jnp.int32)
  starts = jnp.asarray([10, 13, 5, 7], jnp.int32)
  tokens, found = drafts.lookup(z, segments, starts, 5)
  assert np.asarray(found).tolist() == [True, True, True, False]
  np.testing.assert_array_equal(np.asarray(tokens)[:3], [[9, 5, 6, 9, 5], [9, 9, 5, 6, 9], [7, 7, 7, 7, 7]])


def test_greedy_accepts_drafts_that_equal_the_argmax_and_keeps_the_argmax_path():
  rng = np.random.default_rng(4)
  transition = np.zeros((SMALL, SMALL))
  transition[:, TOKENS] = rng.dirichlet(np.full(len(TOKENS), 0.3), size=SMALL)
  length = 24
  canvas = cv.make_canvas([cv.prefix([x], length) for x in (5, 6, 7, 8)])
  for drafter, tree in (("good", None), ("bad", None), ("good", TREE), ("bad", LOOKUPS)):
    network = MarkovNetwork(transition, drafter)
    out = _decode(network, None, canvas, 4, temperature=0.0, eos_to_pad=False, tree=tree)
    tokens = np.asarray(out.tokens)
    for row, first in enumerate((5, 6, 7, 8)):
      path = [first]
      for _ in range(length):
        path.append(int(np.argmax(transition[path[-1]])))
      assert tokens[row, : length + 1].tolist() == path
    accepted = np.asarray(out.accepted)
    if drafter == "good":  # argmax of the marginals often is the next argmax: drafts accepted, fewer passes
      assert accepted[:, 1:].sum() > 0 and np.asarray(out.nfe).max() < length
