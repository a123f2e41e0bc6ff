"""The denoiser: attention masks, time conditioning, implementations that agree, and the key-value cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import kinds as K
from mercury_jax.config import load_config
from mercury_jax.model import KVCache, Transformer
from mercury_jax.objectives import autoregressive, masked_diffusion

CFG = load_config(
  "tiny",
  {
    "model.vocab_size": "64",
    "model.max_length": "40",
    "model.d_model": "32",
    "model.num_heads": "4",
    "model.num_kv_heads": "2",
    "model.head_dim": "16",
  },
).model
TOKENS = jnp.asarray(np.random.default_rng(0).integers(5, 64, (2, 40)), jnp.int32)


def _model(**changes):
  model = Transformer(dataclasses.replace(CFG, **changes))
  t = jnp.full((2,), 0.5) if model.config.time_conditioning else None
  return model, model.init(jax.random.key(0), TOKENS, t)["params"]


def _position_influence(model, params, position: int) -> np.ndarray:
  """Which output positions change when the token at ``position`` changes."""
  apply = jax.jit(lambda x: model.apply({"params": params}, x))
  a, b = apply(TOKENS), apply(TOKENS.at[:, position].set((TOKENS[:, position] + 1) % 64))
  return np.asarray(jnp.abs(a - b).max(axis=(0, 2)) > 1e-6)


def test_bidirectional_sees_the_future_and_causal_does_not():
  model, params = _model()
  assert _position_influence(model, params, 30)[:30].all()
  model, params = _model(causal=True)
  influence = _position_influence(model, params, 30)
  assert not influence[:30].any() and influence[30:].all()


def test_padding_keys_are_invisible():
  model, params = _model()
  segments = jnp.ones((2, 40), jnp.int32).at[:, 32:].set(0)
  a = model.apply({"params": params}, TOKENS, segment_ids=segments)
  b = model.apply({"params": params}, TOKENS.at[:, 32:].set(7), segment_ids=segments)
  np.testing.assert_allclose(a[:, :32], b[:, :32], atol=1e-6)


def test_time_conditioning_is_optional_and_effective():
  model, params = _model(time_conditioning=True)
  params = jax.tree.map(lambda p: p + 0.01, params)  # time_out starts at zero; move it off zero.
  a = model.apply({"params": params}, TOKENS, jnp.full((2,), 0.2))
  b = model.apply({"params": params}, TOKENS, jnp.full((2,), 0.9))
  assert float(jnp.abs(a - b).max()) > 1e-4
  with pytest.raises(ValueError, match="time_conditioning"):
    model.apply({"params": params}, TOKENS)
  plain, plain_params = _model()
  assert "time_in" not in plain_params


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_pallas_model_equals_xla_model_for_loss_and_gradients(causal):
  """attention=pallas (interpret mode on CPU) against attention=xla, with padding and grouped-query heads."""
  kinds = jnp.full((2, 40), K.TARGET).at[0, 33:].set(K.PAD).at[1, :5].set(K.FIXED)
  segments = K.segment_ids(kinds)
  cfg = load_config("tiny").objective

  def loss(params, impl):
    model = Transformer(dataclasses.replace(CFG, attention=impl, causal=causal))
    apply = lambda z, t: model.apply({"params": params}, z, segment_ids=segments)  # noqa: E731
    if causal:
      out = autoregressive.loss(lambda x: apply(x, None), TOKENS, kinds)
    else:
      out = masked_diffusion.loss(apply, TOKENS, kinds, jax.random.key(1), 4, cfg)
    return out["loss_sum"] / out["tokens"]

  _, params = _model(causal=causal)
  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  value_xla, grad_xla = value_and_grad(params, "xla")
  value_pallas, grad_pallas = value_and_grad(params, "pallas")
  np.testing.assert_allclose(value_pallas, value_xla, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grad_pallas), jax.tree.leaves(grad_xla), strict=True):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-3)


def test_kv_cache_decoding_matches_the_full_forward_pass():
  model, params = _model(causal=True)
  full = model.apply({"params": params}, TOKENS)
  positions = jnp.broadcast_to(jnp.arange(40), (2, 40))
  logits, kv = model.apply({"params": params}, TOKENS[:, :12], positions=positions[:, :12], return_kv=True)
  cache = KVCache.empty(model.config, 2, 40).write(kv, 0)
  chunks = [logits]
  step = jax.jit(  # One compilation for the 28 one-token steps (eager, they took most of this test's 30 s).
    lambda cache, tokens, positions, start: model.apply(
      {"params": params}, tokens, positions=positions, cache=cache, cache_start=start, return_kv=True
    )
  )
  for i in range(12, 40):
    logits, kv = step(cache, TOKENS[:, i : i + 1], positions[:, i : i + 1], jnp.int32(i))
    cache = cache.write(kv, i)
    chunks.append(logits)
  np.testing.assert_allclose(jnp.concatenate(chunks, axis=1), full, atol=2e-5)
  # The cache is read, never written: a chunk over it sees its own keys, not the stale ones at its slots.
  stale = KVCache(cache.keys * 0 + 7.0, cache.values * 0 - 3.0, cache.segments)
  fresh, _ = step(cache, TOKENS[:, 20:21], positions[:, 20:21], jnp.int32(20))
  mixed = KVCache(
    cache.keys.at[:, :, 20:].set(stale.keys[:, :, 20:]), cache.values.at[:, :, 20:].set(stale.values[:, :, 20:]),
    cache.segments,
  )  # fmt: skip
  np.testing.assert_allclose(step(mixed, TOKENS[:, 20:21], positions[:, 20:21], jnp.int32(20))[0], fresh, atol=1e-6)
