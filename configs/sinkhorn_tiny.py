"""A tiny causal Sinkhorn model for the CPU: the quickstart's MQAR set-up (31 tokens, d 64, 2
layers), both layers Sinkhorn attention in blocks of 8 (4 blocks per sequence).

  python experiments/train.py --config=configs/sinkhorn_tiny.py --workdir=runs/sinkhorn_tiny
"""

from configs import quickstart
from configs.sinkhorn_152m import to_sinkhorn


def get_config():
  c = quickstart.get_config()
  c.train.update(steps=300, log_every=25)
  c.eval.every_steps = 100
  return to_sinkhorn(c, match_params=False, block_size=8, sortnet_width=32, sort_dim=8,
                     n_iters=7, temperature=0.75)
