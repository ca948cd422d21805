"""Test set-up: simulate 8 CPU devices (must happen before jax is imported anywhere); the test
data (tests/data excerpts, a BPE tokenizer trained on them; the full files only for `-m
full_data`); the slow / ci_extra / full_data markers from tests/slow_tests.txt,
tests/ci_extra.txt and the `full_data` fixture."""

import hashlib
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's cost is compilation (tiny shapes, hundreds of distinct programs), not execution:
# JAX's switch for test suites turns off XLA's backend (LLVM) optimisations, which changes no
# floating-point semantics (no fast-math) and compiles several times faster. Subprocesses the
# tests start (quickstart, faults) inherit it. Benchmarks never run under it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Many tests compile the same programs (e.g. a run, then its resumption): share them through
# the persistent compilation cache (same executables, so results are unchanged). One cache per
# checkout *and per xdist worker*: JAX writes entries in place, so a process that reads an entry
# another process is still writing dies in XLA's executable deserialisation (as when the two
# workers of one suite compile the same program into one shared directory).
_CHECKOUT = hashlib.sha1(str(pathlib.Path(__file__).resolve().parents[1]).encode()).hexdigest()
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      f"/tmp/attn_jax_test_jax_cache/{_CHECKOUT[:12]}-{_WORKER}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

_TESTS = pathlib.Path(__file__).resolve().parent
# The small excerpts the default suite reads (tests/data/SOURCES.md), laid out like the full
# benchmark folder so `eval.tasks.shared_data_paths` maps both.
TEST_DATA = _TESTS / "data"
# The full benchmark files and tokenizers (optional; only `-m full_data` tests read them):
# $ATTN_JAX_SHARED_DATA, else ../shared/data next to the checkout.
SHARED_DATA = pathlib.Path(os.environ.get("ATTN_JAX_SHARED_DATA")
                           or _TESTS.parents[1] / "shared" / "data")


@pytest.fixture(scope="session")
def bench_data() -> pathlib.Path:
  """tests/data: the first records of every benchmark file and a tinyshakespeare excerpt."""
  return TEST_DATA


@pytest.fixture(scope="session")
def full_data() -> pathlib.Path:
  """The full files. A test that takes this fixture is marked `full_data` (deselected by
  default), so only a run that asks for them (`-m full_data`) can skip here."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"full benchmark files not found at {SHARED_DATA} (set ATTN_JAX_SHARED_DATA)")
  return SHARED_DATA


def train_tiny_bpe(text: str, vocab_size: int = 1024):
  """A byte-level BPE (GPT-2 / NeoX style: byte alphabet, `<|endoftext|>` = id 0) trained on
  `text`; deterministic, and any string encodes (the 256 bytes are in the vocabulary)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator([text], trainer=trainer)
  return tok


@pytest.fixture(scope="session")
def tiny_bpe_path(tmp_path_factory) -> pathlib.Path:
  """A tokenizers JSON file (vocabulary 1024) trained on tests/data's tinyshakespeare: the
  stand-in for the NeoX tokenizer wherever a test needs a real BPE, not its exact ids."""
  path = tmp_path_factory.mktemp("tokenizer") / "tiny_bpe.json"
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  train_tiny_bpe(text).save(str(path))
  return path


@pytest.fixture(scope="session")
def tiny_bpe(tiny_bpe_path):
  from attn_jax.data.tokenizer import HFTokenizer
  return HFTokenizer(tiny_bpe_path)


def _id_list(name: str) -> list[str]:
  """The test ids a list file under tests/ holds: the last field of each line ('#' comments)."""
  path = _TESTS / name
  lines = path.read_text().splitlines() if path.exists() else []
  return [line.split()[-1] for line in lines if line.strip() and not line.startswith("#")]


def slow_test_ids() -> set[str]:
  """The test ids tests/slow_tests.txt lists (its header says how they were chosen)."""
  return set(_id_list("slow_tests.txt"))


def ci_extra_ids() -> list[str]:
  """The slow tests CI runs as well (tests/ci_extra.txt; its header says which and why)."""
  return _id_list("ci_extra.txt")


def _check_ci_extra(config, items, listed) -> None:
  """A `-m ci_extra` run must not lose a listed test silently (renamed, new parameters): every
  listed id in a collected file has to be collected."""
  if "ci_extra" not in (config.option.markexpr or ""):
    return
  ids = {item.nodeid for item in items}
  files = {nodeid.split("::")[0] for nodeid in ids}
  stale = [i for i in listed if i.split("::")[0] in files and i not in ids]
  if stale:
    raise pytest.UsageError("tests/ci_extra.txt lists tests that do not exist: "
                            + ", ".join(stale))


@pytest.hookimpl(tryfirst=True)   # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
  slow, extra = slow_test_ids(), ci_extra_ids()
  _check_ci_extra(config, items, extra)
  extra = set(extra)
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
    if item.nodeid in extra:
      item.add_marker(pytest.mark.ci_extra)
    if "full_data" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.full_data)
