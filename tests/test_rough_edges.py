"""Small rough edges: eval.py's unknown-task error names every task name it takes;
stream.py's default --window is what the model holds (configs/stream_tiny.py's documented
commands run as written); a run whose tb/ is a link into another run's folder refuses instead
of moving that run's events; a resume onto a step without its checksum manifest is refused
unless config.checkpoint.allow_unverified; a folder in data.paths is read as prepare_data.py
reads one (its .txt / .jsonl files, recursively, sorted), or refused naming it and why."""

import os
import shutil

import numpy as np
import pytest

from attn_jax.eval.run import parse_tasks
from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train import trainer as trainer_lib
from attn_jax.train.workdir import TensorBoardLinkError
from tests.test_faults import run_config
from tests.test_train import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "tests", "data", "tinyshakespeare", "input.txt")


def test_an_unknown_task_lists_every_task_name_eval_takes():
  assert parse_tasks("lambada,arc_e,arc_c,niah,mqar") == [
      "lambada_openai", "arc_easy", "arc_challenge", "niah", "mqar"]
  with pytest.raises(ValueError) as e:
    parse_tasks("lambada,hellaswagg")
  msg = str(e.value)
  assert msg.startswith("unknown eval task 'hellaswagg'; known: "), msg
  for name in ("lambada_openai", "hellaswag", "arc_easy", "arc_challenge", "winogrande", "niah",
               "mqar", "lambada = lambada_openai", "arc_e = arc_easy", "arc_c = arc_challenge"):
    assert name in msg, (name, msg)


def test_a_tb_link_into_another_runs_folder_is_refused_and_moves_nothing(tmp_path):
  """The other run has ended (no live lock): its events would have been moved into this run's
  tb.1/ by the restart-from-step-0 rotation."""
  other = tmp_path / "other"
  (other / "tb").mkdir(parents=True)
  (other / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
  (other / "tb" / "events.out.tfevents.1.host").write_bytes(b"theirs")
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(other / "tb", run / "tb")
  with pytest.raises(TensorBoardLinkError, match=(
      rf"the TensorBoard folder {run}/tb is a link to {other}/tb, the TensorBoard folder of "
      rf"another run \({other} holds metrics.jsonl\)")):
    trainer_lib.train_and_evaluate(run_config(), str(run))
  assert sorted(os.listdir(other / "tb")) == [".writer.lock", "events.out.tfevents.1.host"]
  assert not any(n.startswith("tb.") for n in os.listdir(run))
  assert not os.path.exists(run / "checkpoints" / "2")


def test_a_tb_link_to_a_folder_of_its_own_is_fine(tmp_path):
  own = tmp_path / "fast_disk" / "tb_of_run"
  own.mkdir(parents=True)
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(own, run / "tb")
  trainer_lib.train_and_evaluate(run_config(steps=2), str(run))
  assert any("tfevents" in n for n in os.listdir(own))


def test_resuming_onto_a_step_without_its_manifest_needs_allow_unverified(tmp_path):
  d = tmp_path / "run"
  trainer_lib.train_and_evaluate(run_config(steps=2), str(d))
  os.remove(d / "checkpoints" / "2" / ckpt_lib.MANIFEST)
  c = run_config(steps=4)
  with pytest.raises(ckpt_lib.CheckpointUnverifiedError,
                     match=r"step 2 .* --config.checkpoint.allow_unverified=True"):
    trainer_lib.train_and_evaluate(c, str(d))
  assert sorted(os.listdir(d / "checkpoints")) == ["2"]          # nothing moved
  c.checkpoint.allow_unverified = True
  out = trainer_lib.train_and_evaluate(c, str(d))
  assert sorted(os.listdir(d / "checkpoints")) == ["2", "4"] and "workdir" in out


def _documented_stream_flags(doc: str) -> dict[str, str]:
  """The --flags of the `experiments/stream.py` command in a docstring (continuation lines
  joined)."""
  text = doc.replace("\\\n", " ")
  line = next(x for x in text.splitlines() if "experiments/stream.py --" in x)
  return dict(f[2:].split("=", 1) for f in line.split() if f.startswith("--"))


def test_streams_default_window_is_what_the_model_holds():
  from attn_jax.eval import stream_run as stream
  assert stream.default_window(128, 4) == 124 and stream.default_window(2048, 1) == 2047
  with pytest.raises(ValueError, match=r"--sinks=128 leaves no room for a window in "
                     r"model.max_seq_len=128"):
    stream.default_window(128, 128)


@pytest.mark.slow   # trains configs/stream_tiny.py, then three streaming policies: ~75 s
def test_stream_tiny_documented_commands_run_as_written(tmp_path):
  """configs/stream_tiny.py's docstring: train on a text file, then its stream.py command as
  written (with no --window, which used to default to 1020 > the model's 128 tokens)."""
  from attn_jax.eval import stream_run as stream
  from configs import stream_tiny
  flags = _documented_stream_flags(stream_tiny.__doc__)
  assert flags == {"workdir": "runs/stream_tiny", "text": "/path/to/input.txt", "tail": "0.01",
                   "policies": "window,recompute,streaming"}, flags
  c = stream_tiny.get_config()
  c.data.paths = SHAKESPEARE
  c.train.update(steps=2, progress_bar=False)   # the documented run, shortened, on a 21 KB
  c.data.eval_fraction = 0.2                    # excerpt (1% of it holds no eval batch)
  c.checkpoint.every_steps = 2
  run = tmp_path / "stream_tiny"
  trainer_lib.train_and_evaluate(c, str(run))
  res = stream.run(str(run), SHAKESPEARE, tail=float(flags["tail"]),
                   names=flags["policies"].split(","), progress=False)
  assert sorted(res["summary"]) == ["recompute(128)", "streaming(4+124)", "window(128)"], res
  shutil.rmtree(run)


def _text_config(paths, source="text"):
  c = tiny_config(source=source, paths=paths, tokenizer="bytes", text_document="line",
                  eval_fraction=0.0)
  c.data.seq_len = 8
  return c.data


def test_a_folder_in_data_paths_is_read_as_its_files(tmp_path):
  """A folder used to be "data file not found"; now it stands for its files of the source's
  format (recursive, sorted: prepare_data.py's rule), and a folder that holds none, or holds
  prepared token shards, is refused naming it and the source that reads what it holds."""
  from attn_jax.data import text as text_lib
  corpus = tmp_path / "corpus"
  (corpus / "b").mkdir(parents=True)
  (corpus / "b" / "two.txt").write_text("second file, in a subfolder\n" * 4)
  (corpus / "a.txt").write_text("first file\n" * 4)
  (corpus / "notes.md").write_text("not a .txt file: not read\n")
  files = [str(corpus / "a.txt"), str(corpus / "b" / "two.txt")]
  assert text_lib.data_files(_text_config(str(corpus))) == files
  stream = text_lib.load_token_stream(_text_config(str(corpus)))
  np.testing.assert_array_equal(stream, text_lib.load_token_stream(_text_config(",".join(files))))
  with pytest.raises(FileNotFoundError, match=(
      rf"data.paths: the folder '{corpus}' holds no .jsonl files .*it holds 2 .txt files: set "
      r"data.source='text'")):
    text_lib.load_token_stream(_text_config(str(corpus), source="jsonl"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=rf"the folder '{empty}' holds no .txt files"):
    text_lib.load_token_stream(_text_config(str(empty)))
  (empty / "index.json").write_text("{}")
  with pytest.raises(ValueError, match=rf"'{empty}' is a folder of token shards .* data.source="
                     r"'shards', not 'text'"):
    text_lib.load_token_stream(_text_config(str(empty)))
