"""Kernel launches per train step (train/hlo_loops.py `launches`: the fusions, custom calls and
copies XLA:GPU launches from the host, times their loops' iterations) of the SSM mixers against
the Transformer's, read from the programs compiled for one H100 (compile-only: nothing runs),
as `experiments/train.py --compile_only=h100x1` prints them.

Scheme: the 152M presets (configs/<mixer>_152m.py) at grad_accum 1, one micro-batch of
32 x 2048 (the presets' batch and length), so the figure is one micro-batch's step: the
layer scan (forward and backward), the loss's chunks and the optimizer update. Mamba-2 152M has
31 layers and Mamba-3 30 against the Transformer's 12, so per layer they must launch well under
half of what a Transformer layer does. The counts are deterministic (no timing).

LIMITS are the ratios reached on this code (a regression guard, a little above the measured
figures in the docstring of each test); the issue's target, 1.5x, is `test_..._within_1_5x`
(Mamba-2 meets it, Mamba-3 does not yet: a strict xfail).

Reproduce a figure: the test's own `_train_step(name)`, or `experiments/train.py
--config=configs/<name>_152m.py --compile_only=h100x1` with grad_accum 1 ("launches" on the
train line).
"""

import re

import pytest

from attn_jax import targets
from attn_jax.registry import available_mixers
from attn_jax.train import aot
from configs import (hybrid_block_152m, hybrid_head_152m, mamba2_152m, mamba3_152m,
                     transformer_152m)
from tests.test_targets import tiny_config

TARGET = "h100x1"
PRESETS = {"transformer": transformer_152m, "mamba2": mamba2_152m, "mamba3": mamba3_152m,
           "hybrid_block": hybrid_block_152m, "hybrid_head": hybrid_head_152m}
LIMITS = {"mamba2": 1.50, "mamba3": 2.22, "hybrid_block": 1.09, "hybrid_head": 1.49}
GOAL = 1.5     # the issue's: Mamba-2's and Mamba-3's steps at most 1.5x the Transformer's


def _need_target():
  if not targets.available(TARGET):
    pytest.skip(f"compile target {TARGET} unavailable here (pip install -e '.[targets]')")


def _train_step(name: str) -> tuple[int, str]:
  """(launches per train step, the report as --compile_only prints it) of a preset."""
  c = PRESETS[name].get_config()
  c.train.grad_accum = 1
  r = aot.compile_for_target(c, TARGET, config_name=f"{name}_152m", programs=("train",),
                             search_fit=False)
  (train,) = r.programs
  assert train.launches, f"{name}: launches unknown ({train.loops})"
  return train.launches, aot.format_report(r)


_CACHE: dict = {}


def _launches(name: str) -> int:
  if name not in _CACHE:
    _need_target()
    _CACHE[name] = _train_step(name)
  n, report = _CACHE[name]
  assert f"; {n} launches," in report, report      # the printed report names the same count
  return n


def _ratios(names) -> dict[str, tuple[int, float]]:
  base = _launches("transformer")
  out = {n: (_launches(n), _launches(n) / base) for n in names}
  print(f"\nlaunches per train step on {TARGET} (152M, 32 x 2048): transformer {base}, " +
        ", ".join(f"{n} {k} ({r:.2f}x)" for n, (k, r) in out.items()))
  return out


@pytest.mark.slow
def test_ssm_train_steps_launch_within_their_limits():
  """Mamba-2 and Mamba-3 within LIMITS of the Transformer's launches (now: Transformer 1,848,
  Mamba-2 2,760 = 1.49x, Mamba-3 4,080 = 2.21x; at 121a7de 3,695 = 2.00x and 4,731 = 2.56x;
  at 877a042 5,533 = 2.99x and 6,604 = 3.57x). Compiles three 152M train steps: ~3 min on the
  2-core CPU."""
  got = _ratios(("mamba2", "mamba3"))
  bad = {n: r for n, (_, r) in got.items() if r > LIMITS[n]}
  assert not bad, f"launch ratios over their limits {LIMITS}: {got}"


@pytest.mark.slow
def test_hybrid_train_steps_launch_within_their_limits():
  """The block and head hybrids (Mamba-2 layers or heads beside attention) within LIMITS (now:
  block 1,997 = 1.08x, head 2,735 = 1.48x; at 121a7de 2,296 = 1.24x and 3,050 = 1.65x; at
  877a042 2,761 = 1.49x and 3,826 = 2.07x)."""
  got = _ratios(("hybrid_block", "hybrid_head"))
  bad = {n: r for n, (_, r) in got.items() if r > LIMITS[n]}
  assert not bad, f"launch ratios over their limits {LIMITS}: {got}"


@pytest.mark.slow
@pytest.mark.parametrize("mixer", [
    "mamba2",
    pytest.param("mamba3", marks=pytest.mark.xfail(
        strict=True, reason="2.21x: 121 launches a layer (46 forward, 75 backward) against "
        "Mamba-2's 74, at 30 layers; 7 of them the rotation angles' wrapped prefix over the "
        "chunks (layers.wrapped_cumsum's associative_scan), 8 the B/C RMS norm and scale")),
])
def test_ssm_train_steps_launch_within_1_5x_the_transformers(mixer):
  """The issue's target: the SSM's train step launches at most 1.5x the Transformer's kernels
  at T 2048. Strict: a mixer that starts meeting it fails until its xfail is removed."""
  (_, r), = _ratios((mixer,)).values()
  assert r <= GOAL, (mixer, r)


# ------------------------------------------------------- the report, every mixer (tiny models)

_LINE = re.compile(r"^\s+train\s.*\n\s+kernels: .*\n\s+\d+ serial iterations.*; (\d+) launches,",
                   re.M)


def _report_launches(mixer: str) -> None:
  c = tiny_config((mixer,), (1, 1, 1), seq_len=256)
  r = aot.compile_for_target(c, TARGET, programs=("train",), search_fit=False)
  m = _LINE.search(aot.format_report(r))
  assert m, aot.format_report(r)
  assert int(m.group(1)) == r.programs[0].launches > 0


def test_the_compile_report_prints_launches_per_train_step():
  """`--compile_only` prints the train step's launches (a tiny Mamba-2 on one H100)."""
  _need_target()
  _report_launches("mamba2")


@pytest.mark.slow
@pytest.mark.parametrize("mixer", available_mixers())
def test_the_compile_report_prints_launches_for_every_mixer(mixer):
  _need_target()
  _report_launches(mixer)
