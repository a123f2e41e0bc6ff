"""The refinement loop (the engine decoding whole canvases without a cache) and its step rules: invariants with a
deterministic fake denoiser, the real model on a mesh."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.config import MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer, param_shardings
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.mesh import jit_on_mesh, mesh_context
from mercury_jax.sampling.network import FunctionNetwork, Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import filter_logits, noise_width, propose, sample_tokens, uniform_noise
from mercury_jax.sampling.settings import SamplerSettings, block_loads, commits_every_step, steps_per_block

VOCAB, MASK, EOS, PAD_ID, UNK, BOS = 16, 4, 3, 0, 1, 2
_TABLE = np.asarray(jax.random.normal(jax.random.key(0), (64, VOCAB)), np.float32)
_MIX = np.asarray(jax.random.normal(jax.random.key(1), (VOCAB, VOCAB)), np.float32)


def fake_denoise(z, t):
  """Deterministic logits from a position table and the left neighbour's token (so a row's content matters)."""
  left = jnp.pad(z, ((0, 0), (1, 0)))[:, :-1]  # [b, l]
  logits = jnp.asarray(_TABLE)[: z.shape[1]][None] + 0.5 * jnp.asarray(_MIX)[left]  # [b, l, vocab]
  return logits + 0.0 * t[:, None, None]


def tabled_denoise(table):
  """A denoiser whose logits are ``table`` [l, vocab] at every step: every output is chosen by the test."""
  table = jnp.asarray(table, jnp.float32)
  return lambda z, t: jnp.broadcast_to(table[: z.shape[1]], (*z.shape, table.shape[-1]))


def mixed_canvas(streams=None) -> cv.Canvas:
  """Prompts of different lengths, fill-in-the-middle and a template, right-padded into one batch."""
  encode = lambda text: [5 + ord(c) % 11 for c in text]  # Never the mask, EOS or padding id.
  examples = [
    cv.prefix([5, 6, 7], 9),
    cv.prefix([8], 14),
    [[9, 10], cv.Hole(5), [11, 12, 13]],
    cv.parse_template('{"a": "<mask:4>", "b": <mask:2>}', encode),
  ]
  return cv.make_canvas(examples, length=24, streams=streams)


def _plan(length: int, settings) -> BlockPlan:
  """A whole-sequence plan without a cache: the canvas as one block, or blocks of ``settings.block_length``."""
  block = settings.block_length or length
  return BlockPlan(block, block + -(-length // block) * block, "none", whole_sequence=True)


def _sampler(engine):
  """``engine.sample`` taking each row's budget as one [b, 2] array: steps per block, blocks with one more."""
  return lambda params, canvas, key, budgets: engine.sample(
    params, canvas, key, budgets[:, 0], extra_steps=budgets[:, 1]
  )


@functools.cache
def _jitted(network, settings, plan):
  return jax.jit(_sampler(BlockEngine(network, settings, plan)))


def _row_steps(canvas, steps, plan, settings=None) -> jnp.ndarray:
  """Each row's steps per block for a total budget of ``steps`` (as ``Sampler.generate`` gives them)."""
  block = plan.block if plan.block < plan.length else 0
  capped = settings is None or commits_every_step(settings)
  return jnp.asarray(
    [steps_per_block(steps, block_loads(row, block), capped=capped) for row in canvas.kinds], jnp.int32
  ).reshape(-1, 2)


_FAKES = {}


def _network(denoise_fn):
  if denoise_fn not in _FAKES:
    _FAKES[denoise_fn] = FunctionNetwork(denoise_fn, VOCAB)
  return _FAKES[denoise_fn]


def _run(canvas, steps, settings, denoise_fn=fake_denoise, seed=0, params=None, network=None):
  plan = _plan(canvas.tokens.shape[1], settings)
  fn = _jitted(network or _network(denoise_fn), settings, plan)
  out = fn(params, canvas, jax.random.key(seed), _row_steps(canvas, steps, plan, settings))
  return jax.tree.map(np.asarray, out)


def _settings(**kw):
  return SamplerSettings(eos_id=EOS, pad_id=PAD_ID, **kw)


