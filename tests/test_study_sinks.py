"""The attention-sink study (configs/study_sinks.py, attn_jax/study/sinks.py).

Default suite: the mass rows, the answer and the drop against hand-made records. Slow: the
whole study at toy size on the tinyshakespeare excerpt (every variant, 2 seeds, training, the
stream phase, the report and its page section): the table's shape and every cell finite.
"""

import math
import os
import re

import numpy as np
import pytest

from attn_jax.study import report, sinks
from attn_jax.study.runner import run_study
from configs import study_sinks

PNG = b"\x89PNG\r\n\x1a\n"


def toy_config(path):
  c = study_sinks.get_config()
  c.model.update(d_model=16, n_heads=2, n_layers=2, d_ff=32, max_seq_len=32)
  c.data.update(paths=path, seq_len=32, global_batch_size=8, eval_fraction=0.05)
  c.train.update(steps=3, log_every=1)
  c.optim.warmup_steps = 1
  c.checkpoint.every_steps = 3
  c.eval.update(every_steps=3, batch_size=8)
  c.study.update(param_tolerance=0.1, lm_windows=2, sink_cache=16, sink_stream_tokens=96,
                 sink_chunk=8, sink_mass_seqs=2, sink_mass_min_query=4)
  return c


def record(variant, seed, one, four, first4=(0.5, 0.5)):
  mass = [{"layer": i, "softmax": True, "sink": 0.0, "first1": x, "first4": x, "null": 0.0}
          for i, x in enumerate(first4)]
  return {"variant": variant, "seed": seed, "tokens": 96, "wall_s": 1.0,
          "nll": {"dense": 3.0, "window": 3.0, "recompute": 2.0, "0+16": 3.0, "1+15": one,
                  "4+12": four}, "mass": mass}


def test_answers_drop_and_rows_from_records():
  runs = [record("vanilla", 0, 2.5, 2.2), record("vanilla", 1, 2.4, 2.3),
          record("sink_token", 0, 2.21, 2.2, (0.3, 0.2)),
          record("sink_token", 1, 2.19, 2.2, (0.3, 0.2))]
  s = {"cache": 16, "keep": [0, 1, 4], "tolerance": 0.05, "runs": runs, "wall_s": 4.0}
  assert sinks.answers(s, ["vanilla", "sink_token"]) == {"vanilla": False, "sink_token": True}
  assert sinks.verdict(s, ["vanilla", "sink_token"]).endswith("holds here.")
  drop = sinks.first_token_drop(s)
  assert drop["per_layer"] == pytest.approx([0.4, 0.6]) and drop["mean"] == pytest.approx(0.5)
  table = sinks.stream_table(s, ["vanilla", "sink_token"])
  assert "| vanilla | 2 |" in table and table.splitlines()[-1].endswith("| yes |")
  # one vanilla seed inside the tolerance is not enough: every seed must be
  runs[0]["nll"]["1+15"] = 2.21
  assert sinks.answers(s, ["vanilla"])["vanilla"] is False


def test_mass_rows_split_sink_real_and_null_columns():
  # one layer, 1 sequence, 1 head, T' = 1 sink + 7 real, the last column the sink logit
  p = np.zeros((1, 1, 8, 9))
  p[..., 0], p[..., 1], p[..., 2:5], p[..., -1] = 0.3, 0.2, 0.1, 0.2   # rows sum to 1
  rows = sinks._mass_rows([p, None], n_sink=1, min_query=2)
  assert rows[1] == {"layer": 1, "softmax": False}
  assert rows[0]["sink"] == pytest.approx(0.3) and rows[0]["first1"] == pytest.approx(0.2)
  assert rows[0]["first4"] == pytest.approx(0.5) and rows[0]["null"] == pytest.approx(0.2)


def test_layouts_and_bad_keep():
  c = study_sinks.get_config()
  assert [sinks.label_of(p) for p in sinks.policies(c.study)] == [
      "dense", "window", "recompute", "0+128", "1+127", "4+124"]
  c.study.sink_keep = (0, 128)
  with pytest.raises(ValueError, match=r"config\.study\.sink_keep"):
    sinks.policies(c.study)


@pytest.mark.slow
def test_sink_study_end_to_end(bench_data, tmp_path):
  path = str(bench_data / "tinyshakespeare" / "input.txt")
  workdir = str(tmp_path / "study")
  res = run_study(toy_config(path), workdir, command="python experiments/study.py --sinks-test",
                  log=lambda s: None)
  names = [v[0] for v in study_sinks.VARIANTS]
  assert sorted((r["variant"], r["seed"]) for r in res["sinks"]["runs"]) == sorted(
      (v, s) for v in names for s in (0, 1))
  cols = ["dense", "window", "recompute", "0+16", "1+15", "4+12"]
  for r in res["sinks"]["runs"]:
    assert r["skipped"] == {} and sorted(r["nll"]) == sorted(cols)
    assert all(math.isfinite(x) for x in r["nll"].values())
    assert len(r["mass"]) == 2 and all(row["softmax"] for row in r["mass"])
  out = report.write_report(workdir)
  md = open(out["tables"]).read()
  assert md.startswith("# Attention-sink study")
  lines = md.split("Streaming NLL past the cache")[1].splitlines()
  table = [ln for ln in lines[2:] if ln.startswith("|")][:2 + len(names)]
  assert len(table) == 2 + len(names)                       # header, rule, one row a model
  for row in table[2:]:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 2 + len(cols) + 2 and cells[0] in names and cells[1] == "2"
    for cell in cells[2:-1]:                                 # every figure finite
      nums = [float(x) for x in re.findall(r"-?\d+\.\d+", cell)]
      assert nums and all(math.isfinite(x) for x in nums)
    assert cells[-1] in ("yes", "no")
  assert "At 1+15, is the sink-token model's streaming NLL within 0.05" in md
  png = [p for p in out["plots"] if p.endswith("sink_layouts.png")]
  assert len(png) == 1 and open(png[0], "rb").read()[:8] == PNG
  page = tmp_path / "studies.md"
  page.write_text("# Studies\n")
  assert report.update_readme(str(page), workdir)
  assert page.read_text().count("<!-- study_sinks:begin -->") == 1
  assert not report.update_readme(str(page), workdir)       # from results.json alone
  # a rerun resumes: every run and every stream is read back, nothing retrained
  again = run_study(toy_config(path), workdir, command="x", log=lambda s: None)
  assert [r["nll"] for r in again["sinks"]["runs"]] == [r["nll"] for r in res["sinks"]["runs"]]
  assert os.path.isfile(os.path.join(res["runs"][0]["workdir"], sinks.SINK_RESULT))
