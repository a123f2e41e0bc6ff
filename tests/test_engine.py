"""The engine: the exact cache reproduces the uncached engine, the cache holds clean keys and values, the twin decodes
as the reference decoder does, and streaming gives the batch result (tiny random models, f32)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ar_reference import decode
from flax import linen as nn

from mercury_jax import sharding as sh
from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.kvcache import KVCache
from mercury_jax.model import Transformer, param_shardings
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine, prefill_slots
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings, SettingError, hole_loads, steps_per_block
from mercury_jax.sampling.state import select_rows

BLOCK = 4
EOS = 3
VOCAB = 64
PROMPTS = ["def add(x, y):", "import os", "class Point:\n  def"]


def _model_cfg(**overrides) -> ModelConfig:
  base = dict(
    vocab_size=VOCAB,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    max_length=64,
    attention="xla",
    unroll_layers=True,
  )
  return ModelConfig(**{**base, **overrides})


def _params(cfg: ModelConfig, seed: int = 0, scale: float = 8.0):
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * scale, params)  # Sharper distributions than the 0.02 init.


def _canvas() -> cv.Canvas:
  """Rows with different prompt lengths (first generated position in different blocks) and a two-hole template."""
  examples = [
    cv.prefix([5, 6, 7], 13),
    cv.prefix([5, 6, 7, 8, 9, 10, 11], 9),
    [[9, 9], cv.Hole(5), [12, 13], cv.Hole(6)],
    cv.prefix([20], 11),
  ]
  return cv.make_canvas(examples)


def _settings(**knobs) -> SamplerSettings:
  return SamplerSettings(eos_id=EOS, num_tokens=VOCAB, **knobs).validate()


def _sample(cfg, params, canvas, settings, cache, steps, *, block=BLOCK, seed=1):
  plan = plan_blocks(canvas.kinds, block, cache=cache, autoregressive=cfg.causal)
  engine = BlockEngine(cfg, settings, plan)
  return jax.jit(engine.sample)(params, canvas, jax.random.key(seed), jnp.int32(steps))


RULES = [
  dict(rule="confidence"),
  dict(rule="threshold", threshold=0.5),
  dict(rule="ancestral"),
  dict(rule="ancestral", revision=0.4),
  dict(rule="confidence", revision=0.3, temperature=0.0),
]


@pytest.mark.parametrize("knobs", RULES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_exact_cache_gives_the_tokens_of_the_uncached_engine(knobs):
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(**knobs)
  cached = _sample(cfg, params, canvas, settings, "exact", 3)
  uncached = _sample(cfg, params, canvas, settings, "none", 3)
  np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(uncached.tokens))
  tokens, kinds = np.asarray(cached.tokens), np.asarray(canvas.kinds)
  assert not (tokens == settings.mask_id).any()
  np.testing.assert_array_equal(tokens[kinds == cv.FIXED], np.asarray(canvas.tokens)[kinds == cv.FIXED])
  # Both ran the same refinement steps; the cache adds a commit pass in steps where a row needed only its finished
  # block written (a template's fixed text), at most one per block.
  plan = plan_blocks(canvas.kinds, BLOCK, cache="exact")
  assert int(uncached.forwards) <= int(cached.forwards) <= int(uncached.forwards) + plan.blocks


def test_the_cache_holds_the_clean_keys_and_values_of_every_committed_block():
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(rule="threshold", threshold=0.5)
  plan = plan_blocks(canvas.kinds, BLOCK, cache="exact")
  engine = BlockEngine(cfg, settings, plan)
  state = jax.jit(lambda p, c: engine.advance(p, engine.init(p, c, jax.random.key(3), jnp.int32(2))))(params, canvas)
  # A full clean pass over the final tokens, block-causal: the keys and values a cache of committed blocks holds.
  model = Transformer(cfg)
  _, clean = model.apply(
    {"params": params},
    state.z,
    segment_ids=state.segments,
    positions=state.positions,
    mask="block_causal",
    diffusion_block=BLOCK,
    return_kv=True,
  )
  # Every block before a row's last one is committed and was written by the next block's commit pass.
  written = np.asarray((jnp.arange(plan.slots)[None, :] < state.last[:, None] * BLOCK) & (state.segments != 0))
  assert int(written.sum()) > 20
  np.testing.assert_array_equal(np.asarray(state.cache.segments)[written], np.asarray(state.segments)[written])
  for got, want in ((state.cache.keys, clean.keys), (state.cache.values, clean.values)):  # [layers, b, slots, ...]
    np.testing.assert_allclose(np.asarray(got)[:, written], np.asarray(want)[:, written], atol=2e-5, rtol=2e-5)
  # A slot never committed (after an EOS, or still masked) is invisible: it waits in segment 0.
  assert (np.asarray(state.cache.segments)[~written & (np.asarray(state.segments) == 0)] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_twin_through_the_engine_decodes_like_the_reference_decoder(temperature):
  cfg, canvas = _model_cfg(causal=True), _canvas()
  params, settings = _params(cfg, seed=3), _settings(temperature=temperature, min_length=4)
  reference = jax.jit(lambda p, c, k: decode(p, c, k, model_cfg=cfg, settings=settings))(
    params, canvas, jax.random.key(2)
  )
  for cache in ("exact", "none"):
    out = _sample(cfg, params, canvas, settings, cache, 1, block=1, seed=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
  # One pass per generated token and row (the pass that feeds the token before it): the row with 9 to generate needs
  # 9; the prefill is not a pass of the loop.
  cached = _sample(cfg, params, canvas, settings, "exact", 1, block=1, seed=2)
  np.testing.assert_array_equal(np.asarray(cached.nfe)[[0, 1, 3]], [13, 9, 11])


def test_exact_cache_on_a_2x2x2_mesh_equals_one_device():
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(rule="ancestral", revision=0.3)
  plan = plan_blocks(canvas.kinds, BLOCK, cache="exact")
  engine = BlockEngine(cfg, settings, plan)
  single = jax.jit(engine.sample)(params, canvas, jax.random.key(4), jnp.int32(2))
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(Transformer(cfg), mesh, sh.RULES)
  sharded = jax.device_put(params, shardings)
  fn = jit_on_mesh(engine.sample, mesh, sh.RULES, shardings, scalars=1)
  out = fn(sharded, canvas, jax.random.key(4), jnp.int32(2))
  assert out.tokens.sharding.spec == sh.batch_spec(sh.RULES, 2)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_array_equal(np.asarray(out.nfe), np.asarray(single.nfe))


def test_a_row_gives_the_same_tokens_alone_or_in_a_batch():
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(rule="threshold", threshold=0.6)
  batch = _sample(cfg, params, canvas, settings, "exact", 2)
  one = cv.Canvas(canvas.tokens[2:3], canvas.kinds[2:3], canvas.streams[2:3])
  alone = _sample(cfg, params, one, settings, "exact", 2)
  length = np.asarray(alone.tokens).shape[1]
  np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[2, :length])


def _eos_model(cfg: ModelConfig):
  """A model whose favourite token is EOS and second favourite token 5, everywhere: one hidden feature, made large in
  every embedding, is the only input of the output head."""
  params = _params(cfg, seed=5, scale=1.0)
  scale = np.zeros(cfg.d_model, np.float32)
  scale[0] = 1.0
  head = np.zeros((cfg.d_model, cfg.vocab_size), np.float32)
  head[0, EOS], head[0, 5] = 30.0, 20.0
  embedding = np.asarray(params["embedding"]).copy()
  embedding[:, 0] = 50.0
  return {**params, "embedding": jnp.asarray(embedding), "final_norm": {"scale": jnp.asarray(scale)}, "head": head}


def test_generation_stops_at_eos_per_row_and_cache_and_no_cache_agree():
  cfg = _model_cfg(tie_embeddings=False)
  params = _eos_model(cfg)
  examples = [cv.prefix([7 + i] * (1 + i % 3), 24) for i in range(5)] + [[[7], cv.Hole(6), [8, 8], cv.Hole(5)]]
  canvas = cv.make_canvas(examples)
  kinds = np.asarray(canvas.kinds)
  outputs = {}
  for min_length in (6, 24):
    settings = _settings(rule="confidence", temperature=0.0, min_length=min_length)
    cached = _sample(cfg, params, canvas, settings, "exact", 4)
    uncached = _sample(cfg, params, canvas, settings, "none", 4)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(uncached.tokens))
    outputs[min_length] = cached
  tokens = np.asarray(outputs[6].tokens)
  for row in range(5):  # Six tokens, then EOS, then padding: nothing after the EOS was generated.
    generated = tokens[row][kinds[row] == cv.TARGET]
    np.testing.assert_array_equal(generated, [5] * 6 + [EOS] + [0] * 17)
  # The template: EOS ends the first hole only (min_length counts over both holes, so the second hole gets EOS at
  # once) and the fixed text between them stays.
  np.testing.assert_array_equal(tokens[5][: 1 + 6 + 2 + 5], [7, 5, 5, 5, 5, 5, 5, 8, 8, EOS, 0, 0, 0, 0])
  # Rows that stop at EOS need fewer forward passes than the same rows generating all 24 tokens.
  assert (np.asarray(outputs[6].nfe)[:5] < np.asarray(outputs[24].nfe)[:5]).all()
  assert int(outputs[6].forwards) < int(outputs[24].forwards)


# ------------------------------------------------------------------------------------------ the Sampler


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir) -> Path:
  root = tmp_path_factory.mktemp("bd")
  model_cfg = _model_cfg(vocab_size=512)
  cfg = Config(model=model_cfg, objective=ObjectiveConfig(block_size=BLOCK), name="bd-test")
  return export_params(
    root / "export", _params(model_cfg, seed=1, scale=10.0), cfg, data_dir / "tokenizer.model"
  ).parent


@pytest.fixture(scope="module")
def sampler(checkpoint) -> Sampler:
  return Sampler.from_checkpoint(checkpoint)


def test_sampler_cache_and_no_cache_agree_and_report_tokens_per_forward(sampler):
  knobs = dict(length=24, steps=12, seed=3, rule="threshold", threshold=0.7)
  cached = sampler.generate(PROMPTS, **knobs)
  uncached = sampler.generate(PROMPTS, cache="none", **knobs)
  assert [s.tokens for s in cached] == [s.tokens for s in uncached]
  for s in cached:
    assert s.tokens_per_forward == pytest.approx(len(s.tokens) / s.nfe)
    # The budget of 12 steps for 24 tokens (25 with the one token healing re-generates) gives each block of 4 two
    # steps; the 25 positions lie in at most 8 blocks, so at most 16 passes and at least 25 / 16 tokens per pass.
    assert len(s.tokens) == 24 + bool(s.healed) and 6 <= s.nfe <= 16


def test_sampling_knobs_are_traced_so_new_values_reuse_the_compiled_engine(sampler):
  base = dict(length=12, steps=6, seed=5, rule="threshold")
  first = sampler.generate(PROMPTS[:2], temperature=0.7, **base)
  assert first[0].compile_time > 0
  runs = [first]
  for knobs in (dict(temperature=1.0), dict(temperature=0.0), dict(top_p=0.5), dict(top_k=1), dict(threshold=0.5)):
    runs.append(sampler.generate(PROMPTS[:2], **base, **knobs))
    assert runs[-1][0].compile_time == 0.0, knobs  # the same program: the knobs are arguments, not constants
  tokens = [[s.tokens for s in run] for run in runs]
  # They take effect: T=1 differs from greedy, and top-k 1 at T=1 is greedy.
  assert tokens[1] != tokens[2] and tokens[4] == tokens[2]
  assert [s.tokens for s in sampler.generate(PROMPTS[:2], temperature=0.0, **base)] == tokens[2]


def test_streamed_blocks_concatenate_to_the_batch_result(sampler):
  knobs = dict(length=20, steps=10, seed=7, num_samples=2)
  batch = sampler.generate(PROMPTS[:2], **knobs)
  for drafts in (False, True):
    texts, finished, draft_seen = {}, set(), 0
    for event in sampler.stream(PROMPTS[:2], drafts=drafts, **knobs):
      assert event.index not in finished
      texts[event.index] = texts.get(event.index, "") + event.text
      finished |= {event.index} if event.done else set()
      draft_seen += event.draft is not None
    assert [texts[i] for i in range(len(batch))] == [s.text for s in batch]
    assert finished == set(range(len(batch)))
    assert (draft_seen > 0) == drafts


def test_sampler_rejects_caches_the_model_does_not_have(sampler):
  with pytest.raises(SettingError, match="cache='dual' is the approximate cache of whole-sequence checkpoints"):
    sampler.generate("x", length=4, cache="dual")
  with pytest.raises(SettingError, match="block_length=8 must be 4"):
    sampler.generate("x", length=4, block_length=8)
  with pytest.raises(SettingError, match="cache='fast' is unknown"):
    sampler.generate("x", length=4, cache="fast")


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_approximate_caches_of_a_whole_sequence_model(cache):
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(rule="confidence")
  plan = plan_blocks(canvas.kinds, BLOCK, cache=cache, whole_sequence=True)
  uncached_plan = plan_blocks(canvas.kinds, BLOCK, cache="none", whole_sequence=True)
  run = lambda plan, steps: jax.jit(BlockEngine(cfg, settings, plan).sample)(  # noqa: E731
    params, canvas, jax.random.key(0), jnp.int32(steps)
  )
  # One step per block: every block is decided by its refresh pass over the whole canvas, which is exact.
  np.testing.assert_array_equal(np.asarray(run(plan, 1).tokens), np.asarray(run(uncached_plan, 1).tokens))
  # More steps: the block's later steps read the refreshed keys and values of the other blocks (approximate), but
  # every position is filled, fixed tokens stay, and each step costs one pass.
  out, exact = run(plan, 3), run(uncached_plan, 3)
  tokens, kinds = np.asarray(out.tokens), np.asarray(canvas.kinds)
  assert not (tokens == settings.mask_id).any()
  np.testing.assert_array_equal(tokens[kinds == cv.FIXED], np.asarray(canvas.tokens)[kinds == cv.FIXED])
  np.testing.assert_array_equal(np.asarray(out.nfe), np.asarray(exact.nfe))  # One pass per step of each row.
  assert int(out.forwards) >= int(np.max(out.nfe))
  with pytest.raises(ValueError, match="approximate cache of whole-sequence checkpoints"):
    plan_blocks(canvas.kinds, BLOCK, cache=cache)
  with pytest.raises(ValueError, match="no exact cache"):
    plan_blocks(canvas.kinds, BLOCK, cache="exact", whole_sequence=True)


def test_command_line_streams_the_text_generate_gives(checkpoint, sampler, capsys):
  from mercury_jax.sample import main

  (expected,) = sampler.generate(PROMPTS[1], length=12, steps=6, seed=4)
  argv = ["--checkpoint", str(checkpoint), "--prompt", PROMPTS[1], "--length", "12", "--steps", "6", "--seed", "4"]
  assert main([*argv, "--stream"]) == 0
  assert capsys.readouterr().out == PROMPTS[1] + expected.text + "\n"
  assert main([*argv, "--cache", "none", "--json"]) == 0
  (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert record["tokens"] == expected.tokens and record["tokens_per_forward"] == pytest.approx(
    expected.tokens_per_forward, abs=1e-3
  )


@pytest.mark.parametrize(
  "extra,message",
  [
    (["--cache", "dual"], "--cache='dual' is the approximate cache of whole-sequence checkpoints"),
    (["--stream", "--show-steps"], "--stream and --show-steps do not go together"),
    (["--block-length", "8"], "--block-length=8 must be 4 (or 0)"),
  ],
)
def test_command_line_rejects_a_cache_the_model_lacks_with_exit_code_2(checkpoint, capsys, extra, message):
  from mercury_jax.sample import main

  with pytest.raises(SystemExit) as exit_info:
    main(["--checkpoint", str(checkpoint), "--prompt", "x", "--length", "4", *extra])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and message in err, err


def test_a_step_that_changed_nothing_reuses_the_last_logits():
  """Ancestral steps that commit nothing (many steps per block) run no forward pass, as MDLM's sampler skips them."""
  cfg, canvas = _model_cfg(), _canvas()
  params, settings = _params(cfg), _settings(rule="ancestral")
  plan = plan_blocks(canvas.kinds, BLOCK, cache="exact")
  engine = BlockEngine(cfg, settings, plan)
  run = jax.jit(lambda p, c, n: engine.advance(p, engine.init(p, c, jax.random.key(5), n)))
  state = run(params, canvas, jnp.int32(16))
  # 16 steps for blocks of at most 4 open positions: many steps unmask nothing in any row (here 27 of 56), and those
  # run no forward pass.
  assert int(state.forwards) <= int(state.iterations) - 15
  uncached = _sample(cfg, params, canvas, settings, "none", 16, seed=5)
  np.testing.assert_array_equal(np.asarray(engine.output(state, canvas.tokens.shape[1]).tokens), uncached.tokens)


