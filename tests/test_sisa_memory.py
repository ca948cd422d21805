"""SISA's train-step memory (attention/sisa.py, `SISA._kernel_forward`, asking the kernels room
`entry.takes_decayed_kernel` and handing it `entry.MatchFactors`): a full forward through the
decayed-attention kernel keeps for its backward what the q/k/v projections and the kernel
keep, plus the output of its one C / B / theta / decay matmul and the kernel's two factors; the
cumulative sums and the rotations (fp32, [B, T, H, d_s/2] cos, sin, pair halves) are
recomputed. Kept per layer, those made the 152M step on a v5p chip 1.35x the Transformer's
(their d_s/2 = 16 last axis pads to the TPU's 128 lanes); the compiled step is within 1.1x of
the Transformer's on a v5p chip and on an H100 (slow: compiled for both targets)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
# `saved_residuals` is what `jax.ad_checkpoint.print_saved_residuals` prints, as data.
from jax._src.ad_checkpoint import saved_residuals

from attn_jax import kernel_choice, targets
from attn_jax.attention import sisa as S
from attn_jax.kernels import entry
from attn_jax.train import aot
from configs import sisa_152m, transformer_152m
from tests.test_sisa import _cfg

B, T = 2, 128


def _kept(layer, x):
  """(aval, why) of every float the backward pass of sum(layer(x)) keeps that is not an
  argument (parameters, x)."""
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(jnp.float32))
  return [(a, why) for a, why in saved_residuals(loss, state, x)
          if not why.startswith("from the argument") and jnp.issubdtype(a.dtype, jnp.floating)]


@pytest.mark.parametrize("parallel_sums", [True, False], ids=["gpu_tpu_sums", "cpu_sums"])
def test_kernel_forward_keeps_the_matmul_output_and_the_factors_only(monkeypatch,
                                                                     parallel_sums):
  """bf16, the kernel taken (on the CPU by `kernels_on_cpu`), g and Phi by the GPU / TPU
  parallel prefixes or the CPU scan: of what sisa.py makes, the backward keeps the matmul's
  bf16 [B, T, H (2 d_s + d_s/2 + 1)] and the kernel's bf16 factors lambda R C and R B; besides
  them only g (fp32 [B, T, H]); nothing fp32 that is d_s or d_s/2 wide."""
  monkeypatch.setattr(kernel_choice, "FORCE_PARALLEL_TIME_SUMS", parallel_sums)
  cfg = _cfg(d_model=64, n_heads=2, dtype="bfloat16")
  H, ds = cfg.n_heads, cfg.options_for("sisa").d_state
  layer = S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, cfg.d_model), jnp.bfloat16)
  with kernel_choice.kernels_on_cpu():
    kept = _kept(layer, x)
  assert any("kernels/decayed.py" in why for _, why in kept), kept   # the kernel's residuals
  own = sorted((a.shape, a.dtype) for a, why in kept
               if ("attention/sisa.py" in why or "kernels/entry.py" in why)
               and a.shape != (B, T, H))
  assert own == sorted([((B, T, H * (2 * ds + ds // 2 + 1)), jnp.bfloat16),
                        ((B, T, H, ds), jnp.bfloat16), ((B, T, H, ds), jnp.bfloat16)]), kept
  wide = [(a, why) for a, why in kept if a.dtype == jnp.float32 and a.ndim == 4
          and a.shape[-1] in (ds, ds // 2)]
  assert not wide, wide
  assert [a.dtype for a, _ in kept if a.shape == (B, T, H)] == [jnp.float32], kept   # g


def _through_match_decay(layer, x):
  """The layer's full forward handing the kernels room a MatchDecay (the kernel makes the
  factors itself, `entry.match_factors`): the route before the factors were rematerialised."""
  cfg = layer.cfg
  f = layer.features(x, None)
  g, phi = S.decay_and_phase(f.loga, f.theta)
  sink = S.sink_logit_of(layer.opts, layer.sink_logit, cfg.n_heads)
  out, _ = entry.attend_decayed(f.q, f.k, f.v, layer._decay(f, g, phi),
                                scale=cfg.head_dim ** -0.5, impl=cfg.attention_impl,
                                sink_logit_H=sink, what="sisa")
  return layer.proj.o(out)


def test_kernel_forward_equals_the_match_decay_route():
  """fp32, the kernel taken (interpreter on the CPU): the output and the gradients (x and every
  parameter) of the layer, whose factors come from its rematerialised function as
  `entry.MatchFactors`, equal those of handing the kernels room a MatchDecay (same operations:
  equal up to fp32 reassociation)."""
  cfg = _cfg(d_model=32, n_heads=2, dtype="float32", sink_logit="learned")
  layer = S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.PRNGKey(2), (B, 64, cfg.d_model), jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(3), (B, 64, cfg.d_model), jnp.float32)
  graphdef, state = nnx.split(layer)

  def loss(route, state, x):
    m = nnx.merge(graphdef, state)
    return jnp.sum(w * (m(x)[0] if route == "layer" else _through_match_decay(m, x)))

  with kernel_choice.kernels_on_cpu():
    assert layer._takes_kernel(x)
    got = jax.value_and_grad(lambda s, x: loss("layer", s, x), argnums=(0, 1))(state, x)
    want = jax.value_and_grad(lambda s, x: loss("decay", s, x), argnums=(0, 1))(state, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    scale = float(jnp.max(jnp.abs(b))) + 1e-30
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, (a, b)


def _train_gib(module, target: str, batch: int) -> float:
  """GiB per device of the preset's train step compiled for `target`, data parallel over its
  devices at `batch` x 2048 (the analysis of `aot.compile_for_target`; nothing runs)."""
  c = module.get_config()
  c.data.global_batch_size, c.data.seq_len, c.train.grad_accum = batch, 2048, 1
  c.mesh.shape = (len(targets.devices(target)), 1, 1)
  r = aot.compile_for_target(c, target, programs=("train",), search_fit=False)
  return r.programs[0].needed / 2 ** 30


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5p-8", "h100x8"])
def test_sisa_152m_step_within_1_1x_the_transformers(target):
  """The 152M train step at batch 4 x 2048 per chip (v5p-8: 4 chips; h100x8: 8 GPUs), compiled
  for the target: SISA needs at most 1.1x the Transformer's memory per device (1.35x on the v5p
  chip before the factors were recomputed). Minutes of CPU per compile: slow, ci_extra."""
  if not targets.available(target):
    pytest.skip(f"compile target {target} unavailable here (pip install -e '.[targets]')")
  batch = 4 * len(targets.devices(target))
  sisa = _train_gib(sisa_152m, target, batch)
  transformer = _train_gib(transformer_152m, target, batch)
  print(f"\n{target}: SISA {sisa:.2f} GiB, Transformer {transformer:.2f} GiB per device")
  assert sisa <= 1.1 * transformer, (sisa, transformer)
