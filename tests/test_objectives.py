"""Training objectives against independent computations: schedules, antithetic t, brute-force ELBO, next-token NLL,
and block diffusion (its mask, its one-pass loss against the two-pass definition, per-block t, the clipped schedule).
"""

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import kinds as K, sharding as sh, trainer
from mercury_jax.config import Config, DataConfig, MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.kernels import masks
from mercury_jax.model import Transformer
from mercury_jax.objectives import autoregressive, block_diffusion, masked_diffusion as diffusion

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


# ------------------------------------------------------------------------------------------- block diffusion


@pytest.mark.parametrize("block", [1, 2, 3, 6])
def test_block_diffusion_mask_is_the_union_of_its_three_rules(block):
  """BD3-LM Sec. 3.2: the training mask over x_t ⊕ x_0, rule by rule for every (query, key) pair."""
  half = 6
  expected = np.zeros((2 * half, 2 * half), bool)
  for q, k in itertools.product(range(2 * half), repeat=2):
    q_noisy, k_noisy = q < half, k < half
    q_block, k_block = (q % half) // block, (k % half) // block
    m_bd = q_noisy and k_noisy and q_block == k_block  # a noisy block sees itself...
    m_obc = q_noisy and not k_noisy and k_block < q_block  # ...and the clean blocks before it;
    m_bc = not q_noisy and not k_noisy and k_block <= q_block  # a clean block sees clean blocks up to itself.
    expected[q, k] = m_bd or m_obc or m_bc
  np.testing.assert_array_equal(masks.dense(2 * half, "block_diffusion", block=block, half=half), expected)


# A tiny float32 denoiser for the one-pass vs two-pass test.
_BD_MODEL = ModelConfig(
  vocab_size=40, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=16,
  attention="xla",
)  # fmt: skip
_BD_MASK_ID = 4


@functools.cache
def _bd_model_and_params():
  model = Transformer(_BD_MODEL)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, _BD_MODEL.max_length), jnp.int32))["params"]
  # Larger layer weights make attention far from uniform, so a wrong mask moves the logits by ~0.5 (measured with
  # a bidirectional and a block-causal pass); the right one agrees with the two-pass logits to ~1e-6.
  params = jax.tree.map(lambda p: 10.0 * p if p.ndim == 4 else p, params)
  return model, params


def _two_pass_logits(model, params, x_t, x, segment_ids, positions, block):
  """BD3-LM's definition: a clean pass over x_0 fills a key-value cache (block-causal); then each noisy block x_t^b
  is run on its own over that cache (its own keys and values in place of the cached ones at its slots)."""
  common = dict(mask="block_causal", diffusion_block=block)
  _, clean = model.apply({"params": params}, x, positions=positions, segment_ids=segment_ids, return_kv=True, **common)
  out = []
  for start in range(0, x.shape[1], block):
    chunk = slice(start, start + block)
    logits = model.apply(
      {"params": params},
      x_t[:, chunk],
      positions=positions[:, chunk],
      segment_ids=segment_ids[:, chunk],
      cache=clean,
      cache_start=start,
      **common,
    )
    out.append(logits)
  return jnp.concatenate(out, axis=1)  # [batch, length, vocab]