def test_eos_to_pad_false_generates_every_position_of_the_hole_for_every_decoder():
  """Without eos_to_pad an EOS is a token like any other: the hole is generated to its end (exact cache, no cache,
  the twin, a whole-sequence model); with it, the rest of the hole is padding."""
  cfg = _model_cfg(tie_embeddings=False)
  params = _eos_model(cfg)
  canvas = cv.make_canvas([cv.prefix([7], 10), cv.prefix([8, 9], 10)])
  target = np.asarray(canvas.kinds) == cv.TARGET
  for causal, cache, block, whole in ((False, "exact", BLOCK, False), (False, "none", BLOCK, False),
                                      (True, "exact", 1, False), (False, "none", 12, True)):  # fmt: skip
    cfg_kind = _model_cfg(tie_embeddings=False, causal=causal)
    for eos_to_pad in (True, False):
      settings = _settings(rule="confidence", temperature=0.0, min_length=3, eos_to_pad=eos_to_pad)
      plan = plan_blocks(canvas.kinds, block, cache=cache, autoregressive=causal, whole_sequence=whole)
      engine = BlockEngine(cfg_kind, settings, plan)
      out = jax.jit(engine.sample)(params, canvas, jax.random.key(0), jnp.full((2,), block, jnp.int32))
      generated = np.asarray(out.tokens)[target].reshape(2, -1)[:, :10]
      assert (generated[:, :3] == 5).all() and (generated[:, 3] == EOS).all(), (cache, causal, generated)
      if eos_to_pad:
        assert (generated[:, 4:] == 0).all(), (cache, causal, generated)
      else:  # Nothing after the EOS is padding: the model (EOS first, 5 second) writes EOS there again.
        assert (generated[:, 4:] == EOS).all(), (cache, causal, generated)


