"""Fault cases, one test each (each one failed on the code before its fix):
  1. resuming with a changed model config names the differing fields and moves nothing;
  2. checkpoint.max_to_keep < 1 is a config error;
  3. SIGHUP stops at a step boundary with a checkpoint, and the rerun equals an uninterrupted run;
  4. a full disk during a save stops the run within seconds, non-zero, older steps kept;
  5. load_for_inference (eval.py, stream.py) verifies checksums and falls back past a damaged
     newest step, and so does config.train.init_from;
  6. a binary --text file of stream.py is an error naming the file;
  7. a crash right after a save resumes from a verified step (manifest written in the commit);
  8. a bit-flipped token shard is an error naming the shard when a run opens it;
and the smaller ones: one-line errors of the entry points, a missing --config file with
overrides, eval.every_steps < 0, the warm-up / schedule warnings, PreemptionGuard keeping an
ignored SIGHUP / SIGINT ignored, decode.generate and NIAH following the one max_seq_len rule.
(tests/test_reliability_runs.py: evaluation beside a saving run, history at step 0, unverified
steps, meta / array mismatches, the entry points' stderr when a run cannot go on.)"""

import errno
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from attn_jax import config as config_lib, model_config
from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train import setup as setup_lib, trainer as trainer_lib
from attn_jax.train.checkpoint import Checkpointer, PreemptionGuard
from attn_jax.train.metrics import read_metrics
from tests.signal_setup import deliver
from tests.test_checkpoint import _flip_bytes, abstract, make_state
from tests.test_train import losses, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_config(steps=4):
  c = tiny_config(steps=steps)
  c.checkpoint.every_steps = 2
  return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each test)."""
  d = tmp_path_factory.mktemp("trained") / "run"
  trainer_lib.train_and_evaluate(run_config(), str(d))
  assert Checkpointer(str(d)).all_steps() == [2, 4]
  return d, losses(d)


def copy_run(trained, tmp_path):
  d = tmp_path / "run"
  shutil.copytree(trained[0], d)
  return d


def step_dirs(workdir):
  return sorted(p.name for p in (workdir / "checkpoints").iterdir())


# ------------------------------------------------------------------ 1. changed config


def test_resume_with_a_changed_model_config_names_the_fields_and_moves_nothing(trained,
                                                                              tmp_path,
                                                                              caplog):
  d = copy_run(trained, tmp_path)
  before_dirs, before_metrics = step_dirs(d), (d / "metrics.jsonl").read_text()
  c = run_config()
  c.model.d_model = 64
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    trainer_lib.train_and_evaluate(c, str(d))
  msg = str(e.value)
  assert "config.model.d_model: 32 -> 64" in msg
  assert "stored (" in msg and "requested (" in msg and "params/" in msg
  assert "Nothing was moved" in msg
  assert step_dirs(d) == before_dirs   # no <step>.corrupt
  assert (d / "metrics.jsonl").read_text() == before_metrics
  # The right config resumes from step 4 (more steps: the schedule change is said out loud).
  with caplog.at_level(logging.WARNING):
    trainer_lib.train_and_evaluate(run_config(steps=6), str(d))
  msgs = " ".join(r.getMessage() for r in caplog.records)
  assert "config.train.steps: 4 -> 6" in msgs and "learning-rate schedule" in msgs
  rows = losses(d)
  assert [s for s, _ in rows] == list(range(1, 7)) and rows[:4] == trained[1]


def test_a_second_corrupt_step_is_left_in_place(tmp_path):
  c = Checkpointer(str(tmp_path), max_to_keep=5)
  for s in (1, 2, 3):
    c.save(s, make_state(s), force=True)
  c.close()
  for s in (2, 3):
    _flip_bytes(os.path.join(tmp_path, "checkpoints", str(s)))
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match=r"step 3 was corrupt.*step 2 is "
                     r"unusable too.*left in place"):
    Checkpointer(str(tmp_path)).restore(abstract())
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3.corrupt"]


# ------------------------------------------------------------------ 2. max_to_keep


@pytest.mark.parametrize("keep", [0, -1])
def test_max_to_keep_below_one_is_a_config_error(keep):
  c = tiny_config()
  c.checkpoint.max_to_keep = keep
  with pytest.raises(ValueError, match="config.checkpoint.max_to_keep: must be an integer >= 1"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="config.checkpoint.max_to_keep"):
    Checkpointer("/nonexistent-never-created", max_to_keep=keep)


# ------------------------------------------------------------------ 3. SIGHUP


def test_sighup_stops_at_a_step_boundary_and_the_rerun_is_identical(trained, tmp_path,
                                                                     monkeypatch):
  def not_intercepted(signum, frame):
    raise RuntimeError("SIGHUP reached the process: the run would have died")

  previous = signal.signal(signal.SIGHUP, not_intercepted)
  real_next = setup_lib.next_batch
  calls = {"n": 0}

  def hangup_at_step_3(*a, **k):
    calls["n"] += 1
    if calls["n"] == 3:                     # the terminal closes during step 3
      deliver(signal.SIGHUP)
    return real_next(*a, **k)

  try:
    monkeypatch.setattr(setup_lib, "next_batch", hangup_at_step_3)
    out = trainer_lib.train_and_evaluate(run_config(), str(tmp_path))
    assert out["preempted"] == "SIGHUP" and out["step"] == 3
    assert signal.getsignal(signal.SIGHUP) is not_intercepted   # put back afterwards
  finally:
    signal.signal(signal.SIGHUP, previous)
  assert Checkpointer(str(tmp_path)).latest_step() == 3
  monkeypatch.setattr(setup_lib, "next_batch", real_next)
  trainer_lib.train_and_evaluate(run_config(), str(tmp_path))
  assert losses(tmp_path) == trained[1]


def test_sighup_ignored_at_start_stays_ignored_and_sig_ign_comes_back():
  prev_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)        # nohup
  prev_int = signal.signal(signal.SIGINT, signal.SIG_IGN)        # a background job
  try:
    with PreemptionGuard() as guard:
      deliver(signal.SIGHUP)
      deliver(signal.SIGINT)
      assert not guard.should_stop
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN   # ignored, as its parent asked
      assert signal.getsignal(signal.SIGTERM) == guard._handle   # the scheduler's notice stops
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGHUP, prev_hup)
    signal.signal(signal.SIGINT, prev_int)


# ------------------------------------------------------------------ 4. full disk


def tmpfs(tmp_path, size: str):
  """A tmpfs of `size` mounted under tmp_path (skips where mounting is not allowed)."""
  mnt = tmp_path / "disk"
  mnt.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                     capture_output=True, text=True)
  if r.returncode:
    pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected case covers it")
  yield mnt
  subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
  yield from tmpfs(tmp_path, "3m")


def _timed_saves(monkeypatch):
  """Records when each save started, to time how long a failed save takes to stop the run."""
  started = {}
  real = Checkpointer.save

  def save(self, step, *a, **k):
    started[step] = time.monotonic()
    return real(self, step, *a, **k)

  monkeypatch.setattr(Checkpointer, "save", save)
  return started


def _check_full_disk_stop(workdir, started, error, first_bad):
  """Stopped within 30 s of the save that failed, saying the disk is full and naming the step
  (or, when a metrics writer failed first, that writer and the disk); the older steps are
  whole."""
  msg = str(error.value)
  if isinstance(error.value, ckpt_lib.CheckpointSaveError):
    assert "disk is full" in msg and f"step {first_bad}" in msg
  else:
    assert re.match(r"writing (metrics\.jsonl|TensorBoard) \(", msg), msg
    assert "the disk mounted at" in msg and "is full" in msg, msg
  elapsed = time.monotonic() - started[first_bad]
  assert elapsed < 30, elapsed
  kept = Checkpointer(str(workdir)).all_steps()
  assert kept and max(kept) <= first_bad
  if isinstance(error.value, ckpt_lib.CheckpointSaveError):
    assert f"Older steps are kept: {kept}" in msg
  for s in kept:   # the older steps are whole
    assert Checkpointer(str(workdir)).verify(s) is None


def test_full_disk_during_a_save_stops_within_seconds_keeping_older_steps(small_disk,
                                                                          monkeypatch):
  started = _timed_saves(monkeypatch)
  c = run_config(steps=400)
  c.checkpoint.update(every_steps=10, max_to_keep=100)   # ~0.4 MB a step: the disk fills
  with pytest.raises(OSError) as e:   # CheckpointSaveError, or metrics.jsonl's write first
    trainer_lib.train_and_evaluate(c, str(small_disk / "run"))
  kept = Checkpointer(str(small_disk / "run")).all_steps()
  failed = [s for s in started if s not in kept]   # empty when metrics.jsonl failed first
  _check_full_disk_stop(small_disk / "run", started, e, min(failed) if failed else max(started))


def test_injected_enospc_in_a_save_stops_with_a_clear_error(tmp_path, monkeypatch):
  started = _timed_saves(monkeypatch)
  real = ckpt_lib.write_manifest

  def no_space(step_dir):
    if int(os.path.basename(step_dir).split(".")[0]) >= 4:
      raise OSError(errno.ENOSPC, "No space left on device", step_dir)
    return real(step_dir)

  monkeypatch.setattr(ckpt_lib, "write_manifest", no_space)
  c = run_config(steps=12)
  with pytest.raises(ckpt_lib.CheckpointSaveError) as e:
    trainer_lib.train_and_evaluate(c, str(tmp_path))
  _check_full_disk_stop(tmp_path, started, e, 4)
  assert max(r["step"] for r in read_metrics(str(tmp_path))) <= 6   # stopped at once


# ------------------------------------------------------------------ 5. inference loading


def test_load_for_inference_falls_back_past_a_damaged_newest_step(trained, tmp_path, caplog):
  d = copy_run(trained, tmp_path)
  _flip_bytes(str(d / "checkpoints" / "4"))
  with caplog.at_level(logging.WARNING):
    model, config, step = ckpt_lib.load_for_inference(str(d))
  assert step == 2 and config.model.d_model == 32
  assert any("step 4" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
  assert step_dirs(d) == ["2", "4"]   # evaluation never moves a run's files
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match="sha256"):
    ckpt_lib.load_for_inference(str(d), step=4)


def test_init_from_a_run_whose_newest_step_is_damaged_starts_from_the_step_before(
    trained, tmp_path, caplog):
  """config.train.init_from (init_step -1) falls back past a damaged newest step as a resume
  does (it used to load the fixed newest step: "trying the previous step", then "no usable
  checkpoint" with step 2 intact); the source run is only read. An explicit init_step of the
  damaged step is an error naming it."""
  d = copy_run(trained, tmp_path)
  _flip_bytes(str(d / "checkpoints" / "4"))
  c = run_config(steps=2)
  c.train.init_from = str(d)
  with caplog.at_level(logging.INFO):
    out = trainer_lib.train_and_evaluate(c, str(tmp_path / "finetune"))
  msgs = [r.getMessage() for r in caplog.records]
  assert out["loss"] == out["loss"]   # trained (finite)
  assert any("step 4" in m and "sha256" in m and "trying the previous step" in m for m in msgs)
  assert any(m.startswith(f"init_from {d} step 2: parameters loaded") for m in msgs), msgs
  assert step_dirs(d) == ["2", "4"]   # nothing moved in the source run
  c.train.init_step = 4
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match=(
      r"checkpoint step 4 in .*is unusable \(.*sha256.*\); no other step was tried")):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "explicit"))


# ------------------------------------------------------------------ 6. binary stream file


def test_binary_stream_file_is_an_error_naming_the_file(tmp_path):
  from attn_jax import streaming
  path = tmp_path / "weights.bin"
  path.write_bytes(b"abc\xff\xfe\x00\x80" * 10)
  with pytest.raises(ValueError, match=r"stream file '.*weights\.bin' \(from --text\) is not "
                     r"UTF-8 text: byte 3"):
    streaming.read_stream(str(path))


# ------------------------------------------------------------------ 7. crash after a save

_CRASH_AFTER_SAVE = """
import os, sys
sys.path.insert(0, {root!r})
from tests.test_checkpoint import make_state
from attn_jax.train.checkpoint import Checkpointer
c = Checkpointer({workdir!r})
c.save(1, make_state(1), force=True)
c._mngr.wait_until_finished()   # orbax's commit is done ...
os._exit(0)                     # ... and the process dies before anything else runs
"""


def test_a_crash_right_after_a_save_resumes_from_a_verified_step(tmp_path, caplog):
  script = _CRASH_AFTER_SAVE.format(root=ROOT, workdir=str(tmp_path))
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                     timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  step_dir = os.path.join(tmp_path, "checkpoints", "1")
  assert os.path.isfile(os.path.join(step_dir, ckpt_lib.MANIFEST))
  assert ckpt_lib.verify_manifest(step_dir) is None
  _flip_bytes(step_dir)   # a flipped byte in the step the crashed run resumes from ...
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match="sha256"):
    Checkpointer(str(tmp_path)).restore(abstract())   # ... is caught, not loaded silently


# ------------------------------------------------------------------ 8. shard checksums


def test_a_bit_flipped_shard_is_an_error_naming_it_when_a_run_opens_it(tmp_path, monkeypatch):
  from attn_jax.data import doc_reader, shard_prep, shards
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path / "cache"))
  (tmp_path / "in").mkdir()
  for i in range(2):
    (tmp_path / "in" / f"d{i}.txt").write_text("\n".join(f"document {i} {j} " * 8
                                                         for j in range(20)))
  out = tmp_path / "out"
  shard_prep.prepare(str(tmp_path / "in"), str(out), workers=1, progress=False)
  shards.TokenShards(str(out))   # verified once ...
  assert os.path.isfile(tmp_path / "cache" / "verified_shards.json")
  path = out / "shard_00001.bin"
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01   # same size: the size check alone misses it
  path.write_bytes(bytes(data))
  with pytest.raises(doc_reader.DataError, match=r"corrupt token shard .*shard_00001\.bin: its "
                     "sha256 differs"):
    shards.TokenShards(str(out))


# ------------------------------------------------------------------ one clear line everywhere


def _script(name, *args, env=None):
  return subprocess.run([sys.executable, f"experiments/{name}", *args], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
                        capture_output=True, text=True, timeout=300)


def test_entry_points_fail_in_one_line_with_status_2(tmp_path):
  r = _script("eval.py", f"--checkpoint={tmp_path / 'nope'}", "--tasks=mqar")
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [x for x in r.stderr.splitlines() if x.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: no checkpoint found under"), lines
  assert "Traceback" not in r.stderr
  r = _script("eval.py", f"--checkpoint={tmp_path / 'nope'}", "--tasks=mqar",
              env={"ATTN_JAX_DEBUG": "1"})
  assert r.returncode == 1 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr


def test_a_bug_keeps_its_traceback(monkeypatch):
  from attn_jax import cli

  def library_bug(argv):
    np.reshape(np.arange(3), (2, 2))   # a ValueError raised inside numpy, not by us

  with monkeypatch.context() as m:   # it would filter pytest's session-wide log handlers
    m.setattr(cli, "quiet_libraries", lambda: None)
    with pytest.raises(ValueError):
      cli.guarded(library_bug)([])

  c = tiny_config()
  c.model.d_model = -1
  with pytest.raises(ValueError) as e:   # one of the project's checks
    config_lib.validate(c)
  assert cli.exit_status(e.value) == cli.USER_ERROR
  assert cli.one_line(e.value).startswith("error: config.model.d_model: must be a positive")
  with pytest.raises(ValueError) as e:
    np.reshape(np.arange(3), (2, 2))
  assert cli.exit_status(e.value) is None


def test_quiet_filter_drops_asyncio_reports_of_failed_tensorstore_reads_only():
  """A restore that stopped part-way leaves tasks whose tensorstore read failed; asyncio logs
  them when collected. Those go; any other asyncio report, or a tensorstore error logged by
  another logger, stays."""
  from attn_jax import cli

  def record(name, error):
    return logging.LogRecord(name, logging.ERROR, "/x/asyncio/base_events.py", 1,
                             "Task exception was never retrieved", None,
                             (type(error), error, None))

  read = ValueError('OUT_OF_RANGE: Error reading "rng/.zarray" [tensorstore_spec=\'{}\']')
  quiet = cli.QuietLibraries()
  assert not quiet.filter(record("asyncio", read))
  assert quiet.filter(record("asyncio", ValueError("a user coroutine failed")))
  assert quiet.filter(record("attn_jax", read))


def test_a_cuda_plugin_without_cuda_is_silent_without_a_gpu_and_one_line_with_one(monkeypatch):
  """JAX's 20-line traceback for a CUDA plugin that cannot load CUDA: dropped where no NVIDIA
  device exists (nothing is lost), one line where one does (the GPU goes unused); another
  plugin error keeps its traceback."""
  from attn_jax import native_logs

  def record(error):
    try:
      try:
        raise RuntimeError("cudaRuntimeGetVersion failed: Error loading CUDA libraries.")
      except RuntimeError as cause:
        raise error from cause
    except RuntimeError as e:
      info = (type(e), e, e.__traceback__)
    return logging.LogRecord("jax._src.xla_bridge", logging.ERROR, "/x/xla_bridge.py", 1,
                             "Jax plugin configuration error: Exception when calling %s",
                             ("jax_plugins.xla_cuda12.initialize()",), info)

  note = native_logs.CudaPluginNote()
  monkeypatch.setattr(native_logs, "has_nvidia_device", lambda: False)
  assert not note.filter(record(RuntimeError("Unable to load CUDA. Is it installed?")))
  monkeypatch.setattr(native_logs, "has_nvidia_device", lambda: True)
  r = record(RuntimeError("Unable to load CUDA. Is it installed?"))
  assert note.filter(r) and r.getMessage() == native_logs.CUDA_NOTE and r.exc_info is None
  other = logging.LogRecord("jax._src.xla_bridge", logging.ERROR, "/x/xla_bridge.py", 1,
                            "Jax plugin configuration error: Exception when calling %s",
                            ("jax_plugins.other.initialize()",),
                            (ValueError, ValueError("bad option"), None))
  assert note.filter(other) and other.exc_info is not None


def test_jax_platforms_defaults_to_cpu_only_where_no_accelerator_exists():
  from attn_jax import native_logs
  env = {}
  assert native_logs.cpu_only_default(env, exists=lambda p: False)
  assert env["JAX_PLATFORMS"] == "cpu"
  for node in ("/dev/nvidia0", "/dev/accel0", "/dev/vfio/vfio", "/dev/kfd"):
    env = {}
    assert not native_logs.cpu_only_default(env, exists=lambda p: p == node) and env == {}
  env = {"JAX_PLATFORMS": "cuda"}
  assert not native_logs.cpu_only_default(env, exists=lambda p: False)
  assert env == {"JAX_PLATFORMS": "cuda"}


def test_compile_only_tpu_topologies_get_plain_libtpu_host_values_off_a_tpu_vm():
  from attn_jax import targets
  env = {}
  targets._quiet_libtpu_off_tpu_vm(targets.get("v5e-8"), env, exists=lambda p: False)
  assert env == {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-8"}
  env = {"TPU_ACCELERATOR_TYPE": "v6e-4"}      # a user's own value stays
  targets._quiet_libtpu_off_tpu_vm(targets.get("v5p-8"), env, exists=lambda p: False)
  assert env == {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v6e-4"}
  for node in ("/dev/accel0", "/dev/vfio/vfio"):   # a TPU VM: libtpu reads its own metadata
    env = {}
    targets._quiet_libtpu_off_tpu_vm(targets.get("v6e-8"), env, exists=lambda p: p == node)
    assert env == {}


def test_an_entry_point_starts_jax_without_a_line_on_stderr():
  """With JAX_PLATFORMS unset (a user's shell) and the targets extra installed, starting an
  entry point and JAX's backends writes nothing to stderr on a machine without accelerators."""
  from attn_jax import native_logs
  if native_logs.accelerators():
    pytest.skip(f"this machine has accelerator devices: {native_logs.accelerators()}")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "ATTN_JAX_DEBUG")}
  code = "import attn_jax.cli, jax; print(jax.default_backend(), len(jax.devices()))"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
  assert out.returncode == 0, out.stderr
  assert out.stdout.split()[0] == "cpu" and out.stderr == "", out.stderr


