"""Block fusion at 152M (Jamba/Samba-style layer interleaving): Transformer layers (attention +
SwiGLU, as transformer_152m) alternating with Mamba-2 blocks without MLP, starting and ending
with attention: pattern ("attention", "mamba2:nomlp") repeated to 17 layers = 9 attention +
8 Mamba-2 layers, 152,892,992 parameters (+0.67% vs the Transformer's 151,878,144; 16 layers
would be -5.5%).
"""

from configs import mamba2_152m, transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=17, d_ff=3072)
  c.model.pattern = ("attention", "mamba2:nomlp")
  mamba2_152m.mixer_options(c, "mamba2", d_state=64, expand=2.0, head_dim=64)
  return c