def test_a_budget_below_one_step_per_block_is_refused_and_steps_per_block_is_the_engines(sampler):
  with pytest.raises(SettingError, match="steps=3 is below the 7 blocks"):
    sampler.generate("def f(x):", length=24, steps=3, token_healing=False)
  with pytest.raises(SettingError, match="give one of them"):
    sampler.generate("x", length=8, steps=4, steps_per_block=2)
  two = sampler.generate(PROMPTS, length=24, steps_per_block=2, seed=1, token_healing=False, rule="confidence")
  for prompt, sample in zip(PROMPTS, two, strict=True):  # two steps a block (one for a block of one position)
    loads = hole_loads(len(sampler.tokenizer.encode(prompt)), 24, BLOCK)
    assert sample.nfe <= sum(min(2, n) for n in loads), prompt


def test_a_chunk_of_blocks_ends_per_block_of_the_rows_with_something_left():
  """``advance(max_blocks=1)``, as ``stream`` runs it: a row of 4 tokens and a row of 24 (same prompt) take about as
  many chunks as the long row has blocks; before, the finished short row ended every later chunk after one step."""
  cfg = _model_cfg()
  params, settings = _params(cfg), _settings(rule="confidence")
  canvas = cv.make_canvas([cv.prefix([5, 6, 7, 8], 4), cv.prefix([5, 6, 7, 8], 24)])
  plan = plan_blocks(canvas.kinds, BLOCK, cache="exact")
  engine = BlockEngine(cfg, settings, plan)
  state = jax.jit(engine.init)(params, canvas, jax.random.key(0), jnp.full((2,), BLOCK, jnp.int32))
  advance = jax.jit(lambda p, st: engine.advance(p, st, max_blocks=jnp.int32(1)))
  chunks = 0
  while not bool(engine.done(state)):
    state = advance(params, state)
    chunks += 1
  assert chunks == 24 // BLOCK, chunks  # one per block of the long row
  assert int(state.iterations) >= 24  # one token per step


