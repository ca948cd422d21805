"""A tiny byte-level Transformer for the streaming experiments (docs/papers.md §3), trained on
CPU in a few minutes on one plain text file (the whole file is one document, packed into
128-byte windows: the training length the streams then run far past).

  python experiments/train.py --config=configs/stream_tiny.py --workdir=runs/stream_tiny \\
      --config.data.paths=/path/to/input.txt        # e.g. tinyshakespeare's input.txt
  python experiments/stream.py --workdir=runs/stream_tiny --text=/path/to/input.txt --tail=0.01 \
      --policies=window,recompute,streaming

(--window defaults to what the model holds: 128 - --sinks. "dense" over a stream longer than
the model's 128 tokens needs --max_seq_len=<the stream's tokens>: it then runs positions the
model was not trained at, which is what the comparison shows.)

The sink twin is configs/stream_tiny_sink.py (one learnable sink token).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(mixer="attention", vocab_size=257, vocab_multiple=1, d_model=64, n_layers=2,
                 n_heads=4, d_ff=192, max_seq_len=128, dtype="float32")
  c.data.update(source="text", paths="", tokenizer="bytes", text_document="file",
                seq_len=128, global_batch_size=16, eval_fraction=0.01)
  c.train.update(steps=400, log_every=50)
  c.optim.update(lr=3e-3, warmup_steps=50, weight_decay=0.1)
  c.checkpoint.every_steps = 400
  c.eval.every_steps = 0
  return c