def test_one_while_loop_and_one_compilation_across_step_counts():
  canvas, settings = mixed_canvas(), _settings()
  plan = _plan(24, settings)
  engine = BlockEngine(_network(fake_denoise), settings, plan)
  fn = jax.jit(_sampler(engine))
  args = (None, canvas, jax.random.key(0))
  assert _count_while(jax.make_jaxpr(fn)(*args, _row_steps(canvas, 4, plan)).jaxpr) == 1
  hlo = fn.lower(*args, _row_steps(canvas, 4, plan)).as_text()
  main = hlo[hlo.index("func.func public @main") :]
  main = main[: main.index("func.func private")]
  assert main.count("stablehlo.while") == 1  # Other whiles in the module are threefry's rounds, called from it.
  outs = {n: fn(*args, _row_steps(canvas, n, plan)) for n in (1, 4, 16, 64)}
  assert fn._cache_size() == 1
  assert [int(outs[n].forwards) for n in (1, 4, 16, 64)] == [1, 4, 14, 14]  # Stops once all 14 tokens are in.
  assert outs[1].nfe.tolist() == [1, 1, 1, 1]
  assert outs[64].nfe.tolist() == [9, 14, 5, 6]  # One token per step: each example's NFE is its own count.


def _sub_jaxprs(value):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def _count_while(jaxpr) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "while"
    for value in eqn.params.values():
      count += sum(_count_while(sub) for sub in _sub_jaxprs(value))
  return count


@pytest.mark.parametrize("cache", ["none", "exact"])
def test_model_sampler_jaxpr_has_exactly_one_while_loop(cache):
  """The refinement is the engine's one while loop: ``advance`` holds it, ``init`` (the prefill) none."""
  cfg = _tiny_model()
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  canvas = mixed_canvas()
  if cache == "none":
    plan = _plan(24, _settings())
  else:
    plan = BlockPlan(4, 4 + 24, "exact")
  engine = BlockEngine(cfg, _settings(), plan)
  steps = jnp.full((4,), 8, jnp.int32)
  state = jax.eval_shape(engine.init, params, canvas, jax.random.key(0), steps)
  assert _count_while(jax.make_jaxpr(engine.init)(params, canvas, jax.random.key(0), steps).jaxpr) == 0
  jaxpr = jax.make_jaxpr(lambda p, st: engine.advance(p, st, jnp.int32(1), jnp.int32(2)))(params, state)
  assert _count_while(jaxpr.jaxpr) == 1  # The layer stack is a scan; the refinement is the only while.


RULE_CASES = [
  dict(rule="ancestral"),
  dict(rule="ancestral", block_length=4, top_p=0.8),
  dict(rule="confidence", temperature=0.0),
  dict(rule="confidence", confidence="margin", block_length=6, revision=0.8, top_k=5),
  dict(rule="threshold", threshold=0.5),
  dict(rule="threshold", confidence="entropy", threshold=-1.0, block_length=8, revision=0.8),
  dict(rule="ancestral", block_length=5, revision=0.5),
]


