"""Context parallelism: a sequence split over the `sequence` mesh axis gives the single-device attention, training
step and prefill, in a layout that balances causal work, with every layer's activations split (8 simulated CPU
devices, conftest).

Tolerances (float32): the shards sum the same terms in another order than one device (the online softmax over key
chunks, the gradients' reductions over positions), so values agree to about 1e-6 relative; a masking, position or
permutation error is O(0.1).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from mercury_jax import attention, sharding as sh
from mercury_jax.config import ConfigError, MeshConfig, ModelConfig, load_config
from mercury_jax.kernels import masks
from mercury_jax.kernels.context_parallel import SequenceLayout
from mercury_jax.model import Transformer, param_shardings
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine, prefill_slots
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.trainer import Trainer, loss_terms

F32_OUT = {"atol": 2e-5, "rtol": 2e-5}
F32_GRAD = {"atol": 5e-5, "rtol": 5e-5}


def _mesh(**sizes):
  return sh.make_mesh(MeshConfig(**{"data": 1, **sizes}), jax.devices()[: int(np.prod(list(sizes.values())))])


# ------------------------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_each_shard_holds_the_positions_its_layout_names_and_the_permutation_inverts(kind):
  layout = SequenceLayout(4, kind)
  x = jnp.arange(2 * 48).reshape(2, 48)
  arranged = layout.to_layout(x, 1)
  np.testing.assert_array_equal(np.asarray(layout.to_natural(arranged, 1)), np.asarray(x))
  local = 48 // 4
  for shard in range(4):
    np.testing.assert_array_equal(
      np.asarray(arranged[0, shard * local : (shard + 1) * local]), np.asarray(layout.positions(shard, local))
    )
  if kind == "zigzag":  # Shard 1 of 4 holds pieces 1 and 6 of 8.
    np.testing.assert_array_equal(np.asarray(layout.positions(1, local)), [*range(6, 12), *range(36, 42)])


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_the_exchange_between_shards_equals_the_gather(shards):
  """The zig-zag permutation of an array split over `sequence` moves pieces by ppermute; it must equal the plain
  gather, both ways, and keep the array split."""
  layout = SequenceLayout(shards, "zigzag")
  mesh = _mesh(sequence=shards)
  x = jnp.arange(2 * 12 * shards * 3, dtype=jnp.float32).reshape(2, 12 * shards, 3)
  logical = (sh.BATCH, sh.LENGTH, None)
  with sh.context(mesh, sh.RULES):
    split = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
    arranged = jax.jit(lambda a: layout.to_layout(a, 1, logical))(split)
    back = jax.jit(lambda a: layout.to_natural(a, 1, logical))(arranged)
  np.testing.assert_array_equal(np.asarray(arranged), np.asarray(layout.to_layout(x, 1)))
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  assert arranged.sharding.spec[1] == "sequence"


def _work_per_shard(layout: SequenceLayout, length: int, mask: str, block=None) -> np.ndarray:
  """The (query, key) pairs each shard's queries see: the attention work it does."""
  half = length // 2 if mask in ("block_diffusion", "verified") else None
  visible = masks.dense(length, mask, block=block, half=half)
  local = length // layout.shards
  return np.array([visible[np.asarray(layout.positions(s, local))].sum() for s in range(layout.shards)])


@pytest.mark.parametrize(
  "mask, block", [("causal", None), ("block_causal", 16), ("block_diffusion", 16), ("verified", 8)]
)
def test_zigzag_balances_the_work_that_a_contiguous_split_piles_on_the_last_shards(mask, block):
  length = 1024
  zigzag = _work_per_shard(SequenceLayout(4, "zigzag"), length, mask, block)
  contiguous = _work_per_shard(SequenceLayout(4, "contiguous"), length, mask, block)
  assert zigzag.sum() == contiguous.sum()
  assert zigzag.max() / zigzag.mean() < 1.05, zigzag
  assert contiguous.max() / contiguous.mean() > 1.4, contiguous


# ------------------------------------------------------------------------------------------------ attention


