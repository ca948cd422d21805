"""SISA 152M (configs/sisa_152m.py, parameter-matched) pre-trained with one learnable sink
token; same preset override of d_state (`--config=configs/sisa_152m_sink.py:16`)."""

from configs import sisa_152m


def get_config(config_string: str = ""):
  c = sisa_152m.get_config(config_string)
  c.model.sink_tokens = 1
  return c
