"""The continuous latent objective (CDCD / LangFlow) against independent computations: its noise schedules, score
interpolation against the analytic Gaussian-mixture score, the likelihood bound against the known entropy of a toy
source under its exact denoiser, the low-noise limit, the block-causal 2n pass, a short training run, and the ODE
solvers against a source whose distribution is known."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import kinds as K
from mercury_jax.bench.cli import main as bench_main
from mercury_jax.checkpoint import restore_params
from mercury_jax.config import ConfigError, ModelConfig, ObjectiveConfig, load_config
from mercury_jax.evaluate import evaluate_params
from mercury_jax.model import WARP_BINS, Transformer, init_params, normalised_latents
from mercury_jax.objectives import continuous as C
from mercury_jax.sample import main as sample_main
from mercury_jax.sampling import latents as L
from mercury_jax.train import train

CFG = ObjectiveConfig(name="continuous", sigma_min=0.1, sigma_max=100.0, self_conditioning=0.0)


def _schedule_params(seed: int) -> dict[str, jax.Array]:
  """Far-from-uniform schedules: random warp masses and an off-centre, narrow Gumbel."""
  warp = jnp.concatenate([jnp.array([0.03, 0.05]), 0.2 * jax.random.normal(jax.random.key(seed), (WARP_BINS,))])
  return {"warp": warp, "gumbel": jnp.array([0.0, 0.0, -0.02, -0.05])}  # Stored / continuous.SCHEDULE_SCALE.


@pytest.mark.parametrize("schedule", ["fixed", "warped", "gumbel"])
def test_schedule_cdf_inverse_and_density_agree(schedule):
  cfg, params = dataclasses.replace(CFG, sigma_schedule=schedule), _schedule_params(0)
  t = jnp.linspace(0.0, 1.0, 1001)
  np.testing.assert_allclose(C.cdf(C.inverse_cdf(t, params, cfg), params, cfg), t, atol=2e-5)
  u = (jnp.arange(WARP_BINS * 8) + 0.5) / (WARP_BINS * 8)  # Never on a warp bin's edge.
  np.testing.assert_allclose(C.inverse_cdf(C.cdf(u, params, cfg), params, cfg), u, atol=1e-4)
  h = 1e-3
  finite_difference = (C.cdf(u + h / 2, params, cfg) - C.cdf(u - h / 2, params, cfg)) / h
  np.testing.assert_allclose(C.density(u, params, cfg), finite_difference, rtol=2e-3, atol=2e-3)
  assert float(C.cdf(jnp.array(0.0), params, cfg)) == pytest.approx(0.0, abs=1e-6)
  assert float(C.cdf(jnp.array(1.0), params, cfg)) == pytest.approx(1.0, abs=1e-6)
  # Draws follow the density: a histogram of F^{-1}(U) against F's own bin masses.
  draws = C.inverse_cdf(jax.random.uniform(jax.random.key(1), (200_000,)), params, cfg)
  counts, edges = np.histogram(np.asarray(draws), bins=10, range=(0.0, 1.0))
  expected = np.diff(np.asarray(C.cdf(jnp.asarray(edges), params, cfg))) * draws.size
  assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 5)
  # The noise levels themselves: sigma_min at u = 0, sigma_max at u = 1, and u_of inverts sigma_of.
  np.testing.assert_allclose(C.sigma_of(jnp.array([0.0, 1.0]), cfg), [0.1, 100.0], rtol=1e-6)
  np.testing.assert_allclose(C.u_of(C.sigma_of(u, cfg), cfg), u, atol=1e-6)


def _toy(vocab: int = 6, dim: int = 4, seed: int = 0) -> jax.Array:
  return normalised_latents(jax.random.normal(jax.random.key(seed), (vocab, dim)))


def test_score_interpolation_equals_the_gaussian_mixture_score():
  """With the exact posterior as the predicted distribution, (E_p[e] - z) / sigma^2 is the score of
  sum_v pi_v N(z; e_v, sigma^2 I), here taken by autodiff of its log density."""
  table = _toy()
  prior = jnp.array([0.05, 0.1, 0.3, 0.25, 0.2, 0.1])
  for seed, sigma in [(1, 0.4), (2, 1.3), (3, 7.0)]:
    z = table[2] + sigma * jax.random.normal(jax.random.key(seed), (table.shape[1],))

    def log_density(z, sigma=sigma):
      return jax.nn.logsumexp(jnp.log(prior) - jnp.sum((z - table) ** 2, axis=-1) / (2 * sigma**2))

    posterior_logits = jnp.log(prior) - jnp.sum((z - table) ** 2, axis=-1) / (2 * sigma**2)
    np.testing.assert_allclose(
      C.score(z, jnp.array(sigma), posterior_logits, table), jax.grad(log_density)(z), atol=1e-5, rtol=1e-5
    )


def _exact_denoiser(table: jax.Array, support: jax.Array):
  """A ``LogitsFn`` that returns the true posterior of a source drawing every token uniformly from ``support``."""
  log_prior = jnp.where(jnp.isin(jnp.arange(table.shape[0]), support), -math.log(support.size), -1e9)

  def logits_fn(tokens, t, *, latent_params=False, latents=None, noise_level=None, self_cond=None, **_):
    if latent_params:
      return {"table": table, **_schedule_params(3)}
    sigma = jnp.maximum(noise_level, 1e-6)[..., None]
    distance = jnp.sum((latents[..., None, :] - table) ** 2, axis=-1)  # [batch, length, vocab]
    return log_prior - distance / (2 * sigma**2)

  return logits_fn


@pytest.mark.parametrize("schedule", ["fixed", "warped", "gumbel"])
def test_the_bound_of_the_exact_denoiser_is_the_source_entropy_under_any_proposal(schedule):
  """Under the optimal denoiser the continuous-time bound is tight: it must come out at the source's entropy, ln 3
  nats per token, whatever schedule the importance proposal mixes in. A wrong weight (sigma^2 for sigma^3, a missing
  log(sigma_max / sigma_min), the proposal density left out) moves it far off."""
  cfg = dataclasses.replace(CFG, sigma_min=0.01, sigma_max=50.0, sigma_schedule=schedule)
  table, support = _toy(vocab=8, dim=4), jnp.array([2, 3, 6])
  fn = _exact_denoiser(table, support)
  batch, length, draws = 256, 4, 96

  @jax.jit
  def one(key):
    tokens_key, loss_key = jax.random.split(key)
    x = jax.random.choice(tokens_key, support, (batch, length))
    kinds = jnp.full((batch, length), K.TARGET, jnp.int8)
    terms = C.loss(fn, x, kinds, loss_key, cfg)
    return terms["loss_sum"] / terms["tokens"]

  estimates = np.asarray(jax.vmap(one)(jax.random.split(jax.random.key(7), draws)))
  mean, stderr = estimates.mean(), estimates.std(ddof=1) / math.sqrt(draws)
  assert stderr < 0.04, stderr
  assert abs(mean - math.log(3)) < 4 * stderr + 0.01, (mean, stderr)


def _tiny_model(latent_dim: int = 16, max_length: int = 16) -> tuple[Transformer, dict]:
  cfg = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64,
    max_length=max_length, latent_dim=latent_dim,
  )  # fmt: skip
  model = Transformer(cfg)
  return model, nn.meta.unbox(init_params(model, jax.random.key(0)))


def test_at_the_lowest_noise_the_loss_tends_to_the_clean_input_cross_entropy():
  model, params = _tiny_model()
  x = jax.random.randint(jax.random.key(1), (4, 16), 5, 64)
  kinds = jnp.full(x.shape, K.TARGET, jnp.int8)
  table = normalised_latents(params["latent_embedding"])

  def fn(tokens, t, **kw):
    return model.apply({"params": params}, tokens, **kw)

  @jax.jit
  def gap(sigma_min):
    """The training loss at u = 0 (sigma = sigma_min), minus the same network's cross-entropy on clean latents."""
    cfg = dataclasses.replace(CFG, sigma_min=1.0, sigma_max=2.0, sigma_schedule="fixed")
    terms = C.loss(fn, x, kinds, jax.random.key(2), cfg, training=True, u=jnp.log(sigma_min) / jnp.log(2.0))
    noisy = terms["loss_sum"] / terms["tokens"]
    logits = fn(x, None, latents=table[x], noise_level=jnp.full(x.shape, sigma_min))
    clean = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, x[..., None], -1)[..., 0])
    return jnp.abs(noisy - clean), clean

  gaps = [float(gap(jnp.full((4, 1), s))[0]) for s in (1e-1, 1e-2, 1e-3, 1e-4)]
  assert gaps[-1] < 1e-4 * max(1.0, float(gap(jnp.full((4, 1), 1e-4))[1])), gaps
  assert gaps[0] > 10 * gaps[-1], gaps


