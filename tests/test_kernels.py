"""The Pallas flash-attention kernel against its plain-jnp reference (interpret mode on CPU; `gpu` twins on a GPU).

Tolerances. float32: the kernel and the reference sum the same terms in a different order (online softmax with
rescaling, exp2 instead of exp), which costs a few float32 ulps per accumulated term; on the lengths here (<= 128 keys)
the measured worst case is 1e-6 for outputs and 5e-6 for gradients, so 2e-5 / 5e-5 (absolute and relative) leave 4-10x
headroom while still catching any masking or indexing error (those are O(0.1) or larger). bfloat16: outputs and
gradients are rounded to bfloat16 (2^-8 relative) and, as in every FlashAttention, the probabilities and dS are
rounded to bfloat16 before their second matmul; the measured worst case is about 1 ulp of the largest value, so the
bound is 2e-2 of the largest reference value (about 5 ulps).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import attention, sharding
from mercury_jax.config import MeshConfig
from mercury_jax.kernels import flash_attention as fa, masks

F32_OUT = {"atol": 2e-5, "rtol": 2e-5}
F32_GRAD = {"atol": 5e-5, "rtol": 5e-5}
BF16_REL = 2e-2
SMALL = fa.BlockSizes(32, 32, 16, 32, 32, 16)  # Several tiles even on short test sequences.


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  length: int
  heads: int
  kv_heads: int
  head_dim: int
  mask: str
  diffusion_block: int | None = None
  segments: bool = False
  blocks: fa.BlockSizes | None = SMALL

  def __str__(self):
    seg = "-seg" if self.segments else ""
    db = f"{self.diffusion_block}" if self.diffusion_block else ""
    return f"b{self.batch}l{self.length}h{self.heads}kv{self.kv_heads}d{self.head_dim}-{self.mask}{db}{seg}"


# Lengths that are not multiples of the 32-row tiles, GQA (2 or 4 query heads per kv head), one head_dim of 128, one
# that is not a power of two, diffusion blocks that do and do not divide the tiles, and three block configurations.
# CASES[1], [2], [7], [9] are also run in bfloat16.
CASES = [
  Case(2, 40, 4, 2, 64, "bidirectional"),
  Case(2, 72, 4, 1, 64, "causal", segments=True),
  Case(1, 100, 4, 2, 64, "block_causal", 16, segments=True),
  Case(1, 100, 4, 4, 64, "block_causal", 7),
  Case(1, 72, 4, 2, 48, "bidirectional", segments=True),
  Case(1, 128, 2, 1, 64, "causal", blocks=fa.BlockSizes(64, 16, 16, 64, 64, 16)),
  # Rows of a query tile that see nothing of its first masked key tile (diffusion_block == block_k < block_q).
  Case(1, 128, 2, 1, 64, "block_causal", 16, blocks=fa.BlockSizes(64, 16, 16, 64, 64, 16)),
  Case(2, 64, 2, 2, 128, "causal", blocks=None),
  Case(1, 100, 2, 2, 64, "block_causal", 32, blocks=None),
  # block_diffusion over x_t ⊕ x_0: halves of 37, 40, 50 and 64 tokens (the first three not multiples of the tiles),
  # blocks that divide the tiles, divide none (5) or outgrow them (48 > 32), GQA, packed segments with padding (0).
  Case(1, 74, 4, 2, 64, "block_diffusion", 8, segments=True),
  Case(2, 80, 4, 1, 32, "block_diffusion", 5, segments=True),
  Case(1, 100, 2, 2, 64, "block_diffusion", 48),
  # Rows that see nothing of the first tiles of a masked range (diffusion_block == block_k < block_q).
  Case(1, 128, 2, 1, 64, "block_diffusion", 16, blocks=fa.BlockSizes(64, 16, 16, 64, 64, 16)),
  Case(1, 200, 2, 2, 64, "block_diffusion", 32, segments=True, blocks=None),
  Case(1, 96, 2, 1, 48, "block_diffusion", 1, segments=True),
]


def _inputs(case: Case, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  shape_q = (case.batch, case.length, case.heads, case.head_dim)
  shape_kv = (case.batch, case.length, case.kv_heads, case.head_dim)
  q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape_q, shape_kv, shape_kv))
  do = jnp.asarray(rng.standard_normal(shape_q), dtype)
  segment_ids = None
  if case.segments:  # Packed documents of random lengths, then right padding (segment 0).
    length = case.length // 2 if case.mask == "block_diffusion" else case.length
    ids = np.sort(rng.integers(1, 4, (case.batch, length)), axis=1)
    ids[:, length - rng.integers(3, 12) :] = 0
    if case.mask == "block_diffusion":  # The ids of x_t, then the same ids for x_0.
      ids = np.concatenate([ids, ids], axis=1)
    segment_ids = jnp.asarray(ids, jnp.int32)
  return q, k, v, do, segment_ids


def _out_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do))


def _kernel_and_reference(case: Case, dtype, interpret: bool = True):
  q, k, v, do, segment_ids = _inputs(case, dtype)
  options = {"segment_ids": segment_ids, "mask": case.mask, "diffusion_block": case.diffusion_block}
  kernel = jax.jit(
    lambda q, k, v, do: _out_and_grads(
      lambda q, k, v: fa.flash_attention(q, k, v, block_sizes=case.blocks, interpret=interpret, **options), q, k, v, do
    )
  )
  reference = jax.jit(
    lambda q, k, v, do: _out_and_grads(lambda q, k, v: fa.reference_attention(q, k, v, **options), q, k, v, do)
  )
  f32 = lambda xs: [x.astype(jnp.float32) for x in xs]
  return f32(kernel(q, k, v, do)), f32(reference(*f32((q, k, v, do))))


def _check_f32(got, want):
  for name, g, w, tol in zip(
    ("out", "dq", "dk", "dv"), got, want, (F32_OUT, F32_GRAD, F32_GRAD, F32_GRAD), strict=True
  ):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=name, **tol)


def _check_bf16(got, want):
  for name, g, w in zip(("out", "dq", "dk", "dv")[: len(got)], got, want, strict=True):
    bound = BF16_REL * float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=bound, rtol=0, err_msg=name)


# The default run checks one case per mask kind (with segments, GQA and the partial-tile case) and four of
# block_diffusion; `-m slow` adds the rest of the grid (other lengths, head_dims and block configurations).
DEFAULT_CASES = (0, 1, 2, 6, 9, 10, 11, 12)
GRID = [pytest.param(c, id=str(c), marks=() if i in DEFAULT_CASES else pytest.mark.slow) for i, c in enumerate(CASES)]


@pytest.mark.parametrize("case", GRID)
def test_float32_forward_and_grads_match_reference(case):
  _check_f32(*_kernel_and_reference(case, jnp.float32))


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[7], CASES[9]], ids=str)
def test_bfloat16_forward_and_grads_match_reference(case):
  _check_bf16(*_kernel_and_reference(case, jnp.bfloat16))


def test_padding_queries_output_zeros_and_get_no_gradient():
  case = Case(1, 40, 2, 1, 64, "causal", segments=True)
  q, k, v, do, _ = _inputs(case, jnp.float32)
  segment_ids = jnp.asarray([[1] * 10 + [2] * 20 + [0] * 10], jnp.int32)
  out, dq, dk, dv = _out_and_grads(
    lambda q, k, v: fa.flash_attention(
      q, k, v, segment_ids=segment_ids, mask="causal", block_sizes=SMALL, interpret=True
    ),
    q,
    k,
    v,
    do,
  )
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in (out, dq, dk, dv))
  np.testing.assert_array_equal(np.asarray(out[:, 30:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[:, 30:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dk[:, 30:]), 0.0)  # Padding keys are seen by nobody.
  # Every implementation agrees on the padding rows, including XLA, whose softmax would average them otherwise.
  xla = attention.attend(q, k, v, causal=True, segment_ids=segment_ids, implementation="xla")
  np.testing.assert_allclose(np.asarray(xla), np.asarray(out), **F32_OUT)


def test_reference_matches_brute_force_loops():
  case = Case(1, 12, 2, 1, 16, "block_causal", 4, segments=True, blocks=None)
  q, k, v, _, _ = _inputs(case, jnp.float32, seed=3)
  segment_ids = np.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
  got = np.asarray(
    fa.reference_attention(q, k, v, segment_ids=jnp.asarray(segment_ids), mask="block_causal", diffusion_block=4)
  )
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  for h in range(2):
    for i in range(12):
      keys = [j for j in range(12) if j // 4 <= i // 4 and segment_ids[0, j] == segment_ids[0, i] != 0]
      if not keys:
        np.testing.assert_array_equal(got[0, i, h], 0.0)
        continue
      logits = np.array([q[0, i, h] @ k[0, j, 0] for j in keys]) / 4.0
      weights = np.exp(logits - logits.max())
      np.testing.assert_allclose(got[0, i, h], (weights / weights.sum()) @ v[0, keys, 0], atol=1e-5)


def _padded_visibility(plan):
  """``(visible [length, length], real [length])`` in the plan's padded layout, built from ``masks.dense``.

  ``visible[i, j]``: padded query ``i`` sees padded key ``j``; padding keys are seen by nobody. A padding query of a
  two-halves (``block_diffusion``, ``verified``) half sees nothing; one at the end of a one-part sequence sees what its
  position sees.
  """
  if plan.half:
    n, half = plan.q_len, plan.half
    where = np.concatenate([np.arange(n), half + np.arange(n)])  # The padded position of each real position.
    visible = np.zeros((plan.length, plan.length), bool)
    visible[np.ix_(where, where)] = masks.dense(2 * n, plan.mask, block=plan.diffusion_block, half=n)
    real = np.zeros(plan.length, bool)
    real[where] = True
    return visible, real
  visible = np.array(masks.dense(plan.length, plan.mask, block=plan.diffusion_block))
  visible[:, plan.q_len :] = False
  return visible, np.arange(plan.length) < plan.q_len


@pytest.mark.parametrize(
  "mask,diffusion_block",
  [
    ("bidirectional", None),
    ("causal", None),
    ("block_causal", 24),
    ("block_causal", 5),
    ("block_diffusion", 5),
    ("block_diffusion", 16),
    ("block_diffusion", 40),
    ("verified", 4),
    ("verified", 5),
    ("verified", 40),
  ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_loop_bounds_visit_exactly_the_visible_tiles(mask, diffusion_block, padded):
  """The ranges of a tile hold exactly the tiles with a visible (real query, real key) pair, each once; the tiles in
  the unmasked ranges are seen whole by every query of the pair of tiles, padding included (no mask needed).

  Query tiles over key tiles are the forward and dq loops, key tiles over query tiles the dkv loop; both with the
  larger and with the smaller tile on the outside. 64 padded positions; the two-halves masks have halves of 32.
  """
  length, parts = 64, 2 if mask in ("block_diffusion", "verified") else 1
  real = length // parts - (7 if padded else 0)  # Real positions per part.
  plan = fa._Plan(
    mask=mask,
    diffusion_block=diffusion_block or 1,
    sm_scale=1.0,
    q_len=real,
    kv_len=real,
    length=length,
    groups=1,
    head_dim=16,
    blocks=SMALL,
    interpret=True,
    half=length // 2 if parts == 2 else 0,
  )
  visible, is_real = _padded_visibility(plan)
  for size, other, by_query in [(16, 8, True), (8, 16, True), (16, 8, False), (8, 16, False)]:
    seen = visible if by_query else visible.T  # [tile side, other side]
    for tile in range(length // size):
      ranges = [
        (int(f), int(e), positional) for _, f, e, positional in plan.tile_ranges(jnp.int32(tile), size, other, by_query)
      ]
      visited = [t for first, end, _ in ranges for t in range(first, end)]
      unmasked = {t for first, end, positional in ranges if not positional for t in range(first, end)}
      assert len(visited) == len(set(visited)), (tile, ranges)
      mine = slice(tile * size, (tile + 1) * size)
      for t in range(length // other):
        theirs = slice(t * other, (t + 1) * other)
        pairs = seen[mine, theirs]
        assert (t in visited) == pairs[is_real[mine]][:, is_real[theirs]].any(), (by_query, size, tile, t)
        assert t not in unmasked or pairs.all(), (by_query, size, tile, t)


def test_argument_errors_name_the_value():
  q = jnp.zeros((1, 16, 4, 64))
  with pytest.raises(ValueError, match="kv_heads=3"):
    fa.flash_attention(q, jnp.zeros((1, 16, 3, 64)), jnp.zeros((1, 16, 3, 64)), interpret=True)
  with pytest.raises(ValueError, match="diffusion_block=None"):
    fa.flash_attention(q, q, q, mask="block_causal", interpret=True)
  with pytest.raises(ValueError, match="mask='sliding'"):
    fa.flash_attention(q, q, q, mask="sliding", interpret=True)
  with pytest.raises(ValueError, match="length=15 must be even"):
    fa.flash_attention(q[:, :15], q[:, :15], q[:, :15], mask="block_diffusion", diffusion_block=4, interpret=True)
  with pytest.raises(ValueError, match="diffusion_block=0"):
    fa.flash_attention(q, q, q, mask="block_diffusion", diffusion_block=0, interpret=True)
  with pytest.raises(ValueError, match="block_k=24"):
    fa.BlockSizes(32, 24, 32, 32, 32, 32)
  with pytest.raises(ValueError, match="causal=True contradicts"):
    attention.attend(q, q, q, causal=True, mask="bidirectional")


def test_auto_implementation_is_pallas_on_gpu_and_xla_elsewhere(monkeypatch):
  assert attention.resolve_implementation("auto") == "xla"
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
  assert attention.resolve_implementation("auto") == "pallas"
  with pytest.raises(ValueError, match="'flash'"):
    attention.resolve_implementation("flash")


def test_cudnn_refuses_float32_with_a_clear_error():
  q = jnp.zeros((1, 16, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="float16 or bfloat16"):
    attention.attend(q, q, q, implementation="cudnn")


@pytest.mark.parametrize("mask", ["bidirectional", "causal", "block_causal", "block_diffusion", "verified"])
def test_kernels_lower_to_triton_for_gpu(mask):
  """The GPU lowering (Pallas -> Triton IR) runs on any host; a missing Triton lowering rule fails here."""
  q = jax.ShapeDtypeStruct((2, 1000, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
  segment_ids = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
  diffusion_block = 100 if mask in ("block_causal", "block_diffusion", "verified") else None

  def loss(q, k, v, segment_ids):
    out = fa.flash_attention(q, k, v, segment_ids=segment_ids, mask=mask, diffusion_block=diffusion_block)
    return out.astype(jnp.float32).sum()

  for segments in (None, segment_ids):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, segments).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3  # forward, dkv, dq


def _mesh_case(kv_heads: int):
  case = Case(4, 40, 4, kv_heads, 64, "block_causal", 8, segments=True)
  q, k, v, do, segment_ids = _inputs(case, jnp.float32)

  def run(q, k, v, do):
    fn = lambda q, k, v: attention.attend(
      q, k, v, segment_ids=segment_ids, implementation="pallas", mask="block_causal", diffusion_block=8
    )
    return _out_and_grads(fn, q, k, v, do)

  return q, k, v, do, run


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_pallas_attend_sharded_equals_unsharded(kv_heads):
  """batch over (data, fsdp), heads over tensor; one kv head cannot split over tensor=2 and is gathered per shard."""
  q, k, v, do, run = _mesh_case(kv_heads)
  want = jax.jit(run)(q, k, v, do)
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    got = jax.jit(run)(q, k, v, do)
    assert "shard_map" in str(jax.make_jaxpr(run)(q, k, v, do))
  _check_f32(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_float32_forward_and_grads_match_reference(case):
  _check_f32(*_kernel_and_reference(case, jnp.float32, interpret=False))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_bfloat16_forward_and_grads_match_reference(case):
  _check_bf16(*_kernel_and_reference(case, jnp.bfloat16, interpret=False))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas", "cudnn"])
def test_gpu_attend_implementations_match_xla(implementation):
  case = Case(2, 256, 8, 2, 128, "causal", segments=True)
  q, k, v, _, segment_ids = _inputs(case, jnp.bfloat16)
  want = attention.attend(q, k, v, causal=True, segment_ids=segment_ids, implementation="xla").astype(jnp.float32)
  got = attention.attend(q, k, v, causal=True, segment_ids=segment_ids, implementation=implementation)
  _check_bf16([got.astype(jnp.float32)], [want])