def test_stream_equals_generate_for_every_checkpoint_kind(tmp_path_factory, data_dir):
  from random_models import random_checkpoint

  root = tmp_path_factory.mktemp("kinds")
  for kind in ("whole_sequence", "block_diffusion", "autoregressive"):
    sampler = Sampler.from_checkpoint(random_checkpoint(root, kind, data_dir / "tokenizer.model"))
    steps = {} if kind == "autoregressive" else {"steps": 12}
    knobs = dict(length=20, seed=3, temperature=1.0, num_samples=2, **steps)
    generated = sampler.generate(PROMPTS, **knobs)
    streamed = [""] * len(generated)
    for event in sampler.stream(PROMPTS, **knobs):
      streamed[event.index] += event.text
    assert streamed == [s.text for s in generated], kind


def test_the_constraint_stops_running_once_its_row_is_released(tmp_path_factory, data_dir):
  """The forced-token walk and the constrained proposals run while a constrained row is served and never after the
  serving engine releases it (``Constraint.passes`` counts the steps that ran them)."""
  from random_models import random_checkpoint

  from mercury_jax.sampling import automata as constrained

  path = random_checkpoint(tmp_path_factory.mktemp("released"), "block_diffusion", data_dir / "tokenizer.model")
  sampler = Sampler.from_checkpoint(path)
  automaton = sampler.constraint(regex=r"[a-z]{30}")
  canvas = cv.make_canvas([cv.prefix(sampler.tokenizer.encode("x = "), 40)] * 2)
  plan = sampler.plan(length=canvas.tokens.shape[1])
  canvas = cv.pad_length(canvas, plan.length)
  settings = sampler.settings(temperature=0.0)
  engine = BlockEngine(sampler.network, settings, plan)
  capacity = constrained.capacity_of([automaton, automaton])
  tables = constrained.tables([automaton, None], capacity, sampler.cfg.model.vocab_size)
  init = jax.jit(lambda p, c, t: engine.init(p, c, jax.random.key(0), jnp.full((2,), 4, jnp.int32), tables=t))
  advance = jax.jit(lambda p, st, n: engine.advance(p, st, max_steps=n))
  state = advance(sampler.params, init(sampler.params, canvas, tables), jnp.int32(3))
  running = int(state.constraint.passes)
  assert running > 0 and bool(state.constraint.tables.on[0])
  state = jax.jit(engine.release)(state, jnp.int32(0))
  assert not bool(state.constraint.tables.on[0]) and int(state.constraint.dfa[0]) == 0
  state = advance(sampler.params, state, jnp.int32(6))
  assert int(state.constraint.passes) == running  # nothing constrained ran after the release
  assert bool(engine.unfinished(state)[1])  # the other row went on


