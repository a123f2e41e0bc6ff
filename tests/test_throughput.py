"""The peak FLOP/s that MFU divides by: vendor datasheets on accelerators, a measured matmul on the CPU."""

from types import SimpleNamespace

import jax
import pytest

from mercury_jax.bench.throughput import peak_flops


@pytest.mark.parametrize(
  "device_kind, dtype, expected",
  [
    # Dense (no sparsity) tensor-core peaks from the NVIDIA datasheets, and per-chip bf16 peaks from Google Cloud.
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "float32", 494.7e12),  # TF32: what f32 matmuls use at JAX's default precision.
    ("NVIDIA H200", "bfloat16", 989.4e12),
    ("NVIDIA B200", "bfloat16", 2.25e15),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
  ],
)
def test_accelerators_use_the_datasheet_peak_of_their_chip_and_dtype(device_kind, dtype, expected):
  device = SimpleNamespace(platform="tpu" if "TPU" in device_kind else "gpu", device_kind=device_kind)
  peak, source = peak_flops(device, dtype)
  assert peak == expected
  assert "datasheet" in source and dtype in source


@pytest.mark.parametrize("device_kind, dtype", [("NVIDIA A10G", "bfloat16"), ("TPU v5 lite", "float32")])
def test_an_unknown_chip_or_dtype_gives_no_peak_and_says_why(device_kind, dtype):
  peak, reason = peak_flops(SimpleNamespace(platform="gpu", device_kind=device_kind), dtype)
  assert peak is None and device_kind in reason and dtype in reason


def test_the_cpu_peak_is_measured():
  peak, source = peak_flops(jax.devices("cpu")[0], "bfloat16")
  assert source == "measured f32 matmul"
  assert 1e8 < peak < 1e14  # Any CPU: more than 0.1 GFLOP/s, less than 100 TFLOP/s.
