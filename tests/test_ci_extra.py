"""CI's selection covers every mixer: each registered mixer's ragged-batch, decode == forward and
packed checks run in the default selection (not slow-listed) or are listed in tests/ci_extra.txt,
which .ci/run runs after it; and every listed id is a slow test, slow-listed or marked slow in
place (else it would run twice, or be listed for nothing)."""

import pathlib

import test_packing
import test_trunk
from attn_jax.registry import available_mixers
from conftest import ci_extra_ids, slow_test_ids

CHECKS = ((test_trunk, "test_ragged_batch_generates_what_each_prompt_generates_alone"),
          (test_trunk, "test_step_by_step_and_chunks_equal_the_full_forward"),
          (test_packing, "test_packed_rows_equal_each_document_alone"))


def _marked_slow_in_place(test_id: str) -> bool:
  """The test's own definition carries `@pytest.mark.slow` (in the decorators above it)."""
  path, _, name = test_id.partition("::")
  lines = (pathlib.Path(__file__).resolve().parents[1] / path).read_text().splitlines()
  (i,) = [k for k, line in enumerate(lines) if line.startswith(f"def {name.split('[')[0]}(")]
  while i > 0 and lines[i - 1].startswith(("@", " ", ")")):
    i -= 1
    if lines[i].startswith("@pytest.mark.slow"):
      return True
  return False


def test_every_mixer_has_its_ragged_decode_and_packed_checks_in_ci():
  slow, extra = slow_test_ids(), ci_extra_ids()
  not_slow = sorted(t for t in set(extra) - slow if not _marked_slow_in_place(t))
  assert len(set(extra)) == len(extra) and not not_slow, not_slow
  not_run = []
  for module, name in CHECKS:
    assert callable(getattr(module, name, None)), f"{module.__name__}.{name} is gone"
    for mixer in (n for n in available_mixers() if not n.startswith("_")):
      test_id = f"tests/{module.__name__}.py::{name}[{mixer}]"
      if test_id in slow and test_id not in extra:
        not_run.append(test_id)
  assert not not_run, f"slow-listed but not in tests/ci_extra.txt: {not_run}"
