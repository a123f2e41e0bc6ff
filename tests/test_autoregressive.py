"""The autoregressive twin through the block engine (blocks of one token) against plain full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax.config import ModelConfig, load_config
from mercury_jax.kinds import TARGET as GENERATE
from mercury_jax.model import Transformer
from mercury_jax.sampling.canvas import Hole, make_canvas, prefix
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.settings import SamplerSettings

CFG = load_config(
  "default_ar",
  {
    "model.vocab_size": "64",
    "model.max_length": "24",
    "model.d_model": "32",
    "model.num_layers": "2",
    "model.num_heads": "4",
    "model.num_kv_heads": "2",
    "model.head_dim": "8",
    "model.mlp_dim": "64",
  },
).model
MODEL = Transformer(CFG)
PARAMS = jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 24), jnp.int32))["params"]
PROMPTS = [[2, 17, 33, 9], [2, 40], [2, 5, 6, 7, 8, 9, 10]]


class jit_decode:  # noqa: N801  (reads like the function it stands for)
  """``(params, canvas, key) -> SampleOutput`` of the twin on the engine, one compilation per layout."""

  def __init__(self, cfg: ModelConfig, settings: SamplerSettings):
    self.cfg, self.settings, self.compiled = cfg, settings, {}
    BlockEngine(cfg, settings, plan_blocks(np.array([[1, GENERATE]]), 1, autoregressive=True))  # checks cfg

  def __call__(self, params, canvas, key):
    plan = plan_blocks(canvas.kinds, 1, autoregressive=True)
    if plan not in self.compiled:
      self.compiled[plan] = jax.jit(BlockEngine(self.cfg, self.settings, plan).sample)
    return self.compiled[plan](params, canvas, key, jnp.int32(1))

  def _cache_size(self) -> int:
    return sum(fn._cache_size() for fn in self.compiled.values())


def _greedy_by_full_passes(canvas, settings, params=PARAMS) -> np.ndarray:
  """Reference: recompute the whole prefix at every position, argmax over the allowed tokens.

  Never the mask, padding, BOS or unknown ids (nor EOS among the first ``min_length`` generated positions); an EOS
  ends its own hole: the rest of the hole is padding in segment 0 (invisible), later holes are generated.
  """
  tokens, kinds = np.array(canvas.tokens), np.asarray(canvas.kinds)
  apply = jax.jit(lambda x, seg: MODEL.apply({"params": params}, x, segment_ids=seg))
  segments = (kinds != 0).astype(np.int32)
  for row in range(tokens.shape[0]):
    rank, hole_ended = -1, False
    for i in range(1, tokens.shape[1]):
      if kinds[row, i] != GENERATE:
        hole_ended = False
        continue
      rank += 1
      if hole_ended:
        tokens[row, i], segments[row, i] = settings.pad_id, 0
        continue
      logits = np.array(apply(tokens[row : row + 1], segments[row : row + 1])[0, i - 1])
      logits[[settings.mask_id, settings.pad_id, settings.bos_id, settings.unk_id]] = -np.inf
      if settings.num_tokens:
        logits[settings.num_tokens :] = -np.inf
      if rank < settings.min_length:
        logits[settings.eos_id] = -np.inf
      tokens[row, i] = int(np.argmax(logits))
      hole_ended = tokens[row, i] == settings.eos_id
  return tokens


@pytest.mark.parametrize("min_length", [0, 5])
def test_kv_cache_greedy_equals_greedy_by_full_forward_passes(min_length):
  settings = SamplerSettings(temperature=0.0, min_length=min_length)
  canvas = make_canvas([prefix(p, 24 - len(p) - 3) for p in PROMPTS], length=24)
  out = jit_decode(CFG, settings)(PARAMS, canvas, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), _greedy_by_full_passes(canvas, settings))
  fixed = np.asarray(canvas.kinds) != GENERATE
  np.testing.assert_array_equal(np.asarray(out.tokens)[fixed], np.asarray(canvas.tokens)[fixed])


def test_templates_force_their_fixed_tokens():
  settings = SamplerSettings(temperature=0.0)
  canvas = make_canvas([[[2, 11], Hole(4), [30, 31], Hole(3)]], length=24)
  out = jit_decode(CFG, settings)(PARAMS, canvas, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens)[0, 6:8], [30, 31])
  np.testing.assert_array_equal(np.asarray(out.tokens), _greedy_by_full_passes(canvas, settings))


def test_sampling_is_batch_invariant_and_one_compile():
  settings = SamplerSettings(temperature=1.0, top_k=20, top_p=0.9)
  decode = jit_decode(CFG, settings)
  batch = make_canvas([prefix(p, 10) for p in PROMPTS], length=24)
  together = np.asarray(decode(PARAMS, batch, jax.random.key(7)).tokens)
  for row, prompt in enumerate(PROMPTS):
    alone = make_canvas([prefix(prompt, 10)], length=24, streams=[row])
    np.testing.assert_array_equal(np.asarray(decode(PARAMS, alone, jax.random.key(7)).tokens)[0], together[row])
  assert decode._cache_size() == 2  # One compilation per batch shape.


def test_nfe_counts_prefill_and_decoding_passes():
  canvas = make_canvas([prefix([2, 9, 9], 6)], length=24)
  out = jit_decode(CFG, SamplerSettings(temperature=0.0, min_length=6))(PARAMS, canvas, jax.random.key(0))
  assert int(out.forwards) == 6  # One pass per token, the pass that feeds the token before it.
  # A causal network cannot refine blocks bidirectionally; a bidirectional one may run an autoregressive plan only as
  # a verified checkpoint's next-token head, which the sampler's decoder choice checks (test_verified_entry_points).
  with pytest.raises(ValueError, match="causal"):
    BlockEngine(CFG, SamplerSettings(), plan_blocks(canvas.kinds, 4))


BIGRAM_CFG = ModelConfig(
  vocab_size=64,
  d_model=64,
  num_layers=1,
  num_heads=2,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=32,
  max_length=24,
  causal=True,
)


def _bigram_params(table: np.ndarray):
  """Parameters that make the causal model a bigram table: the logits after token ``v`` are ``table[v]``.

  Attention and MLP outputs are zero, so the residual stream is the embedding: one-hot rows (d_model = vocab),
  which the final RMSNorm scales by sqrt(d_model) before the head.
  """
  params = nn.meta.unbox(Transformer(BIGRAM_CFG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(np.asarray, params)
  params["blocks"]["attention"]["out"] = np.zeros_like(params["blocks"]["attention"]["out"])
  params["blocks"]["mlp"]["down"] = np.zeros_like(params["blocks"]["mlp"]["down"])
  params["embedding"] = np.eye(BIGRAM_CFG.vocab_size, BIGRAM_CFG.d_model, dtype=np.float32)
  params["head"] = np.asarray(table, np.float32) / np.sqrt(BIGRAM_CFG.d_model)
  return jax.tree.map(jnp.asarray, params)


def _chain(pairs: dict[int, int]) -> np.ndarray:
  """A bigram table whose greedy choice after token ``a`` is ``pairs[a]`` (token 20 after any other token)."""
  table = np.zeros((64, 64), np.float32)
  table[:, 20] = 5.0
  for a, b in pairs.items():
    table[a, b] = 10.0
  return table


def test_eos_ends_its_own_hole_and_later_holes_are_still_decoded():
  settings = SamplerSettings(temperature=0.0)  # EOS 3, padding 0.
  params = _bigram_params(_chain({11: 12, 12: 3, 31: 14, 14: 15, 15: 16}))
  canvas = make_canvas([[[2, 11], Hole(4), [30, 31], Hole(3)], prefix([2, 11], 4)], length=12)
  out = jit_decode(BIGRAM_CFG, settings)(params, canvas, jax.random.key(0))
  tokens = np.asarray(out.tokens)
  # The EOS ends the first hole (its last two positions are padding); the fixed text and the second hole stay.
  assert tokens[0].tolist() == [2, 11, 12, 3, 0, 0, 30, 31, 14, 15, 16, 0]
  assert tokens[1].tolist() == [2, 11, 12, 3, 0, 0] + [0] * 6  # One hole: the row ends at its EOS, as before.
  # Passes feed 1, 2, 3 (the EOS, context of the second hole), 6, 7, 8 and 9: the cut hole costs no pass.
  assert int(out.forwards) == 7


def test_positions_after_an_eos_are_not_attended_to():
  """Scaled up, the random model's second hole depends on whether the padding after the EOS is visible."""
  params = jax.tree.map(lambda p: p * 10.0, PARAMS)
  canvas = make_canvas([[[2, 11], Hole(6), [30, 31], Hole(5)], prefix(PROMPTS[0], 9)], length=24)
  no_eos = SamplerSettings(temperature=0.0, min_length=24)
  first = np.asarray(jit_decode(CFG, no_eos)(params, canvas, jax.random.key(0)).tokens)
  settings = SamplerSettings(temperature=0.0, eos_id=int(first[0, 3]))  # The model's second token ends the hole.
  out = np.asarray(jit_decode(CFG, settings)(params, canvas, jax.random.key(0)).tokens)
  hole = out[0, 2:8].tolist()
  end = hole.index(settings.eos_id)
  assert end <= 1 and hole[end + 1 :] == [settings.pad_id] * (5 - end)
  assert out[0, 8:10].tolist() == [30, 31] and out[0, 10] != settings.pad_id  # The second hole is decoded.
  np.testing.assert_array_equal(out, _greedy_by_full_passes(canvas, settings, params))


@pytest.mark.parametrize("knobs", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=8)])
def test_special_ids_are_never_decoded(knobs):
  table = np.full((64, 64), -30.0, np.float32)
  table[:, [0, 1, 2, 4, 60, 61, 62, 63]] = 30.0  # Padding, UNK, BOS, mask and ids past the tokenizer's 60.
  table[:, 10:13] = 0.0
  settings = SamplerSettings(num_tokens=60, **knobs)
  canvas = make_canvas([prefix([2, 7], 8), [[2], Hole(3), [9], Hole(4)]], length=12)
  out = np.asarray(jit_decode(BIGRAM_CFG, settings)(_bigram_params(table), canvas, jax.random.key(3)).tokens)
  generated = out[np.asarray(canvas.kinds) == GENERATE]
  assert set(generated.tolist()) <= {10, 11, 12}, generated
  if knobs["temperature"]:
    assert len(set(generated.tolist())) > 1  # Sampled from what is left, not collapsed onto one token.
