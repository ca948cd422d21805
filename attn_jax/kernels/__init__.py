"""Pallas kernels (TPU Mosaic, GPU Triton; the Pallas interpreter on CPU for tests)."""
