"""Test set-up: simulate 8 CPU devices (must happen before jax is imported anywhere)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  """../shared/data next to the checkout; tests that need it skip cleanly when absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"shared test data not found at {SHARED_DATA} (only present in the dev/CI sandbox)")
  return SHARED_DATA
