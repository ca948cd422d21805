"""Typed config values are type-checked, and every bad value is refused before anything is
written: one line naming the field, exit status 2, no workdir.

The type rules (attn_jax/field_checks.py): an int field takes an integer, not a bool and not a
float (3.0 neither); a float field takes any real number but a bool; a bool field True or False
only; a tuple field a tuple or list, element by element where its type says (niah_lengths).
In-process cases call what train.py calls (`config.validate`, `eval.run.task_callback`,
`train_and_evaluate`) and check the error's exit status and line as `attn_jax.cli` prints them;
the command-line cases run train.py.
"""

import os
import re
import subprocess
import sys

import ml_collections
import pytest

from attn_jax import cli
from attn_jax import config as config_lib
from attn_jax.field_checks import type_problem
from attn_jax.train.resume import config_changes
from configs import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**data):
  c = quickstart.get_config()
  c.model.update(d_model=32, n_heads=2, d_ff=64, n_layers=2, pattern=())
  c.data.update(seq_len=32, global_batch_size=8, mqar_num_pairs=4, mqar_num_queries=4, **data)
  c.train.update(steps=2, log_every=1, progress_bar=False)
  c.optim.warmup_steps = 1
  return c


def with_section(c, section: str, **values):
  """`c` with `section` rebuilt as a plain ConfigDict holding `values` (what a config file that
  builds its own dict makes: ConfigDict's own type lock does not apply)."""
  d = c[section].to_dict()
  d.update(values)
  c[section] = ml_collections.ConfigDict(d)
  return c


def refused(fn, *args, field: str, **kw) -> str:
  """The one line `cli` prints for the error `fn(*args)` raises: exit status 2, names `field`."""
  with pytest.raises(Exception) as info:
    fn(*args, **kw)
  assert cli.exit_status(info.value) == cli.USER_ERROR, repr(info.value)
  line = cli.one_line(info.value)
  assert "\n" not in line and field in line, line
  return line


def refused_by_training(c, tmp_path, field: str) -> str:
  """train.py's order: validate, the eval tasks' callback, then train_and_evaluate."""
  from attn_jax.eval.run import task_callback
  from attn_jax.train.trainer import train_and_evaluate

  workdir = tmp_path / "run"

  def train():
    run = config_lib.validate(c)
    tasks = task_callback(run)
    train_and_evaluate(run, str(workdir), eval_callbacks=[tasks] if tasks else [])

  line = refused(train, field=field)
  assert not workdir.exists(), sorted(os.listdir(workdir))   # no .lock, checkpoints/, tb/
  return line


# ------------------------------------------------------------------------------ the rules

@pytest.mark.parametrize("value, want, ok", [
    (3, int, True), (3.0, int, False), ("3", int, False), (True, int, False),
    (3, float, True), (3.5, float, True), (True, float, False), ("0.1", float, False),
    (True, bool, True), (1, bool, False), ("false", bool, False),
    ("a", str, True), (1, str, False),
    ((1, 2), tuple[int, ...], True), ([1, 2], tuple[int, ...], True),
    (("abc",), tuple[int, ...], False), ((1, 2.0), tuple[int, ...], False),
    ((0, 0.5), tuple[float, ...], True), ("ab", tuple, False)])
def test_type_rules_bool_is_not_an_int_and_a_whole_float_is_not_an_int(value, want, ok):
  assert (type_problem(value, want) is None) == ok


def test_each_section_and_the_model_and_mixer_options_are_type_checked():
  for section, field, value, said in [
      ("train", "steps", "3", "config.train.steps: must be an integer, got '3' (str)"),
      ("train", "steps", 3.0, "config.train.steps: must be an integer, got 3.0 (float)"),
      ("train", "steps", True, "config.train.steps: must be an integer, got True (bool)"),
      ("optim", "lr", "3e-3", "config.optim.lr: must be a number, got '3e-3' (str)"),
      ("train", "progress_bar", 0, "config.train.progress_bar: must be True or False, got 0"),
      ("data", "paths", 7, "config.data.paths: must be a string, got 7 (int)")]:
    c = with_section(tiny(), section, **{field: value})
    with pytest.raises(ValueError) as info:
      config_lib.validate(c)
    assert str(info.value).startswith(said), (str(info.value), said)
  ok = with_section(tiny(), "optim", lr=1)   # an int where a float is wanted is its value
  assert config_lib.validate(ok).optim.lr == 1
  c = tiny()
  del c["seed"]
  c.seed = "0"
  with pytest.raises(ValueError, match=r"^config\.seed: must be an integer, got '0' \(str\)"):
    config_lib.validate(c)
  c = with_section(tiny(), "model", d_model=32.0)
  with pytest.raises(ValueError, match=r"^config\.model\.d_model: must be an integer, got 32\.0"):
    config_lib.validate(c)
  c = tiny()
  c.model.pattern = ("sisa",)
  c.model.sisa = ml_collections.ConfigDict(dict(c.model.sisa.to_dict(), d_state=8.0))
  with pytest.raises(ValueError, match=r"^config\.model\.sisa\.d_state: must be an integer"):
    config_lib.validate(c)


