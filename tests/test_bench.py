"""attn_jax/bench's config plumbing (experiments/bench.py's): `--set` / `@field=value`
overrides (dotted config paths, as training's --config.*), --scale and --preset as such
overrides, and the --study rows (every study variant at its matched parameter count plus the
cache-policy rows)."""

import os
import re
import runpy
import subprocess
import sys

import pytest
from absl import flags

from attn_jax.bench import configs as bench_configs
from attn_jax.bench import rows as bench_rows
from attn_jax.bench import printout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench_flags():
  """experiments/bench.py's flags (defined when the script is loaded)."""
  runpy.run_path(os.path.join(ROOT, "experiments", "bench.py"), run_name="bench_test")
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  return flags.FLAGS


def test_suffix_sets_any_field_and_keeps_the_sisa_path_shorthand():
  c = bench_configs.named_config(
      "transformer_152m@model.attention.sink_logit=learned,model.n_layers=2")
  assert c.model.attention.sink_logit == "learned" and c.model.n_layers == 2
  assert bench_configs.named_config("sisa_152m@chunked").model.sisa.path == "chunked"
  with pytest.raises(ValueError, match=r"config\.model\.nope: unknown field"):
    bench_configs.named_config("transformer_152m@model.nope.x=1")


def test_study_rows_cover_every_variant_and_the_cache_policies():
  from attn_jax.study import matching
  path = os.path.join(ROOT, "configs", "study_tiny.py")
  rows = bench_configs.study_configs(path)
  study = runpy.run_path(path)["get_config"]()
  names = matching.variant_names(study)
  assert list(rows)[:len(names)] == names
  from attn_jax.attention import cache as cache_lib
  for mixer in ("transformer", "sisa_ds8"):
    for policy, expected in (("window", cache_lib.Ring(256)),
                             ("streaming", cache_lib.SinksRing(4, 256))):
      c = rows[f"{mixer}@{policy}"]
      assert c.model.pattern[-1] in ("attention", "sisa")  # after the shared window-2 layer
      assert c.to_dict() == rows[mixer].to_dict()    # the same model: only the decode differs
      assert bench_configs.row_policy(f"{mixer}@{policy}") == expected
    assert bench_configs.row_policy(mixer) is None


def test_the_cpu_50m_fp32_preset_is_what_its_name_says(bench_flags):
  """The preset runs the 152M configs at the 50M Transformer's shapes (configs/transformer_50m.py,
  docs/papers.md §1.4) in float32; the flag accepts no other name."""
  import importlib
  (name,) = bench_configs.PRESETS
  assert name == "cpu_50m_fp32"
  p = dict(item.split("=") for item in bench_configs.PRESETS[name]["set"].split(","))
  m50 = importlib.import_module("configs.transformer_50m").get_config().model
  assert (p["model.d_model"], p["model.n_heads"], p["model.n_layers"], p["model.vocab_size"]) == (
      str(m50.d_model), str(m50.n_heads), str(m50.n_layers), str(m50.vocab_size))
  assert p["model.d_ff"] == str(4 * m50.d_model) == str(m50.d_ff)
  assert p["model.dtype"] == "float32"
  assert bench_flags["preset"].parser.enum_values == ["", name]


def test_aux_maxima_flattens_pattern_groups():
  """A pattern model's monitors come grouped by layer kind ({"1.sisa": {name: [R]}}); a
  single-mixer model's flat ({name: [R]}). Each becomes its max over the repeats."""
  import numpy as np
  got = bench_rows.aux_maxima({"1.sisa": {"lambda": np.array([0.2, 0.5])},
                             "decay_range": np.array([3.0, 1.0])})
  assert got == {"1.sisa/lambda": 0.5, "decay_range": 3.0}
  assert bench_rows.aux_maxima({}) == {}