def test_one_pass_over_xt_and_x0_equals_the_two_pass_definition():
  model, params = _bd_model_and_params()
  batch, length, block = 2, _BD_MODEL.max_length, 4
  cfg = ObjectiveConfig(block_size=block, mask_id=_BD_MASK_ID)
  x = jnp.asarray(np.random.default_rng(0).integers(5, _BD_MODEL.vocab_size, (batch, length)), jnp.int32)
  kinds = np.full((batch, length), K.TARGET, np.int32)
  kinds[0, :5] = K.FIXED  # An SFT prompt across a block boundary...
  kinds[1, -3:] = K.PAD  # ...and padding.
  segment_ids = np.ones((batch, length), np.int32)
  segment_ids[0, 9:] = 2  # Two packed documents, the second starting inside block 2.
  segment_ids[1, -3:] = 0
  kinds, segment_ids = jnp.asarray(kinds), jnp.asarray(segment_ids)

  @jax.jit
  def both_ways(key):
    """The loss with the one-pass logits_fn and with a two-pass one, and the noisy logits each was given."""
    seen = {}

    def one_pass(tokens, t, **overrides):
      del t
      assert overrides["mask"] == "block_diffusion" and overrides["diffusion_block"] == block
      assert overrides["logits_length"] == length  # Only the noisy half's logits are computed.
      logits = model.apply({"params": params}, tokens, **overrides)
      seen["one_pass"] = logits
      return logits

    def two_pass(tokens, t, *, segment_ids, positions, mask, diffusion_block, logits_length):
      del t, mask, diffusion_block, logits_length
      noisy = _two_pass_logits(
        model, params, tokens[:, :length], tokens[:, length:], segment_ids[:, :length], positions[:, :length], block
      )
      seen["two_pass"] = noisy
      return noisy

    ours = block_diffusion.loss(one_pass, x, kinds, key, _BD_MASK_ID, cfg, segment_ids=segment_ids)
    theirs = block_diffusion.loss(two_pass, x, kinds, key, _BD_MASK_ID, cfg, segment_ids=segment_ids)
    _, is_masked, _ = block_diffusion.noise(key, x, kinds, _BD_MASK_ID, cfg)
    return ours, theirs, seen["one_pass"], seen["two_pass"], is_masked

  ours, theirs, one_pass_logits, two_pass_logits, is_masked = both_ways(jax.random.key(1))
  live = np.asarray(segment_ids != 0)  # Padding queries see nothing; their logits are not scored.
  np.testing.assert_allclose(np.asarray(one_pass_logits)[live], np.asarray(two_pass_logits)[live], atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours["loss_sum"], theirs["loss_sum"], rtol=1e-5)
  assert float(ours["tokens"]) == float((kinds == K.TARGET).sum()) == 24.0
  assert float(ours["masked"]) == float(is_masked.sum()) > 0
  assert not bool(is_masked[kinds != K.TARGET].any())


@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: f"{c.schedule}{c.exponent}")
def test_t_of_mask_rate_inverts_the_schedule(cfg):
  rate = np.linspace(0.0, 1.0, 101)
  t = np.asarray(diffusion.t_of_mask_rate(jnp.asarray(rate, jnp.float32), cfg), np.float64)
  np.testing.assert_allclose(1.0 - _alpha(t, cfg), rate, atol=2e-6)  # The test's own float64 schedule.
  np.testing.assert_allclose(t[[0, -1]], [0.0, 1.0], atol=1e-6)
  assert np.all(np.diff(t) > 0)


def test_every_block_draws_its_own_stratified_t():
  cfg = ObjectiveConfig(t_min=0.0, block_size=4)
  batch, blocks, draws = 4, 8, 200
  keys = jax.random.split(jax.random.key(0), draws)
  t = np.asarray(jax.vmap(lambda k: diffusion.sample_t(k, (batch, blocks), cfg))(keys))  # [draws, batch, blocks]
  assert all(len(set(row)) == blocks for row in t.reshape(-1, blocks))  # The blocks of a sequence differ...
  strata = np.sort(np.floor(t.reshape(draws, -1) * batch * blocks), axis=-1)
  np.testing.assert_array_equal(strata, np.broadcast_to(np.arange(batch * blocks), strata.shape))  # ...one per stratum.
  np.testing.assert_allclose(t.mean(axis=(0, 1)), 0.5, atol=0.05)  # Each block's t is U[0, 1]...
  # ...and neighbouring blocks' t are as far apart as independent draws (E|u - v| = 1/3): the strata are dealt at
  # random. Dealt in order, the blocks of a row would hold neighbouring strata, 1/32 apart.
  gap = np.abs(np.diff(t, axis=-1)).mean()
  assert 0.28 < gap < 0.4, gap