# ----------------------------------------------------- refused before anything is written

def test_a_float_step_count_is_refused_before_training(tmp_path):
  """train.steps = 3.0 passed every check, compiled, then crashed in the loop, leaving .lock,
  checkpoints/ and tb/."""
  line = refused_by_training(with_section(tiny(), "train", steps=3.0), tmp_path,
                             "config.train.steps")
  assert line.startswith("error: config.train.steps: must be an integer, got 3.0 (float)")


def test_a_non_integer_niah_length_is_refused_before_training(tmp_path):
  c = tiny()
  c.eval.niah_lengths = ("abc",)
  line = refused_by_training(c, tmp_path, "config.eval.niah_lengths")
  assert "element 0: must be an integer, got 'abc' (str)" in line
  c = tiny()
  c.eval.niah_lengths = (0, 16)
  refused_by_training(c, tmp_path, "config.eval.niah_lengths")
  c = tiny()
  c.eval.niah_depths = (0.5, 2.0)
  refused_by_training(c, tmp_path, "config.eval.niah_depths")


def _niah_config(**eval_fields):
  c = tiny()
  c.model.vocab_size = 512               # the bytes tokenizer's ids fit
  c.data.tokenizer = "bytes"
  c.eval.update(tasks="niah", **eval_fields)
  return c


def test_niah_on_a_model_too_short_for_it_is_refused_before_training(tmp_path):
  """eval.tasks=niah with every niah length past the eval length (data.seq_len 32 here) used to
  be refused at the first evaluation, after training."""
  line = refused_by_training(_niah_config(), tmp_path, "config.eval.niah_lengths")
  assert "none fits max_len=32" in line
  # within max_len but past the model's max_seq_len: no cell would run
  line = refused_by_training(_niah_config(max_len=512), tmp_path, "config.eval.niah_lengths")
  assert "every length exceeds config.model.max_seq_len=32" in line


def test_niah_too_short_for_its_needle_is_refused_before_training(tmp_path):
  c = _niah_config(niah_lengths=(24,))
  line = refused_by_training(c, tmp_path, "config.eval.niah_lengths")
  assert "too short for the needle and question" in line


def test_benchmark_tasks_without_their_data_are_refused_before_training(tmp_path):
  c = tiny()
  c.eval.tasks = "lambada"
  refused_by_training(c, tmp_path, "config.eval.data_dir")


def _text(tmp_path, content: bytes):
  path = tmp_path / "corpus.txt"
  path.write_bytes(content)
  return path


@pytest.mark.parametrize("content, said", [
    (b"", "data file is empty"), (b"\n  \n", "data file is empty"),
    (b"good line\n\xff\xfe bad bytes\n", "corpus.txt:2: not valid UTF-8")])
def test_an_empty_or_non_utf8_data_file_leaves_no_skeleton(tmp_path, content, said):
  path = _text(tmp_path, content)
  c = tiny(source="text", paths=str(path), tokenizer="bytes")
  c.model.vocab_size = 512
  line = refused_by_training(c, tmp_path, str(path))
  assert said in line


def test_a_held_out_split_smaller_than_one_batch_names_the_global_batch_size(tmp_path):
  """The held-out batches are data.global_batch_size rows; eval.batch_size plays no part."""
  path = _text(tmp_path, ("a line of text for the corpus\n" * 200).encode())
  c = tiny(source="text", paths=str(path), tokenizer="bytes", eval_fraction=0.01)
  c.model.vocab_size = 512
  c.eval.batch_size = 1
  line = refused_by_training(c, tmp_path, "config.data.global_batch_size=8")
  assert "fewer than one held-out batch of 8" in line and "eval.batch_size" not in line
  c.data.eval_fraction = 0.0
  refused_by_training(c, tmp_path, "data.eval_fraction=0.0")
  c.data.eval_fraction = 0.05   # 10 held-out rows: one batch fits
  from attn_jax.train import preflight
  preflight.checked_setup(config_lib.validate(c))


