"""The Weights & Biases writer (attn_jax/train/wandb_writer.py), offline (WANDB_MODE=offline:
W&B's local run files, read back here record by record): the rows metrics.jsonl gets, the
config with parameter counts, devices and mesh, one W&B run id across a resumption; enabled
but not installed is one error naming the field; a wandb failure stops the run through the
writers' one failure path (a WriteError naming wandb)."""

import glob
import json
import os
import struct
import sys

import pytest

from attn_jax.train import trainer as trainer_lib
from attn_jax.train import wandb_writer
from attn_jax.train.metrics import read_metrics
from attn_jax.train.writers import WriteError
from tests.test_train import tiny_config

wandb = pytest.importorskip("wandb")   # the dev extra installs it
from wandb.proto import wandb_internal_pb2  # noqa: E402


def _config(steps):
  c = tiny_config(steps=steps)
  c.checkpoint.every_steps = 2
  c.metrics.wandb_project = "attn_jax_test"
  return c


@pytest.fixture
def offline(monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")


def _records(path):
  """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic, version), then
  LevelDB-log blocks of 32 KiB whose records have a 7-byte header (crc32, length, kind: 1
  whole, 2 first, 3 middle, 4 last part)."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, part = 7, b""
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if left < 7 or (kind == 0 and n == 0):   # the rest of a block is padding
      pos += left
      continue
    part += data[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):
      r = wandb_internal_pb2.Record()
      r.ParseFromString(part)
      part = b""
      yield r


def _read_run(run_dir):
  """(run id, {step: row}, config) of one local W&B run folder."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  rid, rows, config = None, {}, {}
  for r in _records(path):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      rid = r.run.run_id
      config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    elif kind == "config":
      config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    elif kind == "history":
      row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
      rows[r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
  return rid, rows, config


def test_rows_config_and_one_run_across_a_resumption(tmp_path, offline):
  trainer_lib.train_and_evaluate(_config(2), str(tmp_path))        # stops at its checkpoint 2
  first_id = (tmp_path / wandb_writer.RUN_ID_FILE).read_text().strip()
  trainer_lib.train_and_evaluate(_config(4), str(tmp_path))        # resumed at step 2
  assert (tmp_path / wandb_writer.RUN_ID_FILE).read_text().strip() == first_id
  runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
  assert len(runs) == 2
  logged = {}
  for run_dir in runs:
    rid, rows, config = _read_run(run_dir)
    assert rid == first_id                                          # the same W&B run resumed
    logged.update(rows)
    assert config["model"]["d_model"] == 32 and config["train"]["steps"] in (2, 4)
    assert config["n_params"]["total"] > 0 and config["mesh"] == {"data": 8, "fsdp": 1,
                                                                  "tensor": 1}
    assert config["device"]["platform"] == "cpu" and config["device"]["count"] == 8
  want = {}   # a step's rows (the train row and an evaluation's) are one W&B history row
  for r in read_metrics(str(tmp_path)):
    want.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
  assert "eval/accuracy" in want[2] and "loss" in want[2]
  assert sorted(logged) == sorted(want) == [1, 2, 3, 4]
  for step, row in want.items():
    assert set(logged[step]) == set(row), step
    for k, v in row.items():
      assert logged[step][k] == pytest.approx(v, rel=1e-12), (step, k)


def test_enabled_but_not_installed_is_one_error_naming_the_field(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)   # as if not installed
  with pytest.raises(ValueError, match=r"config\.metrics\.wandb_project='attn_jax_test' .*"
                     r"wandb is not installed: pip install 'attn_jax\[wandb\]'"):
    trainer_lib.train_and_evaluate(_config(2), str(tmp_path))
  assert not (tmp_path / "metrics.jsonl").exists()                 # before anything ran


def test_a_wandb_failure_stops_the_run_as_a_write_error(tmp_path, offline, monkeypatch):
  def broken(*a, **k):
    raise RuntimeError("wandb-core exited")

  monkeypatch.setattr(wandb, "init", broken)
  with pytest.raises(WriteError, match=r"writing wandb \(.*wandb\) failed: "
                     r"RuntimeError: wandb-core exited"):
    trainer_lib.train_and_evaluate(_config(4), str(tmp_path))


def test_a_full_disk_under_wandb_mid_run_names_the_step(tmp_path, offline, monkeypatch):
  """wandb.log failing in the writer's thread (its files on a full disk) stops the run at the
  next step boundary with the writers' one error, not a hang or a lost row unnoticed."""
  import errno

  from wandb.sdk import wandb_run
  real = wandb_run.Run.log

  def log(self, data, step=None, **k):
    if step is not None and step >= 3:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data, step=step, **k)

  monkeypatch.setattr(wandb_run.Run, "log", log)
  with pytest.raises(WriteError, match=r"writing wandb \(.*wandb\) failed at step 3: .* is "
                     r"full \(no space left on the device\)"):
    trainer_lib.train_and_evaluate(_config(6), str(tmp_path))
  assert max(r["step"] for r in read_metrics(str(tmp_path))) <= 4   # stopped at once


def test_off_by_default(tmp_path):
  c = tiny_config(steps=1)
  assert c.metrics.wandb_project == ""
  trainer_lib.train_and_evaluate(c, str(tmp_path))
  assert not (tmp_path / wandb_writer.RUN_ID_FILE).exists()
  assert not (tmp_path / "wandb").exists()
