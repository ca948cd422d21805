"""Run directories under stress: evaluation beside a training run that is saving, restarts from
step 0 over an earlier run's history, steps without a checksum manifest, saved configs that do
not build their arrays, and the entry points' output when a run cannot go on (a full disk, a
read-only checkpoint folder, a changed config, Ctrl-C twice, a SIGTERM during the first compile,
an empty --compile_only): one line, no library tracebacks; eval.py and stream.py on a run
folder they cannot write print and keep their results (a named fallback folder), and refuse an
unwritable --out_dir / --out before any work.
(An ignored SIGINT staying ignored: tests/test_faults.py, beside the SIGHUP case.)

The entry points run as subprocesses (their stderr is what a user sees); their configs are
files written next to the run that return `tests.test_train.tiny_config` variants, so they
train the same tiny model as the in-process tests."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from attn_jax import config as config_lib
from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train import setup as setup_lib, trainer as trainer_lib
from attn_jax.train.checkpoint import Checkpointer
from attn_jax.train.workdir import WorkdirLockedError, lock_tensorboard
from tests.test_faults import run_config, tmpfs
from tests.test_train import losses, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "tests", "data", "tinyshakespeare", "input.txt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 4-step run with checkpoints at steps 2 and 4 (copied by the tests)."""
  d = tmp_path_factory.mktemp("reference") / "run"
  trainer_lib.train_and_evaluate(run_config(), str(d))
  return d


def copy_run(reference, tmp_path):
  d = tmp_path / "run"
  shutil.copytree(reference, d)
  return d


def final_state(workdir, step=4):
  setup = setup_lib.build_setup(run_config())
  ckpt = Checkpointer(str(workdir))
  try:
    return jax.device_get(ckpt.restore(setup.abstract_state, step=step))
  finally:
    ckpt.close()


def listing(folder):
  return sorted(os.listdir(folder))


# ------------------------------------------------------------------ evaluation beside training


@pytest.mark.slow   # a training subprocess (or one beside it): > 10 s
def test_eval_while_the_run_saves_is_read_only_and_the_run_is_bit_identical(reference, tmp_path,
                                                                            monkeypatch):
  """experiments/eval.py runs while step 4's save is in its commit (its temporary folder on
  disk, the workdir locked by the run): it loads the newest committed step (2) and neither
  cleans, creates nor locks anything; the run then commits step 4 and ends bit-identical."""
  d, seen = tmp_path / "run", {}
  real = ckpt_lib.write_manifest

  def eval_during_commit(step_dir):
    if os.path.basename(step_dir).startswith("4."):
      root = d / "checkpoints"
      seen["before"] = listing(root)
      seen["eval"] = _script("eval.py", f"--checkpoint={d}", "--tasks=mqar", "--limit=4",
                             f"--out_dir={tmp_path / 'eval'}")
      seen["after"] = listing(root)
    return real(step_dir)

  monkeypatch.setattr(ckpt_lib, "write_manifest", eval_during_commit)
  trainer_lib.train_and_evaluate(run_config(), str(d))
  r = seen["eval"]
  assert r.returncode == 0, r.stderr[-3000:]
  assert "step=2" in r.stdout                    # the newest committed step, not the one saving
  assert any(n.startswith("4.orbax-checkpoint-tmp") for n in seen["before"]), seen
  assert seen["after"] == seen["before"]         # nothing cleaned up or created
  assert Checkpointer(str(d)).all_steps() == [2, 4]
  assert Checkpointer(str(d)).verify(4) is None and Checkpointer(str(d)).has_manifest(4)
  assert losses(d) == losses(reference)          # every step, exactly
  a, b = final_state(d), final_state(reference)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def _read_only_mount(folder):
  """`folder` made read-only: a read-only bind mount as root (root ignores permissions),
  chmod 555 otherwise. Returns the undo, or skips when neither is possible."""
  if os.geteuid() != 0:
    os.chmod(folder, 0o555)
    return lambda: os.chmod(folder, 0o755)
  for cmd in (["mount", "--bind", str(folder), str(folder)],
              ["mount", "-o", "remount,bind,ro", str(folder)]):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
      subprocess.run(["umount", "-l", str(folder)], capture_output=True)
      pytest.skip(f"cannot make a read-only mount here ({r.stderr.strip()})")
  return lambda: subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_load_for_inference_reads_a_read_only_checkpoint_folder(reference, tmp_path):
  d = copy_run(reference, tmp_path)
  undo = _read_only_mount(d / "checkpoints")
  try:
    _, config, step = ckpt_lib.load_for_inference(str(d))
  finally:
    undo()
  assert step == 4 and config.model.d_model == 32


