"""GPU and TPU programs lowered on this CPU (`jax.export`, cross-platform): the trainer's train
step and decoding (`decode.generate`: chunked prefill + the one-token decode step) of every
registered mixer and of the block hybrid (attention + Mamba-2 layers), for `cuda` and `tpu`.

A lowering error, a missing lowering rule or a shape a kernel refuses then fails here rather
than on the first GPU or TPU. What lowering does not prove: the device compiler's own checks
(cuDNN building its graph, Mosaic compiling the splash kernel) and the numerics, which
`experiments/device_check.sh` runs on a lent device.

The platform's attention path: `core.choose_impl("auto")` and the cumulative sums ask
`platform.current()`, which is made to answer the target platform while tracing (`_pretend`), so the traced program is the one the device would run: on cuda with bf16,
"cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`); on tpu, the Pallas "splash"
kernel where it applies (plain causal square, T a multiple of 128) and "xla" elsewhere. Each
case records the implementations the model asked `dot_product_attention` for and asserts that
the platform's kernel is in the lowered module.

cuDNN: JAX's cuDNN attention lowering asks the installed cuDNN for its version, and without the
CUDA plugin it refuses ("cuDNN is not detected"). The `cudnn` cases answer that probe with a
simulated cuDNN 9.10 on a Hopper-class GPU (`_simulated_cudnn`), so JAX's own shape rules for
the cuDNN kernel (head dim <= 256 and a multiple of 8, even lengths with a bias, ...) still run
on our shapes; where that probe is not found in this JAX, the case is skipped with the reason
and the `xla` fallback cases (the same model with attention_impl="xla", what a GPU runs for fp32
or unsupported head dims) still lower. The cuDNN custom calls carry no serialization guarantee
and are allowed explicitly (`disabled_checks`).

Shapes are tiny (d 64, 4 heads of 16, SISA d_state 8 so the widened head is 24, batch 8 x 128,
one layer per pattern entry); lowering compiles nothing. The train step is exported on one
device, and for attention also lowered on the simulated 8-device data mesh (`train_sharded`):
on TPU the splash kernel runs under a shard_map over the batch / head axes
(attention/splash.py), which Mosaic needs on more than one device.
The default suite holds the cases listed at FAST_TPU_TRAIN (about 45 CPU s on 2 cores); the
rest are `slow` (`pytest -m slow tests/test_export.py`).
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attn_jax import decode
from attn_jax import platform as platform_lib
from attn_jax import sharding as shd
from attn_jax.attention import core
from attn_jax.config import validate
from attn_jax.model import abstract_model
from attn_jax.registry import available_mixers
from attn_jax.train import trainer as trainer_lib
from configs import quickstart
from tests.test_trunk import set_tiny

SEQ_LEN = 128          # splash takes T % 128 == 0
BATCH = 8              # one row per simulated device
PROMPT, NEW = 5, 3     # decoding: prompt length, generated tokens
# Small options per mixer (a mixer not listed runs with its defaults: new mixers are covered).
PATTERNS = {m: (m,) for m in available_mixers()}
PATTERNS["hybrid_block"] = ("attention", "mamba2:nomlp")
# (export platform, attention_impl, the platform name `auto` is resolved for)
TARGETS = {"cuda-cudnn": ("cuda", "auto", "gpu"), "cuda-xla": ("cuda", "xla", "gpu"),
           "tpu": ("tpu", "auto", "tpu")}
KERNEL = {"cudnn": r"__cudnn\$fmha", "splash": r"tpu_custom_call"}
# Sharded: the cuDNN call sits behind its `custom_partitioning` wrapper until XLA partitions the
# module on the device.
SHARDED_KERNEL = {"cudnn": r"custom_call @CustomSPMDPartitioning"}
SIMULATED_CUDNN = 91000   # cuDNN 9.10: new enough for every rule JAX checks on these shapes


def config(name: str, impl: str):
  c = quickstart.get_config()
  pattern = PATTERNS[name]
  c.model.update(d_model=64, n_heads=4, d_ff=128, n_layers=len(pattern), pattern=pattern,
                 max_seq_len=SEQ_LEN, dtype="bfloat16", attention_impl=impl)
  set_tiny(c.model, {p.split(":")[0] for p in pattern})
  c.data.update(seq_len=SEQ_LEN, global_batch_size=BATCH)
  return c


@contextlib.contextmanager
def _pretend(platform: str, monkeypatch, asked: list):
  """While tracing: `auto` resolves for `platform`, and every implementation the model asks
  `jax.nn.dot_product_attention` for is appended to `asked` (splash: "splash")."""
  real_dpa = jax.nn.dot_product_attention
  real_splash = core._splash

  def dpa(*a, implementation=None, **kw):
    asked.append(implementation)
    return real_dpa(*a, implementation=implementation, **kw)

  def splash(*a, **kw):
    asked.append("splash")
    return real_splash(*a, **kw)

  with monkeypatch.context() as m:
    m.setattr(platform_lib, "current", lambda: platform_lib.normalize(platform))
    m.setattr(jax.nn, "dot_product_attention", dpa)
    m.setattr(core, "_splash", splash)
    yield


def _simulated_cudnn(monkeypatch):
  """Answer JAX's cuDNN version / compute-capability probes as a Hopper GPU with cuDNN 9.10
  would; skip (with the reason) where this JAX has no such probe."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    names = sorted(set(fa._custom_name_maps.values()))
    fa.check_cudnn_version, fa.check_compute_capability  # noqa: B018 (must exist)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"cuDNN attention cannot lower without the CUDA plugin here, and this JAX has "
                f"no cuDNN version probe to simulate ({e}); the cuda-xla cases lower the "
                f"fallback")
  if fa.cuda_versions is None:   # no CUDA plugin: the probe raises "cuDNN is not detected"
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: SIMULATED_CUDNN)
    monkeypatch.setattr(fa, "check_compute_capability",
                        lambda cap: tuple(map(int, cap.split("."))) <= (9, 0))
  return [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]


