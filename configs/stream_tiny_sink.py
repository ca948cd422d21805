"""configs/stream_tiny.py with one learnable sink token prepended to every training sequence
(model.sink_tokens = 1): StreamingLLM then needs to keep only that token
(`experiments/stream.py --sinks=1`)."""

from configs import stream_tiny


def get_config():
  c = stream_tiny.get_config()
  c.model.sink_tokens = 1
  return c
