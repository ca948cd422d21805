"""The comparison study (attn_jax/study, experiments/study.py): a 2-variant x 2-seed study end to
end in a temporary directory (results.json fields, tables consistent with it, real PNGs, README
section regenerated between its markers only and idempotently, resume skips finished runs and
an unfinished run resumes from its checkpoint without retraining), parameter matching of every
study_tiny variant (abstract shapes only), and the 152M study's configs validate (no
training). The full tiny study is `-m slow`."""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from attn_jax.config import validate
from attn_jax.study import needle, report, matching
from attn_jax.study.runner import RUN_SUMMARY, run_study
from configs import study_152m, study_lm_tiny, study_mqar_state, study_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = ("variant", "seed", "params", "param_diff_pct", "train", "evals", "final_loss",
              "final_train_loss", "recall_acc", "niah_acc", "train_tokens_per_sec", "wall_s",
              "cpu_s", "tokens", "steps")


def shrink(c: ml_collections.ConfigDict, eval_every: int) -> ml_collections.ConfigDict:
  """A study config at toy size (also used by test_study_lm): d 32, 1 layer, seq 32, batch 8,
  4 steps; the Transformer and its sink-token variant, 2 seeds."""
  c.model.update(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=64, pattern=())
  c.data.update(seq_len=32, global_batch_size=8)
  c.train.update(steps=4, log_every=1)
  c.optim.warmup_steps = 1
  c.checkpoint.every_steps = 4
  c.eval.update(every_steps=eval_every, batch_size=8)
  c.study.update(only="transformer_sink", seeds=(0, 1), param_tolerance=0.05)
  return c


def small_config() -> ml_collections.ConfigDict:
  """study_tiny shrunk: transformer + transformer with a sink token, d 32, 1 layer, seq 32,
  4 steps, 2 seeds (the cheapest pair to compile; every variant is covered by the matching test
  and the slow full study)."""
  c = shrink(study_tiny.get_config(), eval_every=2)
  c.data.update(mqar_num_pairs=4, mqar_num_queries=4, mqar_vocab=16)
  c.model.vocab_size = 48
  s = c.study
  s.lrs = ()                        # no sweep here (test_lr_sweep has one)
  s.needle_lengths = (32,)
  s.needle_depths = (0.0, 1.0)
  s.needle_samples = 4
  s.throughput_seq_lens = (32,)
  s.throughput_batch_tokens = 256   # = the training batch (8 x 32): its compilation is reused
  s.throughput_steps = 1
  return c


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("study"))
  res = run_study(small_config(), workdir, command="python experiments/study.py --test",
                  log=lambda s: None)
  out = report.write_report(workdir)
  return workdir, res, out


def test_results_json_has_every_run_and_field(study):
  workdir, res, _ = study
  with open(os.path.join(workdir, "results.json")) as f:
    on_disk = json.load(f)
  assert on_disk["runs"] == json.loads(json.dumps(res["runs"]))
  assert sorted((r["variant"], r["seed"]) for r in on_disk["runs"]) == [
      ("transformer", 0), ("transformer", 1), ("transformer_sink", 0), ("transformer_sink", 1)]
  for r in on_disk["runs"]:
    for k in RUN_FIELDS:
      assert k in r, k
    assert [e["step"] for e in r["evals"]] == [2, 4]
    assert [t["step"] for t in r["train"]] == [1, 2, 3, 4]
    assert r["tokens"] == 4 * 8 * 32
    assert 0.0 <= r["recall_acc"] <= 1.0 and 0.0 <= r["niah_acc"] <= 1.0
    assert np.isfinite(r["final_loss"]) and r["train_tokens_per_sec"] > 0
    last = r["evals"][-1]
    assert r["recall_acc"] == last["eval/mqar/acc"]
    assert r["niah_acc"] == last["eval/needle/acc"]
    assert r["final_loss"] == last["eval/loss"]
    # the needle accuracy is the mean of its grid cells (equal samples per cell)
    cells = [v for k, v in last.items() if k.startswith("eval/needle/C")]
    assert len(cells) == 2 and last["eval/needle/acc"] == pytest.approx(np.mean(cells))
  # the same seed gives the same data stream and init for a variant across a re-read: the two
  # seeds differ (else the spread would be meaningless)
  t = [r for r in on_disk["runs"] if r["variant"] == "transformer"]
  assert t[0]["train"][0]["loss"] != t[1]["train"][0]["loss"]
  thr = on_disk["throughput"]
  assert sorted((r["variant"], r["seq_len"]) for r in thr) == [
      ("transformer", 32), ("transformer_sink", 32)]
  assert all(r["batch"] % 8 == 0 for r in thr)   # whole rows on each of the 8 test devices
  for r in thr:
    if r["variant"] == "transformer":
      assert r["ratio"] == 1.0 and r["cpu_ratio"] == 1.0
    assert r["tok_s"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])