def _unwritable_run(d):
  """The run folder `d` made unwritable to the commands that read it: a read-only bind mount
  as root (root ignores permissions), chmod 555 as another user; where root may not mount,
  its output folders eval/ and stream/ are taken by files, so neither can be made (what a
  read-only run folder also refuses). Returns the undo."""
  if os.geteuid() != 0:
    os.chmod(d, 0o555)
    return lambda: os.chmod(d, 0o755)
  if subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True).returncode == 0:
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(d)],
                      capture_output=True).returncode == 0:
      return lambda: subprocess.run(["umount", "-l", str(d)], capture_output=True)
    subprocess.run(["umount", "-l", str(d)], capture_output=True)
  for name in ("eval", "stream"):
    (d / name).write_text("a file where the output folder would go\n")
  return lambda: [os.remove(d / name) for name in ("eval", "stream")]


def _fallback(r, tmp_path, kind):
  """The fallback folder the command named in its warning (under its $TMPDIR)."""
  said = [x for x in noise(r.stderr) if "cannot be written" in x and "the results go to" in x]
  assert len(said) == 1, r.stderr[-3000:]
  folder = re.search(r"the results go to (\S+) instead", said[0]).group(1)
  assert folder.startswith(str(tmp_path / "tmp" / "attn_jax")) and folder.endswith(kind), folder
  return folder


def _in_tmpdir(tmp_path):
  (tmp_path / "tmp").mkdir(exist_ok=True)
  return {"TMPDIR": str(tmp_path / "tmp")}


def test_eval_of_a_run_it_cannot_write_prints_and_keeps_the_results(reference, tmp_path):
  """A read-only run folder (a shared copy of a colleague's run): the scores are printed and
  written to a fallback folder named at start, not lost to an OSError after the work."""
  d = copy_run(reference, tmp_path)
  before = listing(d)
  undo = _unwritable_run(d)
  try:
    r = _script("eval.py", f"--checkpoint={d}", "--tasks=mqar", "--limit=4",
                env=_in_tmpdir(tmp_path))
    after = listing(d)
  finally:
    undo()
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "| mqar |" in r.stdout and "step=4" in r.stdout, r.stdout
  folder = _fallback(r, tmp_path, "eval")
  assert f"written: {{'json': '{folder}/eval.json'" in r.stdout, r.stdout
  with open(os.path.join(folder, "eval.json")) as f:
    assert "acc" in json.load(f)["results"]["mqar"]
  assert after == before or after == sorted(before + ["eval", "stream"])   # nothing new


def test_stream_of_a_run_it_cannot_write_prints_and_keeps_the_results(reference, tmp_path):
  d = copy_run(reference, tmp_path)
  text = tmp_path / "stream.txt"
  text.write_text("the quick brown fox jumps over the lazy dog\n" * 4)
  before = listing(d)
  undo = _unwritable_run(d)
  try:
    r = _script("stream.py", f"--workdir={d}", f"--text={text}", "--policies=window",
                "--window=8", "--max_tokens=48", "--noprogress", env=_in_tmpdir(tmp_path))
    after = listing(d)
  finally:
    undo()
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert re.search(r"^window\S*\s+\d+\.\d{3}", r.stdout, re.M), r.stdout   # the scores
  folder = _fallback(r, tmp_path, "stream")
  paths = json.loads(r.stdout[r.stdout.index("{"):])
  assert paths["summary"] == os.path.join(folder, "summary.json"), paths
  assert os.path.isfile(paths["summary"]) and os.path.isfile(paths["csv"])
  assert after == before or after == sorted(before + ["eval", "stream"])


