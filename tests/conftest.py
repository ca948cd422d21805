"""Test set-up: simulate 8 CPU devices (must happen before jax is imported anywhere)."""

import hashlib
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (e.g. a run, then its resumption): share them through
# the persistent compilation cache (same executables, so results are unchanged). One cache per
# checkout: suites of several checkouts running at once (worktrees) must not read each other's
# half-written entries (an xdist worker segfaulted in XLA's executable deserialisation so).
_CHECKOUT = hashlib.sha1(str(pathlib.Path(__file__).resolve().parents[1]).encode()).hexdigest()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/attn_jax_test_jax_cache/" + _CHECKOUT[:12])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  """../shared/data next to the checkout; tests that need it skip cleanly when absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"shared test data not found at {SHARED_DATA} (only present in the dev/CI sandbox)")
  return SHARED_DATA
