"""The ``verified`` training mask (TiDAR) and the ``verify_chunk`` inference mask, against rules written as loops.

The training layout is ``[draft half ; clean half]`` of ``2n`` positions: a draft query of block ``b`` (``k`` tokens)
sees its own block's drafts and the clean tokens before ``b * k``; a clean query sees the clean tokens up to itself.
Every implementation (``masks.dense``, the XLA path, the Pallas kernel in interpret mode, the splash mask) is checked
against that rule spelled out independently here. Tolerances as in ``test_kernels.py`` (float32, the same terms
summed in another order: a few ulps; a masking error is O(0.1)).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import attention
from mercury_jax.kernels import cached_attention as ca, flash_attention as fa, masks
from mercury_jax.kernels.common import CachedInputs

F32_OUT = {"atol": 2e-5, "rtol": 2e-5}
F32_GRAD = {"atol": 5e-5, "rtol": 5e-5}
SMALL = fa.BlockSizes(32, 32, 16, 32, 32, 16)
DRAFTS = (1, 2, 4, 8)


def _rule(n: int, k: int) -> np.ndarray:
  """``[2n, 2n]``: the verified mask by its definition, one pair at a time."""
  out = np.zeros((2 * n, 2 * n), bool)
  for i in range(2 * n):
    for j in range(2 * n):
      if i < n:  # a draft query
        block_start = (i // k) * k
        own_block = j < n and block_start <= j < block_start + k
        context = j >= n and j - n < block_start
        out[i, j] = own_block or context
      else:  # a clean query
        out[i, j] = n <= j <= i
  return out


def _attention_loops(q, k, v, visible):
  """Softmax attention by loops in float64 over ``visible [batch, q, k]``; rows that see nothing output zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, length, heads, dim = q.shape
  groups = heads // k.shape[2]
  out = np.zeros(q.shape)
  for b in range(batch):
    for h in range(heads):
      for i in range(length):
        keys = [j for j in range(length) if visible[b, i, j]]
        if keys:
          logits = np.array([q[b, i, h] @ k[b, j, h // groups] for j in keys]) / np.sqrt(dim)
          weights = np.exp(logits - logits.max())
          out[b, i, h] = (weights / weights.sum()) @ v[b, keys, h // groups]
  return out


@pytest.mark.parametrize("k", DRAFTS)
@pytest.mark.parametrize("n", [8, 16])
def test_dense_and_visible_follow_the_rule(n, k):
  want = _rule(n, k)
  np.testing.assert_array_equal(masks.dense(2 * n, "verified", block=k, half=n), want)
  rows, cols = np.arange(2 * n)[:, None], np.arange(2 * n)[None, :]
  np.testing.assert_array_equal(masks.visible(rows, cols, "verified", block=k, half=n), want)
  np.testing.assert_array_equal(np.asarray(masks.dense(2 * n, "verified", block=k, half=n, xp=jnp)), want)


def test_verified_differs_from_block_diffusion_only_in_the_clean_half():
  n, k = 16, 4
  verified = masks.dense(2 * n, "verified", block=k, half=n)
  bd = masks.dense(2 * n, "block_diffusion", block=k, half=n)
  np.testing.assert_array_equal(verified[:n], bd[:n])  # The draft half is BD3-LM's.
  np.testing.assert_array_equal(verified[n:, n:], np.tril(np.ones((n, n), bool)))  # The clean half is causal.
  assert not verified[n:, :n].any()  # A clean token never sees a draft.


@pytest.mark.parametrize("k", [1, 4])
def test_splash_mask_holds_the_dense_mask(k):
  """TPU splash gets ``verified`` through ``NumpyMask`` (its kernel is TPU-only; test_splash.py runs it for
  block_diffusion in interpret mode): each head's array is the rule."""
  n, heads = 16, 3
  mask = masks.splash_mask(2 * n, "verified", block=k, half=n, heads=heads)
  assert len(mask.masks) == heads
  for head in mask.masks:
    np.testing.assert_array_equal(head.array, _rule(n, k))


def _packed(n: int) -> np.ndarray:
  """``[2, n]`` segment ids: two documents then a padding tail (segment 0); one document then a second."""
  segments = np.ones((2, n), np.int32)
  segments[0, n // 3 :] = 2
  segments[0, n - 3 :] = 0
  segments[1, n // 2 :] = 2
  return segments


@pytest.mark.parametrize("k", [1, 4])
def test_xla_attention_matches_loops_over_packed_segments(k):
  n, heads, kv_heads, dim = 12, 4, 2, 16
  segments = _packed(n)
  seg2 = np.concatenate([segments, segments], axis=1)  # The same ids for both halves.
  rng = np.random.default_rng(k)
  q = rng.standard_normal((2, 2 * n, heads, dim)).astype(np.float32)
  kk, v = (rng.standard_normal((2, 2 * n, kv_heads, dim)).astype(np.float32) for _ in range(2))
  got = attention.attend(
    q, kk, v, segment_ids=jnp.asarray(seg2), mask="verified", diffusion_block=k, implementation="xla"
  )
  rule = _rule(n, k)
  visible = rule[None] & (seg2[:, :, None] == seg2[:, None, :]) & (seg2 != 0)[:, :, None]
  np.testing.assert_allclose(np.asarray(got), _attention_loops(q, kk, v, visible), atol=1e-5)


# Halves of 37, 40 and 64 tokens (the first two not multiples of the tiles), drafts that divide the tiles, divide
# none (5) or outgrow them (48 > 32), GQA, packed segments with padding (segment 0).
KERNEL_CASES = [
  (1, 74, 4, 2, 64, 4, True, SMALL),
  (2, 80, 4, 1, 32, 5, True, SMALL),
  (1, 100, 2, 2, 64, 48, False, SMALL),
  (1, 128, 2, 1, 64, 16, False, fa.BlockSizes(64, 16, 16, 64, 64, 16)),
  (1, 96, 2, 1, 48, 1, True, SMALL),
]


def _case_id(case) -> str:
  return "b{}l{}h{}kv{}d{}-k{}".format(*case[:6])


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_pallas_forward_and_grads_match_xla(case):
  _check_kernel(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_gpu_pallas_forward_and_grads_match_xla(case):
  _check_kernel(case, interpret=False)


def _check_kernel(case, interpret: bool):
  batch, length, heads, kv_heads, dim, k, segments, blocks = case
  rng = np.random.default_rng(length)
  q, do = (jnp.asarray(rng.standard_normal((batch, length, heads, dim)), jnp.float32) for _ in range(2))
  kk, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads, dim)), jnp.float32) for _ in range(2))
  segment_ids = None
  if segments:
    half = length // 2
    ids = np.sort(rng.integers(1, 4, (batch, half)), axis=1)
    ids[:, half - rng.integers(3, 12) :] = 0
    segment_ids = jnp.asarray(np.concatenate([ids, ids], axis=1), jnp.int32)
  options = {"segment_ids": segment_ids, "mask": "verified", "diffusion_block": k}

  def out_and_grads(fn):
    out, vjp = jax.vjp(fn, q, kk, v)
    return (out, *vjp(do))

  kernel = jax.jit(
    lambda: out_and_grads(
      lambda q, k, v: fa.flash_attention(q, k, v, block_sizes=blocks, interpret=interpret, **options)
    )
  )()
  with jax.default_matmul_precision("float32"):  # No TF32 on a GPU: the XLA path is the float32 truth.
    xla = jax.jit(lambda: out_and_grads(lambda q, k, v: attention.attend(q, k, v, implementation="xla", **options)))()
  tolerances = (F32_OUT, F32_GRAD, F32_GRAD, F32_GRAD)
  for name, g, w, tol in zip(("out", "dq", "dk", "dv"), kernel, xla, tolerances, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=name, **tol)


def _chunk_rule(k: int) -> np.ndarray:
  size = k + k * k
  out = np.zeros((size, size), bool)
  for i in range(size):
    for j in range(size):
      if i < k:  # the causal part: the committed token, then drafts
        out[i, j] = j <= i
      else:  # pre-draft block a sees the committed token, the first a drafts and its own block
        a = (i - k) // k
        first = k + a * k
        out[i, j] = j <= a or first <= j < first + k
  return out


@pytest.mark.parametrize("k", DRAFTS)
def test_verify_chunk_follows_the_rule(k):
  np.testing.assert_array_equal(masks.verify_chunk(k), _chunk_rule(k))
  np.testing.assert_array_equal(np.asarray(masks.verify_chunk(k, xp=jnp)), _chunk_rule(k))


def _chunk_inputs(k: int, slots: int = 24):
  """Two rows: a chunk after 9 committed slots in one segment (slots after the chunk hold another document), and one
  whose cache starts with padding, whose chunk ends in padding."""
  chunk = k + k * k
  starts = np.array([9, 6], np.int32)
  cache_segments = np.ones((2, slots), np.int32)
  cache_segments[0, 9 + chunk :] = 2
  cache_segments[1, :2] = 0
  segments = np.ones((2, chunk), np.int32)
  segments[1, chunk - 2 :] = 0
  return segments, cache_segments, starts


@pytest.mark.parametrize("k", [1, 2, 4])
def test_cached_verify_chunk_follows_the_rule(k):
  segments, cache_segments, starts = _chunk_inputs(k)
  in_cache, in_chunk = masks.cached(segments, cache_segments, starts, "verify_chunk", block=k)
  chunk_rule = _chunk_rule(k)
  for b in range(2):
    for i in range(segments.shape[1]):
      live = segments[b, i] != 0
      for s in range(cache_segments.shape[1]):
        assert in_cache[b, i, s] == (live and s < starts[b] and cache_segments[b, s] == segments[b, i]), (b, i, s)
      for j in range(segments.shape[1]):
        assert in_chunk[b, i, j] == (live and chunk_rule[i, j] and segments[b, j] == segments[b, i]), (b, i, j)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_attend_cached_verify_chunk_matches_loops(implementation):
  """Both implementations run the XLA path (the Pallas cached kernel has no verify_chunk)."""
  k, slots, heads, kv_heads, dim = 2, 24, 4, 2, 16
  segments, cache_segments, starts = _chunk_inputs(k, slots)
  chunk = segments.shape[1]
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, kk, v = normal(2, chunk, heads, dim), normal(2, chunk, kv_heads, dim), normal(2, chunk, kv_heads, dim)
  cache_k, cache_v = normal(2, slots, kv_heads, dim), normal(2, slots, kv_heads, dim)
  got = attention.attend_cached(
    CachedInputs(q, kk, v, segments, cache_k, cache_v, cache_segments, starts),
    mask="verify_chunk",
    diffusion_block=k,
    implementation=implementation,
  )
  in_cache, in_chunk = masks.cached(segments, cache_segments, starts, "verify_chunk", block=k)
  keys, values = np.concatenate([cache_k, kk], axis=1), np.concatenate([cache_v, v], axis=1)
  visible = np.concatenate([in_cache, in_chunk], axis=-1)  # [batch, chunk, slots + chunk]
  qpad = np.concatenate([np.zeros((2, slots, heads, dim), np.float32), q], axis=1)  # queries at the chunk's rows
  vis = np.zeros((2, slots + chunk, slots + chunk), bool)
  vis[:, slots:] = visible
  want = _attention_loops(qpad, keys, values, vis)[:, slots:]
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


# Draft trees (masks.Tree): the chain, a tree with branches and three outcomes, the root alone, no pre-draft block.
TREES = [
  masks.Tree.chain(3),
  masks.Tree((-1, 0, 0, 1, 2, 0, 5), (0, 1, 5), 3),
  masks.Tree((-1,), (0,), 2),
  masks.Tree((-1, 0, 1, 2), (), 2),
]


def _tree_rule(tree: masks.Tree) -> np.ndarray:
  """``[size, size]``: a node sees its ancestors and itself; a pre-draft block the path to its outcome and itself."""
  n, k = tree.nodes, tree.block

  def path(i):
    out = {i}
    while tree.parents[i] >= 0:
      i = tree.parents[i]
      out.add(i)
    return out

  out = np.zeros((tree.size, tree.size), bool)
  for i in range(tree.size):
    for j in range(tree.size):
      if i < n:
        out[i, j] = j < n and j in path(i)
      else:
        b = (i - n) // k
        out[i, j] = (j < n and j in path(tree.outcomes[b])) or n + b * k <= j < n + (b + 1) * k
  return out


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"n{t.nodes}o{len(t.outcomes)}")
def test_tree_chunk_follows_the_rule_and_the_chain_is_tidars_chunk(tree):
  np.testing.assert_array_equal(masks.verify_chunk(tree), _tree_rule(tree))
  np.testing.assert_array_equal(masks.verify_chunk(masks.Tree.chain(4)), _chunk_rule(4))
  segments = np.ones((2, tree.size), np.int32)
  segments[1, -1:] = 0
  cache_segments, starts = np.ones((2, 24), np.int32), np.array([9, 6], np.int32)
  in_cache, in_chunk = masks.cached(segments, cache_segments, starts, "verify_chunk", block=tree)
  np.testing.assert_array_equal(in_chunk[0], _tree_rule(tree))
  assert (in_cache[0] == (np.arange(24) < 9)[None]).all() and not in_cache[1, -1].any() and not in_chunk[1, -1].any()


@pytest.mark.parametrize("blockwise", [False, True])
def test_attend_cached_over_a_tree_matches_loops(blockwise):
  """The XLA path (one softmax, or the cache in tiles up to the chunk's root) over a tree with branches."""
  tree, slots, heads, kv_heads, dim = TREES[1], 24, 4, 2, 16
  chunk = tree.size
  segments = np.ones((2, chunk), np.int32)
  segments[1, chunk - 2 :] = 0
  cache_segments, starts = np.ones((2, slots), np.int32), np.array([9, 6], np.int32)
  cache_segments[1, :2] = 0
  rng = np.random.default_rng(1)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, kk, v = normal(2, chunk, heads, dim), normal(2, chunk, kv_heads, dim), normal(2, chunk, kv_heads, dim)
  cache_k, cache_v = normal(2, slots, kv_heads, dim), normal(2, slots, kv_heads, dim)
  got = attention.attend_cached(
    CachedInputs(q, kk, v, segments, cache_k, cache_v, cache_segments, starts),
    mask="verify_chunk",
    diffusion_block=tree,
    implementation="xla",
    blockwise=blockwise,
  )
  in_cache, in_chunk = masks.cached(segments, cache_segments, starts, "verify_chunk", block=tree)
  keys, values = np.concatenate([cache_k, kk], axis=1), np.concatenate([cache_v, v], axis=1)
  vis = np.zeros((2, slots + chunk, slots + chunk), bool)
  vis[:, slots:] = np.concatenate([in_cache, in_chunk], axis=-1)
  qpad = np.concatenate([np.zeros((2, slots, heads, dim), np.float32), q], axis=1)
  np.testing.assert_allclose(np.asarray(got), _attention_loops(qpad, keys, values, vis)[:, slots:], atol=1e-5)


def test_errors_name_the_value():
  q = jnp.zeros((1, 16, 2, 16))
  with pytest.raises(ValueError, match="diffusion_block=None"):
    attention.attend(q, q, q, mask="verified", implementation="xla")
  with pytest.raises(ValueError, match="even length"):
    attention.attend(q[:, :15], q[:, :15], q[:, :15], mask="verified", diffusion_block=4, implementation="xla")
  with pytest.raises(ValueError, match="length=15 must be even"):
    fa.flash_attention(q[:, :15], q[:, :15], q[:, :15], mask="verified", diffusion_block=4, interpret=True)
  chunk, cache = jnp.zeros((1, 6, 2, 16)), jnp.zeros((1, 8, 2, 16))
  segments, cache_segments, starts = jnp.ones((1, 6), jnp.int32), jnp.ones((1, 8), jnp.int32), jnp.zeros(1, jnp.int32)
  with pytest.raises(ValueError, match="no Pallas kernel"):
    ca.cached_attention(
      CachedInputs(chunk, chunk, chunk, segments, cache, cache, cache_segments, starts),
      mask="verify_chunk",
      diffusion_block=2,
      interpret=True,
    )
  with pytest.raises(ValueError, match="must be a masks.Tree or a positive int"):
    masks.check("verify_chunk", "4", masks.CACHE_MASKS)
  with pytest.raises(ValueError, match="parents=\\(0,\\) must start with -1"):
    masks.Tree((0,), (), 2)
  seg = jnp.ones((1, 5), jnp.int32)
  with pytest.raises(ValueError, match="chunk of its tree's size"):
    masks.cached(seg, jnp.ones((1, 8), jnp.int32), jnp.zeros((1,), jnp.int32), "verify_chunk", block=2)
