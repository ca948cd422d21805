"""Attention-mass diagnostics: how much attention each layer puts on the first tokens
(the "attention sinks" of StreamingLLM, docs/papers.md §3.1).

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

`sink_profile` is the per-layer test of the attention-sink picture on a long sequence: the
mass on token 0, on the first four tokens and on the query's local neighbourhood, per head
(`profile_of` defines each), computed one layer at a time so that maps of thousands of
positions fit in memory.
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


def spread_windows(tokens, n_seqs: int, L: int) -> tuple[np.ndarray, np.ndarray]:
  """([n_seqs, L] int32 sequences spread evenly over the stream, the first at token 0, the last
  ending at its end; their start positions)."""
  tokens = np.asarray(tokens, np.int32)
  starts = np.linspace(0, len(tokens) - L, n_seqs).astype(int)
  return np.stack([tokens[s:s + L] for s in starts]), starts


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
  L = min(seq_len, len(tokens))
  if L <= min_query:
    raise ValueError(f"attention mass needs sequences longer than min_query={min_query}, "
                     f"the stream has {len(tokens)} tokens")
  batch, _ = spread_windows(tokens, n_seqs, L)
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


# ------------------------------------------------------------------ sink profile per layer

PROFILE = ("token0", "first4", "local")


def profile_of(p_BHTK, *, local: int = 32, min_query: int = 64) -> dict[str, np.ndarray]:
  """Per-head attention mass [H] of one layer's map p [B, H, T, T + 1] (rows = queries i,
  columns = keys j, the last one the sink logit), averaged over the batch and the queries
  i >= `min_query`:
    token0  p[i, 0]                          (the first position)
    first4  sum_{j < 4} p[i, j]              (the first four positions)
    local   sum_{i - local < j <= i} p[i, j] (the `local` most recent keys, the query included)
    null    p[i, T]                          (the sink-logit column; 0 without one)
  `min_query` >= local + 4 keeps the first four and the local keys apart."""
  if min_query < local + 4:
    raise ValueError(f"min_query={min_query} must be >= local + 4 = {local + 4} (the first "
                     "tokens and the local neighbourhood would overlap)")
  p = jnp.asarray(p_BHTK, jnp.float32)
  T = p.shape[-1] - 1
  if T <= min_query:
    raise ValueError(f"sequences of {T} positions leave no query >= min_query={min_query}")
  p = p[:, :, min_query:]                               # [B, H, Q, T + 1]
  i = jnp.arange(min_query, T)[:, None]
  j = jnp.arange(T)[None, :]
  near = ((i - j >= 0) & (i - j < local)).astype(p.dtype)   # [Q, T]
  out = {"token0": p[..., 0], "first4": p[..., :4].sum(-1),
         "local": jnp.einsum("bhqk,qk->bhq", p[..., :T], near), "null": p[..., T]}
  return {k: np.asarray(v.mean(axis=(0, 2)), np.float64) for k, v in out.items()}


def sink_profile(model, tokens_BT, *, local: int = 32, min_query: int = 64) -> dict:
  """`profile_of` for every softmax layer of `model` on `tokens_BT` (one layer's map at a time:
  a [B, H, T, T] map of a long sequence is large). -> {"layers": [{"layer", "softmax",
  token0/first4/local/null (head means), "per_head": {name: [H]}}]}."""
  layers = []
  for i, mixer, x in layer_inputs(model, tokens_BT):
    p = _probs(mixer, x)
    if p is None:
      layers.append({"layer": i, "softmax": False})
      continue
    prof = profile_of(p, local=local, min_query=min_query)
    del p
    row = {"layer": i, "softmax": True}
    row.update({k: float(v.mean()) for k, v in prof.items()})
    row["per_head"] = {k: [float(x) for x in v] for k, v in prof.items()}
    layers.append(row)
  return {"layers": layers}


def run_sink_profile(model, tokens: np.ndarray, out_dir: str, *, n_seqs: int = 2,
                     seq_len: int = 2048, local: int = 32, min_query: int = 64) -> dict[str, str]:
  """`sink_profile` on `n_seqs` sequences of `seq_len` tokens spread over the stream (the
  first starts at token 0); writes sink_mass.json, sink_mass.png (layers x token0 / first4 /
  local, head means) and sink_mass_heads.png (layers x heads, first4 and local)."""
  L = min(seq_len, len(tokens))
  batch, starts = spread_windows(tokens, n_seqs, L)
  table = sink_profile(model, jnp.asarray(batch), local=local, min_query=min_query)
  table["meta"] = {"sequences": int(n_seqs), "seq_len": int(L), "starts": starts.tolist(),
                   "local": int(local), "min_query": int(min_query),
                   "queries": int(n_seqs * (L + model.cfg.sink_tokens - min_query)),
                   "sink_tokens": int(model.cfg.sink_tokens)}
  os.makedirs(out_dir, exist_ok=True)
  paths = {"sink_json": os.path.join(out_dir, "sink_mass.json"),
           "sink_png": os.path.join(out_dir, "sink_mass.png"),
           "sink_heads_png": os.path.join(out_dir, "sink_mass_heads.png")}
  with open(paths["sink_json"], "w") as f:
    json.dump(table, f, indent=1)
  plot_sink_profile(table, paths["sink_png"], paths["sink_heads_png"])
  return paths


def plot_sink_profile(table: dict, path: str, heads_path: str | None = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in table["layers"] if r["softmax"]]
  meta = table.get("meta", {})
  local = meta.get("local", "?")
  names = ["token 0", "tokens 0-3", f"last {local} (local)"]
  heat = np.asarray([[r[k] for k in PROFILE] for r in rows])
  fig, ax = plt.subplots(figsize=(4.6, 1.2 + 0.22 * len(rows)))
  im = ax.imshow(heat, aspect="auto", cmap="magma", vmin=0, vmax=1)
  for (y, x), v in np.ndenumerate(heat):
    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=6,
            color="black" if v > 0.5 else "white")
  ax.set_xticks(range(3), names, fontsize=8)
  ax.set_yticks(range(len(rows)), [str(r["layer"]) for r in rows], fontsize=6)
  ax.set_ylabel("layer")
  ax.set_title(f"attention mass (head mean, {meta.get('queries', '?')} queries)", fontsize=8)
  fig.colorbar(im, ax=ax, fraction=0.05)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  if not heads_path:
    return
  fig, axes = plt.subplots(1, 2, figsize=(7, 1.2 + 0.22 * len(rows)), sharey=True)
  for ax, key, name in zip(axes, ("first4", "local"), names[1:]):
    h = np.asarray([r["per_head"][key] for r in rows])
    im = ax.imshow(h, aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_title(name, fontsize=8)
    ax.set_xlabel("head", fontsize=8)
    ax.set_xticks(range(h.shape[1]))
    ax.tick_params(labelsize=6)
  axes[0].set_yticks(range(len(rows)), [str(r["layer"]) for r in rows])
  axes[0].set_ylabel("layer")
  fig.colorbar(im, ax=axes, fraction=0.04)
  fig.savefig(heads_path, dpi=110, bbox_inches="tight")
  plt.close(fig)