def test_block_masking_rate_follows_each_blocks_t():
  cfg = ObjectiveConfig(block_size=1000, schedule="cosine")
  x = jnp.full((2, 8000), 7)
  kinds = jnp.full(x.shape, K.TARGET).at[:, :1100].set(K.FIXED).at[:, -100:].set(K.PAD)
  x_t, is_masked, t = block_diffusion.noise(jax.random.key(0), x, kinds, 4, cfg)
  assert t.shape == (2, 8) and all(len(set(row)) == 8 for row in np.asarray(t))  # One t per block.
  assert not bool(is_masked[kinds != K.TARGET].any())
  np.testing.assert_array_equal(np.asarray(x_t == 4), np.asarray(is_masked))
  rate = np.asarray(is_masked[:, 2000:-1000].reshape(2, 5, 1000).mean(axis=-1))  # Whole target blocks.
  np.testing.assert_allclose(rate, 1.0 - _alpha(np.asarray(t)[:, 2:-1], cfg), atol=0.06)  # ~4 standard errors.


@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: f"{c.schedule}{c.exponent}")
def test_clipped_schedule_applies_in_training_only(cfg):
  cfg = dataclasses.replace(cfg, mask_rate_min=0.3, mask_rate_max=0.8)
  key = jax.random.key(0)
  for shape in (64, (8, 8)):  # Whole-sequence and per-block t.
    trained = 1.0 - _alpha(np.asarray(diffusion.sample_t(key, shape, cfg, training=True)), cfg)
    assert trained.min() >= 0.3 - 1e-5 and trained.max() <= 0.8 + 1e-5, (trained.min(), trained.max())
    assert trained.min() < 0.35 and trained.max() > 0.75  # The whole clip is used.
    evaluated = 1.0 - _alpha(np.asarray(diffusion.sample_t(key, shape, cfg, training=False)), cfg)
    assert evaluated.min() < 0.2 and evaluated.max() > 0.9
  if cfg.schedule == "linear":  # BD3-LM's clip: the mask rate is U[β, ω].
    np.testing.assert_allclose(np.sort(trained.reshape(-1)), 0.3 + 0.5 * (np.arange(64) + 0.5) / 64, atol=0.5 / 64)
  too_low = dataclasses.replace(cfg, mask_rate_min=0.0, mask_rate_max=0.01, t_min=0.2)
  with pytest.raises(ValueError, match="mask_rate_max=0.01 lies below the mask rate at objective.t_min=0.2"):
    diffusion.sample_t(key, 4, too_low, training=True)


@pytest.mark.parametrize("block_size", [0, 4])
def test_the_train_step_masks_within_the_clip_and_evaluation_over_all_rates(block_size):
  """Through the trainer's loss: ``training=True`` draws mask rates in [0.9, 1]; evaluation draws them all."""
  cfg = Config(
    model=_BD_MODEL,
    objective=ObjectiveConfig(block_size=block_size, mask_rate_min=0.9, mask_rate_max=1.0, mask_id=_BD_MASK_ID),
  ).validate()
  model, params = _bd_model_and_params()
  shape = (32, _BD_MODEL.max_length)
  batch = {"tokens": jnp.full(shape, 7, jnp.int32), "kinds": jnp.full(shape, K.TARGET, jnp.int32)}

  @functools.partial(jax.jit, static_argnames="training")
  def masked_fraction(key, training):
    terms = trainer.loss_terms(params, batch, key, model, cfg, training=training)
    return terms["masked"] / terms["tokens"]

  for training, low, high in ((True, 0.88, 1.0), (False, 0.3, 0.7)):
    rate = float(masked_fraction(jax.random.key(0), training))
    assert low < rate < high, (training, rate)


def test_only_the_train_step_draws_from_the_clipped_schedule(monkeypatch):
  flags = []
  real = trainer.loss_terms

  def spy(*args, training=False, **kwargs):
    flags.append(training)
    return real(*args, training=training, **kwargs)

  monkeypatch.setattr(trainer, "loss_terms", spy)
  cfg = Config(
    model=_BD_MODEL,
    objective=ObjectiveConfig(block_size=4, mask_rate_min=0.3, mask_rate_max=0.8, mask_id=_BD_MASK_ID),
    data=DataConfig(batch_size=2),
    mesh=MeshConfig(data=1),
  ).validate()
  steps = trainer.Trainer(cfg, sh.make_mesh(cfg.mesh, jax.devices()[:1]))
  steps.lower_train_step()
  batch = jax.ShapeDtypeStruct((2, _BD_MODEL.max_length), jnp.int32)
  steps.eval_step.lower(steps.abstract_state()["params"], {"tokens": batch, "kinds": batch}, jax.random.key(0))
  assert flags == [True, False]
