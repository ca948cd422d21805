"""Head fusion (Hymba-style, Dong et al., "Hymba", 2024): attention heads and Mamba-2 heads side
by side in one layer, reading the same (already normed) input.

    a = Attention heads(x)       (cfg.n_heads heads of cfg.head_dim, RoPE, causal; QKVProjection)
    s = Mamba-2 heads(x)         (mamba2.Mamba2.ssm_heads: conv, SSD, gated RMSNorm)
    y = W_o RMSNorm(a) + W_s s  =  [W_o W_s] [RMSNorm(a); s]

Combination: each branch is normalised (attention: an RMSNorm over its heads with a learnable
scale; SSM: Mamba-2's own gated RMSNorm, also with a learnable scale), then the two are
concatenated and projected back to d_model (written as the sum of the two branches' own output
projections). Hymba averages the two normalised branches with learnable per-channel scales
(beta_1, beta_2) before one output projection; with learnable norm scales in front of a shared
linear projection that average is the same function class as this concatenation, and the
separate projections let each branch keep its own (and the existing modules') parameters.
Each branch keeps its own initialisation: the attention heads the Transformer's N(0, init_std),
the SSM heads Mamba-2's (mamba_ssm's fan-in convention, `mamba2.projection_inits`).

Rematerialisation: in a full forward the SSM branch (heads and their output projection) runs
under Mamba-2's checkpoint (`Mamba2.remat_forward`, mamba2.py's docstring: only the
in-projection outputs are kept for the backward); the attention branch is as the attention
mixer's (mha.py): a plain 0..T-1 forward takes the kernels' causal path (no positional mask),
and a core that would keep [T, S] scores for the backward (`kernel_choice.remat_attention`) is
rematerialised.

Decoding state: the tuple (attention KV cache, Mamba-2 state). The attention cache here is a
`cache.KVCache` under the linear policy (keys after RoPE, per-slot positions as the key
mask, so padding tokens, position -1, are never written nor attended to).

Packed rows (`segment_ids_BT`, full forwards, positions restarting at 0 per document): both
branches keep to a token's document. The attention heads mask every key of another document
(`entry.attend(q_segments=, kv_segments=)`, as the attention mixer; with positions restarting,
a later key of the same document still has a larger position, so `prefix_causal` holds); the
Mamba-2 heads restart their conv window and state at the document's first token
(`mamba2.Mamba2.ssm_heads`). The SSM heads cannot give every document a shared prefix, so
`reads_shared_prefix` stays False (mixer.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import QKVProjection
from attn_jax.kernels import entry
from attn_jax.layers import causal_positions, dtype_of, param
from attn_jax.mixer import Mixer, register_mixer
from attn_jax.ssm.mamba2 import Mamba2, document_resets

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

f32 = jnp.float32


@register_mixer("hybrid_heads")
class HybridHeads(Mixer):

  @dataclasses.dataclass(frozen=True)
  class Options:                 # the SSM branch (the attention branch uses cfg's heads)
    d_state: int = 64
    expand: float = 1.0          # SSM inner width = expand * d_model (when ssm_heads = 0)
    head_dim: int = 64
    ssm_heads: int = 0
    n_groups: int = 1
    d_conv: int = 4
    chunk_size: int = 64

    def mamba2(self) -> Mamba2.Options:
      return Mamba2.Options(d_state=self.d_state, expand=self.expand, head_dim=self.head_dim,
                            n_heads=self.ssm_heads, n_groups=self.n_groups, d_conv=self.d_conv,
                            chunk_size=self.chunk_size)

    def validate(self, cfg: ModelConfig, where: str) -> None:
      self.mamba2().validate(cfg, where)

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads)."""
    return dataclasses.replace(cls.Options(), d_state=8, head_dim=8, chunk_size=4)

  def __init__(self, cfg: ModelConfig, opts: "HybridHeads.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.attn = QKVProjection(cfg, rngs=rngs)
    self.attn_norm = param(rngs, nnx.initializers.ones, (cfg.n_heads, cfg.head_dim),
                           ("heads", "head_dim"), kind="norm")
    self.ssm = Mamba2(cfg, opts.mamba2(), rngs=rngs)

  def _attention(self, x_BTD, positions_BT, kv, segment_ids_BT=None, plain=False):
    """`plain`: positions are 0..T-1 in every row (the kernels' fast causal path, as the
    attention mixer's)."""
    cfg, p = self.cfg, self.attn
    scale = cfg.head_dim ** -0.5
    if kv is None:
      q, k, v = p.rotated_qkv(x_BTD, positions_BT, cfg.rope_theta)
      pos = None if plain else positions_BT
      out = entry.attend(
          q, k, v, scale=scale, causal=True, q_positions=pos, kv_positions=pos,
          impl=cfg.attention_impl, prefix_causal=True, q_segments=segment_ids_BT,
          kv_segments=segment_ids_BT, remat=True)   # no [T, S] scores kept for the backward
    else:   # the shared KV cache (attention/cache.py), as the attention mixer
      qkv, rows = p.qkv_and_rows(x_BTD)
      out, kv = cache_lib.cached_attention(kv, *qkv, positions_BT, theta=cfg.rope_theta,
                                           scale=scale, impl=cfg.attention_impl,
                                           qkv_rows=rows)
    o = out.astype(f32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=(-2, -1), keepdims=True) + cfg.norm_eps)
    o = o * self.attn_norm[...].astype(f32)
    return p.o(o.astype(dtype_of(cfg.dtype))), kv

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    document_resets(segment_ids_BT, state, type(self).__name__)   # packed: full forwards only
    plain = positions_BT is None
    if plain:
      positions_BT = causal_positions(*x_BTD.shape[:2])
    kv, ss = (None, None) if state is None else state
    ya, kv = self._attention(x_BTD, positions_BT, kv, segment_ids_BT, plain)
    if state is None:   # a full forward: the SSM branch rematerialised but for its in-projections
      return ya + self.ssm.remat_forward(x_BTD, positions_BT, segment_ids_BT), None, {}
    hs, ss = self.ssm.ssm_heads(x_BTD, positions_BT=positions_BT, state=ss)
    return ya + self.ssm.out(hs), (kv, ss), {}

  def implicit_attention(self, x_BTD) -> dict:
    """The Mamba-2 branch's implicit attention matrix (`Mamba2.implicit_attention`)."""
    return self.ssm.implicit_attention(x_BTD)

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts: "HybridHeads.Options", batch: int, capacity: int,
                 dtype, policy=None):
    """(KV cache of `capacity` slots, Mamba-2 state of fixed size)."""
    return (cache_lib.init_cache(cache_lib.LINEAR, batch, capacity, cfg.kv_heads, cfg.head_dim,
                                 cfg.head_dim, dtype),
            Mamba2.init_state(cfg, opts.mamba2(), batch, capacity, dtype))

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts: "HybridHeads.Options", seq_len: int) -> float:
    """Causal attention scores and values ((L+1)/2 keys per query, as mha.py) + the SSD."""
    attn = 4.0 * cfg.n_heads * cfg.head_dim * (seq_len + 1) / 2.0
    return attn + Mamba2.flops_per_token(cfg, opts.mamba2(), seq_len)

  @classmethod
  def stream_limit(cls, cfg, opts, capacity: int, policy=None) -> int:
    return capacity   # the attention heads' linear KV buffer holds the whole stream