def test_sample_output_steps_is_deprecated_for_forwards(sampler):
  canvas = cv.make_canvas([cv.prefix(sampler.tokenizer.encode("x"), 4)])
  out = sampler.run(canvas, None, 0, sampler.settings())[0]
  with pytest.warns(DeprecationWarning, match="forwards"):
    assert int(out.steps) == int(out.forwards)


@pytest.mark.parametrize("capped", [True, False])
def test_a_total_budget_is_spent_and_never_exceeded(capped):
  """``settings.steps_per_block``: every block gets the same steps, the first ones one more while the budget lasts;
  the total (a block takes at most its positions when every step commits one) never exceeds the budget, and uses
  all of it when the blocks are full."""
  rng = np.random.default_rng(0)
  for _ in range(200):
    loads = hole_loads(int(rng.integers(0, 8)), int(rng.integers(1, 60)), 8)
    steps = int(rng.integers(len(loads), 3 * sum(loads)))
    budget = steps_per_block(steps, loads, capped=capped)
    total = budget.total(loads, capped=capped)
    assert total <= steps and budget.extra < len(loads) + (not capped)
    if not capped or steps <= sum(min(n, 8) for n in loads) - 2 * 8:  # room left in full middle blocks
      assert total >= steps - sum(1 for n in loads if n < 8), (loads, steps, budget)
  with pytest.raises(SettingError, match="below the 3 blocks"):
    steps_per_block(2, [3, 8, 5])


