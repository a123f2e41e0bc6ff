"""Measuring speed: the peak FLOP/s that MFU is quoted against, and a wall-clock timer for jitted calls.

On an accelerator, model FLOPs utilisation divides by the chip's datasheet peak for the compute dtype (dense, no
sparsity), as MaxText and the PaLM paper quote it; a measured matmul would flatter the model by the matmul's own
inefficiency. On a CPU no datasheet applies and the host's capacity varies (BUILD_NOTES.md), so the peak is a
measured f32 matmul.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Dense peak FLOP/s per chip by compute dtype, from the vendors' datasheets. float32 on NVIDIA chips is TF32 on the
# tensor cores (what XLA uses for f32 matmuls at JAX's default precision). TPUs run f32 matmuls as several bf16
# passes, which has no datasheet figure: MFU is not reported for them.
DATASHEET_PEAK_FLOPS: dict[str, dict[str, float]] = {
  # NVIDIA H100 SXM5 datasheet: BF16/FP16 989.4 TFLOPS, TF32 494.7 TFLOPS (dense; twice that with sparsity).
  "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
  # NVIDIA H200 SXM datasheet: the H100's tensor cores with more memory; the same dense peaks.
  "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
  # NVIDIA HGX B200 datasheet, per GPU: BF16/FP16 2.25 PFLOPS, TF32 1.1 PFLOPS (dense).
  "B200": {"bfloat16": 2.25e15, "float16": 2.25e15, "float32": 1.1e15},
  # Google Cloud TPU system architecture pages, per chip, bf16.
  "TPU v4": {"bfloat16": 275e12},
  "TPU v5e": {"bfloat16": 197e12},
  "TPU v5p": {"bfloat16": 459e12},
  "TPU v6e": {"bfloat16": 918e12},
}
# How JAX names the chips (``device.device_kind``), mapped to the table's keys; checked in this order.
_DEVICE_KINDS = (
  (r"H100", "H100"),
  (r"H200", "H200"),
  (r"B200", "B200"),
  (r"TPU v4", "TPU v4"),
  (r"TPU v5 ?(lite|e)", "TPU v5e"),
  (r"TPU v5p?$", "TPU v5p"),
  (r"TPU v6 ?(lite|e)", "TPU v6e"),
)


def chip_name(device_kind: str) -> str | None:
  """The datasheet table's name for a ``device.device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``)."""
  for pattern, name in _DEVICE_KINDS:
    if re.search(pattern, device_kind):
      return name
  return None


def datasheet_peak(device_kind: str, dtype: str) -> float | None:
  """Dense datasheet peak FLOP/s of one chip for ``dtype``, or None for a chip or dtype the table does not know."""
  name = chip_name(device_kind)
  return DATASHEET_PEAK_FLOPS.get(name, {}).get(dtype) if name else None


def peak_flops(device, dtype: str) -> tuple[float | None, str]:
  """The FLOP/s that MFU divides by for one ``device`` computing in ``dtype``, and where it comes from.

  Returns:
    ``(peak, source)``: the datasheet peak of an accelerator (``source`` names the chip), a measured f32 matmul on a
    CPU (``"measured"``), or ``(None, reason)`` for an accelerator the table does not know.
  """
  if device.platform == "cpu":
    return _cpu_peak(), "measured f32 matmul"
  peak = datasheet_peak(device.device_kind, dtype)
  if peak is None:
    return None, f"no datasheet peak for {device.device_kind!r} in {dtype}"
  return peak, f"{chip_name(device.device_kind)} datasheet, {dtype}"


@functools.cache
def _cpu_peak() -> float:
  """:func:`matmul_peak` once per process (a process that trains several times, as the tests do, measures once)."""
  return matmul_peak()


def matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
  """Best FLOP/s of a jitted ``n x n @ n x n`` matmul on the default device (one device).

  The CPU's MFU denominator (see :func:`peak_flops`): the available capacity varies with the host.
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
