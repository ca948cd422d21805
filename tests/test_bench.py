"""experiments/bench.py's config plumbing: `@field=value` suffixes and the --study rows (every
study variant at its matched parameter count plus the cache-policy rows)."""

import os
import runpy
import sys

import pytest
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
  mod = runpy.run_path(os.path.join(ROOT, "experiments", "bench.py"), run_name="bench_test")
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  return mod


def test_suffix_sets_any_field_and_keeps_the_sisa_path_shorthand(bench):
  c = bench["named_config"]("transformer_152m@model.attention.sink_logit=learned,model.n_layers=2")
  assert c.model.attention.sink_logit == "learned" and c.model.n_layers == 2
  assert bench["named_config"]("sisa_152m@chunked").model.sisa.path == "chunked"
  with pytest.raises(ValueError, match=r"config\.model\.nope\.x is not a field"):
    bench["named_config"]("transformer_152m@model.nope.x=1")


def test_study_rows_cover_every_variant_and_the_cache_policies(bench):
  from attn_jax.study import variants
  path = os.path.join(ROOT, "configs", "study_tiny.py")
  rows = bench["study_configs"](path)
  study = runpy.run_path(path)["get_config"]()
  names = variants.variant_names(study)
  assert list(rows)[:len(names)] == names
  from attn_jax.attention import cache as cache_lib
  for mixer in ("transformer", "sisa_ds8"):
    for policy, expected in (("window", cache_lib.Ring(256)),
                             ("streaming", cache_lib.SinksRing(4, 256))):
      c = rows[f"{mixer}@{policy}"]
      assert c.model.pattern[-1] in ("attention", "sisa")  # after the shared window-2 layer
      assert c.to_dict() == rows[mixer].to_dict()    # the same model: only the decode differs
      assert bench["row_policy"](f"{mixer}@{policy}") == expected
    assert bench["row_policy"](mixer) is None


def test_the_cpu_50m_fp32_preset_is_what_its_name_says(bench):
  """The preset runs the 152M configs at the 50M Transformer's shapes (configs/transformer_50m.py,
  docs/papers.md §1.4) in float32; the flag accepts no other name."""
  import importlib
  (name,) = bench["PRESETS"]
  assert name == "cpu_50m_fp32"
  p = bench["PRESETS"][name]
  m50 = importlib.import_module("configs.transformer_50m").get_config().model
  assert (p["d_model"], p["n_heads"], p["n_layers"], p["vocab_size"]) == (
      m50.d_model, m50.n_heads, m50.n_layers, m50.vocab_size)
  assert 4 * p["d_model"] == m50.d_ff   # bench.py's d_ff for an overridden d_model
  assert p["dtype"] == "float32"
  assert flags.FLAGS["preset"].parser.enum_values == ["", name]


def test_aux_maxima_flattens_pattern_groups(bench):
  """A pattern model's monitors come grouped by layer kind ({"1.sisa": {name: [R]}}); a
  single-mixer model's flat ({name: [R]}). Each becomes its max over the repeats."""
  import numpy as np
  got = bench["aux_maxima"]({"1.sisa": {"lambda": np.array([0.2, 0.5])},
                             "decay_range": np.array([3.0, 1.0])})
  assert got == {"1.sisa/lambda": 0.5, "decay_range": 3.0}
  assert bench["aux_maxima"]({}) == {}


def test_document_mask_rows_pack_documents_and_print_skips(bench, capsys):
  import numpy as np
  batch = {"inputs": np.zeros((1, 2, 10), np.int32)}
  f = bench["packed_fields"](batch, 4)
  np.testing.assert_array_equal(f["segment_ids"][0, 1], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(f["positions"][0, 0], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
  bench["_print_document_mask"]([
      {"config": "mamba2_152m", "seq_len": 512, "batch": 4, "doc_len": 128,
       "skipped": "NotImplementedError: not yet"},
      {"config": "transformer_152m", "seq_len": 512, "batch": 4, "doc_len": 128, "plain_s": 1.0,
       "packed_s": 1.1, "ratio": 1.1, "plain_cpu_s": 2.0, "packed_cpu_s": 2.2, "cpu_ratio": 1.1}])
  out = capsys.readouterr().out
  assert "skipped: NotImplementedError: not yet" in out and "1.100" in out
