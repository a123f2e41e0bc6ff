"""Training objectives against independent computations: schedules, antithetic t, brute-force ELBO, next-token NLL."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import kinds as K
from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import autoregressive, masked_diffusion as diffusion

SCHEDULES = [
  ObjectiveConfig(schedule="linear"),
  ObjectiveConfig(schedule="cosine"),
  ObjectiveConfig(schedule="polynomial", exponent=2.0),
  ObjectiveConfig(schedule="polynomial", exponent=0.5),
]


def _alpha(t, cfg) -> np.ndarray:
  """The schedules as the papers write them (MDLM / MD4), in float64: the test's own, not the implementation's."""
  t = np.asarray(t, np.float64)
  if cfg.schedule == "linear":
    return 1.0 - t
  if cfg.schedule == "cosine":
    return 1.0 - np.cos(np.pi / 2 * (1.0 - t))
  return 1.0 - t**cfg.exponent


def _weight(t, cfg, h: float = 1e-6) -> np.ndarray:
  """-alpha'(t) / (1 - alpha(t)) with alpha' by a central finite difference of :func:`_alpha`."""
  derivative = (_alpha(t + h, cfg) - _alpha(t - h, cfg)) / (2 * h)
  return -derivative / (1.0 - _alpha(t, cfg))


def test_schedules_at_hand_computed_points():
  linear, cosine = ObjectiveConfig(schedule="linear"), ObjectiveConfig(schedule="cosine")
  square = ObjectiveConfig(schedule="polynomial", exponent=2.0)
  t = jnp.array([0.0, 0.25, 0.5, 1.0])
  np.testing.assert_allclose(diffusion.alpha(t, linear), [1.0, 0.75, 0.5, 0.0], atol=1e-7)
  np.testing.assert_allclose(
    diffusion.alpha(t, cosine), [1.0, 1 - math.cos(3 * math.pi / 8), 1 - 0.5**0.5, 0.0], atol=1e-7
  )
  np.testing.assert_allclose(diffusion.alpha(t, square), [1.0, 0.9375, 0.75, 0.0], atol=1e-7)
  # The ELBO weight at t = 0.5: linear 1 / t = 2; cosine (pi/2) tan(pi/4) = pi/2; t^2: 2t / t^2 = 4.
  half = jnp.array([0.5])
  np.testing.assert_allclose(diffusion.elbo_weight(half, linear), [2.0], rtol=1e-6)
  np.testing.assert_allclose(diffusion.elbo_weight(half, cosine), [math.pi / 2], rtol=1e-6)
  np.testing.assert_allclose(diffusion.elbo_weight(half, square), [4.0], rtol=1e-6)


@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: f"{c.schedule}{c.exponent}")
def test_schedule_and_weight_match_the_formulas_and_finite_differences(cfg):
  t = np.linspace(0.01, 0.99, 50)
  np.testing.assert_allclose(diffusion.alpha(jnp.asarray(t, jnp.float32), cfg), _alpha(t, cfg), atol=1e-6)
  h = 1e-6
  derivative = (_alpha(t + h, cfg) - _alpha(t - h, cfg)) / (2 * h)
  np.testing.assert_allclose(diffusion.dalpha(jnp.asarray(t, jnp.float32), cfg), derivative, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(diffusion.elbo_weight(jnp.asarray(t, jnp.float32), cfg), _weight(t, cfg), rtol=1e-4)


def test_antithetic_t_puts_one_sample_in_each_stratum():
  cfg = ObjectiveConfig(t_min=0.0)
  for seed in range(5):
    t = np.sort(np.asarray(diffusion.sample_t(jax.random.key(seed), 16, cfg)))
    np.testing.assert_array_equal(np.floor(t * 16), np.arange(16))
    np.testing.assert_allclose(np.diff(t), 1 / 16, atol=1e-6)
  plain = np.asarray(diffusion.sample_t(jax.random.key(0), 4096, dataclasses.replace(cfg, antithetic=False)))
  assert plain.min() >= 0.0 and plain.max() <= 1.0 and abs(plain.mean() - 0.5) < 0.02
  t = diffusion.sample_t(jax.random.key(1), 8, ObjectiveConfig(t_min=0.25))
  assert float(t.min()) >= 0.25


def test_masking_rate_and_kinds():
  cfg = ObjectiveConfig()
  x = jnp.full((4, 5000), 7)
  kinds = jnp.full((4, 5000), K.TARGET).at[:, :100].set(K.FIXED).at[:, -100:].set(K.PAD)
  t = jnp.array([0.1, 0.4, 0.7, 0.95])
  z, masked = diffusion.mask_tokens(jax.random.key(0), x, kinds, t, 4, cfg)
  assert not bool(masked[:, :100].any()) and not bool(masked[:, -100:].any())
  np.testing.assert_array_equal(np.asarray(z == 4), np.asarray(masked))
  rate = np.asarray(masked[:, 100:-100].mean(axis=1))
  np.testing.assert_allclose(rate, 1 - np.asarray(diffusion.alpha(t, cfg)), atol=0.02)


# A denoiser whose logits depend on the whole noised sequence, through fixed random tables.
VOCAB, MASK, LENGTH = 3, 3, 3
_TABLES = np.random.default_rng(0).normal(size=(2, VOCAB + 1, LENGTH, VOCAB + 1)).astype(np.float32)


def _known_denoiser(z, t):
  del t
  own = jnp.asarray(_TABLES[0])[z, jnp.arange(z.shape[1])]  # [batch, length, vocab]
  context = jnp.asarray(_TABLES[1])[z].sum(axis=1)  # [batch, length, vocab]: each position sees all others
  return own + context


def _brute_force_elbo(x: np.ndarray, cfg: ObjectiveConfig, grid: int = 20001) -> float:
  """(1 / (1 - t_min)) ∫ w(t) Σ_masks P(mask | t) Σ_{n in mask} -log p(x_n | z) dt, by enumeration and quadrature."""
  per_mask = {}
  for mask in itertools.product([False, True], repeat=LENGTH):
    z = np.where(mask, MASK, x)[None]
    logits = np.asarray(_known_denoiser(jnp.asarray(z), None), np.float64)[0, :, :VOCAB]  # Mask class (= VOCAB) cut.
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    per_mask[mask] = sum(-logp[n, x[n]] for n in range(LENGTH) if mask[n])
  t = np.linspace(cfg.t_min, 1.0 - 1e-9, grid)
  a, w = _alpha(t, cfg), _weight(t, cfg)
  integrand = np.zeros_like(t)
  for mask, nll in per_mask.items():
    k = sum(mask)
    integrand += (1 - a) ** k * a ** (LENGTH - k) * nll
  integrand *= w
  return float(np.sum((integrand[1:] + integrand[:-1]) / 2 * np.diff(t)) / (1.0 - cfg.t_min))


@pytest.mark.parametrize(
  "cfg",
  [ObjectiveConfig(schedule="linear", t_min=1e-3), ObjectiveConfig(schedule="cosine", t_min=1e-3)],
  ids=["linear", "cosine"],
)
def test_loss_matches_brute_force_elbo(cfg):
  x = np.array([0, 2, 1], np.int32)
  expected = _brute_force_elbo(x, cfg)

  def one(key):
    out = diffusion.loss(_known_denoiser, jnp.asarray(x)[None], jnp.full((1, LENGTH), 2), key, MASK, cfg)
    return out["loss_sum"]

  samples = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), 40000)))
  mean, stderr = samples.mean(), samples.std() / math.sqrt(len(samples))
  assert abs(mean - expected) < 4 * stderr + 1e-3, (mean, stderr, expected)


def test_prompt_and_padding_never_contribute():
  cfg = ObjectiveConfig()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.integers(0, VOCAB, (2, LENGTH)), jnp.int32)
  kinds = jnp.array([[1, 2, 0], [1, 2, 2]])
  base = diffusion.loss(_denoise_ignoring_pad, x, kinds, jax.random.key(3), MASK, cfg)
  changed = diffusion.loss(
    _denoise_ignoring_pad, x.at[0, 2].set((x[0, 2] + 1) % VOCAB), kinds, jax.random.key(3), MASK, cfg
  )
  assert float(base["tokens"]) == 3.0
  np.testing.assert_allclose(base["loss_sum"], changed["loss_sum"])


def _denoise_ignoring_pad(z, t):
  del t
  return jnp.asarray(_TABLES[0])[z, jnp.arange(z.shape[1])]


def test_autoregressive_loss_is_next_token_nll():
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, 4, 5)), jnp.float32)
  x = jnp.array([[1, 3, 0, 4]])
  kinds = jnp.array([[1, 1, 2, 2]])
  out = autoregressive.loss(lambda _: logits, x, kinds)
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  expected = -(logp[1, 0] + logp[2, 4])  # Predictions of the two targets (positions 2 and 3).
  np.testing.assert_allclose(out["loss_sum"], expected, rtol=1e-6)
  assert float(out["tokens"]) == 2.0