def test_tables_match_results(study):
  workdir, res, out = study
  md = open(out["tables"]).read()
  runs = {v: [r for r in res["runs"] if r["variant"] == v] for v in res["variants"]}
  for v, rs in runs.items():
    loss = report.spread([r["final_loss"] for r in rs], 1.0, 3)
    recall = report.spread([r["recall_acc"] for r in rs], 100.0, 1)
    niah = report.spread([r["niah_acc"] for r in rs], 100.0, 1)
    row = next(line for line in md.splitlines() if line.startswith(f"| {v} | ")
               and "seeds" not in line and line.count("|") == 8)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{res['variants'][v]['params']:,}"
    assert cells[2] == "2" and cells[3] == loss and cells[4] == recall and cells[5] == niah
    # an explicit recomputation of one cell: mean ± sample std (min–max), percent
    x = np.array([r["recall_acc"] for r in rs]) * 100
    assert recall == (f"{x.mean():.1f} ± {x.std(ddof=1):.1f} ({x.min():.1f}–{x.max():.1f})")
  # NIAH-vs-step table: one column per evaluation step, cells from the runs' evals
  assert "| variant | step 2 | step 4 |" in md
  m = res["meta"]["niah_metric"]
  vals = [report.metric_at(r, m, 2) for r in runs["transformer"]]
  assert f"| transformer | {report.spread(vals, 100.0, 1, minmax=False)} |" in md
  # the needle grid at the last evaluation: one column per cell, mean ± std over the seeds
  assert "| variant | C32 d0 | C32 d1 |" in md
  x = np.array([r["evals"][-1]["eval/needle/C32_d1"] for r in runs["transformer_sink"]]) * 100
  grid_row = next(line for line in md.splitlines() if line.startswith("| transformer_sink | ")
                  and line.count("|") == 4)
  assert grid_row.endswith(f"| {x.mean():.1f} ± {x.std(ddof=1):.1f} |")
  thr = next(r for r in res["throughput"] if r["variant"] == "transformer_sink" and r["seq_len"] == 32)
  assert f"{thr['tok_s']:,.0f} tok/s, {thr['ratio']:.2f}x wall, {thr['cpu_ratio']:.2f}x CPU" in md


def test_plots_are_real_pngs(study):
  _, _, out = study
  assert [os.path.basename(p) for p in out["plots"]] == list(report.PLOTS)
  for p in out["plots"]:
    with open(p, "rb") as f:
      data = f.read()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000, p
    import matplotlib.image
    img = matplotlib.image.imread(p)
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.std(img)) > 0  # something is drawn


def test_readme_section_replaced_only_between_markers_and_idempotent(study, tmp_path):
  workdir, res, _ = study
  readme = tmp_path / "README.md"
  head, tail = "# title\n\ntext before\n\n", "\n\n## After\ntext after\n"
  readme.write_text(head + report.BEGIN + "\nold generated text\n" + report.END + tail)
  assert report.update_readme(str(readme), workdir)
  text = readme.read_text()
  assert text.startswith(head) and text.endswith(tail)
  assert "old generated text" not in text
  section = text[len(head):len(text) - len(tail)]
  assert section.startswith(report.BEGIN) and section.endswith(report.END)
  assert section.count(report.BEGIN) == 1
  assert report.final_table(res) in section and report.params_table(res) in section
  assert res["meta"]["command"] in section
  for p in report.PLOTS:
    assert f"{os.path.relpath(workdir, str(tmp_path))}/{p})" in section
  assert not report.update_readme(str(readme), workdir)  # idempotent
  assert readme.read_text() == text
  assets = tmp_path / "docs" / "study"   # PNGs copied to a tracked folder and linked there
  assert report.update_readme(str(readme), workdir, str(assets))
  text = readme.read_text()
  for p in report.PLOTS:
    assert f"](docs/study/{p})" in text
    assert (assets / p).read_bytes() == open(os.path.join(workdir, p), "rb").read()
  assert "--assets=docs/study" in text and text.startswith(head) and text.endswith(tail)
  plain = tmp_path / "R2.md"  # no markers yet: a section is appended, then replaced in place
  plain.write_text("# x\n")
  report.update_readme(str(plain), workdir)
  once = plain.read_text()
  report.update_readme(str(plain), workdir)
  assert plain.read_text() == once and once.startswith("# x\n")