def test_missing_config_file_with_overrides_names_the_file(capsys):
  from attn_jax import config_flags
  parse = config_flags.flags_parser("config", "configs/quickstart.py")
  with pytest.raises(SystemExit) as e:
    parse(["train.py", "--config=configs/nope.py", "--config.model.d_model=8"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "config file not found: 'configs/nope.py'" in err and "_ErrorConfig" not in err


def test_eval_every_steps_below_zero_and_a_long_warmup(caplog):
  c = tiny_config()
  c.eval.every_steps = -1
  with pytest.raises(ValueError, match="config.eval.every_steps: must be an integer >= 0"):
    config_lib.validate(c)
  c = tiny_config(steps=10)
  c.optim.warmup_steps = 50
  with caplog.at_level(logging.WARNING):
    config_lib.validate(c)
  assert any("config.optim.warmup_steps=50 >= config.train.steps=10" in r.getMessage()
             for r in caplog.records)


# ------------------------------------------------------------------ one max_seq_len rule


def test_generate_refuses_a_prompt_longer_than_max_seq_len():
  from attn_jax import decode
  from attn_jax.model import build_model
  c = tiny_config()
  c.model.max_seq_len = 16
  model = build_model(model_config.ModelConfig.from_config(c.model), seed=0)
  with pytest.raises(ValueError, match=r"decode.generate: the prompt: 17 tokens is longer than "
                     r"the model's max_seq_len=16"):
    decode.generate(model, np.zeros((1, 17), np.int32), max_new_tokens=1)


def test_niah_cells_beyond_max_seq_len_are_not_available_not_zero():
  from attn_jax.data.tokenizer import ByteTokenizer
  from attn_jax.eval import niah, result_tables

  def never_called(*a, **k):
    raise AssertionError("a context beyond max_seq_len must not be run")

  res = niah.run_niah(never_called, ByteTokenizer(), context_lengths=(96, 128),
                      depths=(0.0, 1.0), samples_per_cell=1, max_seq_len=64)
  assert np.isnan(res.grid).all() and math.isnan(res.accuracy)
  assert set(res.not_available) == {96, 128}
  assert "n/a: context length 96: 96 tokens is longer than the model's max_seq_len=64" in (
      res.not_available[96])
  md = result_tables.to_markdown({"results": {"niah": {"acc": res.accuracy,
                                                "notes": list(res.not_available.values())}}})
  assert "| niah |" in md and "| – |" in md and "n/a: context length 96" in md


def test_a_workdir_that_is_a_file_or_unwritable_is_named(tmp_path):
  from attn_jax.train.workdir import WorkdirLock
  f = tmp_path / "afile"
  f.write_text("x")
  with pytest.raises(NotADirectoryError, match=r"--workdir .*afile is a file"):
    WorkdirLock(str(f)).acquire()
  with pytest.raises(OSError, match=r"--workdir .*afile/run is not usable: cannot create"):
    WorkdirLock(str(f / "run")).acquire()


def test_an_empty_or_binary_benchmark_file_is_named(tmp_path):
  from attn_jax.eval import tasks
  empty = tmp_path / "lambada.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match=r"benchmark file is empty: '.*lambada\.jsonl'"):
    list(tasks._iter_jsonl(empty))
  binary = tmp_path / "arc.jsonl"
  binary.write_bytes(b'{"a": 1}\n\xff\xfe\n')
  with pytest.raises(ValueError, match=r"arc\.jsonl:2: not UTF-8 text"):
    list(tasks._iter_jsonl(binary))