def test_the_held_out_batch_error_at_run_time_names_the_global_batch_size(tmp_path):
  from attn_jax.data import pipeline
  path = _text(tmp_path, ("a line of text for the corpus\n" * 200).encode())
  run = config_lib.validate(tiny(source="text", paths=str(path), tokenizer="bytes",
                                 eval_fraction=0.01))
  with pytest.raises(ValueError, match=r"fewer than one batch of 8 \(data\.global_batch_size\); "
                     r"raise data\.eval_fraction or lower data\.global_batch_size"):
    pipeline.make_eval_batches(run.data, seed=0, num_batches=1)


def test_the_sinks_study_checks_sink_keep_before_any_run_trains(tmp_path):
  from attn_jax.study.runner import run_study
  from configs import study_sinks
  c = study_sinks.get_config()
  c.study.sink_keep = (0, 4096)
  workdir = tmp_path / "study"
  line = refused(run_study, c, str(workdir), log=lambda s: None, field="config.study.sink_keep")
  assert "must be in [0, study.sink_cache=" in line
  assert not workdir.exists()


# -------------------------------------------------------------------------------- resuming

def test_a_field_absent_from_an_older_saved_config_at_its_default_is_no_change():
  now = config_lib.validate(tiny()).to_json()
  saved = {**now, "data": {k: v for k, v in now["data"].items() if k != "window_offset"}}
  saved["model"] = {**now["model"], "sisa": {k: v for k, v in now["model"]["sisa"].items()
                                             if k not in ("use_phase", "d_state")}}
  # was: data.window_offset: '(absent)' -> 'none'; the preset's sisa.d_state 8 is no default
  assert config_changes(saved, now) == ["config.model.sisa.d_state: '(absent)' -> 8"]
  changed = {**now, "data": {**now["data"], "window_offset": "random"}}
  assert config_changes(saved, changed) == ["config.data.window_offset: '(absent)' -> 'random'",
                                            "config.model.sisa.d_state: '(absent)' -> 8"]
  assert config_changes(now, saved) == [       # a field the config lost is still said
      "config.data.window_offset: 'none' -> '(absent)'",
      "config.model.sisa.d_state: 8 -> '(absent)'", "config.model.sisa.use_phase: True -> "
      "'(absent)'"]


# ------------------------------------------------------------------------- the command line

def _train(tmp_path, *args):
  r = subprocess.run([sys.executable, "experiments/train.py", f"--workdir={tmp_path / 'run'}",
                      *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  lines = [x for x in r.stderr.splitlines() if x.strip() and not re.match(r"[IW]\d{4} ", x)]
  assert r.returncode == 2, r.stderr[-3000:]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert not (tmp_path / "run").exists()
  return lines[0]


_FILE = """
import ml_collections
from configs import quickstart


def get_config():
  c = quickstart.get_config()
  {body}
  return c
"""


@pytest.mark.parametrize("body, said", [
    # a config file building its own section: the type check in config.validate
    ('c.train = ml_collections.ConfigDict(dict(c.train.to_dict(), steps="3"))',
     "error: config.train.steps: must be an integer, got '3' (str)"),
    # a preset assigning a string to an int field: ConfigDict's own TypeError, in one line
    ('c.train.steps = "3"',
     "FATAL Flags parsing error: --config={path}: {path}:8 (c.train.steps = \"3\"): TypeError: "
     "Could not override field 'steps'")])
def test_train_py_a_mistyped_config_file_is_one_line_exit_2(tmp_path, body, said):
  path = tmp_path / "cfg.py"
  path.write_text(_FILE.format(body=body))
  line = _train(tmp_path, f"--config={path}")
  assert line.startswith(said.format(path=path)), line


def test_train_py_a_mistyped_override_is_one_line_exit_2(tmp_path):
  """absl's flag error used to exit 1, with a second line of usage advice."""
  line = _train(tmp_path, "--config.train.steps=3.0")
  assert line == ("FATAL Flags parsing error: flag --config.train.steps=3.0: invalid literal "
                  "for int() with base 10: '3.0'"), line


def test_a_config_file_error_is_one_line_naming_its_line(tmp_path):
  from attn_jax import config_flags
  cases = [('c.train.steps = "3"', f"{tmp_path}/cfg0.py:8 (c.train.steps = \"3\"): TypeError: "
            "Could not override field 'steps'"),
           ("c.train.steps = (", "SyntaxError: ")]
  for i, (body, said) in enumerate(cases):
    path = tmp_path / f"cfg{i}.py"
    path.write_text(_FILE.format(body=body))
    with pytest.raises(Exception) as info:
      config_flags.load_config_file(str(path))
    line = config_flags.config_file_error(info.value)
    assert "\n" not in line and line.startswith(said), line
    assert "Traceback" not in line and "Error whilst parsing" not in line
