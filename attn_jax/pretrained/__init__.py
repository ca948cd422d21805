"""Pretrained Llama-family checkpoints in and out of attn_jax's Transformer baseline
(docs/pretrained.md): `load` a GGUF file or Hugging Face folder, `export_hf` / `export_gguf` a
model, `write_workdir` a loaded checkpoint as a run directory. `llama.py` holds the mapping."""

from attn_jax.pretrained.llama import LlamaSpec, PretrainedError, exportable_problem
from attn_jax.pretrained.loader import (Pretrained, export_gguf, export_hf, load,
                                        read_checkpoint)

__all__ = ["LlamaSpec", "Pretrained", "PretrainedError", "exportable_problem", "export_gguf",
           "export_hf", "load", "read_checkpoint"]