@pytest.mark.parametrize("script, flag", [("eval.py", "--out_dir"), ("stream.py", "--out")])
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(reference, tmp_path,
                                                                             script, flag):
  (tmp_path / "a_file").write_text("not a folder\n")
  out = tmp_path / "a_file" / "results"
  args = ([f"--checkpoint={reference}", "--tasks=mqar", "--limit=4"] if script == "eval.py"
          else [f"--workdir={reference}", f"--text={SHAKESPEARE}", "--max_tokens=48"])
  r = _script(script, *args, f"{flag}={out}")
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stdout == ""                       # nothing evaluated
  lines = noise(r.stderr)
  assert lines == [f"error: {flag}={out} cannot be written (Not a directory: "
                   f"{tmp_path / 'a_file'} is a file); nothing was computed. Point {flag} at a "
                   "writable folder (--debug or ATTN_JAX_DEBUG=1: traceback)"], lines


def test_eval_past_a_truncated_unverified_step_prints_no_library_tracebacks(reference,
                                                                            tmp_path):
  """orbax's read coroutines of the failed step report their errors again when collected
  (after the fallback has loaded step 2): the entry point drops those reports. (Unverified
  steps allowed: refused otherwise, see the manifest test below.)"""
  d = copy_run(reference, tmp_path)
  os.remove(d / "checkpoints" / "4" / ckpt_lib.MANIFEST)
  for folder, _, names in os.walk(d / "checkpoints" / "4" / "state"):
    for name in names if os.path.basename(folder) == "d" else ():
      path = os.path.join(folder, name)   # every OCDBT data file cut in half: nothing reads
      os.truncate(path, os.path.getsize(path) // 2)
  r = _script("eval.py", f"--checkpoint={d}", "--tasks=mqar", "--limit=4",
              f"--out_dir={tmp_path / 'eval'}", "--allow_unverified")
  assert r.returncode == 0 and "step=2" in r.stdout, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
  lines = noise(r.stderr)
  assert len(lines) == 2 and "step 4" in lines[0] and "loaded step 2" in lines[1], lines


def test_a_step_pruned_while_it_is_read_gives_way_to_the_newest(reference, tmp_path, caplog,
                                                                 monkeypatch):
  """The training run commits step 6 and prunes 2 and 4 (checkpoint.max_to_keep) while the
  evaluator reads step 4: it loads the newest committed step instead of failing on 2."""
  d = copy_run(reference, tmp_path)
  root, real = d / "checkpoints", ckpt_lib._load_step

  def training_moves_on(ckpt, step, devices):
    if step == 4 and not (root / "6").exists():
      shutil.copytree(root / "4", root / "6")
      shutil.rmtree(root / "4")
      shutil.rmtree(root / "2")
    return real(ckpt, step, devices)

  monkeypatch.setattr(ckpt_lib, "_load_step", training_moves_on)
  with caplog.at_level(logging.WARNING):
    assert ckpt_lib.load_for_inference(str(d))[2] == 6
  assert any("step 4" in r.getMessage() and "deleted while it was read" in r.getMessage()
             for r in caplog.records)


# ------------------------------------------------------------------ history at step 0


def test_a_restart_from_step_0_moves_the_old_history_aside_and_says_so(reference, tmp_path,
                                                                       caplog):
  """All checkpoints set aside as corrupt (what reruns over damaged steps leave): the rerun
  starts at step 0, and the earlier run's metrics and TensorBoard events are kept whole."""
  d = copy_run(reference, tmp_path)
  old_rows = (d / "metrics.jsonl").read_text()
  old_events = listing(d / "tb")
  for s in ("2", "4"):
    os.rename(d / "checkpoints" / s, d / "checkpoints" / f"{s}.corrupt")
  with caplog.at_level(logging.WARNING):
    trainer_lib.train_and_evaluate(run_config(), str(d))
  msg = " ".join(r.getMessage() for r in caplog.records if "step 0" in r.getMessage())
  assert "earlier run's history" in msg and "2.corrupt, 4.corrupt" in msg, msg
  assert "metrics.jsonl.1" in msg and "tb.1" in msg and "nothing was deleted" in msg
  assert (d / "metrics.jsonl.1").read_text() == old_rows          # every old row kept
  assert listing(d / "tb.1") == [n for n in old_events if n != ".writer.lock"]
  assert losses(d) == losses(reference)                           # the new run, from step 1
  assert not any("logged again" in r.getMessage() for r in caplog.records)


def test_a_run_writing_another_runs_tensorboard_folder_is_refused(tmp_path):
  other = tmp_path / "other"
  (other / "tb").mkdir(parents=True)
  (tmp_path / "run").mkdir()
  os.symlink(other / "tb", tmp_path / "run" / "tb")   # two workdirs, one TensorBoard folder
  held = lock_tensorboard(str(other))
  try:
    with pytest.raises(WorkdirLockedError, match=rf"TensorBoard folder .*run/tb \(= .*other/tb"
                       rf"\) is in use by pid {os.getpid()}"):
      trainer_lib.train_and_evaluate(run_config(), str(tmp_path / "run"))
  finally:
    held.release()


# ------------------------------------------------------------------ manifests and meta


def _change_a_value_unseen(step_dir, abstract_state):
  """Step `step_dir`'s largest parameter + 0.5, written as valid orbax arrays, and its
  manifest removed: damage that only the manifest could have caught (the new value returned).
  Deterministic, unlike flipping a byte of the compressed files: where the middle of the
  largest data file falls changes from run to run (orbax's writer threads), and a flip there
  can make a zstd frame undecodable or a value non-finite, which the load does catch."""
  ckpt = Checkpointer(str(step_dir.parent.parent), read_only=True)
  state = ckpt.restore(abstract_state, step=int(step_dir.name))
  ckpt.close()
  leaves, tree = jax.tree.flatten(state["params"])
  i = max(range(len(leaves)), key=lambda j: leaves[j].size)
  leaves[i] = leaves[i] + 0.5
  state["params"] = jax.tree.unflatten(tree, leaves)
  shutil.rmtree(step_dir / "state")
  with ocp.StandardCheckpointer() as c:
    c.save(str(step_dir / "state"), state)
  os.remove(step_dir / ckpt_lib.MANIFEST)
  return i, np.asarray(leaves[i])


def test_a_step_without_a_manifest_is_refused_unless_allowed_then_said_unverified(
    reference, tmp_path, caplog):
  """A changed value in a step without its manifest cannot be detected: the evaluator and a
  resuming run refuse the step (nothing moved, no older step in its place), naming the switch;
  allowed, the load says plainly that it is unverified (no "older version" excuse)."""
  d = copy_run(reference, tmp_path)
  abstract_state = setup_lib.build_setup(run_config()).abstract_state
  i, changed = _change_a_value_unseen(d / "checkpoints" / "4", abstract_state)
  refused = (r"checkpoint step 4 in .*checkpoints has no checksum manifest "
             r"\(attn_jax_sha256.json\), so damaged bytes in it cannot be detected, and it was "
             r"not loaded \(nothing was moved\).* --config.checkpoint.allow_unverified=True "
             r"\(train.py\) or --allow_unverified \(eval.py, stream.py\)")
  with pytest.raises(ckpt_lib.CheckpointUnverifiedError, match=refused):
    ckpt_lib.load_for_inference(str(d))
  with pytest.raises(ckpt_lib.CheckpointUnverifiedError, match=refused):
    Checkpointer(str(d)).restore(abstract_state)
  assert listing(d / "checkpoints") == ["2", "4"]
  with caplog.at_level(logging.WARNING):
    _, _, step = ckpt_lib.load_for_inference(str(d), allow_unverified=True)
    state = Checkpointer(str(d), allow_unverified=True).restore(abstract_state)
  assert step == 4
  np.testing.assert_array_equal(jax.tree.leaves(state["params"])[i], changed)   # unseen
  warned = [r.getMessage() for r in caplog.records if "UNVERIFIED" in r.getMessage()]
  assert len(warned) == 2 and all("step 4" in w and "no checksum manifest" in w and
                                  "cannot be detected" in w for w in warned), warned
  assert not any("older version" in r.getMessage() for r in caplog.records)


def _edit_meta(step_dir, edit):
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  edit(meta["config"]["model"])
  with open(path, "w") as f:
    json.dump(meta, f)
  ckpt_lib.write_manifest(step_dir)   # consistent checksums: only the config is wrong


def test_a_saved_config_that_does_not_build_its_arrays_is_a_named_mismatch(tmp_path):
  """FoX weights whose saved config was edited to plain attention (the same projections, no
  forget gate): a partial restore would evaluate them as attention; the load refuses, naming
  the arrays, for the newest step and for an explicit one, and tries no older step."""
  c = tiny_config()
  c.model.pattern = ("fox",)
  setup = setup_lib.build_setup(c)
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  for s in (1, 2):
    ckpt.save(s, setup.init_fn(), meta={"config": config_lib.config_to_json(c)}, force=True)
  ckpt.close()
  assert ckpt_lib.load_for_inference(str(tmp_path))[2] == 2   # as saved: loads
  _edit_meta(os.path.join(tmp_path, "checkpoints", "2"), lambda m: m.update(pattern=[]))
  for step in (None, 2):
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=(
        r"step 2 .*the config saved with it .*model.mixer='attention', model.pattern=\(\), .*"
        r"does not build the parameters stored in it.*fgate.* in the checkpoint, not "
        r"requested")):
      ckpt_lib.load_for_inference(str(tmp_path), step)
  assert listing(tmp_path / "checkpoints") == ["1", "2"]


