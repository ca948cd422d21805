"""Fine-tuning from a run: `config.train.init_from` (a run directory, converted by
experiments/convert.py or trained) gives the parameters of step 0; `config.train.trainable`
says which of them train.

    config.train.init_from = "runs/smollm2_sisa"   # "" = a fresh random init
    config.train.init_step = -1                    # its checkpoint step; -1 = the newest usable
    config.train.trainable = "all"                 # all | new | new+norms
    config.train.new_scalar_lr_mult = 1.0          # lr multiplier of the new scalars/biases

- The model is the config's (`config.model`), which must be the run's architecture: every
  model field and mixer option equal to the run's saved config except the compute settings
  (`COMPUTE_FIELDS`: dtype, remat, the attention kernel, max_seq_len, ...) and the init-only
  options (`_ignored_option`); else one line naming both. `run_config(...)` (configs/finetune.py)
  builds a config from the run's own, so this holds by construction there.
- The data's tokenizer must be the run's vocabulary (the same token -> id table, or both the
  byte tokenizer); else one line naming both tokenizers.
- "new": only the parameters the conversion added (the run's pretrained.json lists them,
  `variants.to_variant`); "new+norms": those and every norm scale (kind "norm"). Frozen
  parameters get a zero gradient before clipping and no weight decay, so their Adam moments
  stay 0 and their update is exactly 0 (the moments are still allocated: simple, not lean).
- `new_scalar_lr_mult` multiplies the learning rate of the new parameters of kind "scalar" or
  "bias" (on top of their own `lr_mult` metadata): a sink logit that starts at -20 or a forget
  bias at 16 must travel several units to matter, which a fine-tuning lr for pretrained
  weights (1e-4) cannot do in a short run, while a new weight matrix (FoX's gate, SISA's B/C)
  moved at that rate would swamp its outputs at the first Adam step.
- `init_step` -1 takes the newest step that loads, as a resume does: a damaged newest step
  (checksums, unreadable arrays or saved config) is skipped with a warning naming it, and the
  step before it is used (nothing in the source run is moved: it is only read). An explicit
  `init_step` loads that step or stops with an error naming it.
- The optimizer state is fresh (AdamW moments 0, step 0, the LR schedule from its warm-up);
  the log says so. A workdir that holds a checkpoint resumes from it and ignores init_from.

Every check runs before the trainer creates the workdir (`check`), so a refused run writes
nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_jax import paths
from attn_jax.config import RunConfig
from attn_jax.data.tokenizer import get_tokenizer
from attn_jax.model_config import ModelConfig
from attn_jax.run_layout import RunLayout
from attn_jax.train.checkpoint import Checkpointer, load_for_inference

TRAINABLE = ("all", "new", "new+norms")
COMPUTE_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "attention_impl",
                  "max_seq_len", "init_std", "embed_init_std")


@dataclasses.dataclass(frozen=True)
class InitSource:
  path: str
  step: int | None              # None (init_step -1): the newest usable step, found as it loads
  new_params: tuple[str, ...]   # "/"-joined parameter paths the conversion added


def _ignored_option(name: str) -> bool:
  """Option fields that change no computation of a loaded model: inits, lr multipliers,
  kernel/path choices."""
  return (name.endswith(("_init", "_init_std", "_lr_mult")) or
          name in ("chunk_size", "path", "fast_max_range", "block_size", "block"))


def _saved_config(path: str, step: int | None) -> tuple[ml_collections.ConfigDict, int]:
  """The config saved with `step` (None: with the newest step whose saved config reads; a
  damaged step is judged when the parameters load, `initial_state`) and that step."""
  ckpt = Checkpointer(path, read_only=True)
  try:
    steps = sorted(ckpt.all_steps())
    if not steps:
      raise ValueError(f"config.train.init_from={path}: its checkpoints/ holds no step")
    if step is not None and step not in steps:
      raise ValueError(f"config.train.init_step={step}: {path} has steps {steps}")
    errors = []
    for s in ([step] if step is not None else steps[::-1]):
      try:
        return ckpt.saved_config(s), s
      except Exception as e:  # noqa: BLE001 - a damaged meta: the previous step's, as a resume
        if step is not None:
          raise
        errors.append(f"step {s}: {type(e).__name__}: {e}")
    raise ValueError(f"config.train.init_from={path}: no step's saved config can be read "
                     f"({'; '.join(errors)[:600]})")
  finally:
    ckpt.close()


def architecture(model_cfg) -> dict[str, Any]:
  """The fields of a model config that decide what its parameters compute (flat)."""
  cfg = ModelConfig.from_config(model_cfg) if isinstance(
      model_cfg, ml_collections.ConfigDict) else model_cfg
  out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
         if f.name not in COMPUTE_FIELDS + ("options",)}
  for spec in sorted({s.mixer for s in cfg.period}):
    for k, v in dataclasses.asdict(cfg.options_for(spec)).items():
      if not _ignored_option(k):
        out[f"{spec}.{k}"] = v
  return out


def _describe(arch: dict) -> str:
  return f"mixer={arch['mixer']}, d_model={arch['d_model']}, n_layers={arch['n_layers']}"


def _check_architecture(config, saved, path: str) -> None:
  want, have = architecture(config.model), architecture(saved.model)
  diff = [f"{k} {have.get(k, '(absent)')!r} vs {want.get(k, '(absent)')!r}"
          for k in sorted(want.keys() | have.keys(), key=lambda k: ("." in k, k))
          if want.get(k) != have.get(k)]   # model fields first, then mixer options
  if diff:
    raise ValueError(f"config.train.init_from={path}: a run of another architecture (its model: "
                     f"{_describe(have)}; config.model: {_describe(want)}; the run's vs "
                     f"config.model: {', '.join(diff[:6])})")


def _vocabulary(spec: str) -> tuple[str, dict | None, int]:
  """(how to name it, token -> id table (None: bytes), size)."""
  tok = get_tokenizer(str(spec))
  table = tok._tok.get_vocab(with_added_tokens=True) if hasattr(tok, "_tok") else None
  return str(spec), table, int(tok.vocab_size)


def _run_tokenizer(path: str, saved) -> str:
  """The run's tokenizer: its own copy (a converted run's tokenizer.json) when the saved path
  has moved, else the saved `data.tokenizer`."""
  spec = str(saved.data.tokenizer)
  own = RunLayout.of(path).tokenizer
  if (spec not in ("bytes", "byte", "") and not paths.run_path(spec).is_file()
      and own.is_file()):
    return paths.name(own)
  return spec


def _check_vocabulary(config, saved, path: str) -> None:
  data_spec = str(config.data.tokenizer)
  run_spec = _run_tokenizer(path, saved)
  d_name, d_table, d_n = _vocabulary(data_spec)
  r_name, r_table, r_n = _vocabulary(run_spec)
  if d_table == r_table and d_n == r_n:
    return
  what = "byte tokenizer" if d_table is None else f"{d_n} tokens"
  theirs = "byte tokenizer" if r_table is None else f"{r_n} tokens"
  detail = ""
  if d_table is not None and r_table is not None:
    differ = sorted(set(d_table.items()) ^ set(r_table.items()))
    detail = f"; {len(differ)} token/id pairs differ, e.g. {differ[0]!r}" if differ else ""
  raise ValueError(f"config.data.tokenizer={d_name} ({what}) is not the vocabulary of "
                   f"config.train.init_from={path} (its tokenizer {r_name}, {theirs}{detail}): "
                   "fine-tune with the run's tokenizer")


def _new_params(path: str) -> tuple[str, ...]:
  info = RunLayout.of(path).pretrained_info
  if not info.is_file():
    return ()
  return tuple(sorted(json.loads(info.read_text()).get("variant", {}).get("new", {})))


def check(config: RunConfig) -> InitSource | None:
  """The init_from run (None without one), every check done (module docstring)."""
  t = config.train
  path, trainable = str(t.init_from or ""), str(t.trainable)
  if trainable not in TRAINABLE:
    raise ValueError(f"config.train.trainable: {trainable!r} not in {TRAINABLE}")
  if not path:
    if trainable != "all":
      raise ValueError(f"config.train.trainable={trainable!r} needs config.train.init_from (a "
                       "converted run whose new parameters are listed)")
    return None
  if not RunLayout.of(path).checkpoints.is_dir():
    raise ValueError(f"config.train.init_from={path}: not a run directory (no checkpoints/)")
  step = int(t.init_step)
  step = None if step < 0 else step   # -1: the newest usable step, as a resume picks it
  saved, _ = _saved_config(path, step)
  _check_architecture(config, saved, path)
  _check_vocabulary(config, saved, path)
  new = _new_params(path)
  if trainable != "all" and not new:
    raise ValueError(f"config.train.trainable={trainable!r}: config.train.init_from={path} "
                     "lists no new parameters (its pretrained.json has none: only "
                     "experiments/convert.py --mixer=... writes them); use 'all'")
  return InitSource(paths.name(path), step, new)


def _path(keys) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in keys)


def trainable_mask(config: RunConfig, abstract_params) -> Any | None:
  """A pure-dict tree of bools (True = trains) over the parameters, or None (all train)."""
  from flax import nnx
  trainable = str(config.train.trainable)
  if trainable == "all":
    return None
  src = check(config)
  new = set(src.new_params)

  def trains(keys, var):
    kind = var.get_metadata().get("kind")
    return _path(keys) in new or (trainable == "new+norms" and kind == "norm")

  is_var = lambda x: isinstance(x, nnx.Variable)
  mask = jax.tree_util.tree_map_with_path(trains, abstract_params, is_leaf=is_var)
  mask = nnx.to_pure_dict(mask) if isinstance(mask, nnx.State) else mask
  n_train = sum(bool(x) for x in jax.tree.leaves(mask))
  if not n_train:
    raise ValueError(f"config.train.trainable={trainable!r}: no parameter of config.model is "
                     f"among the new ones listed by {src.path}")
  return mask


def lr_scale(config: RunConfig, abstract_params) -> Any | None:
  """A pure-dict tree of lr multipliers (`new_scalar_lr_mult` on the new parameters of kind
  scalar or bias, 1 elsewhere), or None when it is 1."""
  from flax import nnx
  mult = float(config.train.new_scalar_lr_mult)
  if not mult > 0:
    raise ValueError(f"config.train.new_scalar_lr_mult: must be > 0, got {mult!r}")
  if mult == 1.0:
    return None
  src = check(config)
  if src is None or not src.new_params:
    raise ValueError(f"config.train.new_scalar_lr_mult={mult:g} needs config.train.init_from "
                     "(a converted run whose new parameters are listed)")
  new = set(src.new_params)

  def scale(keys, var):
    scalar = var.get_metadata().get("kind") in ("scalar", "bias")
    return mult if scalar and _path(keys) in new else 1.0

  is_var = lambda x: isinstance(x, nnx.Variable)
  tree = jax.tree_util.tree_map_with_path(scale, abstract_params, is_leaf=is_var)
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def optimizer_groups(config: RunConfig, abstract_params) -> tuple[Any, Any]:
  """(trainable mask, lr scale) for `optim.make_optimizer` (each None when it changes
  nothing)."""
  return trainable_mask(config, abstract_params), lr_scale(config, abstract_params)


def initial_state(config: RunConfig, setup, fresh: dict) -> dict:
  """`fresh` (the trainer's jitted init: sharded, optimizer state zero) with the init_from
  run's parameters and non-trainable state put in, on the same shardings; `fresh` itself
  without init_from."""
  src = check(config)
  if src is None:
    return fresh
  from flax import nnx

  # init_step -1: the newest step that verifies and loads (a damaged newest step is skipped
  # with a warning and left in place, as load_for_inference does for the evaluator).
  model, _, step = load_for_inference(src.path, src.step)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  for name, part in (("params", params), ("rest", rest)):
    loaded = nnx.to_pure_dict(part)
    fresh[name] = jax.tree.map(lambda new, old: jax.device_put(
        np.asarray(new).astype(old.dtype), old.sharding), loaded, fresh[name])
  mask = trainable_mask(config, nnx.state(model, nnx.Param))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(fresh["params"]))
  n_train = n if mask is None else sum(
      int(np.prod(x.shape)) for x, m in zip(jax.tree.leaves(fresh["params"]),
                                            jax.tree.leaves(mask)) if m)
  logging.info("init_from %s step %d: parameters loaded; training %s of %s stored parameter "
               "values, vocabulary padding rows included (config.train.trainable=%r); "
               "optimizer state fresh (AdamW moments 0, step 0, "
               "the LR schedule from its start)", src.path, step, f"{n_train:,}", f"{n:,}",
               str(config.train.trainable))
  return fresh


def finetune_config(run: str, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`base` (configs/base.py get_config() or a preset) set to fine-tune the run `run`: its
  model (every field and mixer option of its saved config), its tokenizer, train.init_from =
  `run`. The caller then sets the data, the steps and the optimizer."""
  saved, _ = _saved_config(run, None)
  config = ml_collections.ConfigDict(base.to_dict())
  for key, value in saved.model.items():
    config.model[key] = (ml_collections.ConfigDict(value.to_dict())
                         if isinstance(value, ml_collections.ConfigDict) else value)
  config.data.tokenizer = _run_tokenizer(run, saved)
  config.train.init_from = str(run)
  return config
