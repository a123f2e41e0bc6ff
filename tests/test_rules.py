"""Revision: ReMDM's re-masking posterior in the ancestral rule against an enumerated chain; finished blocks."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.config import ObjectiveConfig
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import FunctionNetwork
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.settings import SamplerSettings, block_loads, commits_every_step, steps_per_block

VOCAB, MASK = 16, 4
LOGITS = np.linspace(-1.0, 1.0, VOCAB, dtype=np.float32)  # Any distribution: the transitions ignore the tokens.


def constant_denoise(z, t):
  return jnp.broadcast_to(jnp.asarray(LOGITS), (*z.shape, VOCAB))


NETWORK = FunctionNetwork(constant_denoise, VOCAB)


def _settings(**kw) -> SamplerSettings:
  return SamplerSettings(eos_id=3, pad_id=0, eos_to_pad=False, objective=ObjectiveConfig(schedule="linear"), **kw)


@functools.cache
def _jitted(settings, length):
  block = settings.block_length or length
  plan = BlockPlan(block, block + -(-length // block) * block, "none", whole_sequence=True)
  engine = BlockEngine(NETWORK, settings, plan)
  fn = jax.jit(lambda p, c, k, budgets: engine.sample(p, c, k, budgets[:, 0], extra_steps=budgets[:, 1]))
  return fn, (settings.block_length if settings.block_length else 0)


def _run(canvas, steps, settings):
  """The engine over whole canvases (blocks of ``block_length``) for a total budget of ``steps``; every frame of the
  trace after a row's last step shows its final canvas (a finished block stays as it is)."""
  fn, block = _jitted(settings, canvas.tokens.shape[1])
  capped = commits_every_step(settings)
  per_row = jnp.asarray(
    [steps_per_block(steps, block_loads(row, block), capped=capped) for row in canvas.kinds], jnp.int32
  ).reshape(-1, 2)
  out = jax.tree.map(np.asarray, fn(None, canvas, jax.random.key(0), per_row))
  canvases = out.canvases.copy()
  for row in range(canvases.shape[1]):
    canvases[out.commits[:, row] < 0, row] = out.tokens[row]
  return out._replace(canvases=canvases)


def _alpha(t: float) -> float:
  return 1.0 - t  # The linear schedule.


def _remdm(t: float, s: float, eta: float) -> tuple[float, float]:
  """``(p_unmask, sigma)`` of one step from t to s, from the paper: Eq. 6, the Eq. 7 bound, ReMDM-rescale (4.1)."""
  alpha_t, alpha_s = _alpha(t), _alpha(s)
  sigma = eta * (min(1.0, (1.0 - alpha_s) / alpha_t) if alpha_t > 0 else 1.0)
  return (alpha_s - (1.0 - sigma) * alpha_t) / (1.0 - alpha_t), sigma


def _enumerate_chain(length: int, steps: int, eta: float) -> tuple[list[tuple[bool, ...]], list[np.ndarray]]:
  """Exact distribution of a one-block canvas's mask pattern after each step, by enumerating every pattern.

  Each position moves independently: masked -> committed with p_unmask, committed -> masked with sigma. A pattern
  with nothing masked is a finished block and stays; the last step commits everything.
  """
  patterns = list(itertools.product([True, False], repeat=length))  # True: masked.
  dist = np.array([float(all(p)) for p in patterns])
  after_each_step = []
  for j in range(steps):
    last = j == steps - 1
    p_unmask, sigma = (1.0, 0.0) if last else _remdm(1.0 - j / steps, 1.0 - (j + 1) / steps, eta)
    moved = np.zeros_like(dist)
    for a, before in enumerate(patterns):
      if not any(before):
        moved[a] += dist[a]
        continue
      for b, after in enumerate(patterns):
        move = [
          (1.0 - p_unmask if now else p_unmask) if was else (sigma if now else 1.0 - sigma)
          for was, now in zip(before, after, strict=True)
        ]
        moved[b] += dist[a] * np.prod(move)
    dist = moved
    after_each_step.append(dist)
  return patterns, after_each_step


