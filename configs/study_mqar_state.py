"""MQAR recall against SSM state size (issue 19): the ordering of the Mamba-2 paper's MQAR
figure (Dao & Gu 2024, Fig. 8: Mamba-2 improves with state size N = 16 -> 64 -> 256 and
approaches attention at N = 256; T 256-1024 there) scaled to study_tiny's task and budget on a
2-core CPU.

  python experiments/study.py --config=configs/study_mqar_state.py --workdir=runs/study_state

Same task, trunk, optimizer, lr sweep and seeds as configs/study_tiny.py. Variants: the
Transformer and two-block Mamba-2 models (their own short conv, mamba_ssm init) at d_state 4,
8, 16 and 64 with expand 1 (4 heads of 16), each matched to the Transformer's parameter count
by its MLP width (d_ff), so the state is what differs. The published claim to reproduce:
recall grows with N and the largest state comes closest to attention. 5 variants x (3 sweep
lrs + 2 seeds) = 25 runs, ~45 minutes on 2 quiet cores.
"""

from configs import study_tiny


def _mamba2(n):
  mix = "model.mamba2"
  return (f"mamba2_n{n}", "model.d_ff",
          (("model.pattern", ("mamba2", "mamba2")), ("model.n_layers", 2),
           (f"{mix}.expand", 1.0), (f"{mix}.head_dim", 16), (f"{mix}.d_state", n),
           (f"{mix}.chunk_size", 16)),
          f"two Mamba-2 blocks, d_state {n}, expand 1; mamba_ssm init (Dao & Gu 2024, Fig. 8)")


VARIANTS = (study_tiny.VARIANTS[0],) + tuple(_mamba2(n) for n in (4, 8, 16, 64))


def get_config():
  c = study_tiny.get_config()
  c.study.variants = VARIANTS
  c.study.param_tolerance = 0.03
  return c
