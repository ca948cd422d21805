"""Weights & Biases as a third metrics writer, beside metrics.jsonl and TensorBoard (writers.py).

Off by default; `config.metrics.wandb_project` turns it on (`pip install 'attn_jax[wandb]'`;
`wandb login` once, or WANDB_MODE=offline for local files that `wandb sync` uploads later).

What it logs: every row metrics.jsonl gets, at the same step; the run's config (as
metrics.jsonl's run has it, `config_to_json`) plus `n_params` (the parameter counts) and
`device` / `mesh` (device kind and count, process count, mesh axis sizes) in the W&B run's
config. Process 0 alone writes, as for the other writers.

One W&B run per training run: its id is drawn when the run starts at step 0 and kept in
`<workdir>/wandb_run_id`, and every resumption opens that run again (`resume="allow"`), so a
preempted and resumed run is one curve (a restart from step 0, whose earlier rows metrics.py
moves aside, is a new W&B run). The rows a resumed run logs again (those after the last
checkpoint, metrics.py) and that W&B already holds (`run.step`: the next step it takes) are not
sent again; W&B keeps the first value of a step. W&B's local files go to `<workdir>/wandb/`.

Failure: `wandb.init` runs once in the main thread before the first step (bounded by W&B's
own init timeout, 90 s; a failure there is a WriteError before any step). It does not run in
the writer's thread: on CPython 3.11 it parses code (`ast`) while the main thread may be doing
the same, and the interpreter's shared AST recursion counter then fails one of them
("AST constructor recursion depth mismatch"). Every row and the close then go through
`writers.Background`: a slow network or a hung W&B service never blocks the training loop, and
any wandb failure, a full disk among them, stops the run like a failed metrics.jsonl append (a
WriteError naming "wandb", its folder, the disk and the step). Enabled but not installed is one
line before anything is compiled (`check_installed`).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import tempfile
from typing import Any, Mapping

from attn_jax import paths, run_layout
from attn_jax.run_layout import RunLayout
from attn_jax.train import writers as writers_lib

RUN_ID_FILE = run_layout.WANDB_RUN_ID


def settings(config) -> dict[str, str] | None:
  """{"project", "entity"} when the run's (`RunConfig`) metrics.wandb_project is set, else
  None (off)."""
  m = config.metrics
  if not m.wandb_project:
    return None
  return {"project": str(m.wandb_project), "entity": str(m.wandb_entity or "")}


def check_installed(config) -> None:
  """ValueError (one line, naming the field) when W&B is asked for but not installed."""
  s = settings(config)
  if s and importlib.util.find_spec("wandb") is None:
    raise ValueError(f"config.metrics.wandb_project={s['project']!r} asks for Weights & Biases, "
                     "but wandb is not installed: pip install 'attn_jax[wandb]' (or pip install "
                     "wandb), or leave config.metrics.wandb_project empty")


def run_id(workdir: str, *, fresh: bool = False) -> str:
  """The W&B run id of the training run in `workdir`: the kept one, or (none kept, or `fresh`:
  a run starting at step 0) a new one, kept."""
  path = RunLayout.of(workdir).wandb_run_id
  if not fresh and path.is_file():
    kept = path.read_text().strip()
    if kept:
      return kept
  new = secrets.token_hex(4)   # W&B ids: up to 64 of [a-z0-9_-]
  try:
    if paths.is_uri(path):   # an object is written whole
      path.write_text(new + "\n")
    else:
      tmp = path.parent / (path.name + ".tmp")
      tmp.write_text(new + "\n")
      tmp.replace(path)
  except OSError as e:
    raise writers_lib.write_error("wandb", path, None, e) from e
  return new


class WandbWriter:
  """A `writers.Writer` over one W&B run (`open` first, in the main thread)."""

  name = "wandb"

  def __init__(self, workdir: str, project: str, *, entity: str = "", config: dict,
               info: dict, fresh: bool = False):
    # W&B's own files are local files: for a workdir on object storage they go to a
    # temporary folder (the run id, what a resume needs, is kept in the workdir).
    self.workdir = paths.name(workdir)
    self.path = (paths.name(RunLayout.of(self.workdir).wandb) if paths.is_local(workdir)
                 else paths.name(RunLayout.of(tempfile.mkdtemp(prefix="attn_jax_wandb")).wandb))
    self.project, self.entity = project, entity or None
    self.id = run_id(workdir, fresh=fresh)
    self.config, self.info = config, info
    self.run: Any = None

  def open(self) -> None:
    """Starts (or resumes) the W&B run; a failure is a WriteError naming wandb."""
    try:
      self._init()
    except Exception as e:  # noqa: BLE001 - wandb's errors (network, service, disk) alike
      raise writers_lib.write_error(self.name, self.path, None, e) from e

  def _init(self) -> None:
    import wandb
    os.makedirs(self.path, exist_ok=True)
    name = paths.run_path(self.workdir).name
    self.run = wandb.init(project=self.project, entity=self.entity, id=self.id, resume="allow",
                          dir=os.path.dirname(self.path), name=name, config=self.config,
                          settings=wandb.Settings(console="off"))
    self.run.config.update(self.info, allow_val_change=True)

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    if step < self.run.step:   # W&B holds it already (rows logged again after a resume)
      return
    self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(step))

  def flush(self) -> None:
    """W&B's service writes and uploads on its own; nothing is held here."""

  def close(self) -> None:
    if self.run is not None:
      self.run.finish()
      self.run = None


def run_info(setup) -> dict:
  """What the W&B run's config gets beside the config: parameter counts, devices, mesh."""
  import jax
  devices = jax.devices()
  return {"n_params": dict(setup.n_params),
          "device": {"kind": devices[0].device_kind, "platform": devices[0].platform,
                     "count": len(devices), "processes": jax.process_count()},
          "mesh": {str(k): int(v) for k, v in dict(setup.mesh.shape).items()}}


def add_wandb(metric_writer, config, workdir: str, setup, config_json: dict, *,
              start: int) -> None:
  """Adds the W&B writer behind `writers.Background` to `metric_writer` when
  config.metrics.wandb_project is set (process 0: where the metric writer is enabled). A run
  resumed at `start` > 0 continues its W&B run; one from step 0 opens a new one."""
  s = settings(config)
  if s is None or not metric_writer.enabled:
    return
  writer = WandbWriter(workdir, s["project"], entity=s["entity"], config=config_json,
                       info=run_info(setup), fresh=start == 0)
  writer.open()
  metric_writer.add(writers_lib.Background(writer, should_stop=metric_writer.should_stop))
