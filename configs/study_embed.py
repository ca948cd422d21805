"""The token table's init scale, for the SSMs and the attention baseline alike: does the MQAR
gap of the comparison study (configs/study_tiny.py) close when every variant may draw its tied
table N(0, 1) instead of the shared trunk's N(0, 0.02)?

  python experiments/study.py --config=configs/study_embed.py --workdir=runs/study_embed
  python experiments/study.py --report=runs/study_embed --readme=docs/studies.md \
      --assets=docs/study_embed

Why: beside a minimal Mamba-2 written from the paper, ours computes the same function and
gradient and trains the same from the same start; the whole gap to a PyTorch-default minimal
model was the table's init, N(0, 1) (`nn.Embedding`) against N(0, 0.02) (GPT-2, and mamba_ssm's
own language model), docs/mamba_parity.md. Giving the SSMs a larger table alone would not be
fair, so every variant here runs at both scales (`model.embed_init_std`), the Transformer
included, on study_tiny's task, trunk, optimizer, seeds and budget.

Variants: the Transformer (the control), Mamba-2, Mamba-3 and the head-level hybrid (the study
rows the finding is about), each in study_tiny's configuration (same parameter matching), at
N(0, 0.02) and as `<name>_e1` at N(0, 1). What is cut to fit the budget: the N(0, 0.02) rows
run at the lr study_tiny's sweep chose for them (Transformer and hybrid 3e-3, the SSMs 1e-3;
study_tiny's rows re-run: same configs and seeds); the N(0, 1) rows get study_tiny's own lr
sweep (1e-3, 3e-3 on seed 0), since a larger table may move the best lr. SISA (d_s 8),
Sinkhorn, FoX and ALiBi run at N(0, 1) only (`WIDE_ONLY`, with the lr sweep): their
N(0, 0.02) rows are the comparison study's, whose table docs/studies.md holds.
"""

from configs import study_tiny

FAMILIES = ("transformer", "mamba2", "mamba3", "hybrid_heads")
# study_tiny's sweep (docs/studies.md, the sweep table): the lr each family's N(0, 0.02) row runs at
CHOSEN_LR = {"transformer": 3e-3, "mamba2": 1e-3, "mamba3": 1e-3, "hybrid_heads": 3e-3}
WIDE_STD = 1.0   # PyTorch's nn.Embedding default
# The other attention variants at N(0, 1) only (their N(0, 0.02) rows are the comparison
# study's, same configs and seeds): the fair version of the question covers every method.
WIDE_ONLY = ("sisa_ds8", "sinkhorn", "fox", "alibi")


def _narrow(name, match, overrides, setting):
  """study_tiny's row at the lr its sweep chose."""
  return (name, match, tuple(overrides) + (("study.lrs", (CHOSEN_LR[name],)),),
          f"{setting}; table N(0, 0.02), lr {CHOSEN_LR[name]:g} (study_tiny's sweep)")


def _wide(name, match, overrides, setting):
  """The same variant with the N(0, 1) table, lr swept."""
  return (f"{name}_e1", match or "model.d_ff",
          tuple(overrides) + (("model.embed_init_std", WIDE_STD),),
          f"{setting}; table N(0, {WIDE_STD:g}) (PyTorch's nn.Embedding), lr swept")


VARIANTS = tuple(row for v in study_tiny.VARIANTS if v[0] in FAMILIES
                 for row in (_narrow(*v), _wide(*v))) + \
    tuple(_wide(*v) for v in study_tiny.VARIANTS if v[0] in WIDE_ONLY)


def get_config():
  c = study_tiny.get_config()
  c.study.variants = VARIANTS
  c.study.only = ""
  c.study.readme_marker = "study_embed"   # docs/studies.md <!-- study_embed:begin/end -->
  c.study.throughput_seq_lens = ()        # the table's scale does not change a step's cost
  return c
