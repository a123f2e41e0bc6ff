"""Measuring speed: the peak FLOP/s that MFU is quoted against, the one wall-clock timer of every benchmark, and
the machine a measurement was taken on.

On an accelerator, model FLOPs utilisation divides by the chip's datasheet peak for the compute dtype (dense, no
sparsity), as MaxText and the PaLM paper quote it; a measured matmul would flatter the model by the matmul's own
inefficiency. On a CPU no datasheet applies and the host's capacity varies (BUILD_NOTES.md), so the peak is a
measured f32 matmul.

The timer: :func:`timed` (a call's result and its seconds, waiting for the result), :func:`time_call` (its seconds),
:func:`median_seconds` / :func:`best_seconds` (a warmed-up call repeated) and :func:`interleaved` (several calls in
turn, round after round, so that a drift of a shared host's speed hits them alike). Every ``python -m
mercury_jax.bench`` command times with these.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
  return 2.0 * n**3 / best_seconds(jax.jit(lambda x: x @ x), jnp.ones((n, n), dtype), repeats=repeats)


def timed(fn: Callable, *args, **kwargs) -> tuple[Any, float]:
  """One call of ``fn`` (jitted or not): its result, computed (``jax.block_until_ready``), and its wall seconds."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, time.perf_counter() - start


def time_call(fn: Callable, *args) -> float:
  """Seconds for one call of ``fn``, waiting for the result."""
  return timed(fn, *args)[1]


def median_seconds(fn: Callable, *args, repeats: int, warm: bool = True) -> float:
  """The median seconds of ``repeats`` calls of ``fn`` (after one untimed call that compiles and warms it up)."""
  if warm:
    jax.block_until_ready(fn(*args))
  return statistics.median(time_call(fn, *args) for _ in range(repeats))


def best_seconds(fn: Callable, *args, repeats: int, warm: bool = True) -> float:
  """The fewest seconds of ``repeats`` calls of ``fn`` (after one untimed call that compiles and warms it up)."""
  if warm:
    jax.block_until_ready(fn(*args))
  return min(time_call(fn, *args) for _ in range(repeats))


def interleaved(
  calls: dict[str, tuple[Callable, tuple]], repeats: int, *, order: str = "rotate", warm: bool = True
) -> dict[str, list[float]]:
  """Each call's seconds over ``repeats`` rounds that run every call once, in turn (``{name: (fn, args)}``).

  Args:
    calls: The calls, by name.
    repeats: Rounds.
    order: ``rotate``: round ``r`` starts at the ``r``-th call; ``alternate``: every other round runs them in
      reverse; ``same``: always in the order given.
    warm: Run each call once untimed first (it compiles, and a first call allocates).
  """
  names = list(calls)
  if warm:
    for fn, args in calls.values():
      jax.block_until_ready(fn(*args))
  seconds: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    if order == "rotate":
      turn = names[r % len(names) :] + names[: r % len(names)]
    else:
      turn = names[::-1] if order == "alternate" and r % 2 else names
    for name in turn:
      fn, args = calls[name]
      seconds[name].append(time_call(fn, *args))
  return seconds


def cpu_name() -> str:
  """The host CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def host_info() -> dict[str, Any]:
  """The host a benchmark ran on and its load when it started, without starting JAX (a client beside a server)."""
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "cpu": cpu_name(),
    "cpu_count": os.cpu_count(),
    "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "load_average": list(os.getloadavg()),
    "platform": platform.platform(),
    "python": platform.python_version(),
  }


def machine_info() -> dict[str, Any]:
  """:func:`host_info` and the JAX devices a benchmark ran on (for results files)."""
  devices = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
  return {**host_info(), **devices, "devices": jax.device_count()}
