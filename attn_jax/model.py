"""Decoder-only language model: embed -> N x [pre-norm mixer + pre-norm SwiGLU] -> norm -> head.

The token mixer of every block is chosen by name from the registry (`cfg.mixer`). Blocks are
created stacked (one leading `layers` axis on every parameter, via `nnx.vmap`) and run with
`jax.lax.scan`, so compile time stays flat in depth; `cfg.remat` picks the rematerialisation
policy of one block.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attn_jax.config import ModelConfig, validate_model
from attn_jax.layers import RMSNorm, SwiGLU, dtype_of, param
from attn_jax.registry import get_mixer

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    self.mixer_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt)
    self.mixer = get_mixer(cfg.mixer)(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt)
    self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, rngs=rngs, init_std=cfg.init_std,
                      out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers), dtype=dt,
                      param_dtype=pdt)

  def __call__(self, x, *, positions, cache=None, cache_index=None):
    h, cache, aux = self.mixer(self.mixer_norm(x), positions=positions, cache=cache,
                               cache_index=cache_index)
    x = x + h.astype(x.dtype)
    x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
    return x, cache, aux


class Decoder(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    self.embed = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                       ("vocab", "embed"), pdt)

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
      return Block(cfg, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt)
    if not cfg.tie_embeddings:
      self.head = param(rngs, nnx.initializers.normal(cfg.init_std),
                        (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

  @property
  def mixer_cls(self):
    return get_mixer(self.cfg.mixer)

  def unembed(self, h: jax.Array) -> jax.Array:
    """Final hidden states [..., D] -> fp32 logits [..., V] (the LM head)."""
    w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
    return jnp.einsum("...d,dv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)

  def init_cache(self, batch: int, max_len: int) -> Any:
    """Decoding state of all layers, stacked on a leading layer axis."""
    one = self.mixer_cls.init_cache(self.cfg, batch, max_len, dtype_of(self.cfg.dtype))
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.cfg.n_layers,) + a.shape), one)

  def __call__(self, tokens_BT: jax.Array, *, positions=None, cache=None, cache_index=None,
               return_aux: bool = False, features_only: bool = False):
    """tokens [B, T] -> logits [B, T, V] (fp32). With `cache`, returns (logits, new_cache).
    `features_only`: return the final-norm hidden states [B, T, D] instead (see `unembed`)."""
    cfg = self.cfg
    B, T = tokens_BT.shape
    if positions is None:
      start = 0 if cache is None else cache_index
      positions = jnp.arange(T, dtype=jnp.int32)[None, :] + jnp.asarray(start, jnp.int32)
      positions = jnp.broadcast_to(positions, (B, T))
    x = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype_of(cfg.dtype))

    graphdef, block_state = nnx.split(self.blocks)

    def body(x, layer):
      state, layer_cache = layer
      blk = nnx.merge(graphdef, state)
      x, new_cache, aux = blk(x, positions=positions, cache=layer_cache, cache_index=cache_index)
      return x, (new_cache, aux)

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      x, (new_cache, aux) = jax.lax.scan(body, x, (block_state, cache))
    else:
      outs = []
      for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda a: a[i], (block_state, cache))
        x, out = body(x, layer)
        outs.append(out)
      new_cache, aux = jax.tree.map(lambda *a: jnp.stack(a), *outs)

    if features_only:
      return self.final_norm(x)
    logits = self.unembed(self.final_norm(x))
    out = (logits,) if cache is None else (logits, new_cache)
    if return_aux:
      out = out + (aux,)
    return out[0] if len(out) == 1 else out


def build_model(cfg: ModelConfig | ml_collections.ConfigDict, *, seed: int = 0) -> Decoder:
  if isinstance(cfg, ml_collections.ConfigDict):
    cfg = ModelConfig.from_config(cfg)   # validates
  else:
    validate_model(cfg)
  return Decoder(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig | ml_collections.ConfigDict) -> Decoder:
  """The model with ShapeDtypeStruct leaves: no memory allocated."""
  return nnx.eval_shape(lambda: build_model(cfg))


def count_params(cfg: ModelConfig | ml_collections.ConfigDict) -> dict[str, int]:
  """Parameter counts from abstract shapes (a 369M model is counted in seconds, no allocation).

  `total` counts every parameter once (tied embeddings once); `non_embedding` excludes the
  token embedding (and an untied head), the usual convention for FLOPs (6 N per token).
  """
  model = abstract_model(cfg)
  state = nnx.state(model, nnx.Param)
  sizes = {"/".join(str(k) for k in path): math.prod(v.shape)
           for path, v in nnx.to_flat_state(state)}
  total = sum(sizes.values())
  emb = sum(n for p, n in sizes.items() if p in ("embed", "head"))
  mixer = sum(n for p, n in sizes.items() if p.startswith("blocks/mixer/"))
  mlp = sum(n for p, n in sizes.items() if p.startswith("blocks/mlp/"))
  return {"total": total, "embedding": emb, "non_embedding": total - emb, "mixer": mixer,
          "mlp": mlp}