# ------------------------------------------------------------------ entry points: one line

_CONFIG = """
import sys
sys.path.insert(0, {root!r})
from tests.test_train import tiny_config


def get_config():
  c = tiny_config(steps={steps})
  c.checkpoint.update({checkpoint!r})
  c.model.update({model!r})
  c.train.update({train!r})
  return c
"""


def write_config(path, steps=4, checkpoint=None, model=None, train=None):
  path.write_text(_CONFIG.format(root=ROOT, steps=steps, checkpoint=checkpoint or
                                 {"every_steps": 2}, model=model or {}, train=train or {}))
  return f"--config={path}"


def _script(name, *args, runner=None, env=None):
  cmd = [sys.executable] + (["-c", runner, name] if runner else [f"experiments/{name}"])
  return subprocess.run(cmd + list(args), cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
                        capture_output=True, text=True, timeout=300)


def noise(stderr):
  """stderr without the run's INFO log records (absl's "I<mmdd> ..." lines)."""
  return [x for x in stderr.splitlines() if x.strip() and not re.match(r"I\d{4} ", x)]


def _check_clean(r, status, first):
  lines = noise(r.stderr)
  assert r.returncode == status, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "orbax" not in r.stderr, r.stderr[-3000:]
  assert len(lines) <= 3 and lines[-1].startswith(first), lines
  return lines


