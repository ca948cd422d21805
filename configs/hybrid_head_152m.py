"""Head fusion at 152M (Hymba-style, attn_jax/ssm/hybrid_heads.py): every layer runs 12
attention heads and 12 Mamba-2 heads (expand 1, head dim 64, d_state 64) side by side, then a
SwiGLU. The SSM heads add 1,883,044 parameters per layer; the SwiGLU narrows from 3072 to 2256
to pay for them: 151,913,904 parameters (+0.02% vs the Transformer's 151,878,144).
"""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=12, d_ff=2256)
  c.model.pattern = ("hybrid_heads",)
  c.model.hybrid_heads.update(d_state=64, expand=1.0, head_dim=64)
  return c
