"""Block fusion at 152M (Jamba/Samba-style layer interleaving): Transformer layers (attention +
SwiGLU) alternating with Mamba-2 blocks without MLP: pattern ("attention", "mamba2:nomlp")
repeated to 16 layers = 8 attention + 8 Mamba-2 layers (the decoder scans whole periods, so the
depth is a multiple of 2). The SwiGLU widens 3072 -> 3528 to match the Transformer's parameter
count: 151,859,264 vs 151,878,144 (-0.01%).
"""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=16, d_ff=3528)
  c.model.pattern = ("attention", "mamba2:nomlp")
  c.model.mamba2.update(d_state=64, expand=2.0, head_dim=64)
  return c
