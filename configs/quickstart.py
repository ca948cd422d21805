"""The embedded default: a tiny Transformer learns multi-query associative recall (MQAR) on
generated data — no download — in a few minutes on a laptop CPU.

Each sequence holds 8 fresh random key->value pairs, then 8 queries of earlier keys; the loss
and accuracy are measured only at the answers. Chance is <= 1/8 (12.5%) for a model that does
not look back at the pairs. In the 1000 steps here a tiny model reaches ~34-36%: the score of
answering among the values not yet asked (H_8/8 = 34.0%); the real key->value lookup needs an
induction circuit that forms after a much longer plateau (see README). The run ends by printing
its held-out accuracy next to these no-lookup baselines and a few held-out sequences with the
model's answers (attn_jax.eval.run.explain_checkpoint).

  python experiments/train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python experiments/train.py --config=configs/quickstart.py --config.model.mixer=sisa
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(mixer="attention", vocab_size=96, d_model=64, n_layers=2, n_heads=4,
                 d_ff=192, max_seq_len=64, dtype="float32", init_std=0.02)
  c.model.sisa.d_state = 8
  c.data.update(source="synthetic", synthetic_task="mqar", seq_len=64, global_batch_size=64,
                mqar_num_pairs=8, mqar_num_queries=8, mqar_vocab=32)
  c.train.update(steps=1000, log_every=50)
  c.optim.update(lr=3e-3, warmup_steps=100, weight_decay=0.1)
  c.checkpoint.every_steps = 500
  c.eval.every_steps = 250
  return c