def _attention_inputs(length, heads, kv_heads, segments: bool, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, length, heads, 16), jnp.float32)
  k = jax.random.normal(keys[1], (2, length, kv_heads, 16), jnp.float32)
  v = jax.random.normal(keys[2], (2, length, kv_heads, 16), jnp.float32)
  d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
  seg = None
  if segments:  # Two documents and a padding tail in row 0; one document in row 1.
    row = np.concatenate([np.full(length // 3, 1), np.full(length - length // 3 - 5, 2), np.zeros(5)])
    seg = jnp.asarray(np.stack([row, np.ones(length)]), jnp.int32)
  return q, k, v, seg, d_out


CASES = [  # (mask, diffusion block, heads, kv heads, segments)
  ("causal", None, 4, 2, True),
  ("bidirectional", None, 4, 4, True),
  ("block_causal", 8, 4, 2, False),
  ("block_diffusion", 8, 4, 1, True),
  ("verified", 4, 2, 2, False),
]


def _attend(q, k, v, seg, d_out, mask, block, strategy, layout):
  """The attention output and the gradients of ``sum(out * d_out)`` wrt ``q, k, v``."""

  def loss(q, k, v):
    out = attention.attend(
      q, k, v, segment_ids=seg, mask=mask, diffusion_block=block, layout=layout, context_parallel=strategy,
      implementation="xla", blockwise=None if layout else False,
    )  # fmt: skip
    return jnp.sum(out * d_out), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("mask, block, heads, kv_heads, segments", CASES, ids=[c[0] for c in CASES])
def test_sequence_sharded_attention_equals_one_device(strategy, mask, block, heads, kv_heads, segments):
  """Values and gradients on (data 2, sequence 4) and (sequence 2, tensor 2): rows, positions and heads split, the kv
  heads split like the query heads or (one kv head over two head shards) gathered per shard."""
  q, k, v, seg, d_out = _attention_inputs(128, heads, kv_heads, segments)
  want = jax.jit(lambda: _attend(q, k, v, seg, d_out, mask, block, strategy, None))()
  kind = "contiguous" if mask == "bidirectional" else "zigzag"
  for sizes in ({"data": 2, "sequence": 4}, {"sequence": 2, "tensor": 2}):
    mesh, layout = _mesh(**sizes), SequenceLayout(sizes["sequence"], kind)
    # The inputs in the layout's order, as the model feeds them; the results back in the natural order.
    arranged = [None if a is None else layout.to_layout(a, 1) for a in (q, k, v, seg, d_out)]
    with sh.context(mesh, sh.RULES):
      fn = jax.jit(lambda: _attend(*arranged, mask, block, strategy, layout))  # noqa: B023
      text, got = fn.lower().as_text(), fn()
    got = jax.tree.map(lambda a: layout.to_natural(a, 1), got)  # noqa: B023
    assert ("all_gather" in text) == (strategy == "all_gather")
    assert ("collective_permute" in text) == (strategy == "ring")
    chex.assert_trees_all_close(got[0], want[0], **F32_OUT)
    chex.assert_trees_all_close(got[1], want[1], **F32_GRAD)


# ------------------------------------------------------------------------------------------------ training

SHAPE = {
  "model.vocab_size": "256",
  "model.max_length": "64",
  "model.num_kv_heads": "2",
  "model.unroll_layers": "false",  # One compiled block: a third less compile time here.
  "optim.warmup_steps": "0",
}
OBJECTIVES = {
  "masked_diffusion": {},
  "block_diffusion": {"objective.block_size": "4"},
  "autoregressive": {"objective.name": "autoregressive", "model.causal": "true"},
  "verified": {"objective.name": "verified", "objective.draft_length": "4"},
  "continuous": {"objective.name": "continuous", "model.latent_dim": "16", "objective.block_size": "4"},
}


def _batch(length):
  rng = np.random.default_rng(0)
  kinds = np.full((8, length), 2, np.int32)
  kinds[:2, :6] = 1  # Two conditional examples with prompts ...
  kinds[:2, -5:] = 0  # ... and padding.
  return {"tokens": jnp.asarray(rng.integers(5, 256, (8, length)), jnp.int32), "kinds": jnp.asarray(kinds)}


def _loss_and_grads(cfg, devices):
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, devices))
  state = trainer.init_state(seed=0)
  key = jax.random.fold_in(state["key"], 0)

  def objective(params, batch):
    terms = loss_terms(params, batch, key, trainer.model, cfg)
    return terms["loss_sum"] / terms["tokens"]

  grad_fn = sh.MeshJit(
    jax.value_and_grad(objective),
    trainer.mesh,
    trainer.rules,
    in_shardings=(trainer.state_shardings["params"], trainer.batch_sharding),
  )
  batch = jax.device_put(_batch(cfg.model.max_length), trainer.batch_sharding)
  lowered = grad_fn.lower(state["params"], batch)
  loss, grads = lowered.compile()(state["params"], batch)
  return float(loss), jax.tree.map(np.asarray, grads), lowered.as_text()


SEQUENCE_4 = MeshConfig(data=2, sequence=4)
MIXED = MeshConfig(data=1, fsdp=2, sequence=2, tensor=2)
# Each objective on one mesh (every mesh compiles a train step, about 4-9 s each here): the sequence split four ways
# for the plain and the doubled (x_t ⊕ x_0) layouts, the mixed mesh (FSDP and tensor beside the sequence) for the
# causal, the [draft ; clean] and the latent layouts.
MESHES = {
  "masked_diffusion": SEQUENCE_4,
  "block_diffusion": SEQUENCE_4,
  "autoregressive": MIXED,
  "verified": MIXED,
  "continuous": MIXED,
}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_sequence_sharded_loss_and_gradients_equal_one_device(objective, capfd):
  cfg = load_config("tiny", {**SHAPE, **OBJECTIVES[objective]})
  single_loss, single, _ = _loss_and_grads(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), jax.devices()[:1])
  capfd.readouterr()
  loss, grads, text = _loss_and_grads(dataclasses.replace(cfg, mesh=MESHES[objective]), jax.devices())
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  assert "all_gather" in text  # The attention ran context-parallel, not on a gathered sequence.
  np.testing.assert_allclose(loss, single_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(b, a, atol=2e-5 * max(float(np.abs(a).max()), 1e-30), rtol=0)


def test_the_sequence_axis_splits_every_layers_activations():
  """Per-device temp memory of a compiled train step at 16 K tokens: the activations split 8 ways over `sequence`
  (measured: 53 MiB against 271 MiB on one device, the rest being the blockwise loops' fixed tiles; a split that
  gathers the sequence on every device keeps about the single-device size)."""
  cfg = load_config(
    "tiny", {"model.max_length": "16384", "data.batch_size": "1", "model.vocab_size": "512", "model.remat": "true"}
  )

  def temp(mesh_cfg, devices):
    trainer = Trainer(dataclasses.replace(cfg, mesh=mesh_cfg), sh.make_mesh(mesh_cfg, devices))
    return trainer.lower_train_step().compile().memory_analysis().temp_size_in_bytes

  one = temp(MeshConfig(data=1), jax.devices()[:1])
  split = temp(MeshConfig(data=1, sequence=8), jax.devices())
  assert split < 0.3 * one, (split, one)


def test_bad_sequence_meshes_are_one_line_errors():
  with pytest.raises(ConfigError, match="multiple of 2 \\* mesh.sequence=8"):
    load_config("tiny", {"mesh.sequence": "4", "model.max_length": "36"})
  with pytest.raises(ConfigError, match="four DATA,FSDP,SEQUENCE,TENSOR"):
    sh.mesh_from_flag("2,2")
  assert dict(sh.mesh_from_flag("2,1,2,2").shape) == {"data": 2, "fsdp": 1, "sequence": 2, "tensor": 2}
  assert dict(sh.mesh_from_flag("2,2,2").shape) == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}


