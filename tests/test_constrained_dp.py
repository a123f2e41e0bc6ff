"""The constrained proposal's dynamic program against brute force, and the forced-token walk."""

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.sampling import automata as device
from mercury_jax.sampling.proposal import Knobs

MASK = 5  # the tiny vocabulary's mask id: tokens 0..4 are text, 5 is the mask


def tiny_automaton(table: np.ndarray, accepting: np.ndarray, start: int):
  """An automaton-shaped object over a token-level table [states, vocab] (every token its own class)."""
  states, vocab = table.shape
  distance = np.where(accepting, 0, 10**6).astype(np.int32)
  for _ in range(states):  # Bellman-Ford on the reversed graph
    nxt = np.where(table >= 0, distance[np.maximum(table, 0)] + 1, 10**6).min(axis=1)
    distance = np.minimum(distance, nxt).astype(np.int32)
  forced = np.where((table >= 0).sum(axis=1) == 1, np.argmax(table >= 0, axis=1), -1).astype(np.int32)
  return types.SimpleNamespace(
    classes=np.arange(vocab + 1, dtype=np.int32) % vocab,  # the mask id shares token 0's class; never scored
    table=table.astype(np.int32),
    accepting=accepting,
    distance=distance,
    forced=forced,
    free=np.zeros(states, bool),
    start=start,
    num_states=states,
    num_classes=vocab,
    num_edges=int((table >= 0).sum()),
    mask_id=MASK,
  )


def walk(a, state, tokens):
  for t in tokens:
    if state < 0:
      return -1
    state = int(a.table[state, a.classes[t]])
  return state


# A DFA over tokens 0..4 with a cycle, a dead end avoided only by looking ahead, and a single-token state.
TABLE = np.array(
  [
    # 0    1   2   3   4
    [1, 2, -1, -1, 0],  # state 0 (start)
    [-1, 3, 3, -1, -1],  # state 1
    [-1, -1, -1, 4, -1],  # state 2: only token 3 (forced)
    [0, -1, 4, -1, 3],  # state 3
    [4, 4, -1, 1, -1],  # state 4 (accepting)
  ]
)
ACCEPTING = np.array([False, False, False, False, True])


@pytest.mark.parametrize("budget", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_dp_string_is_the_best_valid_string(seed, budget):
  rng = np.random.default_rng(seed)
  a = tiny_automaton(TABLE, ACCEPTING, start=0)
  length = 4
  logits = rng.normal(size=(1, length, 5)).astype(np.float32) * 3
  z = np.full((1, length), MASK)
  committed = rng.random(length) < 0.3
  # Commit positions to a valid string's tokens so that a valid completion exists.
  valid = [s for s in itertools.product(range(5), repeat=length) if walk(a, 0, s) >= 0]
  reference = valid[rng.integers(len(valid))]
  z[0, committed] = np.asarray(reference)[committed]
  remaining = np.arange(length)[::-1][None].copy()  # the hole ends with the block
  t = device.tables([a], device.capacity_of([a]), vocab=6)
  t = t._replace(budgeted=np.array([budget]))
  t = jax.tree.map(jnp.asarray, t)
  hole = jnp.ones((1, length), bool)
  clean = jnp.pad(jnp.asarray(logits), ((0, 0), (0, 0), (0, 1)), constant_values=-jnp.inf)
  knobs = Knobs(*(jnp.asarray([v]) for v in (0.0, 0, 1.0, 0.9)))
  noise = jnp.full((1, length, 6), 0.5)
  class_noise = jnp.full((1, length, t.table.shape[2]), 0.5)
  block = device.Block(jnp.asarray([0]), jnp.asarray(z), hole, jnp.asarray(remaining), MASK)
  x0, found = device.propose(t, block, clean, knobs, noise, class_noise)
  x0 = np.asarray(x0)[0]
  chosen = np.where(committed, z[0], x0)

  def score(s):
    return sum(logits[0, i, tok] for i, tok in enumerate(s) if not committed[i])

  def ok(s):
    end = walk(a, 0, s)
    return end >= 0 and all(s[i] == z[0, i] for i in range(length) if committed[i]) and (not budget or ACCEPTING[end])

  brute = max((s for s in itertools.product(range(5), repeat=length) if ok(s)), key=score, default=None)
  assert bool(found[0]) == (brute is not None)
  if brute is not None:
    assert ok(tuple(chosen)), (chosen, brute)
    np.testing.assert_allclose(score(tuple(chosen)), score(brute), rtol=1e-6)
    assert tuple(chosen) == brute


def test_force_commits_single_token_states_while_the_state_is_known():
  a = tiny_automaton(TABLE, ACCEPTING, start=0)
  t = jax.tree.map(jnp.asarray, device.tables([a], device.capacity_of([a]), vocab=6))
  # 1 -> state 2, whose only token is 3 (forced) -> state 4; then a real choice; the last position stays open.
  z = jnp.asarray([[1, MASK, MASK, MASK]])
  out, forced, end = device.force(t, jnp.asarray([0]), z, jnp.ones((1, 4), bool), MASK)
  assert np.asarray(out).tolist() == [[1, 3, MASK, MASK]]
  assert np.asarray(forced).tolist() == [[False, True, False, False]]
  assert int(end[0]) == device.UNKNOWN
  done, _, end = device.force(t, jnp.asarray([0]), jnp.asarray([[1, MASK, 0, 3]]), jnp.ones((1, 4), bool), MASK)
  assert np.asarray(done).tolist() == [[1, 3, 0, 3]]
  assert int(end[0]) == walk(a, 0, [1, 3, 0, 3])
