"""Attention-mass diagnostics: how much attention each layer puts on the first tokens
(the "attention sinks" of StreamingLLM, SPEC.md section 3).

For a few sequences the attention probabilities of every softmax layer are computed
explicitly (an fp32 reference path: the decoder's own embedding, sink-token prefix, norms and
the mixers' own projections, scores formed as a dense [T, T] matrix — `core`-style masks, the
sink column of `sink_logit`, SISA's full score from `sisa_attention_reference`), while the
residual stream is advanced by the real blocks. Reported per layer (mean over heads,
sequences and queries at positions >= `min_query`):
  mass_first[k]  share of attention on the first k positions (k = 1, 4) — sink tokens count
                 as positions;
  mass_null      share on the sink-logit column ("nothing"; 0 without sink_logit);
and a heatmap (layers x first `n_keys` key positions) written as PNG. Mixers without a softmax
(SSMs) get no row.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from attn_jax.eval.maps import layer_inputs


def _probs(mixer, h_BTD):
  """[B, H, T, T + 1] attention probabilities (last column: the sink logit), from the mixer's
  optional `attention_probs` hook; None for a mixer without a softmax map (SSMs, Sinkhorn)."""
  hook = getattr(mixer, "attention_probs", None)
  return None if hook is None else hook(h_BTD)


def attention_maps(model, tokens_BT) -> list:
  """Per layer (in depth order): [B, H, T', T' + 1] probabilities or None (T' includes the
  sink tokens)."""
  return [_probs(mixer, x) for _, mixer, x in layer_inputs(model, tokens_BT)]


def mass_table(maps, *, min_query: int = 16, n_keys: int = 32) -> dict:
  layers = []
  heat = []
  for i, p in enumerate(maps):
    if p is None:
      layers.append({"layer": i, "softmax": False})
      continue
    p = np.asarray(p[:, :, min_query:], np.float64)      # [B, H, Tq, T + 1]
    T = p.shape[-1] - 1
    per_head = p.mean(axis=(0, 2))                        # [H, T + 1]
    layers.append({"layer": i, "softmax": True,
                   "mass_first": {str(k): float(per_head[:, :k].sum(-1).mean()) for k in (1, 4)},
                   "mass_first_per_head": [float(x) for x in per_head[:, :1].sum(-1)],
                   "mass_null": float(per_head[:, T].mean())})
    heat.append(per_head[:, :min(n_keys, T)].mean(0))
  return {"layers": layers, "heatmap": [h.tolist() for h in heat]}


def run(model, tokens: np.ndarray, out_dir: str, *, n_seqs: int = 4, seq_len: int = 128,
        min_query: int = 16, n_keys: int = 32) -> dict[str, str]:
  """Diagnostics on `n_seqs` sequences of `seq_len` tokens spread over the stream."""
  tokens = np.asarray(tokens, np.int32)
  L = min(seq_len, len(tokens))
  if L <= min_query:
    raise ValueError(f"attention mass needs sequences longer than min_query={min_query}, "
                     f"the stream has {len(tokens)} tokens")
  starts = np.linspace(0, len(tokens) - L, n_seqs).astype(int)
  batch = np.stack([tokens[s:s + L] for s in starts])
  table = mass_table(attention_maps(model, jnp.asarray(batch)), min_query=min_query,
                     n_keys=n_keys)
  table["meta"] = {"sequences": int(n_seqs), "seq_len": int(L), "min_query": min_query,
                   "sink_tokens": int(model.cfg.sink_tokens)}
  os.makedirs(out_dir, exist_ok=True)
  paths = {"mass_json": os.path.join(out_dir, "attention_mass.json"),
           "mass_png": os.path.join(out_dir, "attention_mass.png")}
  with open(paths["mass_json"], "w") as f:
    json.dump(table, f, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  heat = np.asarray(table["heatmap"])
  fig, ax = plt.subplots(figsize=(8, 1 + 0.5 * max(1, len(heat))))
  im = ax.imshow(heat, aspect="auto", cmap="viridis")
  ax.set_xlabel("key position (sink tokens first)")
  ax.set_ylabel("softmax layer")
  ax.set_title(f"mean attention on the first {heat.shape[-1] if heat.size else 0} positions "
               f"(queries >= {min_query})")
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(paths["mass_png"], dpi=120)
  plt.close(fig)
  return paths