# ------------------------------------------------------------------------------------------------ prefill


def _decoder_model(causal: bool) -> tuple[ModelConfig, dict]:
  cfg = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=128,
    attention="xla", unroll_layers=True, causal=causal,
  )  # fmt: skip
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  return cfg, jax.tree.map(lambda p: p * 8.0, params)  # Sharper distributions than the 0.02 init.


@pytest.mark.parametrize("causal", [False, True], ids=["block_diffusion", "twin"])
def test_sequence_sharded_prefill_gives_the_cache_logits_and_tokens_of_one_device(causal):
  cfg, params = _decoder_model(causal)
  block = 1 if causal else 4
  canvas = cv.make_canvas([cv.prefix(list(range(5, 57)), 12), cv.prefix(list(range(7, 40)), 20)])
  settings = SamplerSettings(eos_id=3, num_tokens=64, rule="confidence").validate()
  plan = plan_blocks(canvas.kinds, block, cache="exact", autoregressive=causal)
  engine = BlockEngine(cfg, settings, plan)
  size = prefill_slots(canvas.kinds, plan)
  assert size % 8 == 0  # The prefill runs split over the 4 shards in the zig-zag layout.
  start = lambda p: engine.init(p, canvas, jax.random.key(2), jnp.full((2,), 3), prefill=size)  # noqa: E731
  one = jax.jit(start)(params)
  single = jax.jit(engine.sample)(params, canvas, jax.random.key(4), jnp.int32(3))

  mesh = sh.make_mesh(MeshConfig(data=2, sequence=4))
  shardings = param_shardings(Transformer(cfg), mesh, sh.RULES)
  sharded = jax.device_put(params, shardings)
  split = sh.MeshJit(start, mesh, sh.RULES)
  got = split(sharded)
  assert "all_gather" in split.lower(sharded).as_text()
  # The cache keeps a quarter of every row's slots per device (rounded up to a multiple of 4 slots, in segment 0).
  assert got.cache.keys.sharding.spec[2] == "sequence"
  assert got.cache.slots == -(-plan.slots // 4) * 4
  np.testing.assert_array_equal(np.asarray(got.cache.segments)[:, plan.slots :], 0)
  for a, b in zip(got.cache, one.cache, strict=True):
    slots = np.asarray(a)[..., : plan.slots, :, :] if a.ndim == 5 else np.asarray(a)[:, : plan.slots]
    np.testing.assert_allclose(slots, np.asarray(b), atol=2e-4, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(one.logits), atol=2e-4, rtol=1e-5)
  out = jit_on_mesh(engine.sample, mesh, sh.RULES, shardings, scalars=1)(
    sharded, canvas, jax.random.key(4), jnp.int32(3)
  )
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