def test_the_engine_takes_the_steps_of_its_budget(sampler):
  """Greedy, confidence rule, no early EOS: every row takes exactly the steps its budget gives it."""
  settings = dict(rule="confidence", temperature=0.0, eos_to_pad=False, token_healing=False, seed=1)
  for steps in (7, 10, 16, 24):
    samples = sampler.generate(PROMPTS, length=24, steps=steps, **settings)
    for prompt, sample in zip(PROMPTS, samples, strict=True):
      first = len(sampler.tokenizer.encode(prompt))
      loads = hole_loads(first, 24, BLOCK)
      assert sample.nfe == steps_per_block(steps, loads).total(loads) <= steps, (prompt, steps)


def test_the_prefill_covers_only_what_the_first_step_reads():
  """``prefill_slots``: nothing for prompts within their first generated block, a power of two of blocks otherwise;
  the tokens equal those of a prefill over every slot, for block diffusion and the twin."""
  cfg = _model_cfg()
  params, settings = _params(cfg), _settings(rule="threshold", threshold=0.6)
  short = cv.make_canvas([cv.prefix([5, 6], 13), cv.prefix([5], 14)])
  plan = plan_blocks(short.kinds, BLOCK, cache="exact")
  assert prefill_slots(short.kinds, plan) == 0
  for canvas in (short, _canvas()):
    for causal, block in ((False, BLOCK), (True, 1)):
      plan = plan_blocks(canvas.kinds, block, cache="exact", autoregressive=causal)
      engine = BlockEngine(_model_cfg(causal=causal), settings, plan)
      size = prefill_slots(canvas.kinds, plan)
      run = lambda prefill, e=engine, c=canvas: (
        jax.jit(  # noqa: E731
          lambda p: e.advance(p, e.init(p, c, jax.random.key(2), jnp.full((c.tokens.shape[0],), 2), prefill=prefill))
        )(params).z
      )
      np.testing.assert_array_equal(np.asarray(run(size)), np.asarray(run(None)))
      assert size == 0 or (size % block == 0 and size <= plan.slots)
  long = cv.make_canvas([cv.prefix(list(range(5, 30)), 6)])  # 25 prompt tokens: blocks 1..7 are the prompt
  assert prefill_slots(long.kinds, plan_blocks(long.kinds, BLOCK, cache="exact")) == 8 * BLOCK


