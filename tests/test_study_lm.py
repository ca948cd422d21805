"""The language-modelling study (configs/study_lm_tiny.py, attn_jax/study/lm.py) at toy size on
the tinyshakespeare excerpt in tests/data: the held-out stream is exactly the
file's tail after the training windows, bits per byte counts bytes (EOS = 0), position buckets
partition the long windows, and a 2-variant x 2-seed study writes bpb and by-position tables,
the extra plot and its own README section."""

import json
import os

import numpy as np
import pytest

from attn_jax.data.text import split_counts
from attn_jax.study import lm, report
from attn_jax.study.runner import run_study
from configs import study_lm_tiny
from test_study import shrink

PNG = b"\x89PNG\r\n\x1a\n"


def toy_config(path):
  c = shrink(study_lm_tiny.get_config(), eval_every=4)
  c.data.update(paths=path, eval_fraction=0.02)
  c.study.update(lm_extrapolate=2, lm_windows=4)
  return c


@pytest.fixture(scope="module")
def corpus(bench_data):
  """The first 800 lines of tinyshakespeare (tests/data/SOURCES.md)."""
  return str(bench_data / "tinyshakespeare" / "input.txt")


def test_heldout_stream_is_the_tail_of_the_file(corpus):
  c = toy_config(corpus)
  lines = [ln for ln in open(corpus, encoding="utf-8").read().split("\n") if ln.strip()]
  tokens = []
  for ln in lines:                       # explicit packing: bytes of each line, then EOS 256
    tokens += list(ln.encode("utf-8")) + [256]
  n_train, n_eval = split_counts(len(tokens), c.data)
  L = c.data.seq_len
  want = np.array(tokens[n_train * L:(n_train + n_eval) * L + 1], np.int32)
  np.testing.assert_array_equal(lm.heldout_stream(c), want)
  nb = lm.token_bytes("bytes", want)
  assert int(nb.sum()) == int(np.sum(want != 256))
  w = lm.windows(want, 8, 3)
  np.testing.assert_array_equal(w[1], want[8:17])


def test_position_buckets_partition_the_window():
  nll = np.arange(24, dtype=np.float64).reshape(2, 12)
  nb = np.ones((2, 12), np.int64)
  nb[0, 0] = 0                                       # an EOS target: no bytes
  out = lm._bucket_bpb(nll, nb, 5)
  assert list(out) == ["eval/lm/pos0_5", "eval/lm/pos5_10", "eval/lm/pos10_12"]
  want = (nll[:, 0:5].sum() / np.log(2)) / 9
  assert out["eval/lm/pos0_5"] == pytest.approx(want)


def test_lm_study_end_to_end(corpus, tmp_path):
  workdir = str(tmp_path / "study")
  res = run_study(toy_config(corpus), workdir, command="python experiments/study.py --lm-test",
                  log=lambda s: None)
  assert sorted((r["variant"], r["seed"]) for r in res["runs"]) == [
      ("transformer", 0), ("transformer", 1), ("transformer_sink", 0), ("transformer_sink", 1)]
  for r in res["runs"]:
    last = r["evals"][-1]
    assert r["bpb"] == last["eval/lm/bpb"] and np.isfinite(r["bpb"])
    # near-uniform after 4 steps: bits/byte ~ the held-out loss in bits (EOS ~2% of targets)
    assert abs(r["bpb"] / (r["final_loss"] / np.log(2)) - 1) < 0.1
    assert sorted(k for k in last if k.startswith("eval/lm/pos")) == [
        "eval/lm/pos0_32", "eval/lm/pos32_64"]
  out = report.write_report(workdir)
  md = open(out["tables"]).read()
  assert md.startswith("# Language-modelling study") and "bits/byte" in md
  assert "| variant | pos 0-32 | pos 32-64 |" in md
  assert "Recall accuracy" not in md
  png = [p for p in out["plots"] if p.endswith("lm_position.png")]
  assert len(png) == 1 and open(png[0], "rb").read()[:8] == PNG
  # no recall / NIAH metric and no throughput measured: those plots are neither drawn nor linked
  assert [os.path.basename(p) for p in out["plots"]] == ["loss.png", "lm_position.png"]
  readme = tmp_path / "README.md"
  readme.write_text("# x\n\n<!-- study:begin -->\nMQAR\n<!-- study:end -->\n")
  assert report.update_readme(str(readme), workdir)
  text = readme.read_text()
  assert "<!-- study:begin -->\nMQAR\n<!-- study:end -->" in text   # the MQAR section untouched
  assert text.count("<!-- study_lm:begin -->") == 1 and "## Language-modelling study" in text
  assert "loss.png)" in text and not any(f"{p})" in text for p in ("niah.png", "recall.png",
                                                                    "throughput.png"))
  assert not report.update_readme(str(readme), workdir)
  with open(os.path.join(workdir, "results.json")) as f:
    assert json.load(f)["runs"][0]["bpb"] == res["runs"][0]["bpb"]
