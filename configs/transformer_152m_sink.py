"""Transformer 152M pre-trained with one learnable sink token (docs/papers.md §3.3: the 160M
Pythia recipe of the StreamingLLM paper): at inference a StreamingLLM cache keeps just it,
`model.init_state(batch, capacity, policy=cache.SinksRing(1, window))` (attention/cache.py)."""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.sink_tokens = 1
  return c