def test_a_changed_config_resume_is_one_line(reference, tmp_path):
  d = copy_run(reference, tmp_path)
  r = _script("train.py", write_config(tmp_path / "cfg.py", model={"d_model": 64}),
              f"--workdir={d}")
  lines = _check_clean(r, 2, "error: checkpoint step 4")
  assert r.stderr.strip().splitlines() == lines   # refused before the run logs anything
  assert len(lines) == 1 and "config.model.d_model: 32 -> 64" in lines[0]
  assert "Event loop is closed" not in r.stderr


def test_a_read_only_checkpoint_folder_is_one_line_before_training(reference, tmp_path):
  d = copy_run(reference, tmp_path)
  undo = _read_only_mount(d / "checkpoints")
  try:
    r = _script("train.py", write_config(tmp_path / "cfg.py", steps=6), f"--workdir={d}")
  finally:
    undo()
  lines = _check_clean(r, 2, f"error: checkpoint folder {d / 'checkpoints'} is not writable")
  assert r.stderr.strip().splitlines() == lines and len(lines) == 1, r.stderr
  assert listing(d / "checkpoints") == ["2", "4"]


_ENOSPC_RUNNER = """
import errno, os, runpy, sys
sys.path.insert(0, os.getcwd())
import attn_jax.cli  # JAX starts as in the entry point (its native start-up lines filtered)
from attn_jax.train import checkpoint

real = checkpoint.write_manifest


def no_space(step_dir):   # from step 4 on, the step's commit finds the disk full
  if int(os.path.basename(step_dir).split(".")[0]) >= 4:
    raise OSError(errno.ENOSPC, "No space left on device", step_dir)
  return real(step_dir)


checkpoint.write_manifest = no_space
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join("experiments", script), run_name="__main__")
"""


