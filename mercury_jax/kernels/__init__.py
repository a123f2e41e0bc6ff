"""Pallas kernels (GPU via Triton; any backend with interpret=True)."""