def test_resume_skips_finished_and_resumes_unfinished(study):
  workdir, res, _ = study
  finished = os.path.join(workdir, "runs", "transformer", "seed0", RUN_SUMMARY)
  unfinished = os.path.join(workdir, "runs", "transformer_sink", "seed1")
  mtime = os.path.getmtime(finished)
  with open(os.path.join(unfinished, "metrics.jsonl")) as f:
    rows_before = [json.loads(line) for line in f if line.strip()]
  os.remove(os.path.join(unfinished, RUN_SUMMARY))   # as if the study stopped after its training
  logs = []
  again = run_study(small_config(), workdir, command="python experiments/study.py --test",
                    log=logs.append)
  assert os.path.getmtime(finished) == mtime
  assert sum("finished earlier, skipped" in line for line in logs) == 3
  assert any("throughput: measured earlier, skipped" in line for line in logs)
  with open(os.path.join(unfinished, "metrics.jsonl")) as f:
    rows_after = [json.loads(line) for line in f if line.strip()]
  train_rows = lambda rows: [r for r in rows if "loss" in r]
  assert train_rows(rows_after) == train_rows(rows_before)   # resumed at step 4: no retraining
  a = next(r for r in again["runs"] if r["variant"] == "transformer_sink" and r["seed"] == 1)
  b = next(r for r in res["runs"] if r["variant"] == "transformer_sink" and r["seed"] == 1)
  assert a["recall_acc"] == b["recall_acc"] and a["final_loss"] == pytest.approx(b["final_loss"])


def test_a_finished_run_of_another_config_is_an_error_not_reused(study, tmp_path):
  """Which runs a study does (study.only, seeds, ...) may change between invocations; what a
  finished run computed may not: a changed config is an error naming the run."""
  import shutil
  workdir = str(tmp_path / "study")
  shutil.copytree(study[0], workdir)   # the fixture's results.json stays as the other tests see it
  c = small_config()
  c.study.update(only="transformer", seeds=(0,), throughput_seq_lens=())
  logs = []
  run_study(c, workdir, log=logs.append)
  assert sum("finished earlier, skipped" in line for line in logs) == 1
  c.optim.weight_decay = 0.05
  with pytest.raises(ValueError, match=r"transformer.seed0.*another config"):
    run_study(c, workdir, log=lambda s: None)


def test_lr_sweep_then_seeds_at_the_best(tmp_path):
  """The sweep trains each lr on the sweep seed, keeps the best by the sweep metric (ties:
  lower loss; recomputed here from the sweep rows), runs the other seeds at it only (the sweep
  seed's run is reused), reports the sweep table, and a rerun retrains nothing."""
  c = small_config()
  c.study.only = "transformer"          # the baseline alone
  c.study.lrs = (1e-3, 3e-2)
  c.study.sweep_metric = "eval/loss_neg"   # not a metric: every row ties, the lower loss wins
  c.study.throughput_seq_lens = ()
  workdir = str(tmp_path)
  res = run_study(c, workdir, log=lambda s: None)
  sw = res["sweep"]
  assert [(r["lr"], r["seed"]) for r in sw] == [(1e-3, 0), (3e-2, 0)]
  best = min(sw, key=lambda r: r["final_loss"])["lr"]
  assert res["variants"]["transformer"]["lr"] == best
  assert [(r["seed"], r["lr"]) for r in res["runs"]] == [(0, best), (1, best)]
  assert res["runs"][0]["final_loss"] == next(r for r in sw if r["lr"] == best)["final_loss"]
  assert os.path.isfile(os.path.join(workdir, "runs", "transformer", f"lr{best:g}", "seed1",
                                     RUN_SUMMARY))
  assert res["meta"]["complete"]
  # the study's training time counts every distinct run once: 2 sweep runs + seed 1
  t = res["meta"]["training"]
  assert t["runs"] == 3
  assert t["wall_s"] == pytest.approx(sum(r["wall_s"] for r in sw) + res["runs"][1]["wall_s"])
  assert "over all 3 runs (sweep included)" in report.conditions(res)
  md = report.tables_markdown(res)
  assert "Learning-rate sweep" in md
  row = next(line for line in md.splitlines() if line.startswith("| transformer | ")
             and "/" in line)
  chosen = next(r for r in sw if r["lr"] == best)
  assert f"**{100 * chosen['recall_acc']:.1f} / {chosen['final_loss']:.3f}**" in row
  logs = []
  run_study(c, workdir, log=logs.append)
  assert sum("finished earlier, skipped" in line for line in logs) == 3


def test_param_matching_every_tiny_variant():
  c = study_tiny.get_config()
  c.study.only = ""                  # every variant, not just the default run's
  cfgs = matching.all_variant_configs(c)
  assert list(cfgs) == [v[0] for v in study_tiny.VARIANTS]
  target = cfgs["transformer"][1]["params"]
  for name, (vc, info) in cfgs.items():
    n = matching.total_params(vc)   # recounted from the returned config
    assert n == info["params"]
    assert abs(n - target) / target <= c.study.param_tolerance, (name, n, target)
    assert info["diff_pct"] == pytest.approx(100 * (n - target) / target)
    validate(vc)
  # matching did move the knobs (a variant built without it is off by more)
  raw = matching.apply_overrides(c, {v[0]: v[2] for v in study_tiny.VARIANTS}["mamba2"])
  assert abs(matching.total_params(raw) - target) > abs(cfgs["mamba2"][1]["params"] - target)