def _export(fn, platform, args, checks):
  return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*args)


def _train_args(setup):
  batch = {k: jax.ShapeDtypeStruct((1, BATCH, SEQ_LEN),
                                   jnp.float32 if k == "weights" else jnp.int32,
                                   sharding=setup.batch_sharding)
           for k in ("inputs", "targets", "weights")}
  return setup.abstract_state, batch


def _lower_train(c, platform, checks):
  """The trainer's step on one device, exported (`jax.export`): -> StableHLO text."""
  setup = trainer_lib.build_setup(c, devices=jax.devices()[:1])
  with shd.use_rules(setup.mesh, setup.rules):   # as trainer.compile_step traces it
    return _export(setup.step_fn, platform, _train_args(setup), checks).mlir_module()


def _lower_decode(c, platform, checks):
  """decode.generate (chunked prefill, then the one-token decode step in a while loop)."""
  graphdef, state = nnx.split(abstract_model(validate(c)))
  prompt = jax.ShapeDtypeStruct((2, PROMPT), jnp.int32)

  @jax.jit
  def gen(state, prompt_BT):
    return decode.generate(nnx.merge(graphdef, state), prompt_BT, max_new_tokens=NEW)

  return _export(gen, platform, (state, prompt), checks).mlir_module()


def _lower_sharded_train(c, platform, checks):
  """The trainer's step on the simulated 8-device data mesh, lowered for `platform`
  (`Traced.lower(lowering_platforms=...)`, the step jax.export runs before serializing: the
  cuDNN kernel's sharding rule is a Python `custom_partitioning` callback, which jax.export
  cannot serialize)."""
  del checks
  setup = trainer_lib.build_setup(c)
  assert setup.mesh.size == 8
  with shd.use_rules(setup.mesh, setup.rules):
    lowered = setup.step_fn.trace(*_train_args(setup)).lower(lowering_platforms=(platform,))
  return lowered.as_text()


LOWER = {"train": _lower_train, "decode": _lower_decode, "train_sharded": _lower_sharded_train}


@pytest.fixture(autouse=True)
def _fresh_traces():
  """Traces are cached by function and shapes, not by the pretended platform: start clean."""
  jax.clear_caches()
  yield
  jax.clear_caches()


# The default suite lowers every pattern's decoding for each target, every pattern's train
# step for cuda-cudnn, and the TPU train step of the patterns with softmax-attention layers that
# take splash or its fallback (attention, sisa, the block hybrid); the other cases are slow.
FAST_TPU_TRAIN = ("attention", "sisa", "hybrid_block")


def _slow(name, target, step) -> bool:
  if target == "cuda-xla":
    return name != "attention"
  return target == "tpu" and step == "train" and name not in FAST_TPU_TRAIN


def _cases():
  out = []
  for name in PATTERNS:
    for target in TARGETS:
      for step in ("train", "decode"):
        out.append(pytest.param(name, target, step, id=f"{name}-{target}-{step}",
                                marks=pytest.mark.slow if _slow(name, target, step) else ()))
  for target in ("cuda-cudnn", "tpu"):
    out.append(pytest.param("attention", target, "train_sharded",
                            id=f"attention-{target}-train_sharded"))
  return out


@pytest.mark.parametrize("name,target,step", _cases())
def test_lowers_for_the_device(name, target, step, monkeypatch):
  platform, impl, backend = TARGETS[target]
  checks = _simulated_cudnn(monkeypatch) if target == "cuda-cudnn" else []
  asked = []
  with _pretend(backend, monkeypatch, asked):
    text = LOWER[step](config(name, impl), platform, checks)
  expect = {"cuda-cudnn": {"cudnn"}, "cuda-xla": {"xla"}, "tpu": {"splash", "xla"}}[target]
  assert set(asked) <= expect, f"{target}: the model asked for {sorted(set(asked))}"
  kernels = dict(KERNEL, **(SHARDED_KERNEL if step == "train_sharded" else {}))
  for path in set(asked) & set(kernels):
    assert re.search(kernels[path], text), f"{path} asked for but not in the lowered module"
  if target == "tpu" and step.startswith("train") and "attention" in PATTERNS[name]:
    assert "splash" in asked, "plain causal attention at T % 128 == 0 must take splash on TPU"