@pytest.mark.parametrize("knobs", RULE_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_every_mask_resolved_and_fixed_tokens_never_change(knobs):
  canvas = mixed_canvas()
  out = _run(canvas, 12, _settings(trace=12, **knobs))
  fixed = canvas.kinds == K.FIXED
  assert not (out.tokens == MASK).any()
  np.testing.assert_array_equal(out.tokens[fixed], canvas.tokens[fixed])
  np.testing.assert_array_equal(out.tokens[canvas.kinds == K.PAD], PAD_ID)
  for row in range(canvas.tokens.shape[0]):  # Fixed tokens hold at every step, revision included.
    for step in out.canvases[: int(out.nfe[row]), row]:
      np.testing.assert_array_equal(step[fixed[row]], canvas.tokens[row][fixed[row]])
  assert (out.nfe <= 12).all() and int(out.forwards) >= out.nfe.max()
  if knobs.get("revision"):  # Revision re-masks tokens, and its budget is 0 by the step that finishes a block.
    last = out.nfe - 1
    assert out.remasks.sum() > 0 and (out.remasks[last, np.arange(last.size)] == 0).all()


def test_confidence_rule_commits_k_most_confident_per_step():
  table = np.zeros((16, VOCAB), np.float32)
  table[np.arange(16), 5 + np.arange(16) % 7] = 0.3 * np.arange(16)  # Confidence grows with the position.
  canvas = cv.make_canvas([cv.prefix([6], 10)])
  out = _run(canvas, 4, _settings(rule="confidence", temperature=0.0, trace=4), tabled_denoise(table))
  assert out.commits[:, 0].tolist() == [3, 3, 2, 2]  # LLaDA's schedule: 10 tokens over 4 steps.
  first = out.canvases[0, 0] != MASK
  assert first.tolist() == [True] + [False] * 7 + [True] * 3  # The 3 most confident: the last three positions.
  blocks = _run(canvas, 6, _settings(rule="confidence", block_length=4, trace=6), tabled_denoise(table))
  # Engine blocks are canvas positions [0, 4), [4, 8), [8, 12): they hold 3, 4 and 3 of the 10 positions, and the
  # budget of 6 gives each 2 steps.
  assert blocks.commits[:, 0].tolist() == [2, 1, 2, 2, 2, 1]
  block_of_step = [int(np.flatnonzero(blocks.canvases[j, 0] != MASK).max()) // 4 for j in range(6)]
  assert block_of_step == [0, 0, 1, 1, 2, 2]  # Left to right, one block after the other.


def test_threshold_rule_commits_all_confident_and_at_least_one():
  table = np.zeros((16, VOCAB), np.float32)
  table[np.arange(16), 5 + np.arange(16) % 7] = np.where(np.arange(16) % 2, 12.0, 0.5)  # Odd positions are sure.
  canvas = cv.make_canvas([cv.prefix([6], 12)])
  settings = _settings(rule="threshold", threshold=0.9, temperature=0.0, trace=12)
  out = _run(canvas, 12, settings, tabled_denoise(table))
  used = int(out.forwards)
  first = out.canvases[0, 0, 1:] != MASK
  assert first.tolist() == [True, False] * 6  # Every confident position in step one, nothing else.
  assert (out.commits[:used, 0] >= 1).all()
  assert used == 7 < 12  # 6 easy tokens in one step, then the 6 uncertain ones one per step.
  assert not (out.tokens == MASK).any()


def _posterior_by_enumeration(alpha_t, alpha_s, q):
  """p(z_s | z_t = mask) by Bayes over z_s in {x, mask} for x ~ q: the forward process enumerated."""
  # Forward: z_s = x w.p. alpha_s, else mask; then z_t = z_s w.p. alpha_t / alpha_s, else mask (once masked, stays).
  joint_clean = alpha_s * (1.0 - alpha_t / alpha_s)  # P(z_s = x, z_t = mask)
  joint_mask = 1.0 - alpha_s  # P(z_s = mask, z_t = mask)
  evidence = joint_clean + joint_mask
  return joint_clean / evidence * q, joint_mask / evidence


def test_ancestral_step_matches_brute_force_posterior():
  schedule = ObjectiveConfig(schedule="cosine")
  logits = np.array([0.5, -1.0, 1.0, 0.2, 9.0, 2.0, -0.5, 0.0] * 2, np.float32)  # Special ids' logits are ignored.
  q = np.exp(np.where(np.isin(np.arange(16), [PAD_ID, UNK, BOS, MASK]), -np.inf, logits))
  q /= q.sum()
  rows, length, steps = 2048, 8, 4
  canvas = cv.make_canvas([[cv.Hole(length)]] * rows)
  settings = _settings(rule="ancestral", objective=schedule, eos_to_pad=False, trace=2)
  out = _run(canvas, steps, settings, tabled_denoise(np.tile(logits, (length, 1))))
  alpha = lambda t: 1.0 - np.cos(0.5 * np.pi * (1.0 - t))
  before = np.full((rows, length), MASK)
  for j, (t, s) in enumerate([(1.0, 0.75), (0.75, 0.5)]):
    after = out.canvases[j]
    moved = after[before == MASK]
    p_tokens, p_mask = _posterior_by_enumeration(alpha(t), alpha(s), q)
    empirical = np.bincount(moved, minlength=16) / moved.size
    expected = p_tokens.copy()
    expected[MASK] = p_mask
    tolerance = 5 * np.sqrt(expected * (1 - expected) / moved.size) + 1e-4
    assert (np.abs(empirical - expected) <= tolerance).all(), (j, empirical, expected)
    before = after


def test_eos_becomes_padding_and_min_length_forbids_early_eos():
  table = np.zeros((16, VOCAB), np.float32)
  table[:, 7] = 1.0
  table[4, EOS] = 20.0  # The model wants to end at position 4.
  canvas = cv.make_canvas([cv.prefix([6], 10)])
  greedy = _settings(rule="confidence", temperature=0.0)
  out = _run(canvas, 10, greedy, tabled_denoise(table))
  assert out.tokens[0].tolist()[:6] == [6, 7, 7, 7, EOS, PAD_ID] and (out.tokens[0, 5:] == PAD_ID).all()
  late = _run(canvas, 10, dataclasses.replace(greedy, min_length=6), tabled_denoise(table))
  assert EOS not in late.tokens[0, :7].tolist() and (late.tokens[0, 1:11] != PAD_ID).all()


def test_eos_ends_only_its_own_hole_and_min_length_counts_over_holes():
  table = np.zeros((16, VOCAB), np.float32)
  table[:, 7] = 1.0
  table[[2, 8, 9], EOS] = 20.0  # The model wants to end the first hole at its second position, the second at 8, 9.
  canvas = cv.make_canvas([[[5], cv.Hole(4), [9, 10], cv.Hole(4)]])  # Generated ranks 0-3 at 1-4, 4-7 at 7-10.
  greedy = _settings(rule="confidence", temperature=0.0)
  out = _run(canvas, 8, greedy, tabled_denoise(table))
  # The EOS pads the rest of the first hole only; the fixed text and the second hole keep their tokens.
  assert out.tokens[0].tolist() == [5, 7, EOS, PAD_ID, PAD_ID, 9, 10, 7, EOS, PAD_ID, PAD_ID]
  # min_length=6 bans EOS from the first 6 generated positions: the whole first hole and 2 of the second.
  late = _run(canvas, 8, dataclasses.replace(greedy, min_length=6), tabled_denoise(table))
  assert late.tokens[0].tolist() == [5, 7, 7, 7, 7, 9, 10, 7, 7, EOS, PAD_ID]


SPECIAL_IDS = [PAD_ID, UNK, BOS, MASK, 14, 15]  # 14 and 15 lie past a 14-token tokenizer in the 16-id vocabulary.


@pytest.mark.parametrize(
  "knobs",
  [
    dict(rule="confidence", temperature=0.0),
    dict(rule="confidence", temperature=1.0, block_length=4, revision=0.3),
    dict(rule="ancestral", temperature=1.0, revision=0.5),
    dict(rule="threshold", temperature=0.8, top_p=0.9, top_k=6),
  ],
  ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()),
)
def test_special_ids_are_never_proposed(knobs):
  table = np.zeros((16, VOCAB), np.float32)
  table[:, SPECIAL_IDS] = 30.0  # Almost all of the model's mass, yet none of them may be generated.
  table[:, EOS] = -5.0  # EOS stays allowed; kept unlikely so the rows stay long.
  canvas = cv.make_canvas([[cv.Hole(12)]] * 32)
  out = _run(canvas, 6, _settings(num_tokens=14, eos_to_pad=False, **knobs), tabled_denoise(table))
  generated = out.tokens[canvas.kinds == K.TARGET]  # Every proposal committed (no padding after an EOS).
  assert not np.isin(generated, SPECIAL_IDS).any(), generated
  if knobs["temperature"]:
    assert len(set(generated.tolist()) - {EOS}) > 5  # Drawn from every token that is left.


def test_confidence_is_measured_on_the_cleaned_distribution():
  table = np.zeros((16, VOCAB), np.float32)
  table[:, [PAD_ID, UNK, BOS, 14, 15]] = 40.0
  table[:, 7] = 10.0  # p(7) is 0.9995 once the special ids are gone, e^-30 before.
  canvas = cv.make_canvas([cv.prefix([6], 8)])
  settings = _settings(rule="threshold", threshold=0.9, temperature=0.0, num_tokens=14)
  out = _run(canvas, 8, settings, tabled_denoise(table))
  assert int(out.forwards) == 1 and out.tokens[0, 1:].tolist() == [7] * 8  # Every position is sure at once.

  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, VOCAB)) + 30.0 * np.isin(np.arange(16), [0, 15]))
  p = np.exp(np.where(np.isin(np.arange(16), SPECIAL_IDS), -np.inf, np.asarray(logits, np.float64)))
  p /= p.sum(axis=-1, keepdims=True)
  top2 = np.sort(p, axis=-1)[..., -2:]
  entropy = -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=-1)
  expected = dict(prob=p.max(-1), margin=top2[..., 1] - top2[..., 0], entropy=-entropy)
  banned = jnp.zeros((2, 3), bool)
  for measure, want in expected.items():
    x0, confidence = propose(logits, None, banned, _settings(temperature=0.0, confidence=measure, num_tokens=14))
    np.testing.assert_array_equal(np.asarray(x0), p.argmax(-1))
    np.testing.assert_allclose(np.asarray(confidence), want, rtol=1e-4, atol=1e-6)