def test_document_mask_rows_pack_documents_and_print_skips(capsys):
  import numpy as np
  batch = {"inputs": np.zeros((1, 2, 10), np.int32)}
  f = bench_rows.packed_fields(batch, 4)
  np.testing.assert_array_equal(f["segment_ids"][0, 1], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(f["positions"][0, 0], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
  printout.print_document_mask([
      {"config": "mamba2_152m", "seq_len": 512, "batch": 4, "doc_len": 128,
       "skipped": "NotImplementedError: not yet"},
      {"config": "transformer_152m", "seq_len": 512, "batch": 4, "doc_len": 128, "plain_s": 1.0,
       "packed_s": 1.1, "ratio": 1.1, "plain_cpu_s": 2.0, "packed_cpu_s": 2.2, "cpu_ratio": 1.1}])
  out = capsys.readouterr().out
  assert "skipped: NotImplementedError: not yet" in out and "1.100" in out


def test_a_preset_fills_only_the_options_not_given():
  o = bench_configs.Options(preset="cpu_50m_fp32", set="model.n_layers=2", steps=3)
  got = o.with_preset(given={"preset", "set", "steps"})
  m = bench_configs.named_config("transformer_152m", got).model
  assert (m.n_layers, got.steps) == (2, 3)                          # given: kept
  assert (m.d_model, got.batch_tokens, m.dtype) == (512, 4096, "float32")   # the preset's
  assert list(got.configs) == ["transformer_152m", "sisa_152m", "sisa_152m@fast"]
  assert bench_configs.Options().with_preset() == bench_configs.Options()   # no preset


# The model fields --scale=tiny and --preset=cpu_50m_fp32 gave when they were flags of their own
# (--d_model, --n_heads, ..., --dtype; commit 0d5e272), spelled out: the same models now.
SHAPE = ("mixer", "d_model", "n_heads", "n_layers", "vocab_size", "d_ff", "dtype")
BEFORE = {
    ("tiny", "transformer_152m"): ("attention", 256, 4, 4, 4096, 1024, "bfloat16"),
    ("tiny", "sisa_152m"): ("sisa", 256, 4, 4, 4096, 916, "bfloat16"),
    ("cpu_50m_fp32", "transformer_152m"): ("attention", 512, 8, 6, 50277, 2048, "float32"),
    ("cpu_50m_fp32", "sisa_152m"): ("sisa", 512, 8, 6, 50277, 1832, "float32"),
}


@pytest.mark.parametrize("setting, name", sorted(BEFORE))
def test_scale_and_preset_give_the_model_configs_they_gave_before(setting, name):
  from attn_jax.model_config import ModelConfig
  options = (bench_configs.Options(scale="tiny") if setting == "tiny" else
             bench_configs.Options(preset=setting).with_preset())
  got = ModelConfig.from_config(bench_configs.named_config(name, options).model)
  assert tuple(getattr(got, f) for f in SHAPE) == BEFORE[setting, name]
  assert got.options_for("sisa").d_state == 32 and got.options_for("sisa").path == "auto"
  plain = ModelConfig.from_config(bench_configs.named_config(name).model)
  assert got.replace(**{f: getattr(plain, f) for f in SHAPE}) == plain   # nothing else moved


def test_set_reaches_the_model_config_and_rematches_the_twins():
  """--set's dotted paths reach the typed model config the step is built from; SISA and FoX
  get the d_ff that matches the overridden Transformer (model.d_ff is the Transformer's)."""
  from attn_jax.model import count_params
  from attn_jax.model_config import ModelConfig
  o = bench_configs.Options(set="model.d_model=512,model.n_heads=8,model.d_ff=2048,"
                                "model.sisa.d_state=16,model.remat=full")
  m = ModelConfig.from_config(bench_configs.named_config("sisa_152m", o).model)
  assert (m.d_model, m.n_heads, m.d_ff, m.remat, m.options_for("sisa").d_state) == (
      512, 8, 1940, "full", 16)
  t = bench_configs.named_config("transformer_152m", o).model
  assert (t.d_model, t.n_heads, t.d_ff) == (512, 8, 2048)
  fox = bench_configs.named_config("fox_50m", o).model     # its Transformer: transformer_50m
  assert fox.d_ff == 2044
  total = lambda m: count_params(m)["total"]
  gap = total(fox) - total(bench_configs.named_config("transformer_50m", o).model)
  assert abs(gap) <= fox.n_layers * 3 * fox.d_model * 2   # d_ff rounded to a multiple of 4
  # a config's own suffix comes after --set and is not re-matched
  assert bench_configs.named_config("sisa_152m@model.d_ff=100", o).model.d_ff == 100


def test_a_bad_override_names_the_field():
  from attn_jax.config_flags import ConfigFieldError
  with pytest.raises(ConfigFieldError, match=r"^config\.model\.d_modle: unknown field .*"
                                             r"did you mean config\.model\.d_model\?"):
    bench_configs.named_config("transformer_152m", bench_configs.Options(set="model.d_modle=5"))
  with pytest.raises(ConfigFieldError, match=r"^config\.model\.n_heads=4\.5: not a valid int"):
    bench_configs.named_config("sisa_152m", bench_configs.Options(set="model.n_heads=4.5"))
  with pytest.raises(ConfigFieldError, match=r"want <path>=<value>"):
    bench_configs.named_config("sisa_152m", bench_configs.Options(set="model.d_model"))


def test_bench_script_reports_a_bad_set_path_in_one_line():
  r = subprocess.run([sys.executable, "experiments/bench.py", "--configs=transformer_152m",
                      "--set=model.d_model=64,model.sisa.d_stat=8"], cwd=ROOT,
                     capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stdout == ""                        # nothing measured, nothing printed
  lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and lines[0].startswith(
      "error: config.model.sisa.d_stat: unknown field (known: "), r.stderr[-3000:]
  assert "did you mean config.model.sisa.d_state?" in lines[0]


def test_sinkhorn_crossover_is_the_length_from_which_it_stays_faster():
  from attn_jax.bench import sinkhorn_scaling
  t = {"dense": [1.0, 2.0, 4.0, 8.0], "soft": [2.0, 1.5, 5.0, 6.0], "sortcut": [0.5, 1.0, 3.0, 9.0]}
  rows = [{"variant": v, "seq_len": L, "wall_s": w, "cpu_s": w}
          for v, ws in t.items() for L, w in zip((64, 128, 256, 512), ws)]
  assert sinkhorn_scaling.crossover(rows, "soft") == 512      # faster at 128 too, but not at 256
  assert sinkhorn_scaling.crossover(rows, "sortcut") is None  # slower at the longest length


def _trace_file(tmp_path, events):
  import gzip
  import json
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(path)


def test_kernel_profile_sums_device_tracks_by_kernel_family(tmp_path):
  """A trace with a GPU device process: only its events count, numbered instances of one
  kernel are one family, the host's are ignored; durations in microseconds."""
  from attn_jax.bench import kernel_profile
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #1"}},
          {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "tf_XLA x"}}]
  x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur,
                                   "ts": 0}
  path = _trace_file(tmp_path, meta + [x(1, 7, "loop_add_fusion.3", 300.0),
                                       x(1, 7, "loop_add_fusion.4", 100.0),
                                       x(1, 7, "decayed_fwd", 600.0), x(2, 3, "host_op", 9e6)])
  rows, busy = kernel_profile.top_kernels(path, top=5)
  assert busy == pytest.approx(1e-3)
  assert [(r.name, r.count) for r in rows] == [("decayed_fwd", 1), ("loop_add_fusion", 2)]
  assert rows[1].seconds == pytest.approx(4e-4)
  assert "60.0%" in kernel_profile.format_top("x", rows, busy, 2e-3)