def test_block_causal_pass_equals_each_block_after_its_clean_prefix():
  """The 2n pass's logits for block b are those of one pass over the clean blocks before b followed by block b's
  latents, under the block-causal mask (what the engine's exact cache will compute)."""
  block, length = 4, 16
  model, params = _tiny_model(max_length=length)
  cfg = dataclasses.replace(CFG, block_size=block, sigma_schedule="fixed")
  x = jax.random.randint(jax.random.key(3), (2, length), 5, 64)
  kinds = jnp.full(x.shape, K.TARGET, jnp.int8).at[:, :2].set(K.FIXED)  # A clean prompt stays clean when noised.
  seen = {}

  def fn(tokens, t, **kw):
    out = model.apply({"params": params}, tokens, **kw)
    if "latents" in kw:
      seen.update(kw, logits=out)
    return out

  @jax.jit
  def two_n_pass():
    C.loss(fn, x, kinds, jax.random.key(4), cfg)
    return seen["latents"][:, :length], seen["noise_level"][:, :length], seen["logits"]

  z, level, logits = two_n_pass()
  assert np.all(np.asarray(level[:, :2]) == 0) and np.all(np.asarray(level[:, 2:]) > 0)

  @jax.jit
  def alone(z, level):
    """Every block b in one pass of its own: the clean blocks before it (noise level 0), then its latents."""
    return model.apply({"params": params}, x, latents=z, noise_level=level, mask="block_causal", diffusion_block=block)

  for b in range(length // block):
    start, end = b * block, (b + 1) * block
    # Blocks after b are left in the pass; the block-causal mask keeps them out of blocks <= b.
    prefix_level = level.at[:, :start].set(0.0)
    np.testing.assert_allclose(logits[:, start:end], alone(z, prefix_level)[:, start:end], atol=2e-5)


def test_continuous_configs_are_checked():
  with pytest.raises(ConfigError, match="model.latent_dim"):
    load_config("tiny", {"objective.name": "continuous"})
  with pytest.raises(ConfigError, match="sigma_min"):
    load_config("tiny_continuous", {"objective.sigma_min": "0"})
  with pytest.raises(ConfigError, match="self_conditioning"):
    load_config("tiny_continuous", {"objective.self_conditioning": "1.5"})
  with pytest.raises(ConfigError, match="objective.sigma_schedule"):
    load_config("tiny_continuous", {"objective.sigma_schedule": "cosine"})


def test_training_lowers_the_held_out_bound_fits_the_schedule_and_keeps_latents_normalised(tmp_path, data_dir, capsys):
  overrides = {
    "data.path": str(data_dir),
    "model.max_length": "64",
    "model.vocab_size": "400",
    "train.steps": "200",
    "train.eval_every": "200",
    "train.eval_batches": "1",
    "train.log_every": "50",
    "checkpoint.every": "200",  # The one checkpoint the test reads, the last (the preset saves every 50 steps).
    "checkpoint.async_save": "false",
  }
  cfg = load_config("tiny_continuous", overrides)
  model = Transformer(cfg.model)
  fresh = nn.meta.unbox(init_params(model, jax.random.key(cfg.train.seed)))
  before = evaluate_params(fresh, cfg, data_dir, t_samples=4, batch_size=8)
  # One device: measured interleaved, this training took 52 s on the conftest's 8 simulated devices and 30 s on one
  # (sharding is not under test). In process, it skips the 8 s start-up of a training command's own process.
  train(cfg, tmp_path / "run", log=False, devices=jax.devices()[:1])
  params, stored = restore_params(tmp_path / "run")
  after = evaluate_params(params, stored, data_dir, t_samples=4, batch_size=8)
  assert math.isfinite(after["nats_per_token"])
  assert after["nats_per_token"] < before["nats_per_token"] - 1.0, (before, after)
  latents = model.apply({"params": params}, jnp.zeros((1, 64), jnp.int32), latent_params=True)
  np.testing.assert_allclose(jnp.linalg.norm(latents["table"], axis=-1), math.sqrt(32), rtol=1e-5)
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  fits = [m["schedule_fit"] for m in logged if "schedule_fit" in m]
  assert len(fits) >= 3 and fits[-1] < 0.5 * fits[0], fits
  # The sampling command decodes the trained checkpoint with the ODE rule (Heun), and refuses a discrete rule.
  capsys.readouterr()
  flags = ["--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--length", "16", "--json"]
  assert sample_main([*flags, "--solver", "heun", "--steps", "16", "--temperature", "0"]) in (0, None)
  out = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert out["nfe"] == 2 * 16 - 1 and len(out["tokens"]) > 0, out  # one block (the canvas), Heun: 31 passes
  with pytest.raises(SystemExit) as exit_info:
    sample_main([*flags, "--sampler", "confidence"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "--sampler='confidence' does not apply to a continuous checkpoint" in err and err.count("\n") == 1, err
  # python -m mercury_jax.bench noise-profile: the denoiser reads a nearly clean block far better than pure noise.
  data = ["--checkpoint", str(tmp_path / "run"), "--data", str(data_dir), "--batches", "1", "--batch-size", "8"]
  bench_main(["noise-profile", *data, "--sigmas", "1,100"])
  lines = capsys.readouterr().out.splitlines()
  ce = [float(line.split("cross-entropy ")[1].split()[0]) for line in lines if line.startswith("sigma")]
  assert len(ce) == 2 and ce[0] < ce[1] - 1.0, lines
  assert "P(sigma > 100) =" in lines[-1], lines


def _two_word_run(solver: str, steps: int, samples: int = 8192) -> np.ndarray:
  """Token counts of ``samples`` ODE runs on a one-token, two-word source (prior 0.3 / 0.7) under its exact
  denoiser, each run projected to the word whose posterior is largest at sigma_min."""
  cfg = dataclasses.replace(CFG, sigma_min=0.05, sigma_max=50.0)
  table = normalised_latents(jnp.array([[1.0, 0.2, -0.3], [-0.4, 1.0, 0.5]]))
  log_prior = jnp.log(jnp.array([0.3, 0.7]))

  def posterior_logits(z, sigma):
    return log_prior - jnp.sum((z[..., None, :] - table) ** 2, axis=-1) / (2 * sigma**2)

  def denoise(z, sigma):
    return C.estimate(posterior_logits(z, sigma), table)

  ladder = L.sigma_ladder(cfg, steps)

  @jax.jit
  def run(key):
    z = L.initial_latents(key, (samples, table.shape[1]), cfg)
    z = jax.lax.fori_loop(0, steps, lambda i, z: L.step(denoise, z, ladder[i], ladder[i + 1], solver), z)
    return jnp.argmax(posterior_logits(z, ladder[-1]), axis=-1)

  return np.bincount(np.asarray(run(jax.random.key(11))), minlength=2)


def _chi2(counts: np.ndarray, probs=(0.3, 0.7)) -> float:
  expected = np.asarray(probs) * counts.sum()
  return float(np.sum((counts - expected) ** 2 / expected))


def test_ode_solvers_converge_to_the_source_distribution_as_steps_grow():
  """Chi-squared (1 degree of freedom; 10.83 is its 0.1 % critical value) of the words the probability-flow ODE
  ends on, over 8,192 runs: coarse ladders are biased, fine ones match the source, and Heun gets there in fewer
  steps than Euler."""
  euler = {steps: _chi2(_two_word_run("euler", steps)) for steps in (2, 8, 256)}
  heun = {steps: _chi2(_two_word_run("heun", steps)) for steps in (2, 8)}
  assert euler[2] > 100 and euler[2] > euler[8], euler
  assert euler[256] < 10.83, euler
  assert heun[8] < 10.83, heun
  assert heun[2] < euler[2], (heun, euler)
  with pytest.raises(ValueError, match="solver"):
    L.step(lambda z, s: z, jnp.zeros(3), 1.0, 0.5, "rk4")
  np.testing.assert_allclose(L.sigma_ladder(CFG, 4)[jnp.array([0, -1])], [100.0, 0.1], rtol=1e-5)
  assert np.all(np.diff(np.asarray(L.sigma_ladder(CFG, 16))) < 0)
