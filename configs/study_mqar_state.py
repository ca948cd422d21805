"""MQAR recall against SSM state size: the ordering of the Mamba-2 paper's MQAR figure
(docs/papers.md §2.3; Dao & Gu 2024, Fig. 8: Mamba-2 improves with state size
N = 16 -> 64 -> 256 and approaches attention at N = 256; T 256-1024 there) scaled to study_tiny's
task and budget on a 2-core CPU.

  python experiments/study.py --config=configs/study_mqar_state.py --workdir=runs/study_state

Same task, trunk, optimizer and seeds as configs/study_tiny.py. Variants: the Transformer and
two-block Mamba-2 models (their own short conv, mamba_ssm init) at d_state 4, 16 and 64 with
expand 1 (4 heads of 16), each matched to the Transformer's parameter count by its MLP width
(d_ff), so the state is what differs. The published claim to reproduce: recall grows with N and
the largest state comes closest to attention.

What is cut to fit (4 variants x 3 seeds = 12 runs; docs/studies.md gives their time): no sweep
of its own. Each family runs at its best setting in configs/study_embed.py's sweep of lr and
token-table scale: the Transformer as study_tiny's baseline (table N(0, 0.02), lr 3e-3; with an
N(0, 1) table it stays near 13% recall), Mamba-2 with an N(0, 1) table at lr 3e-3 (99.9% there
against 27.8% for study_tiny's N(0, 0.02) table at its best lr, 1e-3).
`--config.study.lrs=1e-3,3e-3` restores an lr sweep; N = 8 is left out (`STATES` below). The
Transformer here is study_tiny's baseline run for run (same config and seeds).
"""

from configs import study_tiny

STATES = (4, 16, 64)
MAMBA2_LR = 3e-3       # study_embed's sweep: Mamba-2 (expand 2, N 64) with the N(0, 1) table
MAMBA2_EMBED_STD = 1.0  # the token table's init std (model.embed_init_std), same sweep


def _mamba2(n):
  mix = "model.mamba2"
  return (f"mamba2_n{n}", "model.d_ff",
          (("model.pattern", ("mamba2", "mamba2")), ("model.n_layers", 2),
           (f"{mix}.expand", 1.0), (f"{mix}.head_dim", 16), (f"{mix}.d_state", n),
           (f"{mix}.chunk_size", 32), ("optim.lr", MAMBA2_LR),
           ("model.embed_init_std", MAMBA2_EMBED_STD)),
          f"two Mamba-2 blocks, d_state {n}, expand 1; mamba_ssm init (Dao & Gu 2024, Fig. 8), "
          f"token table N(0, {MAMBA2_EMBED_STD:g}); lr {MAMBA2_LR:g} (study_embed's Mamba-2 sweep)")


VARIANTS = (study_tiny.VARIANTS[0],) + tuple(_mamba2(n) for n in STATES)


def get_config():
  c = study_tiny.get_config()
  c.study.variants = VARIANTS
  c.study.only = ""
  c.study.lrs = ()
  c.study.param_tolerance = 0.03
  c.study.readme_marker = "study_state"   # README section <!-- study_state:begin/end -->
  c.study.throughput_seq_lens = ()        # study_tiny measures the Mamba-2 step
  return c