def test_kernel_profile_of_a_real_cpu_step(tmp_path):
  """A jitted call traced on this CPU: its XLA ops are found (no enclosing executor event)."""
  import jax
  import jax.numpy as jnp

  from attn_jax.bench import kernel_profile
  f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
  a = jnp.ones((256, 256))
  f(a).block_until_ready()
  rows, busy = kernel_profile.top_kernels(kernel_profile.trace_call(lambda: f(a), str(tmp_path)))
  assert busy > 0 and rows
  assert not any(r.name.startswith("ThunkExecutor") for r in rows)


def _documented_bench_commands():
  """The flags of every `experiments/bench.py ...` command in the docs, the README, the device
  check and bench.py's own docstring."""
  paths = [os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
           if f.endswith(".md")]
  paths += [os.path.join(ROOT, p) for p in ("README.md", "experiments/device_check.sh",
                                            "experiments/bench.py")]
  for path in paths:
    text = open(path).read().replace("\\\n", " ")
    for m in re.finditer(r"experiments/bench\.py((?: +--?[^\s`|;#]+)*)", text):
      yield path, m.group(1).split()


def test_every_documented_bench_command_uses_flags_bench_has(bench_flags):
  commands = list(_documented_bench_commands())
  assert len(commands) >= 10
  for path, args in commands:
    for arg in args:
      name, _, value = arg.lstrip("-").partition("=")
      assert name in bench_flags or name.removeprefix("no") in bench_flags, (path, arg)
      if name == "set":
        bench_configs.named_config("transformer_152m", bench_configs.Options(set=value))
      if name == "configs" and "$" not in value:
        for config in value.split(","):
          bench_configs.named_config(config)
