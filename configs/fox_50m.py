"""Forgetting Transformer (FoX), 50M: the Transformer 50M preset with mixer "fox", the SwiGLU
narrowed to match its parameter count (`configs/fox_152m.py`; `:pro` for the Pro block)."""

from configs import fox_152m, transformer_50m


def get_config(config_string: str = ""):
  return fox_152m.matched(transformer_50m.get_config(), config_string)