def test_fixed_key_reproduces_and_streams_make_examples_batch_invariant():
  settings = _settings(trace=12, **RULE_CASES[3])  # Blocks, revision and top-k: every random draw in play.
  canvas = mixed_canvas(streams=[10, 11, 12, 13])
  first, again = _run(canvas, 12, settings), _run(canvas, 12, settings)
  assert first.remasks.sum() > 0
  np.testing.assert_array_equal(first.tokens, again.tokens)
  assert not np.array_equal(first.tokens, _run(canvas, 12, settings, seed=1).tokens)
  alone = _run(cv.make_canvas([cv.prefix([8], 14)], streams=[11]), 12, settings)  # Shorter canvas, one row.
  np.testing.assert_array_equal(alone.tokens[0], first.tokens[1, :15])


def _tiny_model() -> ModelConfig:
  return ModelConfig(
    vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64, max_length=32
  )


def test_real_model_batch_invariance_and_mesh_equals_one_device():
  cfg = _tiny_model()
  model = Transformer(cfg)
  params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: p * 20.0, params)  # Sharper distributions than the 0.02 init.
  rng = np.random.default_rng(0)
  examples = [cv.prefix(rng.integers(5, 64, size=1 + i).tolist(), 12 + i) for i in range(8)]
  canvas = cv.make_canvas(examples, length=32)
  settings = _settings(rule="confidence", block_length=8, revision=0.2)
  network = Network(cfg)
  single = _run(canvas, 8, settings, params=params, network=network)
  assert not (single.tokens == MASK).any()
  alone = _run(cv.make_canvas(examples[5:6], streams=[5]), 8, settings, params=params, network=network)
  np.testing.assert_array_equal(alone.tokens[0], single.tokens[5, : alone.tokens.shape[1]])

  mesh = sh.make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  shardings = param_shardings(model, mesh, sh.RULES)
  sharded = jax.device_put(params, shardings)
  assert any(
    len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(sharded)
  )
  plan = _plan(32, settings)
  engine = BlockEngine(network, settings, plan)
  fn = jit_on_mesh(_sampler(engine), mesh, sh.RULES, shardings, batched=jnp.zeros((8, 2), jnp.int32))
  with mesh_context(mesh, sh.RULES):
    out = fn(sharded, canvas, jax.random.key(0), np.asarray(_row_steps(canvas, 8, plan, settings)))
  assert out.tokens.sharding.spec == sh.batch_spec(sh.RULES, 2)
  np.testing.assert_array_equal(np.asarray(out.tokens), single.tokens)
  np.testing.assert_array_equal(np.asarray(out.nfe), single.nfe)