def test_ancestral_revision_follows_the_remdm_posterior_step_by_step():
  rows, length, steps, eta = 8192, 3, 4, 0.5
  canvas = cv.make_canvas([[cv.Hole(length)]] * rows)
  out = _run(canvas, steps, _settings(rule="ancestral", revision=eta, trace=steps))
  assert int(out.forwards) == steps
  masked = out.canvases == MASK  # [steps, rows, length]
  assert not np.isin(out.canvases, [0, 1, 2]).any()  # Committed tokens are proposals, never special ids.

  def within(empirical, expected, n):
    return abs(empirical - expected) <= 5 * np.sqrt(expected * (1 - expected) / n) + 1e-3

  # Per-step transitions of unfinished rows: committed -> masked with sigma_t, masked -> committed with ReMDM's
  # p_unmask (above MDLM's (alpha_s - alpha_t) / (1 - alpha_t) whenever sigma_t > 0).
  before = np.ones((rows, length), bool)
  for j in range(steps):
    p_unmask, sigma = (1.0, 0.0) if j == steps - 1 else _remdm(1.0 - j / steps, 1.0 - (j + 1) / steps, eta)
    running = before.any(axis=-1, keepdims=True)
    was_masked, was_committed = before & running, ~before & running
    unmasked = (~masked[j])[was_masked]
    assert within(unmasked.mean(), p_unmask, unmasked.size), (j, unmasked.mean(), p_unmask)
    if was_committed.any():
      remasked = masked[j][was_committed]
      assert within(remasked.mean(), sigma, remasked.size), (j, remasked.mean(), sigma)
    before = masked[j]
  assert _remdm(0.75, 0.5, eta) == (0.5, 0.5)  # A step with re-masking really is in the test: sigma 1/2 at t = 3/4.

  # The joint mask pattern after every step, against the enumerated chain.
  patterns, expected = _enumerate_chain(length, steps, eta)
  for j in range(steps):
    counts = {p: 0 for p in patterns}
    for row in map(tuple, masked[j].tolist()):
      counts[row] += 1
    for p, want in zip(patterns, expected[j], strict=True):
      assert within(counts[p] / rows, want, rows), (j, p, counts[p] / rows, want)


def test_revision_spreads_commits_instead_of_piling_them_on_the_last_step():
  rows, length, steps = 2048, 16, 8
  canvas = cv.make_canvas([[cv.Hole(length)]] * rows)
  out = _run(canvas, steps, _settings(rule="ancestral", revision=0.5, trace=steps))
  commits = out.commits.mean(axis=1)  # [steps]: tokens committed per step, averaged over rows
  assert out.remasks.sum() > rows  # Revision is at work.
  # ReMDM keeps the masked fraction at 1 - alpha_s after each step, so the last step (t = 1/8) unmasks 1/8 of the
  # canvas in expectation (less when a row finished early), the share of a step without revision.
  last = length * (1.0 - _alpha(1.0 / steps))
  assert commits[-1] <= last + 5 * np.sqrt(last / rows)
  assert commits[-1] <= commits[:-1].mean()


@pytest.mark.parametrize(
  "knobs",
  [
    dict(rule="ancestral", revision=0.6),
    dict(rule="confidence", revision=0.8),
    dict(rule="threshold", threshold=0.2, revision=0.8),
  ],
  ids=lambda k: k["rule"],
)
def test_revision_never_remasks_a_finished_block(knobs):
  rows, block, blocks, steps = 64, 6, 3, 18
  canvas = cv.make_canvas([[cv.Hole(block * blocks)]] * rows)
  out = _run(canvas, steps, _settings(block_length=block, temperature=1.0, trace=steps, **knobs))
  assert out.remasks.sum() > 0  # Revision is at work.
  used = int(out.forwards)
  for b in range(blocks):
    span = slice(b * block, (b + 1) * block)
    for row in range(rows):
      frames = out.canvases[:used, row, span]  # [steps, block]
      done = np.flatnonzero((frames != MASK).all(axis=-1))
      assert done.size, (b, row)
      # Once every position of the block is committed, it never changes again.
      np.testing.assert_array_equal(frames[done[0] :], np.broadcast_to(out.tokens[row, span], frames[done[0] :].shape))