@pytest.mark.parametrize("module", [study_mqar_state, study_lm_tiny])
def test_other_tiny_studies_match_and_validate(module):
  """The state-size and LM studies: every variant matched and valid; the state study's
  variants differ in d_state only among the SSM's options (abstract shapes, no training)."""
  c = module.get_config()
  cfgs = matching.all_variant_configs(c)
  for name, (vc, info) in cfgs.items():
    assert abs(info["diff_pct"]) <= 100 * c.study.param_tolerance, name
    assert info["setting"], name      # every variant declares its setting
    validate(vc)
  if module is study_mqar_state:
    states = [cfgs[n][0].model.mamba2.d_state for n in cfgs if n.startswith("mamba2")]
    assert states == list(study_mqar_state.STATES)
    assert sorted(states) == states and len(states) >= 3


def test_match_params_is_closest_on_the_grid():
  c = matching.apply_overrides(study_tiny.get_config(),
                               dict((v[0], v[2]) for v in study_tiny.VARIANTS)["sisa_ds8"])
  target = matching.total_params(study_tiny.get_config())
  value, n = matching.match_params(c, "model.d_ff", target)
  counts = {}
  for d_ff in range(value - 40, value + 44, 4):   # the whole neighbourhood, counted
    cc = ml_collections.ConfigDict(c.to_dict())
    cc.model.d_ff = d_ff
    counts[d_ff] = matching.total_params(cc)
  assert counts[value] == n
  assert abs(n - target) == min(abs(v - target) for v in counts.values())


def test_study_152m_configs_validate():
  c = study_152m.get_config()
  assert c.data.source == "shards" and c.study.niah == "text"
  cfgs = matching.all_variant_configs(c)
  assert len(cfgs) == len(study_152m.VARIANTS)
  assert cfgs["transformer"][1]["params"] == 151_878_144
  for name, (vc, info) in cfgs.items():
    cfg = validate(vc).model
    assert abs(info["diff_pct"]) <= 100 * c.study.param_tolerance, name
    assert vc.data.seq_len == 2048 and cfg.d_model == 768
  assert cfgs["sisa_ds32"][0].model.d_ff == 2748   # docs/papers.md §1.4
  # the text NIAH runs through the evaluator's task list
  from attn_jax.eval.run import parse_tasks
  assert parse_tasks(c.eval.tasks) == ["niah", "mqar"]


def test_needle_examples_layout():
  toks, ans = needle.needle_batch(context_length=24, depth=1.0, samples=3, num_pairs=4,
                                  mqar_vocab=16, seed=0, cell=0)
  assert toks.shape == (3, 24) and ans.shape == (3,)
  for row, a in zip(toks, ans):
    keys, vals = row[0:8:2], row[1:8:2]
    assert np.all(keys < 16) and np.all((vals >= 16) & (vals < 32))
    assert np.all(row[8:23] >= 32)                # noise only between the pairs and the query
    assert row[23] == keys[3] and a == vals[3]    # depth 1.0: the last pair
  toks0, ans0 = needle.needle_batch(context_length=24, depth=0.0, samples=3, num_pairs=4,
                                    mqar_vocab=16, seed=0, cell=0)
  assert np.all(toks0[:, 23] == toks0[:, 0]) and np.all(ans0 == toks0[:, 1])
  with pytest.raises(ValueError, match="needle context length"):
    needle.needle_batch(context_length=8, depth=0.0, samples=1, num_pairs=4, mqar_vocab=16,
                        seed=0, cell=0)


def test_bad_study_config_errors_name_the_field():
  c = study_tiny.get_config()
  c.study.only = "nope"
  with pytest.raises(ValueError, match="config.study.only"):
    matching.variant_names(c)
  c = study_tiny.get_config()
  c.study.param_tolerance = 0.0001
  with pytest.raises(ValueError, match="param_tolerance"):
    matching.all_variant_configs(c)


@pytest.mark.slow
def test_full_tiny_study(tmp_path):
  """The study command of docs/studies.md end to end (a whole study: slow)."""
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "study.py"),
         "--config=" + os.path.join(ROOT, "configs", "study_tiny.py"),
         f"--workdir={tmp_path}"]
  subprocess.run(cmd, check=True, cwd=ROOT)
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  assert len(res["runs"]) == len(matching.variant_names(study_tiny.get_config())) * 3
  for p in report.PLOTS:
    assert (tmp_path / p).read_bytes()[:8] == PNG_SIGNATURE
