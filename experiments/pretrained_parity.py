"""attn_jax's import of a GGUF Llama against transformers on the same file, in one run.

  python experiments/pretrained_parity.py --src=smollm2 --text=tests/data/tinyshakespeare/input.txt

The reference is transformers' own GGUF reader (`load_gguf_checkpoint`: its dequantisation
and its reversal of llama.cpp's q/k permutation) in a `LlamaForCausalLM`, fp32. Prints, as a
markdown table: the largest weight difference, the token ids of both tokenizers on the text,
the fp32 logits' relative difference (max |ours - ref| / max |ref|), the mean NLL of the text
under both, and the same for attn_jax computing in bfloat16 (parameters fp32).
Needs torch and transformers (the dev extra).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_SRC = flags.DEFINE_string("src", "smollm2", "A .gguf file or a packaged checkpoint's name.")
_TEXT = flags.DEFINE_string("text", "tests/data/tinyshakespeare/input.txt", "Text to score.")
_TOKENS = flags.DEFINE_integer("tokens", 512, "Tokens of the text in the forward pass.")


def reference(path):
  """(LlamaForCausalLM with transformers' reading of the GGUF, its tensors, its tokenizer)."""
  import torch
  import transformers
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  folder, name = os.path.dirname(path), os.path.basename(path)
  cfg = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
  with torch.device("meta"):
    meta = transformers.LlamaForCausalLM(cfg)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta)["tensors"]
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.load_state_dict(tensors, strict=False)
  model.tie_weights()
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return model, {k: v.float().numpy() for k, v in tensors.items()}, tok


def nll(logits, ids):
  import numpy as np
  z = np.asarray(logits[0, :-1], np.float64)
  z = z - z.max(-1, keepdims=True)
  lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return float(-lp[np.arange(len(ids) - 1), ids[1:]].mean())


def main(argv):
  del argv
  import jax.numpy as jnp
  import numpy as np
  import torch
  from flax import nnx

  from attn_jax.model import abstract_model
  from attn_jax.pretrained import load
  from attn_jax.pretrained.loader import hf_tensors
  pre = load(_SRC.value)
  # the same fp32 parameters computing in bfloat16 (no second read of the file)
  graphdef16 = nnx.split(abstract_model(pre.cfg.replace(dtype="bfloat16")))[0]
  model16 = nnx.merge(graphdef16, nnx.state(pre.model))
  ref, ref_tensors, ref_tok = reference(pre.source)
  ours = hf_tensors(pre.model)
  w_diff = max(float(np.abs(ours[k] - w).max()) for k, w in ref_tensors.items())
  text = open(_TEXT.value, encoding="utf-8").read()
  ids_ours = pre.encode(text)
  same_ids = ids_ours == ref_tok(text, add_special_tokens=False).input_ids
  ids = np.asarray(ids_ours[:_TOKENS.value])
  with torch.no_grad():
    z_ref = ref(torch.tensor(ids[None])).logits.numpy()
  z32 = np.asarray(pre.model(jnp.asarray(ids[None])))
  z16 = np.asarray(model16(jnp.asarray(ids[None])))
  rel = lambda z: float(np.abs(z - z_ref).max() / np.abs(z_ref).max())
  agree = lambda z: float((z.argmax(-1) == z_ref.argmax(-1)).mean())
  print(f"{pre.source}: {len(ids_ours)} tokens in {_TEXT.value} (ids equal to transformers': "
        f"{same_ids}); largest weight difference {w_diff:g}")
  print("| attn_jax | logits rel. diff | argmax agreement | NLL (attn_jax) | NLL (transformers) |")
  print("|---|---:|---:|---:|---:|")
  for name, z in (("fp32", z32), ("bf16 compute", z16)):
    print(f"| {name} | {rel(z):.2e} | {agree(z):.4f} | {nll(z, ids):.5f} | "
          f"{nll(z_ref, ids):.5f} |")


if __name__ == "__main__":
  cli.run(main)
