"""The run directory's layout: every file and folder a training run keeps under its --workdir,
named here once and reached through one value, `RunLayout.of(workdir)`.

    <workdir>/
      .lock                 the workdir lock (train/workdir.py)
      checkpoints/          orbax steps, each with its checksum manifest (train/checkpoint.py)
      metrics.jsonl         one row per logged step (train/metrics.py)
      tb/                   TensorBoard events, and tb/.writer.lock (train/workdir.py)
      metrics.jsonl.<k>     an earlier run's history, moved aside when a run starts again at
      tb.<k>/                 step 0 (workdir.rotate_history)
      eval/                 experiments/eval.py's results (outputs.results_folder)
      stream/               experiments/stream.py's results
      profile/              profiler traces (train/profile.py)
      wandb_run_id          the W&B run id a resume continues; wandb/ holds W&B's own files
      pretrained.json       a converted pretrained model's record, beside its tokenizer.json
                              (pretrained/run_dir.py; read by train/init_from.py)

The trainer, the evaluator, the streaming command and the study all build their paths from the
same value, on a local disk and on object storage alike: its paths are `etils.epath.Path`s
made by `paths.run_path` (a local folder made absolute, a `gs://` URI kept as written).
tests/test_run_layout.py checks that no other module joins these names onto a path.
"""

from __future__ import annotations

import dataclasses

from etils import epath

from attn_jax import paths

LOCK = ".lock"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TB = "tb"
TB_LOCK = ".writer.lock"
RESULTS = ("eval", "stream")   # the folders of the commands that read a run
PROFILE = "profile"
WANDB_RUN_ID = "wandb_run_id"
WANDB = "wandb"
PRETRAINED_INFO = "pretrained.json"
TOKENIZER = "tokenizer.json"   # = pretrained.hf.TOKENIZER, the file write_tokenizer writes
HISTORY = (METRICS, TB)        # what rotate_history moves aside
MARKERS = (LOCK, CHECKPOINTS, METRICS)   # a folder holding one of these is a run's


ATTRIBUTES = {"lock": LOCK, "checkpoints": CHECKPOINTS, "metrics": METRICS, "tb": TB,
              "profile": PROFILE, "wandb_run_id": WANDB_RUN_ID, "wandb": WANDB,
              "pretrained_info": PRETRAINED_INFO, "tokenizer": TOKENIZER}


@dataclasses.dataclass(frozen=True)
class RunLayout:
  """The paths of one run directory (module docstring); `RunLayout.of(workdir)`."""

  root: epath.Path
  lock: epath.Path
  checkpoints: epath.Path
  metrics: epath.Path
  tb: epath.Path
  profile: epath.Path
  wandb_run_id: epath.Path
  wandb: epath.Path
  pretrained_info: epath.Path
  tokenizer: epath.Path

  @classmethod
  def of(cls, workdir: paths.PathLike) -> "RunLayout":
    root = paths.run_path(workdir)
    return cls(root, **{attribute: root / name for attribute, name in ATTRIBUTES.items()})

  @property
  def tb_lock(self) -> epath.Path:
    return self.tb / TB_LOCK

  def results(self, kind: str) -> epath.Path:
    """The folder of `kind` results ("eval", "stream")."""
    if kind not in RESULTS:
      raise ValueError(f"results of kind {kind!r}: the run directory has {RESULTS}")
    return self.root / kind

  def history(self, name: str, k: int) -> epath.Path:
    """`name` (metrics.jsonl or tb) of the k-th earlier run moved aside."""
    if name not in HISTORY:
      raise ValueError(f"history of {name!r}: rotated entries are {HISTORY}")
    return self.root / f"{name}.{k}"

  def markers(self) -> dict[str, epath.Path]:
    """{name: path} of what marks a folder as a training run's."""
    return {name: self.root / name for name in MARKERS}
