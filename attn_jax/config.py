"""The run's typed config: one frozen dataclass per section, and every default declared once.

A run is configured as an ml-collections `ConfigDict` (presets in `configs/`, `--config.a.b=v`
on the command line, the config saved in a checkpoint's meta). Entry points turn it into a
`RunConfig` once (`validate`), and everything below them reads that object's typed fields:

    RunConfig(seed, model: ModelConfig, data: DataConfig, train: TrainConfig,
              optim: OptimConfig, checkpoint: CheckpointConfig, eval: EvalConfig,
              mesh: MeshConfig, metrics: MetricsConfig, extra)

The defaults below are the only ones: `default_config()` builds the ConfigDict every preset
starts from (`configs/base.py`) out of these dataclasses and the registry's mixer options, and
`RunConfig.from_config` fills a field the ConfigDict lacks (a config saved before the field
existed) with the same default. A field no section declares is an error naming it, so a typo in
a preset or an override never passes silently. Top-level sections other than the eight above
(a study's `study`) are kept, as plain dicts, in `extra`: only their own entry points read them.
`RunConfig.to_json()` is what `config_to_json` makes of the ConfigDict (the checkpoint meta's
`config`), unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import types
from typing import Any

import ml_collections

from attn_jax import jsonio
from attn_jax.data.offsets import WINDOW_OFFSETS
from attn_jax.data.pipeline import DATA_SOURCES
from attn_jax.field_checks import check_fields, field_check, is_int, is_number, type_problem
from attn_jax.model_config import ModelConfig
from attn_jax.registry import available_mixers, axis_rules, default_options, get_mixer
from attn_jax.sharding import TRUNK_RULES, MeshAxes, rules_dict


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """config.data: where the tokens come from and how they are cut into windows."""
  source: str = "synthetic"      # synthetic | text | jsonl | shards
  paths: str = ""                # text/jsonl: comma-separated files; shards: the folder written
                                 # by experiments/prepare_data.py (index.json + shard_*.bin)
  text_field: str = "text"       # JSONL field holding the document
  tokenizer: str = "bytes"       # "bytes" or a path to a tokenizers JSON file
  seq_len: int = 2048
  global_batch_size: int = 32    # sequences per micro-batch, summed over hosts
  shuffle: bool = True
  num_workers: int = 0
  synthetic_task: str = "mqar"   # mqar | random (for throughput runs)
  mqar_num_pairs: int = 8
  mqar_num_queries: int = 4
  mqar_vocab: int = 64
  random_vocab: int = 256        # synthetic_task=random: tokens uniform in [0, random_vocab)
  text_document: str = "line"    # source=text: "line" = one document per non-blank line;
                                 # "file" = one per file
  eval_fraction: float = 0.01    # text/jsonl: last fraction of packed sequences held out
  document_mask: bool = False    # packed rows: False = plain concatenation (documents joined by
                                 # EOS, every mixer reads across them: what the SISA paper's
                                 # authors trained with); True = each document exact as if alone
                                 # (batches add `segment_ids`, `positions` restarting at 0; the
                                 # EOS ending a document is the next one's BOS; data/documents.py)
  window_offset: str = "none"    # text/jsonl/shards training windows: "none" = at multiples of
                                 # seq_len; "random" = each at a random token, new every epoch
                                 # (data/offsets.py; the eval split stays aligned)
  verify_mb: int = 2048          # shards: MB re-hashed against index.json at every start (all
                                 # of a smaller corpus; else the least recently verified first;
                                 # new or changed shards always; -1 = all; data/shards.py)
  read_threads: int = 4          # grain threads building batches (0 = in the training thread)
  prefetch_batches: int = 8      # batches read ahead per process


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """config.train: the loop, its guards and fine-tuning's starting point."""
  steps: int = 10_000
  grad_accum: int = 1            # micro-batches per optimizer step
  log_every: int = 10
  progress_bar: bool = True
  profile_steps: str = ""        # "20:25": a jax.profiler trace of steps 20-24 in
                                 # <workdir>/profile (TensorBoard / Perfetto; docs/guide.md)
  peak_flops: float = 0.0        # per device, FLOP/s; 0 = look up from the device kind
  auto_microbatch: bool = False  # step does not fit the device: pick the largest micro-batch
                                 # that does (same tokens per step via grad_accum); else stop
  device_memory_gb: float = 0.0  # > 0: size the run for this much memory per device
  nonfinite: str = "skip"        # a step with a NaN/Inf loss, gradient or update is never
                                 # applied; "skip": count it and go on, "halt": stop and name
                                 # the last finite step and the latest checkpoint
  nonfinite_max_consecutive: int = 10  # skip: halt after this many non-finite steps in a row
  spike_window: int = 100        # loss-spike detector: running window of finite losses (0 = off)
  spike_threshold: float = 6.0   # spike: loss > mean + spike_threshold * std of the window
  init_from: str = ""            # fine-tune: a run directory whose parameters start this run
                                 # (experiments/convert.py or train.py; train/init_from.py)
  init_step: int = -1            # its checkpoint step; -1 = the newest usable one
  trainable: str = "all"         # all | new (the parameters a conversion added) | new+norms
  new_scalar_lr_mult: float = 1.0  # lr multiplier of the scalars/biases a conversion added


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """config.optim: AdamW with warm-up and cosine decay to min_lr_ratio * lr (train/optim.py)."""
  lr: float = 6e-4
  min_lr_ratio: float = 0.1
  warmup_steps: int = 500
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """config.checkpoint: how often and how many (train/checkpoint.py)."""
  every_steps: int = 1000
  max_to_keep: int = 3
  allow_unverified: bool = False  # resume from a step without its checksum manifest (copied
                                  # without it, written by other code): its bytes cannot be checked
  save_timeout_s: float = 600.0   # a save not committed within this is abandoned: the run ends
                                  # naming the step and the last committed one (a stalled bucket)
  signal_grace_s: float = 15.0    # after SIGTERM/SIGINT/SIGHUP, a save still running this long is
                                  # abandoned (schedulers SIGKILL ~30 s after SIGTERM)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """config.eval: held-out loss and the benchmark tasks run at eval steps (eval/run.py)."""
  every_steps: int = 0           # 0 = only at the end of training
  tasks: str = ""                # extra tasks at eval steps, comma-separated, e.g. "mqar,niah"
  batch_size: int = 8
  data_dir: str = ""             # benchmark files laid out like shared/data (lambada/, arc/, ...)
  max_len: int = 0               # 0 = data.seq_len
  limit: int = 0                 # 0 = every document
  niah_lengths: tuple[int, ...] = (256, 512)   # context lengths (tokens) of the needle grid
  niah_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)   # needle depths, in [0, 1]
  niah_samples: int = 2          # needles per (length, depth) cell


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """config.mesh: the device mesh and the logical -> mesh axis rules (sharding.py). Tuples,
  not lists: config_flags cannot override lists."""
  shape: tuple[int, ...] = (-1, 1, 1)      # -1 = all remaining devices
  axis_names: tuple[str, ...] = ("data", "fsdp", "tensor")
  replicate_indivisible: tuple[str, ...] = ()  # fnmatch patterns (parameter path or logical
                                 # axis name) allowed to replicate when their size does not
                                 # divide their mesh axes; anything else is an error naming the
                                 # parameter
  # logical axis -> mesh axis (or None = replicated); batch goes over data + fsdp. Mixers' own
  # axes come from their `axis_rules` (config_rules below); a rule here, for either, wins.
  rules: tuple = TRUNK_RULES


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  """config.metrics: where metric rows go besides metrics.jsonl and TensorBoard."""
  wandb_project: str = ""        # Weights & Biases project: log the run there too ("" = off;
                                 # pip install 'attn_jax[wandb]'; train/wandb_writer.py)
  wandb_entity: str = ""         # its team or user ("" = wandb's default)


