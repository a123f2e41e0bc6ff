"""TPU splash attention (interpret mode on CPU) with the masks of ``mercury_jax.kernels.masks``, against the reference.

The same ``masks.dense`` drives the XLA path, the Pallas kernel and, through ``masks.splash_mask``, splash attention;
this checks that a TPU user gets BD3-LM's block_diffusion mask from one call. Splash takes ``[heads, length,
head_dim]``, does not scale q, and needs lengths that are multiples of its 128-wide tiles. Tolerances as in
``test_kernels.py`` (float32, a different summation order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

from mercury_jax.kernels import flash_attention as fa, masks

F32_OUT = {"atol": 2e-5, "rtol": 2e-5}
F32_GRAD = {"atol": 5e-5, "rtol": 5e-5}
TILES = sk.BlockSizes(*(128,) * 8)  # block_q, block_kv, block_kv_compute and the five backward blocks.


def _splash(mask, heads: int, head_dim: int, segment_ids):
  """``fn(q, k, v)`` over ``[batch=1, length, heads, head_dim]`` (the reference's layout) running splash attention."""
  kernel = sk.make_splash_mha(mask, block_sizes=TILES, head_shards=1, q_seq_shards=1, interpret=True)
  segments = None if segment_ids is None else sk.SegmentIds(q=segment_ids[0], kv=segment_ids[0])

  def fn(q, k, v):
    heads_first = lambda x: jnp.swapaxes(x[0], 0, 1)  # [heads, length, head_dim]
    out = kernel(heads_first(q) * head_dim**-0.5, heads_first(k), heads_first(v), segment_ids=segments)
    return jnp.swapaxes(out, 0, 1)[None]  # [1, length, heads, head_dim]

  return fn


@pytest.mark.parametrize(
  "diffusion_block,segments",
  [(24, False), (160, False), (16, True)],
  ids=["block24", "block160", "block16-packed"],
)
def test_splash_block_diffusion_matches_reference(diffusion_block, segments):
  """Forward and dq, dk, dv; blocks that divide no tile (24) or span two (160); packed documents with padding (0)."""
  half, heads, head_dim = 128, 2, 64
  length = 2 * half
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.float32) for _ in range(4))
  segment_ids, real = None, np.ones(length, bool)
  if segments:  # Three documents and a padding tail in x_t, the same ids again for x_0.
    ids = np.repeat([1, 2, 3, 0], [40, 50, 28, 10])
    segment_ids = jnp.asarray(np.tile(ids, 2)[None], jnp.int32)
    real = np.tile(ids, 2) != 0
  mask = masks.splash_mask(length, "block_diffusion", block=diffusion_block, half=half, heads=heads)
  options = {"segment_ids": segment_ids, "mask": "block_diffusion", "diffusion_block": diffusion_block}
  reference = lambda q, k, v: fa.reference_attention(q, k, v, **options)
  splash = _splash(mask, heads, head_dim, segment_ids)
  got, want = ((lambda out, vjp: (out, *vjp(do)))(*jax.vjp(fn, q, k, v)) for fn in (splash, jax.jit(reference)))
  # Splash treats segment 0 like any other id (padding rows see the padding keys), so compare real positions: a real
  # query sees only real keys in both, and a padding query sends gradient only to padding keys.
  for name, g, w, tol in zip(
    ("out", "dq", "dk", "dv"), got, want, (F32_OUT, F32_GRAD, F32_GRAD, F32_GRAD), strict=True
  ):
    np.testing.assert_allclose(np.asarray(g)[:, real], np.asarray(w)[:, real], err_msg=name, **tol)