def test_template_parsing_and_canvas_padding():
  pieces = cv.parse_template("x<mask:2>yz<mask:1>", lambda s: [ord(c) for c in s])
  assert pieces == [[120], cv.Hole(2), [121, 122], cv.Hole(1)]
  with pytest.raises(ValueError, match="no hole"):
    cv.parse_template("no holes here", lambda s: [1])
  with pytest.raises(ValueError, match="at least 1"):
    cv.parse_template("a<mask:0>", lambda s: [1])
  canvas = cv.make_canvas([pieces, cv.prefix([7], 1)], length=8)
  assert canvas.kinds.tolist() == [[1, 2, 2, 1, 1, 2, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]]
  with pytest.raises(ValueError, match="does not fit"):
    cv.make_canvas([pieces], length=4)
  infill = cv.from_fixed([[7, 0, 0, 8]], [[True, False, False, True]])
  assert infill.kinds.tolist() == [[1, 2, 2, 1]]


def test_two_level_gumbel_max_draws_the_softmax_and_filters_apply():
  vocab, rows, length = 37, 1024, 8  # 37 tokens: 7 chunks of 7, the last padded.
  logits = np.random.default_rng(0).normal(size=vocab).astype(np.float32) * 1.5
  batch = jnp.broadcast_to(jnp.asarray(logits), (rows, length, vocab))
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(rows))
  noise = uniform_noise(keys, (length, noise_width(vocab)))
  draw = jax.jit(lambda x, settings: sample_tokens(filter_logits(x, settings), noise), static_argnums=1)
  p = np.exp(logits - logits.max())
  order = np.argsort(-logits)
  for settings, kept in [
    (_settings(), order),
    (_settings(top_k=3), order[:3]),
    (_settings(top_p=0.5), order[: np.searchsorted(np.cumsum(p[order] / p.sum()), 0.5) + 1]),
  ]:
    counts = np.bincount(np.asarray(draw(batch, settings)).ravel(), minlength=vocab)
    expected = np.zeros(vocab)
    expected[kept] = p[kept] / p[kept].sum()
    empirical = counts / counts.sum()
    assert (np.abs(empirical - expected) <= 5 * np.sqrt(expected * (1 - expected) / counts.sum()) + 1e-4).all()
  noisy = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, vocab)), jnp.float32)
  np.testing.assert_array_equal(sample_tokens(noisy, None), jnp.argmax(noisy, axis=-1))
