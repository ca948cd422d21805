"""Test set-up: simulate 8 CPU devices (must happen before jax is imported anywhere)."""

import hashlib
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's cost is compilation (tiny shapes, hundreds of distinct programs), not execution:
# JAX's switch for test suites turns off XLA's backend (LLVM) optimisations, which changes no
# floating-point semantics (no fast-math) and cut tests/test_ssd.py from 146 to 64 CPU-seconds.
# Subprocesses the tests start (quickstart, faults) inherit it. Benchmarks never run under it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Many tests compile the same programs (e.g. a run, then its resumption): share them through
# the persistent compilation cache (same executables, so results are unchanged). One cache per
# checkout *and per xdist worker*: JAX writes entries in place, so a process that reads an entry
# another process is still writing dies in XLA's executable deserialisation (CI lost a worker so,
# with both workers of one suite compiling the same program into one directory).
_CHECKOUT = hashlib.sha1(str(pathlib.Path(__file__).resolve().parents[1]).encode()).hexdigest()
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      f"/tmp/attn_jax_test_jax_cache/{_CHECKOUT[:12]}-{_WORKER}")
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


_SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def slow_test_ids() -> set[str]:
  """The test ids tests/slow_tests.txt lists (its header says how they were chosen)."""
  lines = _SLOW_LIST.read_text().splitlines() if _SLOW_LIST.exists() else []
  return {line.split()[1] for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)   # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
  del config
  slow = slow_test_ids()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
