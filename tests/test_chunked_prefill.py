"""Chunked prefill (``BlockPlan.prefill_chunk``): a long prompt's keys and values computed a chunk at a time against
the cache equal the one-pass prefill's, and decoding from them gives the same greedy tokens, for block diffusion,
the autoregressive twin and verified decoding (tiny random models, f32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax.config import ModelConfig
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.settings import SamplerSettings, SettingError

VOCAB = 64
EOS = 3

# (decoder, block, autoregressive, draft, causal_context, causal model)
DECODERS = {
  "block_diffusion": (4, False, 0, False, False),
  "twin": (1, True, 0, False, True),
  "verified": (1, True, 3, True, False),
}


def _model_cfg(causal: bool) -> ModelConfig:
  return ModelConfig(
    vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=96,
    attention="xla", causal=causal,
  )  # fmt: skip


def _params(cfg: ModelConfig, seed: int = 0):
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * 8.0, params)  # Sharper distributions than the 0.02 init.


def _canvas() -> cv.Canvas:
  """Prompts of 61, 37 and 9 tokens (many chunks, a chunk boundary inside a block, shorter than one chunk) and a
  template whose fixed text follows a hole."""
  rng = np.random.default_rng(0)
  prompt = lambda n: rng.integers(5, VOCAB, n).tolist()  # noqa: E731
  return cv.make_canvas(
    [cv.prefix(prompt(61), 12), cv.prefix(prompt(37), 9), cv.prefix(prompt(9), 14), [prompt(30), cv.Hole(6), [7, 8]]]
  )


def _engine(name: str, chunk: int, canvas: cv.Canvas):
  block, autoregressive, draft, causal_context, causal = DECODERS[name]
  cfg = _model_cfg(causal)
  settings = SamplerSettings(eos_id=EOS, num_tokens=VOCAB, temperature=0.0, rule="threshold").validate()
  plan = plan_blocks(
    canvas.kinds,
    block,
    cache="exact",
    autoregressive=autoregressive,
    draft=draft,
    causal_context=causal_context,
    prefill_chunk=chunk,
  )
  return cfg, BlockEngine(cfg, settings, plan)


@pytest.mark.parametrize("name", list(DECODERS))
def test_chunked_prefill_writes_the_one_pass_cache_and_decodes_the_same_tokens(name):
  canvas = _canvas()
  runs = {}
  for chunk in (0, 12, 16):  # 12: three blocks of 4, so chunks start inside blocks of the twin's slots; 16: a page
    cfg, engine = _engine(name, chunk, canvas)
    params = _params(cfg)
    init = jax.jit(lambda p, e=engine: e.init(p, canvas, jax.random.key(1), jnp.int32(2)))
    state = init(params)
    final = jax.jit(engine.advance)(params, state)
    runs[chunk] = (engine.plan, state.cache, final)
  plan, one_pass, one_final = runs[0]
  assert plan.prefill_chunk == 0 and runs[12][0].prefill_chunk == -(-12 // plan.block) * plan.block
  written = np.asarray(one_pass.segments) != 0
  assert written.sum() > 100  # the prompts' slots, most of the cache
  for chunk in (12, 16):
    _, cache, final = runs[chunk]
    np.testing.assert_array_equal(np.asarray(cache.segments), np.asarray(one_pass.segments))
    for got, want in ((cache.keys, one_pass.keys), (cache.values, one_pass.values)):  # [layers, b, slots, ...]
      np.testing.assert_allclose(np.asarray(got)[:, written], np.asarray(want)[:, written], atol=2e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(final.z), np.asarray(one_final.z))


def test_a_broken_chunk_order_is_caught():
  """The comparison above can fail: a chunk computed without the cache before it (its queries see only the chunk)
  gives other keys and values than the one-pass prefill."""
  canvas = _canvas()
  cfg, engine = _engine("twin", 0, canvas)
  params = _params(cfg)
  state = jax.jit(lambda p: engine.init(p, canvas, jax.random.key(1), jnp.int32(1)))(params)
  cut = engine.cache.fill(params, state._replace(cache=engine.cache.empty(4)), jnp.int32(32), 16, first=True)
  written = np.asarray(state.cache.segments)[:, 32:48] != 0
  got, want = np.asarray(cut.keys)[:, :, 32:48], np.asarray(state.cache.keys)[:, :, 32:48]
  assert not np.allclose(got[:, written], want[:, written], atol=1e-3)


def test_bad_prefill_chunks_are_refused():
  kinds = np.asarray(_canvas().kinds)
  with pytest.raises(ValueError, match="prefill_chunk=-4 must be >= 0"):
    plan_blocks(kinds, 4, prefill_chunk=-4)
  with pytest.raises(SettingError, match="prefill_chunk"):
    SamplerSettings(prefill_chunk=-1).validate()
  assert plan_blocks(kinds, 4, prefill_chunk=10).prefill_chunk == 12  # rounded up to whole blocks
