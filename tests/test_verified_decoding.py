"""Verified decoding (``sampling/verify.py``): greedy equals the network's own autoregressive greedy decoding token
for token, and sampling is distributed exactly as its next-token head, whatever the drafter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from test_engine import _canvas  # four rows: prompts of 3, 7 and 1 tokens, and a two-hole template

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.model import KVCache, Transformer, param_shardings
from mercury_jax.sampling import canvas as cv
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


def _decode(network, params, canvas, draft: int, *, seed=0, mesh=None, shardings=None, **knobs):
  settings = SamplerSettings(objective=ObjectiveConfig(), num_tokens=network.vocab_size, **knobs).validate()
  plan = plan_blocks(canvas.kinds, 1, autoregressive=True, draft=draft, causal_context=True)
  engine = BlockEngine(network, settings, plan)
  if mesh is None:
    return jax.jit(engine.sample)(params, canvas, jax.random.key(seed), jnp.int32(1))
  fn = jit_on_mesh(engine.sample, mesh, sh.RULES, shardings, scalars=1, accepted=bool(draft))
  return fn(params, canvas, jax.random.key(seed), jnp.int32(1))


@pytest.mark.parametrize("draft", [2, 4])
def test_greedy_equals_the_networks_autoregressive_greedy_decoding(draft):
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg)
  ar = _decode(cfg, params, canvas, 0, temperature=0.0)
  verified = _decode(cfg, params, canvas, draft, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(verified.tokens), np.asarray(ar.tokens))
  # Every step commits at least one token of its own: never more forward passes than the one-token decoder.
  assert (np.asarray(verified.nfe) <= np.asarray(ar.nfe)).all()
  accepted = np.asarray(verified.accepted)
  assert accepted.shape == (4, draft) and (accepted.sum(axis=1) == np.asarray(verified.nfe)).all()


def test_greedy_on_a_2x2x2_mesh_equals_one_device():
  cfg, canvas = _model_cfg(), _canvas()
  params = _params(cfg)
  single = _decode(cfg, params, canvas, 4, temperature=0.0)
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(Transformer(cfg), mesh, sh.RULES)
  out = _decode(cfg, jax.device_put(params, shardings), canvas, 4, mesh=mesh, shardings=shardings, temperature=0.0)
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


@pytest.mark.parametrize(
  "drafter, temperature, top_k, top_p",
  [("good", 1.0, 0, 1.0), ("bad", 1.0, 0, 1.0), ("good", 0.7, 4, 0.9), ("bad", 1.3, 0, 0.8)],
)
def test_sampled_tokens_follow_the_next_token_distribution_exactly(drafter, temperature, top_k, top_p):
  transition, chains, length, draft = _transition(1), 8192, 6, 4
  network = MarkovNetwork(transition, drafter)
  canvas = cv.make_canvas([cv.prefix([5], length)] * chains, streams=range(chains))
  settings = SamplerSettings(objective=ObjectiveConfig(), num_tokens=SMALL, eos_to_pad=False).validate()
  plan = plan_blocks(canvas.kinds, 1, autoregressive=True, draft=draft, causal_context=True)
  engine = BlockEngine(network, settings, plan)
  values, types = (temperature, top_k, top_p, 0.9), (np.float32, np.int32, np.float32, np.float32)
  knobs = Knobs(*(np.full((chains,), v, d) for v, d in zip(values, types, strict=True)))
  out = jax.jit(engine.sample)(None, canvas, jax.random.key(11), jnp.int32(1), knobs)
  tokens = np.asarray(out.tokens)[:, 1:]
  p = _filtered(transition, temperature, top_k, top_p)
  marginal = np.eye(SMALL)[5]
  for position in range(length):
    marginal = marginal @ p
    counts = np.bincount(tokens[:, position], minlength=SMALL) / chains
    se = np.sqrt(marginal * (1 - marginal) / chains)
    assert (np.abs(counts - marginal) <= 5 * se + 1e-9).all(), (position, counts, marginal)
  tpf = length / np.asarray(out.nfe).mean()
  if drafter == "good":
    assert tpf > 1.5, tpf  # the marginals are accepted often (they are not the conditionals)
  else:
    assert tpf < 1.25, tpf  # a bad drafter is rejected: towards one token per forward


def test_greedy_accepts_drafts_that_equal_the_argmax_and_keeps_the_argmax_path():
  rng = np.random.default_rng(4)
  transition = np.zeros((SMALL, SMALL))
  transition[:, TOKENS] = rng.dirichlet(np.full(len(TOKENS), 0.3), size=SMALL)
  length = 24
  canvas = cv.make_canvas([cv.prefix([x], length) for x in (5, 6, 7, 8)])
  for drafter in ("good", "bad"):
    out = _decode(MarkovNetwork(transition, drafter), None, canvas, 4, temperature=0.0, eos_to_pad=False)
    tokens = np.asarray(out.tokens)
    for row, first in enumerate((5, 6, 7, 8)):
      path = [first]
      for _ in range(length):
        path.append(int(np.argmax(transition[path[-1]])))
      assert tokens[row, : length + 1].tolist() == path
    accepted = np.asarray(out.accepted)
    if drafter == "good":  # argmax of the marginals often is the next argmax: drafts accepted, fewer passes
      assert accepted[:, 1:].sum() > 0 and np.asarray(out.nfe).max() < length
