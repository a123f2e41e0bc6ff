"""The continuous family's step rule (``rule="ode"``) in the one engine: the exact cache reproduces the uncached
2n pass, a row's tokens do not depend on its batch, its mesh or its serving bucket, Heun's passes are counted,
structured output is valid with random weights, streams and drafts follow the batch result, and the front ends
take the new knobs (tiny random models, f32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from random_models import random_checkpoint
from test_paged_serving import _requests, _together
from test_structured import LENGTH, _check, _suite, halves

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer, param_shardings
from mercury_jax.sample import main as sample_main
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.latents import block_ladder
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import MASK_TEXT, Sampler
from mercury_jax.sampling.settings import SamplerSettings, SettingError, block_loads
from mercury_jax.sampling.text import Row
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.scheduler import Scheduler

BLOCK = 4
EOS = 3
VOCAB = 64
OBJECTIVE = ObjectiveConfig(name="continuous", block_size=BLOCK, self_conditioning=0.5)
MODEL = ModelConfig(
  vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=64,
  attention="xla", unroll_layers=True, latent_dim=16,
)  # fmt: skip


def _params(seed: int = 0):
  params = nn.meta.unbox(Transformer(MODEL).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * 8.0, params)  # Sharp distributions: a random model with strong opinions.


def _canvas() -> cv.Canvas:
  """Rows whose first generated position lies in different blocks, and a template with fixed text inside blocks."""
  return cv.make_canvas(
    [cv.prefix([5, 6, 7], 13), cv.prefix([5, 6, 7, 8, 9, 10, 11], 9), [[9, 9], cv.Hole(5), [12, 13], cv.Hole(6)]]
  )


def _settings(**knobs) -> SamplerSettings:
  return SamplerSettings(rule="ode", objective=OBJECTIVE, eos_id=EOS, num_tokens=VOCAB, **knobs).validate()


def _engine(canvas, settings, cache):
  return BlockEngine(MODEL, settings, plan_blocks(canvas.kinds, BLOCK, cache=cache))


def _sample(canvas, settings, cache, steps, seed=1, params=None):
  engine = _engine(canvas, settings, cache)
  params = _params() if params is None else params
  return jax.jit(engine.sample)(params, canvas, jax.random.key(seed), jnp.int32(steps))


KNOBS = [
  dict(solver="euler", temperature=0.0),
  dict(solver="heun", temperature=1.0),
  dict(solver="euler", temperature=1.0, self_conditioning=False, eos_to_pad=False),
  dict(solver="heun", temperature=0.0, guidance=2.5),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_exact_cache_gives_the_tokens_of_the_uncached_2n_pass(knobs):
  """Each block's latents run over the clean keys and values of the blocks before it (the cache) or through the
  block-diffusion mask over x_t + x_0 (no cache): the same ODE, the same tokens; fixed text stays."""
  canvas, settings = _canvas(), _settings(**knobs)
  cached = _sample(canvas, settings, "exact", 3)
  uncached = _sample(canvas, settings, "none", 3)
  tokens, kinds = np.asarray(cached.tokens), np.asarray(canvas.kinds)
  np.testing.assert_array_equal(tokens, np.asarray(uncached.tokens))
  assert not (tokens == settings.mask_id).any()
  np.testing.assert_array_equal(tokens[kinds == cv.FIXED], np.asarray(canvas.tokens)[kinds == cv.FIXED])
  # A different seed draws other initial latents, hence other text: the latents, not the prompt alone, decide.
  other = _sample(canvas, settings, "exact", 3, seed=2)
  assert (np.asarray(other.tokens) != tokens)[kinds == cv.TARGET].any()


def test_every_step_runs_the_network_and_heun_adds_a_pass_per_move():
  """With the hole generated to its end, a row's passes are its blocks times the steps (Euler) and times
  ``2 steps - 1`` (Heun: a second pass for every step but the last, which commits)."""
  canvas = cv.make_canvas([cv.prefix([5, 6, 7], 13), cv.prefix([5, 6, 7, 8, 9, 10, 11], 9)])
  blocks = np.asarray([len(block_loads(row, BLOCK)) for row in np.asarray(canvas.kinds)])
  for solver, guidance, per_block in (("euler", 1.0, 4), ("heun", 1.0, 7), ("euler", 2.0, 8), ("heun", 2.0, 14)):
    out = _sample(canvas, _settings(solver=solver, eos_to_pad=False, guidance=guidance), "exact", 4)
    np.testing.assert_array_equal(np.asarray(out.nfe), blocks * per_block, err_msg=f"{solver} {guidance}")


@pytest.mark.parametrize("cache", ["exact", "none"])
def test_guidance_zero_ignores_the_context_and_guidance_changes_the_text(cache):
  """w = 0 decodes from the unconditional pass alone: two rows with different prompts and the same stream give the
  same tokens (the prompts fill whole blocks: a block's own fixed positions stay visible); w = 3 makes the prompt
  count more than w = 1 does, so the text differs from the unguided one."""
  canvas = cv.make_canvas([cv.prefix([5, 6, 7, 8], 12), cv.prefix([40, 41, 42, 43], 12)])
  canvas = canvas._replace(streams=np.zeros(2, np.int32))
  unguided = np.asarray(canvas.kinds) == cv.TARGET
  blind = np.asarray(_sample(canvas, _settings(guidance=0.0, temperature=0.0), cache, 3).tokens)
  np.testing.assert_array_equal(blind[0][unguided[0]], blind[1][unguided[1]])
  plain = np.asarray(_sample(canvas, _settings(temperature=0.0), cache, 3).tokens)
  guided = np.asarray(_sample(canvas, _settings(guidance=3.0, temperature=0.0), cache, 3).tokens)
  assert (plain[0][unguided[0]] != plain[1][unguided[1]]).any()
  assert (guided != plain)[unguided].any()


def test_the_ladder_runs_from_sigma_max_to_sigma_min():
  steps = jnp.full((5,), 5)
  ladder = np.asarray(block_ladder(jnp.arange(5), steps, OBJECTIVE))
  np.testing.assert_allclose(ladder[[0, -1]], [OBJECTIVE.sigma_max, OBJECTIVE.sigma_min], rtol=1e-5)
  assert np.all(np.diff(ladder) < 0)
  # One step a block: the network reads pure noise, so it predicts each token's marginal.
  assert float(block_ladder(jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), OBJECTIVE)[0]) == pytest.approx(100.0)


def test_a_row_gives_the_same_tokens_alone_in_a_batch_and_on_a_mesh():
  canvas, settings = _canvas(), _settings(solver="heun", temperature=1.0)
  params = _params()
  batch = _sample(canvas, settings, "exact", 3, seed=4, params=params)
  one = cv.Canvas(canvas.tokens[2:3], canvas.kinds[2:3], canvas.streams[2:3])
  alone = _sample(one, settings, "exact", 3, seed=4, params=params)
  length = np.asarray(alone.tokens).shape[1]
  np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[2, :length])
  four = cv.Canvas(*(np.concatenate([a, a[:1]]) for a in canvas))  # 4 rows: the data axis splits them
  four = four._replace(streams=np.arange(4))
  engine = _engine(four, settings, "exact")
  single = jax.jit(engine.sample)(params, four, jax.random.key(4), jnp.int32(3))
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(Transformer(MODEL), mesh, sh.RULES)
  fn = jit_on_mesh(engine.sample, mesh, sh.RULES, shardings, scalars=1)
  out = fn(jax.device_put(params, shardings), four, jax.random.key(4), jnp.int32(3))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))


@pytest.fixture(scope="module")
def samplers(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("latent")
  tokenizer = data_dir / "tokenizer.model"
  return {
    kind: Sampler.from_checkpoint(random_checkpoint(root, kind, tokenizer))
    for kind in ("continuous_block", "continuous")
  }


@pytest.mark.parametrize("kind", ["continuous_block", "continuous"])
def test_random_weights_give_valid_output_for_every_schema_and_regex(samplers, kind):
  """Validity by construction: what a block's last step commits is the automaton's most probable valid string. Every
  suite row runs once per model, greedy and sampled halves swapped between the two (``test_structured.halves``)."""
  sampler = samplers[kind]
  steps = 24 if kind == "continuous" else None  # a block-causal model: a step per position (4 a block)
  for temperature, rows, automata in halves(*_suite(sampler), swap=int(kind == "continuous")):
    samples = sampler.generate(
      ["x = "] * len(rows), length=LENGTH, constraint=automata, temperature=temperature, seed=3, steps=steps
    )
    _check(samples, automata, rows, LENGTH)


def test_streams_and_drafts_follow_the_batch_result(samplers):
  sampler = samplers["continuous_block"]
  prompts = ["def add(x, y):", "import os"]
  knobs = dict(length=20, seed=3, temperature=1.0, steps=15, solver="heun")
  generated = sampler.generate(prompts, **knobs)
  streamed, drafts = [""] * len(prompts), [[] for _ in prompts]
  for event in sampler.stream(prompts, drafts=True, **knobs):
    if event.draft is not None:
      drafts[event.index].append(event.draft)
    streamed[event.index] += event.text
  assert streamed == [s.text for s in generated]
  for row in drafts:  # a draft at every step: the current block's proposals (the argmax at T=0), then masks
    assert len(row) >= 10 and row[0][0] != MASK_TEXT and MASK_TEXT in row[0] and len(set(row)) > 3, row
  # Whole-sequence: one block over the canvas, refined by 8 solver steps; each frame shows the step's draft.
  whole = samplers["continuous"].generate(prompts, length=20, seed=3, steps=8, show_steps=True)
  for sample in whole:
    assert len(sample.steps) == 8 and sample.steps[-1].endswith(sample.text), sample.steps
    assert MASK_TEXT not in sample.steps[0] and len(set(sample.steps)) > 2, sample.steps


def test_the_knobs_are_checked_with_one_line(samplers):
  sampler = samplers["continuous_block"]
  with pytest.raises(SettingError, match="rule='threshold' does not apply to a continuous checkpoint"):
    sampler.generate("x", rule="threshold")
  with pytest.raises(SettingError, match="solver='rk4' is unknown"):
    sampler.generate("x", solver="rk4")
  with pytest.raises(SettingError, match="revision"):
    sampler.generate("x", revision=0.3)
  with pytest.raises(SettingError, match="cache='dual'"):
    samplers["continuous"].generate("x", cache="dual")
  with pytest.raises(SettingError, match="block_length=8 must be 0"):
    samplers["continuous"].generate("x", block_length=8)
  with pytest.raises(SettingError, match="rule='ode' needs a continuous checkpoint"):
    SamplerSettings(rule="ode").validate()
  with pytest.raises(SettingError, match="guidance=20.0 must lie in"):
    sampler.generate("x", guidance=20.0)
  with pytest.raises(SettingError, match="guidance=2.0 applies to a continuous checkpoint"):
    SamplerSettings(guidance=2.0).validate()


def test_serving_buckets_give_a_request_the_same_tokens_and_compile_nothing(samplers):
  scheduler = Scheduler(samplers["continuous_block"], ServeConfig(slots=4, max_queue=16))
  scheduler.start()
  try:
    compiled = scheduler.compilations
    target = Row.completion((9, 17, 33), 14, knobs=Knobs(1.0, 0, 1.0, 0.9), seed=7)
    others = _requests(3, seed=2)
    alone = _together(scheduler, [target])[0]
    among_4 = _together(scheduler, [target, *others])[0]
    assert alone == among_4 and alone[0]
    regex = scheduler.compiler.regex("[a-z]{3,9}")
    text = scheduler.tokenizer.decode(list(_together(scheduler, [dataclasses.replace(target, constraint=regex)])[0][0]))
    assert 3 <= len(text) <= 9 and text.isalpha() and text.islower(), text
    assert scheduler.compilations == compiled
  finally:
    scheduler.shutdown(0)
  with pytest.raises(ValueError, match="whole-sequence continuous checkpoint"):
    Scheduler(samplers["continuous"], ServeConfig(slots=2))


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--solver", "rk4"], "--solver='rk4' is unknown"),
    (["--sampler", "ode"], "--sampler"),  # a masked-diffusion checkpoint has no ODE
    (["--guidance", "-1"], "--guidance=-1.0 must lie in [0, 16]"),
  ],
)
def test_command_line_knobs(samplers, tmp_path, data_dir, flags, message, capsys):
  path = random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model")
  with pytest.raises(SystemExit) as exit_info:
    sample_main(["--checkpoint", str(path), "--prompt", "x", "--length", "8", *flags])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err
