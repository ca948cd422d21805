"""One conversion call behind experiments/convert.py: read a model from any of

    a .gguf file | a Hugging Face folder (config.json) | a run directory (checkpoints/)

and write it as any of a run directory (`workdir.write_workdir`), a Hugging Face folder
(`loader.export_hf`) or a GGUF file (`loader.export_gguf`). With `mixer`, the run directory
holds the model converted into that attention variant, unchanged at step 0 (`pretrained/variants.py`;
the distance is measured and returned). Every input is read and every output's
preconditions (exportable, tokenizer fits, target free, variant offered) are checked before
the first file is written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import ml_collections

from attn_jax import paths
from attn_jax.pretrained import granite_swa, loader
from attn_jax.pretrained.llama import PretrainedError, exportable_problem
from attn_jax.pretrained.run_dir import write_workdir
from attn_jax.pretrained.variants import VariantInit, check_variant, to_variant
from attn_jax.run_layout import RunLayout
from attn_jax.train.checkpoint import load_for_inference


def is_run_dir(path: str) -> bool:
  return RunLayout.of(path).checkpoints.is_dir()


def load_run(workdir: str, step: int | None = None,
             tokenizer: str | None = None) -> loader.Pretrained:
  """A run directory as a `Pretrained` (its tokenizer `tokenizer`, else config.data.tokenizer;
  None for the byte tokenizer, which has no tokenizers JSON)."""
  model, config, _ = load_for_inference(workdir, step)
  spec_ids = {}
  info = paths.name(RunLayout.of(workdir).pretrained_info)
  if os.path.isfile(info):
    with open(info) as f:
      s = json.load(f).get("spec", {})
    spec_ids = {"bos_id": s.get("bos_id"), "eos_id": s.get("eos_id")}
  tok_spec = config.data.tokenizer
  if tokenizer:
    tok = loader.as_tokenizer(tokenizer)
  else:
    tok = None if tok_spec in ("bytes", "byte", "") else loader.as_tokenizer(tok_spec)
  spec = (loader.spec_of(model.cfg, **spec_ids)
          if not exportable_problem(model.cfg) or granite_swa.holds(model.cfg) else None)
  return loader.Pretrained(model, tok, spec, os.path.abspath(workdir), "run")


def convert(src: str, *, workdir: str = "", hf_out: str = "", gguf_out: str = "",
            qtype: str = "F32", base_config: ml_collections.ConfigDict | None = None,
            tokenizer: str | None = None, dtype: str = "float32",
            step: int | None = None, mixer: str = "",
            variant_init: VariantInit | None = None, seed: int = 0) -> dict[str, Any]:
  """Reads `src`, writes each output asked for; returns {"workdir"|"hf"|"gguf": path} (and
  "step0_rel_logit_diff" with `mixer`)."""
  if not (workdir or hf_out or gguf_out):
    raise PretrainedError("nothing to write: give workdir, hf_out or gguf_out")
  if mixer:
    check_variant(mixer)
    if not workdir or hf_out or gguf_out:
      raise PretrainedError(f"--mixer={mixer} writes a run directory (--workdir) only; export "
                            "a fine-tuned variant from its run directory")
  if workdir and base_config is None:
    raise PretrainedError("a run directory needs a base config (configs/base.py get_config())")
  for out in (workdir, hf_out, gguf_out):
    if out and os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
      raise PretrainedError(f"{os.path.abspath(out)}: exists; choose a new output path")
  if is_run_dir(src):
    pre = load_run(src, step, tokenizer)
  else:
    pre = loader.load(src, dtype=dtype, tokenizer=tokenizer)
  bos, eos = (pre.spec.bos_id, pre.spec.eos_id) if pre.spec else (None, None)
  problem = exportable_problem(pre.cfg)
  if hf_out and problem and not granite_swa.holds(pre.cfg):
    raise PretrainedError(f"{src}: cannot export as Llama (nor as any transformers model): "
                          f"{problem}")
  if gguf_out and problem:
    raise PretrainedError(f"{src}: cannot export as Llama: {problem}"
                          + ("; llama.cpp's llama architecture has no sinks (--hf_out writes "
                             "it as transformers' GraniteSWA)" if granite_swa.holds(pre.cfg)
                             else ""))
  if workdir and pre.tokenizer is None:
    raise PretrainedError(f"{src}: no tokenizer to put in the run directory (pass one)")
  written: dict[str, Any] = {}
  record = None
  if mixer:
    model, record = to_variant(pre.model, mixer, variant_init or VariantInit(), seed=seed)
    pre = dataclasses.replace(pre, model=model)
    written["step0_rel_logit_diff"] = record["step0"]["rel_logit_diff"]
  if workdir:
    written["workdir"] = write_workdir(pre, workdir, base_config, variant=record)
  if hf_out:
    if pre.tokenizer is None:
      logging.warning("%s has no tokenizers JSON (byte tokenizer): the HF folder gets none", src)
    written["hf"] = loader.export_hf(pre.model, hf_out, tokenizer=pre.tokenizer, bos_id=bos,
                                     eos_id=eos)
  if gguf_out:
    written["gguf"] = loader.export_gguf(pre.model, gguf_out, tokenizer=pre.tokenizer,
                                         qtype=qtype, bos_id=bos, eos_id=eos)
  return written