@pytest.fixture
def small_disk(tmp_path):
  yield from tmpfs(tmp_path, "1m")


@pytest.mark.slow   # a training subprocess (or one beside it): > 10 s
def test_a_full_disk_is_one_line_injected(tmp_path):
  cfg = write_config(tmp_path / "cfg.py")   # the reference run's program: a compile-cache hit
  r = _script("train.py", cfg, f"--workdir={tmp_path / 'run'}", runner=_ENOSPC_RUNNER)
  lines = _check_clean(r, 2, "error: saving checkpoint step 4")
  assert "the disk is full" in lines[-1] and "Older steps are kept: [2]" in lines[-1]


@pytest.mark.slow   # a training subprocess (or one beside it): > 10 s
def test_a_full_disk_is_one_line_tmpfs(small_disk, tmp_path):
  """A real 1 MB disk filling up at the second checkpoint (~0.7 MB a step): tensorstore's
  write errors in orbax's threads."""
  r = _script("train.py", write_config(tmp_path / "cfg.py"), f"--workdir={small_disk / 'run'}")
  lines = _check_clean(r, 2, "error: ")
  assert "No space left on device" in lines[-1] or "the disk is full" in lines[-1], lines


_DOUBLE_INTERRUPT_RUNNER = """
import os, runpy, signal, sys, threading, time
sys.path.insert(0, os.getcwd())
import attn_jax.cli  # JAX starts as in the entry point (its native start-up lines filtered)
import orbax.checkpoint as ocp
from attn_jax.train import checkpoint, setup as setup_lib

real_next, real_wait = setup_lib.next_batch, checkpoint.Checkpointer.wait
real_in_progress = ocp.CheckpointManager.is_saving_in_progress
armed, waiting = [], threading.Event()
# Ctrl-C as in a terminal, whatever pytest inherited (a background job ignores SIGINT), sent to
# the main thread (a signal sent to the process may be taken by any thread: handled late).
signal.signal(signal.SIGINT, signal.default_int_handler)


def ctrl_c():
  signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def in_progress(self):   # marks the moment the run is inside its wait for the commit (the
  busy = real_in_progress(self)   # checkpointer polls this flag while a commit runs)
  if busy:
    waiting.set()
  return busy


def next_batch(it, *a, **k):   # Ctrl-C while step 3's micro-batches are pulled ...
  if not hasattr(next_batch, "n"):
    next_batch.n = 0
  next_batch.n += 1
  if next_batch.n == 3:
    next(it)
    ctrl_c()
    armed.append(True)
  return real_next(it, *a, **k)


def wait(self):   # ... and again while the run waits for step 2's commit
  if armed:
    armed.clear()
    waiting.clear()

    def interrupt():   # a timer alone could fire before the wait began on a loaded machine
      waiting.wait(30)
      time.sleep(0.005)
      ctrl_c()

    threading.Thread(target=interrupt, daemon=True).start()
  return real_wait(self)


setup_lib.next_batch, checkpoint.Checkpointer.wait = next_batch, wait
ocp.CheckpointManager.is_saving_in_progress = in_progress
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join("experiments", script), run_name="__main__")
"""


@pytest.mark.slow   # a training subprocess (or one beside it): > 10 s
def test_ctrl_c_twice_keeps_the_save_being_committed_and_prints_no_traceback(tmp_path):
  cfg = write_config(tmp_path / "cfg.py", train={"grad_accum": 2})
  d = tmp_path / "run"
  r = _script("train.py", cfg, f"--workdir={d}", runner=_DOUBLE_INTERRUPT_RUNNER)
  assert r.returncode == 130, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "orbax" not in r.stderr, r.stderr[-3000:]
  assert noise(r.stderr)[-1] == "interrupted"
  assert listing(d / "checkpoints") == ["2"]   # committed, not a temporary folder
  assert Checkpointer(str(d)).verify(2) is None


