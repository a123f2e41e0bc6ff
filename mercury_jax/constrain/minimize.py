"""Minimizing a byte automaton's table (``columns [states, classes]``, ``accepting``), at the level of arrays:
merging equal columns into byte classes, trimming the states that are not reachable or cannot reach acceptance, and
finding the classes of equivalent states: one pass from the last states back when the automaton has no cycle
(a state's class is its acceptance and its successors' classes), else Moore's partition refinement within a work
budget (past it, or on a hash collision, states are left apart: the language is the same).
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csgraph, csr_matrix

from mercury_jax.constrain import meter

MOORE_WORK = 20_000_000  # Table cells Moore's refinement may visit (rounds * states * byte classes) before it stops.
MOORE_SCALE = 8  # Table cells per unit of a compile attempt's work (meter.spend): a round is vectorized.


def compressed(columns: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The table with equal columns merged, numbered by first byte: ``(columns, classes)``."""
  k = columns.shape[1]
  if k <= 1:
    return columns, classes
  weights = np.random.default_rng(3).integers(1, 2**62, size=len(columns), dtype=np.int64)
  hashes = weights @ (columns.astype(np.int64) + 1)  # wraps around: a hash of each column
  _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
  if len(first) == k:
    kept, inverse = np.arange(k), np.arange(k)
  elif np.array_equal(columns[:, first[inverse.reshape(-1)]], columns):
    kept, inverse = first, inverse.reshape(-1)
  else:  # a collision: compare exactly
    _, kept, inverse = np.unique(columns, axis=1, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
  order = np.argsort(kept, kind="stable")
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  return columns[:, kept[order]], rank[inverse][classes]


def trimmed(columns: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
  """Only the states reachable from the start that can reach acceptance, numbered by first visit; None when the
  start cannot."""
  n = len(columns)
  src, cls = np.nonzero(columns >= 0)
  dst = columns[src, cls]
  graph = csr_matrix((np.ones(len(src), np.int8), (src, dst)), shape=(n, n))
  forward = csgraph.breadth_first_order(graph, 0, directed=True, return_predecessors=False)
  finals = np.flatnonzero(accepting)
  back = csr_matrix(
    (
      np.ones(len(src) + len(finals), np.int8),
      (np.concatenate([dst, np.full(len(finals), n)]), np.concatenate([src, finals])),
    ),
    shape=(n + 1, n + 1),
  )  # reversed edges, and a virtual state n before every accepting one
  live = np.zeros(n + 1, bool)
  live[csgraph.breadth_first_order(back, n, directed=True, return_predecessors=False)] = True
  keep = np.zeros(n, bool)
  keep[forward] = True
  keep &= live[:n]
  if not keep[0]:
    return None
  order = forward[keep[forward]]  # breadth-first from the start: the start stays 0
  renumber = np.full(n + 1, -1, np.int64)
  renumber[order] = np.arange(len(order))
  out = renumber[np.where(columns[order] >= 0, columns[order], n)]
  return out.astype(np.int32), accepting[order]


def _acyclic(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
  """Equivalence classes of the states of an automaton without cycles, classed from the last states back (a state
  once all its successors are: same acceptance and same successors' classes); None if it has a cycle."""
  rows = columns.tolist()
  final = accepting.tolist()
  n = len(rows)
  block = [-1] * n
  state_of: dict[tuple, int] = {}
  color = [0] * n  # 0 new, 1 on the stack, 2 classed
  for root in range(n):
    if color[root]:
      continue
    stack = [(root, iter(set(rows[root]) - {-1}))]
    color[root] = 1
    while stack:
      state, successors = stack[-1]
      for nxt in successors:
        if color[nxt] == 1:
          return None
        if color[nxt] == 0:
          color[nxt] = 1
          stack.append((nxt, iter(set(rows[nxt]) - {-1})))
          break
      else:
        stack.pop()
        key = (final[state], *[block[t] if t >= 0 else -1 for t in rows[state]])
        block[state] = state_of.setdefault(key, len(state_of))
        color[state] = 2
  return np.asarray(block, np.int64)


def _moore(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
  """Moore's partition refinement (hashed, checked exactly at the end); None when it would take more than
  :data:`MOORE_WORK`, or a hash collision merged states that differ (rare: they are then left apart)."""
  n, k = columns.shape
  missing, targets = columns < 0, np.maximum(columns, 0)
  weights = np.random.default_rng(1).integers(1, 2**63, size=k + 1, dtype=np.uint64)
  block, count, work = accepting.astype(np.int64), len(np.unique(accepting)), 0
  while True:
    work += n * max(k, 1)
    if work > MOORE_WORK:
      return None
    meter.spend(n * max(k, 1) // MOORE_SCALE)
    rows = np.where(missing, 0, block[targets] + 1).astype(np.uint64)
    _, inverse = np.unique((rows * weights[1:]).sum(axis=1) + block.astype(np.uint64) * weights[0], return_inverse=True)
    inverse = inverse.reshape(-1)
    grown = len(np.unique(inverse))
    block, grew, count = inverse.astype(np.int64), grown > count, grown
    if not grew:
      break
  members = np.unique(block, return_index=True)[1]
  rows = np.where(missing, -1, block[targets])
  if np.array_equal(rows, rows[members][block]) and np.array_equal(accepting, accepting[members][block]):
    return block
  return None


def blocks(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
  """The class of equivalent states of each state (module docstring); None when they cannot be told apart within
  the work budget."""
  found = _acyclic(columns, accepting)
  return _moore(columns, accepting) if found is None else found
