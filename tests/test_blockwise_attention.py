"""The blockwise (memory-bounded) XLA attention against the dense XLA path, and its memory bound at 32 K tokens.

Tolerances (float32): both paths sum the same terms in a different order (an online softmax with rescaling over key
chunks against one softmax over the row); the measured worst case on these shapes is 1e-6 for outputs and 3e-6 for
gradients, so 2e-5 / 5e-5 leave about 10x headroom and still catch any masking or indexing error (those are O(0.1)).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mercury_jax import attention
from mercury_jax.kernels import blockwise_attention as bw, masks

F32_OUT = {"atol": 2e-5, "rtol": 2e-5}
F32_GRAD = {"atol": 5e-5, "rtol": 5e-5}
HEAD_DIM = 32


@dataclasses.dataclass(frozen=True)
class Case:
  length: int
  mask: str
  diffusion_block: int | None
  blocks: bw.BlockSizes
  segments: str  # "none", "packed" (two documents and a padding tail) or "random" (ids 0..2 anywhere).
  heads: int = 4
  kv_heads: int = 2
  batch: int = 2

  def __str__(self):
    db = self.diffusion_block or ""
    return f"l{self.length}-{self.mask}{db}-q{self.blocks.block_q}k{self.blocks.block_k}-{self.segments}"


# Chunks that do not divide the length (padded internally), chunks that do, query chunks that straddle the two halves
# of block_diffusion / verified, GQA (2 query heads per kv head) and MQA, diffusion blocks smaller than the chunks.
CASES = [
  Case(96, "bidirectional", None, bw.BlockSizes(32, 64), "random"),
  Case(200, "causal", None, bw.BlockSizes(48, 64), "packed"),
  Case(512, "causal", None, bw.BlockSizes(128, 128), "none", heads=2, kv_heads=1, batch=1),
  Case(200, "block_causal", 16, bw.BlockSizes(64, 48), "packed"),
  Case(200, "block_diffusion", 16, bw.BlockSizes(64, 64), "packed"),
  Case(256, "block_diffusion", 32, bw.BlockSizes(64, 32), "none"),
  Case(200, "verified", 8, bw.BlockSizes(48, 64), "packed"),
]


def _segments(case: Case, key) -> jax.Array | None:
  if case.segments == "none":
    return None
  if case.segments == "random":
    return jax.random.randint(key, (case.batch, case.length), 0, 3)
  two_halves = case.mask in ("block_diffusion", "verified")
  n = case.length // 2 if two_halves else case.length
  first, pad = n // 3, n // 8  # Document 1, document 2, then padding (segment 0).
  row = np.concatenate([np.full(first, 1), np.full(n - first - pad, 2), np.zeros(pad)]).astype(np.int32)
  if two_halves:  # x_0 repeats the ids of x_t.
    row = np.concatenate([row, row])
  return jnp.asarray(np.stack([row, np.roll(row, 0 if two_halves else 5)])[: case.batch])


def _inputs(case: Case):
  keys = jax.random.split(jax.random.key(case.length + len(case.mask)), 5)
  q = jax.random.normal(keys[0], (case.batch, case.length, case.heads, HEAD_DIM), jnp.float32)
  k = jax.random.normal(keys[1], (case.batch, case.length, case.kv_heads, HEAD_DIM), jnp.float32)
  v = jax.random.normal(keys[2], (case.batch, case.length, case.kv_heads, HEAD_DIM), jnp.float32)
  d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
  return q, k, v, _segments(case, keys[4]), d_out


def _value_and_grads(fn, q, k, v, d_out):
  """``fn(q, k, v)`` and the vector-Jacobian product with ``d_out`` wrt ``q, k, v``, in one compiled program."""

  def run(q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)

  return jax.jit(run)(q, k, v, d_out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blockwise_matches_dense_values_and_gradients(case):
  q, k, v, segment_ids, d_out = _inputs(case)
  options = {"segment_ids": segment_ids, "mask": case.mask, "diffusion_block": case.diffusion_block}
  got, got_grads = _value_and_grads(
    lambda q, k, v: bw.blockwise_attention(q, k, v, block_sizes=case.blocks, **options), q, k, v, d_out
  )
  want, want_grads = _value_and_grads(
    lambda q, k, v: attention.attend(q, k, v, implementation="xla", blockwise=False, **options), q, k, v, d_out
  )
  chex.assert_trees_all_close(got, want, **F32_OUT)
  for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, **F32_GRAD, err_msg=f"d{name}")
  if segment_ids is not None:  # Padding queries output zeros and send no gradient to q.
    padding = np.asarray(segment_ids == 0)
    assert padding.any()
    np.testing.assert_array_equal(np.asarray(got)[padding], 0.0)
    np.testing.assert_array_equal(np.asarray(got_grads[0])[padding], 0.0)


def test_attend_blockwise_true_forces_the_blockwise_path_on_short_sequences():
  case = CASES[1]
  q, k, v, segment_ids, _ = _inputs(case)
  options = {"segment_ids": segment_ids, "causal": True, "implementation": "xla"}
  forced = jax.jit(lambda q, k, v: attention.attend(q, k, v, blockwise=True, **options))
  dense = jax.jit(lambda q, k, v: attention.attend(q, k, v, blockwise=False, **options))
  chex.assert_trees_all_close(forced(q, k, v), dense(q, k, v), **F32_OUT)
  # Not the dense program: the blockwise one loops (a while loop in its HLO), the dense one does not.
  assert "while" in forced.lower(q, k, v).as_text()
  assert "while" not in dense.lower(q, k, v).as_text()


@pytest.mark.parametrize(
  "mask, diffusion_block", [("causal", None), ("block_causal", 16), ("block_diffusion", 16), ("verified", 8)]
)
def test_visited_key_chunks_hold_every_visible_key_and_causal_skips_all_empty_ones(mask, diffusion_block):
  length, block_q, block_k = 384, 32, 48
  half = length // 2 if mask in ("block_diffusion", "verified") else None
  plan = bw.Plan(mask, diffusion_block, half, block_q, block_k, 1.0)
  visible = masks.dense(length, mask, block=diffusion_block, half=half)
  live = visible.reshape(length // block_q, block_q, length // block_k, block_k).any(axis=(1, 3))  # [q chunks, k]
  visited = np.zeros_like(live)
  for i in range(length // block_q):
    first, last = jnp.int32(i * block_q), jnp.int32(i * block_q + block_q - 1)
    lo, hi = (int(x) for x in bw._chunk_range(plan, first, last, jnp.int32(0), length // block_k))
    visited[i, lo:hi] = True
  assert not (live & ~visited).any(), "a key chunk with visible keys is skipped"
  if mask in ("causal", "block_causal"):  # A prefix mask: exactly the chunks up to the diagonal (block).
    np.testing.assert_array_equal(visited, live)
  else:  # The two-halves masks visit a range around the live chunks; the tile mask skips the rest by a cond.
    assert visited.sum() < 0.6 * visited.size


def test_sharded_over_batch_and_heads_matches_one_device():
  """GSPMD partitions the loops: rows over `data`, kv heads over `tensor` (8 simulated CPU devices, conftest)."""
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
  case = CASES[1]
  q, k, v, segment_ids, d_out = _inputs(case)

  def fn(q, k, v):
    return bw.blockwise_attention(q, k, v, segment_ids=segment_ids, mask="causal", block_sizes=case.blocks)

  want = _value_and_grads(fn, q, k, v, d_out)
  heads = NamedSharding(mesh, P("data", None, "tensor", None))
  got = _value_and_grads(fn, *(jax.device_put(x, heads) for x in (q, k, v, d_out)))
  assert got[0].sharding.spec == P("data", None, "tensor")  # Not gathered onto one device.
  chex.assert_trees_all_close(got, want, **F32_GRAD)


def _temp_bytes(fn, *shapes) -> int:
  return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mask, grad", [("causal", False), ("causal", True), ("block_diffusion", False)])
def test_temp_memory_at_32k_tokens_is_far_below_the_score_matrix(mask, grad):
  """Lowered and compiled only, never run: 32 K tokens, 2 heads of 64 (dense scores: 8 GiB)."""
  length, heads = 32768, 2
  q = jax.ShapeDtypeStruct((1, length, heads, 64), jnp.float32)
  segment_ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
  diffusion_block = 32 if mask == "block_diffusion" else None

  def forward(q, k, v, segment_ids):
    return bw.blockwise_attention(q, k, v, segment_ids=segment_ids, mask=mask, diffusion_block=diffusion_block)

  fn = jax.grad(lambda *args: forward(*args).sum(), argnums=(0, 1, 2)) if grad else forward
  temp = _temp_bytes(fn, q, q, q, segment_ids)
  scores = length * length * 4 * heads
  assert temp < scores / 16, f"{temp=} bytes is not far below the dense scores' {scores} bytes"


def test_attend_xla_switches_to_blockwise_from_the_threshold():
  """Told apart by compiled temp memory: the dense program holds ``[heads, length, length]`` scores."""
  heads = 2

  def temp(length: int, blockwise: bool | None) -> int:
    q = jax.ShapeDtypeStruct((1, length, heads, 64), jnp.float32)
    return _temp_bytes(lambda q, k, v: attention.attend(q, k, v, causal=True, blockwise=blockwise), q, q, q)

  long = 8 * attention.BLOCKWISE_MIN_LENGTH
  scores = long * long * 4 * heads
  assert temp(long, blockwise=False) >= scores  # The measurement tells the paths apart ...
  assert temp(long, blockwise=None) < scores / 16  # ... and the default takes the blockwise one.
  short = attention.BLOCKWISE_MIN_LENGTH // 2
  assert temp(short, blockwise=None) == temp(short, blockwise=False)  # Below the threshold: the dense program.


def test_bad_arguments_name_the_value():
  q = jnp.zeros((1, 16, 4, 32))
  with pytest.raises(ValueError, match="blockwise=True applies to implementation='xla' only"):
    attention.attend(q, q, q, implementation="pallas", blockwise=True)
  with pytest.raises(ValueError, match="length=15"):
    bw.blockwise_attention(q[:, :15], q[:, :15], q[:, :15], mask="verified", diffusion_block=4)
  with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
    bw.blockwise_attention(q, q[:, :, :3], q[:, :, :3])
  with pytest.raises(ValueError, match="diffusion_block=None"):
    bw.blockwise_attention(q, q, q, mask="block_causal")
  with pytest.raises(ValueError, match="block_k=0"):
    bw.BlockSizes(64, 0)
