"""ALiBi, 152M: the Transformer 152M preset with mixer "alibi" (the bias -m_h (i - j) with the
paper's slopes instead of RoPE; no extra parameters, so the SwiGLU is unchanged)."""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.mixer = "alibi"
  return c
