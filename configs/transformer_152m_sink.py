"""Transformer 152M pre-trained with one learnable sink token (SPEC.md section 3: the 160M
Pythia recipe of the StreamingLLM paper): at inference a StreamingLLM cache keeps just it,
`cfg.with_options("attention", cache="streaming", cache_sinks=1, cache_window=...)`."""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.sink_tokens = 1
  return c
