"""A loaded checkpoint as a run directory, the layout `experiments/train.py` leaves, so that
`train.checkpoint.load_for_inference` (and through it experiments/eval.py, stream.py, the
notebook, `decode.generate` on the loaded model) reads it like any trained run:

    <workdir>/checkpoints/0/          orbax step 0: state {"params", "rest"} + meta {"config"}
    <workdir>/tokenizer.json          the checkpoint's tokenizer (config.data.tokenizer)
    <workdir>/tokenizer_config.json   its bos/eos token names (HFTokenizer's EOS: the checkpoint's)
    <workdir>/pretrained.json         where it came from and its hyper-parameters; for a
                                      variant (`variants.to_variant`) also "variant": which
                                      parameters came from the checkpoint, which are new (and
                                      their init), which were expanded, the step-0 distance

The config is the caller's base config (configs/base.py `get_config()`) with `model` set from
the checkpoint and `data.tokenizer` pointing at the copied tokenizer (an absolute path: move
the folder and that field must follow). `data.seq_len` is the model's context length. Step 0
holds no optimizer state: the run is for inference (fine-tuning it would start a new run
from these parameters).

Everything is written into a temporary folder beside `workdir` and renamed at the end
(`loader.staged_dir`), so a failure leaves nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections
from flax import nnx

from attn_jax import paths
from attn_jax.config import config_to_json, validate
from attn_jax.pretrained.hf import write_tokenizer
from attn_jax.pretrained.loader import Pretrained, special_names, staged_dir
from attn_jax.run_layout import RunLayout
from attn_jax.train.checkpoint import Checkpointer

def run_config(pre: Pretrained, base: ml_collections.ConfigDict,
               workdir: str) -> ml_collections.ConfigDict:
  """`base` with the model and tokenizer of `pre` (module docstring); validated."""
  config = ml_collections.ConfigDict(base.to_dict())
  fields = {f.name: getattr(pre.cfg, f.name) for f in dataclasses.fields(pre.cfg)}
  for name, opts in fields.pop("options"):   # a variant's mixer options (sink logit, d_state)
    for key, value in dataclasses.asdict(opts).items():
      config.model[name][key] = tuple(value) if isinstance(value, list) else value
  for key, value in fields.items():
    config.model[key] = tuple(value) if isinstance(value, list) else value
  config.data.tokenizer = paths.name(RunLayout.of(workdir).tokenizer)
  config.data.seq_len = int(pre.cfg.max_seq_len)
  config.eval.max_len = int(pre.cfg.max_seq_len)
  validate(config)
  return config


def write_workdir(pre: Pretrained, workdir: str, base: ml_collections.ConfigDict, *,
                  variant: dict | None = None) -> str:
  """Writes the run directory of `pre` (module docstring); returns its absolute path.
  `variant`: the record of `variants.to_variant` when `pre.model` is a converted variant."""
  config = run_config(pre, base, workdir)
  _, params, rest = nnx.split(pre.model, nnx.Param, ...)
  state = {"params": nnx.to_pure_dict(params), "rest": nnx.to_pure_dict(rest)}
  info = {"source": pre.source, "kind": pre.kind, "spec": dataclasses.asdict(pre.spec)}
  if variant is not None:
    info["variant"] = variant
  with staged_dir(workdir) as tmp:
    write_tokenizer(tmp, pre.tokenizer.to_str(),
                    special_names(pre.tokenizer, pre.spec) if pre.spec else {},
                    pre.cfg.max_seq_len)
    with open(paths.name(RunLayout.of(tmp).pretrained_info), "w") as f:
      json.dump(info, f, indent=1)
    ckpt = Checkpointer(tmp, max_to_keep=1)
    try:
      ckpt.save(0, state, meta={"config": config_to_json(config), "pretrained": info},
                force=True)
    finally:
      ckpt.close()
  return os.path.abspath(workdir)
