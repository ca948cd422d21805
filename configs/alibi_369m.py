"""ALiBi, 369M: the Transformer 369M preset with mixer "alibi" (the bias -m_h (i - j) with the
paper's slopes instead of RoPE; no extra parameters, so the SwiGLU is unchanged)."""

from configs import transformer_369m


def get_config():
  c = transformer_369m.get_config()
  c.model.mixer = "alibi"
  return c
