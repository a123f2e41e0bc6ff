"""Measuring speed: the matmul peak that MFU is quoted against, and a wall-clock timer for jitted calls."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
  """Best FLOP/s of a jitted ``n x n @ n x n`` matmul on the default device (one device).

  On accelerators use the datasheet peak instead; on CPU this measured peak is the honest denominator, since the
  available capacity varies with the host (see BUILD_NOTES.md).
  """
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = min(time_call(matmul, a) for _ in range(repeats))
  return 2.0 * n**3 / best


def time_call(fn: Callable, *args) -> float:
  """Seconds for one call of a jitted ``fn``, waiting for the result."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start
