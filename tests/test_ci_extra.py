"""CI's selection covers every mixer: each registered mixer's ragged-batch, decode == forward and
packed checks run in the default selection (not slow-listed) or are listed in tests/ci_extra.txt,
which .ci/run runs after it; and every listed id is a slow-listed test (else it would run
twice, or be listed for nothing)."""

import test_packing
import test_trunk
from attn_jax.registry import available_mixers
from conftest import ci_extra_ids, slow_test_ids

CHECKS = ((test_trunk, "test_ragged_batch_generates_what_each_prompt_generates_alone"),
          (test_trunk, "test_step_by_step_and_chunks_equal_the_full_forward"),
          (test_packing, "test_packed_rows_equal_each_document_alone"))


def test_every_mixer_has_its_ragged_decode_and_packed_checks_in_ci():
  slow, extra = slow_test_ids(), ci_extra_ids()
  assert len(set(extra)) == len(extra) and set(extra) <= slow, sorted(set(extra) - slow)
  not_run = []
  for module, name in CHECKS:
    assert callable(getattr(module, name, None)), f"{module.__name__}.{name} is gone"
    for mixer in (n for n in available_mixers() if not n.startswith("_")):
      test_id = f"tests/{module.__name__}.py::{name}[{mixer}]"
      if test_id in slow and test_id not in extra:
        not_run.append(test_id)
  assert not not_run, f"slow-listed but not in tests/ci_extra.txt: {not_run}"