_SIGTERM_IN_COMPILE_RUNNER = """
import os, runpy, signal, sys, time
sys.path.insert(0, os.getcwd())
import attn_jax.cli  # JAX starts as in the entry point (its native start-up lines filtered)
from attn_jax.train import fitting

real = fitting.compile_step


def compile_step(*a, **k):   # the first compile: the scheduler's SIGTERM comes in the middle of
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(120)            # a compile that goes on for minutes (no Python code runs in it)
  return real(*a, **k)


fitting.compile_step = compile_step   # what fitting.compile_for calls
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join("experiments", script), run_name="__main__")
"""


def test_sigterm_during_the_first_compile_is_one_line_and_releases_the_lock(tmp_path):
  """A SIGTERM before the first step used to kill the process silently (the default action),
  leaving its pid in the workdir lock; now the run ends at once, even inside a long compile,
  with the stop line and status 143, the lock released and nothing to save."""
  d = tmp_path / "run"
  t0 = time.monotonic()
  r = _script("train.py", write_config(tmp_path / "cfg.py"), f"--workdir={d}",
              runner=_SIGTERM_IN_COMPILE_RUNNER)
  assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-3000:])
  assert time.monotonic() - t0 < 100      # not after the 120 s compile
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == (
      "stopped by SIGTERM before training started (nothing to save); rerun the same command "
      "to resume"), r.stdout
  assert (d / ".lock").read_text() == ""   # released: the next run takes no stale lock
  assert listing(d / "checkpoints") == [] and not (d / "metrics.jsonl").exists()


def test_an_empty_compile_only_is_an_error_not_a_cpu_training_run(tmp_path):
  r = _script("train.py", write_config(tmp_path / "cfg.py", steps=1), "--compile_only=",
              f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2, r.stderr[-3000:]
  lines = noise(r.stderr)
  assert len(lines) == 1 and lines[0].startswith(
      "error: --compile_only= is empty: name a hardware target (h100x1, "), lines
  assert "v5e-8" in lines[0] and "or leave the flag out to train" in lines[0]
  assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the small ones


def test_bench_with_an_unknown_config_is_one_line():
  r = _script("bench.py", "--configs=transformer_152m,transformer_9000m", "--scale=tiny")
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stdout == ""                        # nothing measured, nothing printed
  lines = noise(r.stderr)
  assert len(lines) == 1 and lines[0].startswith(
      "error: --configs: unknown config 'transformer_9000m': there is no "
      "configs/transformer_9000m.py (configs: "), lines


def test_study_refuses_a_training_run_folder(reference):
  r = _script("study.py", "--config=configs/study_tiny.py", f"--workdir={reference}")
  assert r.returncode == 2, r.stderr[-3000:]
  lines = noise(r.stderr)
  assert len(lines) == 1 and f"--workdir={reference} is a training run's folder" in lines[0]
  assert listing(reference) == [".lock", "checkpoints", "metrics.jsonl", "tb"]


@pytest.mark.parametrize("text, warned", [("one document, one line, no separators", True),
                                          ("first document\nsecond document\n", False)])
def test_document_mask_on_a_single_document_says_so(tmp_path, caplog, text, warned):
  from attn_jax.data import text as text_lib
  path = tmp_path / "corpus.txt"
  path.write_text(text * 8)
  c = tiny_config(source="text", paths=str(path), tokenizer="bytes", text_document="line",
                  document_mask=True, eval_fraction=0.0)
  c.data.seq_len = 8
  with caplog.at_level(logging.WARNING):
    text_lib.make_text_source(c.data, split="train")
  said = [r.getMessage() for r in caplog.records if "document_mask" in r.getMessage()]
  assert bool(said) == warned, said
  if warned:
    assert "holds 1 document" in said[0] and "changes nothing" in said[0]
    assert str(path) in said[0]