SECTIONS = {"data": DataConfig, "train": TrainConfig, "optim": OptimConfig,
            "checkpoint": CheckpointConfig, "eval": EvalConfig, "mesh": MeshConfig,
            "metrics": MetricsConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The whole run, typed. Build it with `validate(config)`; `replace_in` edits a section."""
  seed: int = 0
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  optim: OptimConfig = OptimConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  mesh: MeshConfig = MeshConfig()
  metrics: MetricsConfig = MetricsConfig()
  extra: types.MappingProxyType = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))   # other top-level sections

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "RunConfig":
    """The typed run config of `config`; a missing field takes its default, an unknown one is
    an error naming it; a value not of its field's declared type is an error naming the field
    (`field_checks.type_problem`: 3.0 is not an int, "3" not a number). Values: `validate`."""
    seed = config.get("seed", 0)
    why = type_problem(seed, int)
    if why:
      raise ValueError(f"config.seed: {why}")
    kw: dict[str, Any] = {"seed": seed}
    kw["model"] = ModelConfig.from_config(config.model)
    for name, section_cls in SECTIONS.items():
      kw[name] = section_of(section_cls, name, config[name] if name in config else {})
    known = set(SECTIONS) | {"seed", "model"}
    extra = {k: _plain(config[k]) for k in config if k not in known}
    return cls(**kw, extra=types.MappingProxyType(extra))

  def to_json(self) -> dict:
    """The config as JSON, as `config_to_json` writes the ConfigDict it came from (what a
    checkpoint's meta records as `config`): equal to it, field for field, plus any edit made
    with `replace_in`."""
    d: dict[str, Any] = {"seed": self.seed}
    m = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelConfig)
         if f.name != "options"}
    d["model"] = {**m, **{k: dataclasses.asdict(v) for k, v in self.model.options}}
    for name in SECTIONS:
      d[name] = dataclasses.asdict(getattr(self, name))
    d.update(self.extra)
    return json.loads(json.dumps(d, default=str))

  def replace_in(self, section: str, **fields) -> "RunConfig":
    """A copy with these fields of one section replaced (e.g. the fitted micro-batch)."""
    return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section),
                                                                     **fields)})


def config_to_json(config: ml_collections.ConfigDict) -> dict:
  """The ConfigDict as JSON (what a checkpoint's meta records as `config`)."""
  return json.loads(config.to_json_best_effort())


def _plain(value):
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def section_of(section_cls: type, name: str, values) -> Any:
  """`section_cls` from a ConfigDict section (or dict): lists become tuples, a missing field
  takes its default, an unknown field or a value not of the field's declared type is an error
  naming it (`field_checks.check_fields`)."""
  known = {f.name for f in dataclasses.fields(section_cls)}
  kw = {}
  for key in values:
    if key not in known:
      raise ValueError(f"config.{name}.{key}: unknown field (known: {', '.join(sorted(known))})")
    val = _plain(values[key])
    kw[key] = _frozen(val)
  check_fields(section_cls, kw, f"config.{name}")
  return section_cls(**kw)


def config_rules(run: RunConfig) -> dict[str, MeshAxes]:
  """The logical-axis rules of a run (what `attn_jax.sharding` shards by): those the pattern's
  mixers declare (`Mixer.axis_rules`), overridden by `run.mesh.rules` (the trunk's defaults
  plus any the user sets). Here and not in sharding.py, which the mixers' attention cores
  import: a module they import must not import the registry or this module."""
  names = [spec.mixer for spec in run.model.period]
  return {**axis_rules(names), **rules_dict(run.mesh.rules)}


def _frozen(val):
  if isinstance(val, (list, tuple)):
    return tuple(_frozen(v) for v in val)
  return val


def default_config() -> ml_collections.ConfigDict:
  """The ConfigDict every preset starts from: the dataclasses' defaults, the model's fields
  and one sub-dict per registered mixer with that mixer's `Options` defaults (so an override
  like --config.model.sisa.d_state=16, or a pattern naming any mixer, finds its sub-dict)."""
  c = ml_collections.ConfigDict()
  c.seed = RunConfig.seed
  model = {f.name: getattr(ModelConfig(), f.name) for f in dataclasses.fields(ModelConfig)
           if f.name != "options"}
  c.model = ml_collections.ConfigDict(model)
  for name in available_mixers():
    c.model[name] = ml_collections.ConfigDict(default_options(name))
  for name, section_cls in SECTIONS.items():
    c[name] = ml_collections.ConfigDict(dataclasses.asdict(section_cls()))
  return c


@functools.lru_cache(maxsize=1)
def _default_json_fields() -> dict[str, Any]:
  return jsonio.flatten(config_to_json(default_config()), ".")


def is_default(path: str, value: Any) -> bool:
  """Whether `path` ("data.window_offset", "model.sisa.d_state") is a field declared here whose
  default is `value` (in JSON form: tuples as lists). A config saved before the field existed
  lacks it and meant this default (`RunConfig.from_config` fills it in)."""
  defaults = _default_json_fields()
  return path in defaults and defaults[path] == value


def validate(config: ml_collections.ConfigDict) -> RunConfig:
  """Check the whole config, with errors naming the field; returns the typed run config."""
  run = RunConfig.from_config(config)
  cfg, d, t, o = run.model, run.data, run.train, run.optim
  need = field_check("config")
  need(d.seq_len > 0, "data.seq_len", "must be positive")
  need(d.seq_len <= cfg.max_seq_len, "data.seq_len",
       f"{d.seq_len} exceeds model.max_seq_len={cfg.max_seq_len}")
  need(d.global_batch_size > 0, "data.global_batch_size", "must be positive")
  need(t.steps > 0, "train.steps", "must be positive")
  need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
  need(t.log_every >= 1, "train.log_every", "must be >= 1")
  window_problem = profile_window_problem(t.profile_steps, int(t.steps))
  if window_problem:   # a window past the run's end traced nothing, silently
    logging.warning("%s", window_problem)
  _check_optim(o, need)
  need(d.source in DATA_SOURCES, "data.source", f"{d.source!r} not in {DATA_SOURCES}")
  need(d.window_offset in WINDOW_OFFSETS, "data.window_offset",
       f"{d.window_offset!r} not in {WINDOW_OFFSETS}")
  need(d.window_offset == "none" or d.source != "synthetic", "data.window_offset",
       "'random' needs a packed source (text, jsonl, shards), not data.source='synthetic'")
  need(run.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  keep = run.checkpoint.max_to_keep
  need(is_int(keep, 1), "checkpoint.max_to_keep",
       f"must be an integer >= 1 (the newest steps kept), got {keep!r}")
  for name in ("save_timeout_s", "signal_grace_s"):
    seconds = getattr(run.checkpoint, name)
    need(is_number(seconds) and seconds > 0, f"checkpoint.{name}",
         f"must be a number of seconds > 0, got {seconds!r}")
  _check_eval(run.eval, need)
  if o.warmup_steps >= t.steps:
    logging.warning("config.optim.warmup_steps=%d >= config.train.steps=%d: the learning rate "
                    "never reaches optim.lr=%g (warm-up is cut at step %d, then decays)",
                    o.warmup_steps, t.steps, o.lr, max(t.steps - 1, 0))
  need(len(run.mesh.shape) == len(run.mesh.axis_names), "mesh.shape",
       f"{run.mesh.shape} does not match mesh.axis_names {run.mesh.axis_names}")
  check_document_mask(cfg, d)
  return run


def as_run(config: ml_collections.ConfigDict | RunConfig) -> RunConfig:
  """`config` itself when it is already typed, else `validate(config)`: for library functions
  that a notebook may call with a ConfigDict (an entry point passes its RunConfig down)."""
  return config if isinstance(config, RunConfig) else validate(config)


def _check_eval(e: EvalConfig, need) -> None:
  """config.eval's values (their types are checked by `section_of`): read at eval steps and at
  the end of training, so a bad one must stop the run here, not after hours of training."""
  need(is_int(e.every_steps, 0), "eval.every_steps",
       f"must be an integer >= 0 (0 = only at the end), got {e.every_steps!r}")
  for f in ("batch_size", "niah_samples"):
    need(is_int(getattr(e, f), 1), f"eval.{f}", f"must be an integer >= 1, got "
         f"{getattr(e, f)!r}")
  for f in ("max_len", "limit"):
    need(is_int(getattr(e, f), 0), f"eval.{f}", f"must be an integer >= 0 (0 = the default), "
         f"got {getattr(e, f)!r}")
  need(len(e.niah_lengths) > 0 and all(is_int(x, 1) for x in e.niah_lengths),
       "eval.niah_lengths", f"must be context lengths in tokens (integers >= 1), got "
       f"{e.niah_lengths!r}")
  need(len(e.niah_depths) > 0 and all(is_number(x, 0) and x <= 1 for x in e.niah_depths),
       "eval.niah_depths", f"must be depths in [0, 1], got {e.niah_depths!r}")


def _check_optim(o: OptimConfig, need) -> None:
  need(is_number(o.lr) and o.lr > 0, "optim.lr", f"must be a finite positive number, got {o.lr!r}")
  need(is_number(o.min_lr_ratio, 0) and o.min_lr_ratio <= 1, "optim.min_lr_ratio",
       f"must be in [0, 1], got {o.min_lr_ratio!r}")
  for f in ("b1", "b2"):
    v = getattr(o, f)
    need(is_number(v, 0) and v < 1, f"optim.{f}", f"must be in [0, 1), got {v!r}")
  need(is_number(o.eps) and o.eps > 0, "optim.eps",
       f"must be a finite positive number, got {o.eps!r}")
  for f in ("weight_decay", "clip_norm"):
    v = getattr(o, f)
    need(is_number(v, 0), f"optim.{f}", f"must be a finite number >= 0, got {v!r}")
  need(0 <= o.warmup_steps, "optim.warmup_steps", "must be >= 0")


def check_document_mask(cfg: ModelConfig, data_cfg) -> None:
  """`data.document_mask` (packed rows, data/documents.py): refused for a mixer whose
  `packed_rows_problem(opts)` names a reason (sinkhorn's non-causal mode). With
  `model.sink_tokens` > 0: the sink tokens are the shared prefix of every document, so every
  layer's mixer must read that prefix per document exactly (`reads_shared_prefix`, mixer.py);
  a mixer that restarts a recurrent state at each document's first token cannot."""
  if not data_cfg.document_mask:
    return
  for name in sorted({s.mixer for s in cfg.period}):
    why = get_mixer(name).packed_rows_problem(cfg.options_for(name))
    if why:
      raise ValueError(f"config.data.document_mask: {why}; set data.document_mask=False")
  if not cfg.sink_tokens:
    return
  lacking = sorted({s.mixer for s in cfg.period
                    if not getattr(get_mixer(s.mixer), "reads_shared_prefix", False)})
  if lacking:
    raise ValueError(
        f"config.data.document_mask: with model.sink_tokens={cfg.sink_tokens} every layer's "
        f"mixer must give each packed document the shared sink prefix (reads_shared_prefix, "
        f"attn_jax/mixer.py), and {', '.join(lacking)} does not; set data.document_mask="
        "False or model.sink_tokens=0")


def profile_steps(spec: str) -> tuple[int, int] | None:
  """config.train.profile_steps "a:b" -> (a, b): a jax.profiler trace of steps a to b - 1 (a
  Python slice: "20:25" is five steps); "" -> None (no trace)."""
  if spec in ("", None):
    return None
  start, sep, end = str(spec).partition(":")
  ok = sep and start.strip().isdigit() and end.strip().isdigit()
  if not ok or not 1 <= int(start) < int(end):
    raise ValueError(f"config.train.profile_steps: want 'first:stop' with 1 <= first < stop "
                     f"(steps first to stop - 1 are traced, e.g. '20:25'), got {spec!r}")
  return int(start), int(end)


def profile_window_problem(spec: str, last: int, *, start: int = 0) -> str | None:
  """Why `config.train.profile_steps` traces nothing (or less) in a run of steps start + 1 to
  `last`, else None."""
  window = profile_steps(spec)
  if window is None:
    return None
  first, stop = window
  field = f"config.train.profile_steps={spec!r}"
  if first > last:
    return (f"{field}: no trace will be written: the run ends at step {last} "
            f"(config.train.steps), before the window's first step {first}")
  if stop - 1 <= start:
    return (f"{field}: no trace will be written: the run resumes after step {start}, past the "
            f"window (steps {first} to {stop - 1})")
  if stop - 1 > last:
    return (f"{field}: the trace stops at the run's last step {last} (config.train.steps), "
            f"not at step {stop - 1}")
  return None