def test_the_engine_is_the_only_decoding_loop():
  """One refinement loop: the whole-canvas loop module is gone, and no other sampling module runs a while loop."""
  import importlib.util

  from mercury_jax import sampling

  assert importlib.util.find_spec("mercury_jax.sampling.loop") is None
  assert importlib.util.find_spec("mercury_jax.sampling.blocks") is None
  folder = Path(sampling.__file__).parent
  loops = sorted(p.name for p in folder.glob("*.py") if "while_loop(" in p.read_text())
  assert loops == ["engine.py"], loops


def test_a_pass_run_for_some_rows_leaves_the_other_rows_logits_and_cache_as_they_were():
  """``state.select_rows``: a batched pass runs when any row wants it; the rows that did not want it keep what they had,
  in every layer (keys and values are ``[layers, b, ...]``, here with as many layers as rows, so that a mix-up of the
  two axes shows)."""
  want = jnp.asarray([True, False])
  old = KVCache(jnp.zeros((2, 2, 3, 1, 4)), jnp.zeros((2, 2, 3, 1, 4)), jnp.zeros((2, 3), jnp.int32))
  new = KVCache(jnp.ones((2, 2, 3, 1, 4)), 2 * jnp.ones((2, 2, 3, 1, 4)), jnp.ones((2, 3), jnp.int32))
  got = select_rows(want, new, old)
  np.testing.assert_array_equal(got.keys[:, 0], 1.0)
  np.testing.assert_array_equal(got.keys[:, 1], 0.0)
  np.testing.assert_array_equal(got.values[:, 0], 2.0)
  np.testing.assert_array_equal(got.values[:, 1], 0.0)
  np.testing.assert_array_equal(got.segments, [[1, 1, 1], [0, 0, 0]])
  logits = select_rows(want, jnp.ones((2, 4, 8)), jnp.zeros((2, 4, 8)))
  np.testing.assert_array_equal(logits.sum(axis=(1, 2)), [32.0, 0.0])
