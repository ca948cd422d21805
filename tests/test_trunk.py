"""The trunk: layer patterns, mixer-owned decoding state, RNG/mode, parameter metadata, layering.

Every registered mixer (and a mixed pattern) must decode step by step exactly as its full
forward, and a batch of prompts of different lengths must generate what each prompt generates
alone. Mixers registered later are picked up automatically (each mixer's `tiny()` options).
"""

import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import decode
from attn_jax.layers import Linear
from attn_jax.mixer import Mixer, register_mixer
from attn_jax.model import build_model, count_params, init_state
from attn_jax.model_config import ModelConfig, validate_model
from attn_jax.registry import available_mixers, get_mixer

TOL = 2e-5  # fp32, relative to the largest |logit|; fixed once
VOCAB = 61
# Small options per mixer for these tests (a mixer not listed runs with its defaults).
MIXED = ("attention", "sisa", "sliding_window:nomlp")


def _options(names):
  """(name, the mixer's test-sized options) for each mixer named (`Mixer.tiny`)."""
  return tuple((name, get_mixer(name).tiny()) for name in sorted(set(names)))


def set_tiny(model_config, names) -> None:
  """Write each named mixer's `tiny()` options into a ConfigDict's `model.<name>` sub-dict."""
  for name in set(names):
    model_config[name].update(dataclasses.asdict(get_mixer(name).tiny()))


def _cfg(pattern, n_layers=None, **kw) -> ModelConfig:
  pattern = tuple(pattern)
  names = [p.split(":")[0] for p in pattern]
  base = dict(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48, max_seq_len=64,
              dtype="float32", pattern=pattern, n_layers=n_layers or len(pattern),
              options=_options(names))
  base.update(kw)
  cfg = ModelConfig(**base)
  validate_model(cfg)
  return cfg


def _model(cfg, seed=0, std=0.3):
  """Parameters drawn by numpy (faster than compiling threefry per shape), large enough that
  every mixer's contribution is visible in the logits."""
  model = build_model(cfg, seed=seed)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(seed)

  def fill(path, a):
    name = jax.tree_util.keystr(path)
    if "scale" in name or "lambda_raw" in name or "bias" in name:
      return a  # norms, lambda, decay biases keep their initialisation
    return jnp.asarray(rng.standard_normal(a.shape) * std, a.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def _close(a, b, tol=TOL):
  """max|a - b| <= tol * max|b| (chex, with the tolerance scaled by the reference's size)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  chex.assert_trees_all_close(a, b, atol=tol * float(np.max(np.abs(b))), rtol=0.0)


@nnx.jit
def _full(model, tokens):
  return model(tokens)


@nnx.jit
def _step(model, tokens, positions, state):
  return model.step(tokens, positions_BT=positions, state=state)


def _decode(model, tokens, first: int, capacity: int = 16):
  """Logits of prefilling tokens[:, :first] in one call, then stepping one token at a time."""
  B, T = tokens.shape
  state = model.init_state(B, capacity)
  pos = jnp.broadcast_to(jnp.arange(first, dtype=jnp.int32), (B, first))
  out, state = _step(model, tokens[:, :first], pos, state)
  outs = [out]
  for t in range(first, T):
    logits, state = _step(model, tokens[:, t:t + 1], jnp.full((B, 1), t, jnp.int32), state)
    outs.append(logits)
  return jnp.concatenate(outs, axis=1)


def _patterns():
  names = [n for n in available_mixers() if not n.startswith("_")]
  return [(n,) for n in names] + [MIXED]


@pytest.mark.parametrize("pattern", _patterns(), ids=lambda p: "+".join(p))
def test_step_by_step_and_chunks_equal_the_full_forward(pattern):
  cfg = _cfg(pattern, n_layers=2 * len(pattern))
  model = _model(cfg)
  B, T = 2, 11
  tokens = _tokens(1, (B, T))
  full = _full(model, tokens)
  _close(_decode(model, tokens, 1), full)                  # token by token
  # a 6-token prefill chunk (5 for bounded mixers' max_chunk) then steps
  _close(_decode(model, tokens, min(6, decode.mixer_limits(cfg, 16)[0] or 6)), full)


@pytest.mark.parametrize("pattern", _patterns(), ids=lambda p: "+".join(p))
def test_ragged_batch_generates_what_each_prompt_generates_alone(pattern):
  cfg = _cfg(pattern, n_layers=len(pattern))
  model = _model(cfg, seed=2)
  lengths = [7, 3, 5]
  T, n_new = max(lengths), 6
  prompts = [_tokens(10 + i, (1, n)) for i, n in enumerate(lengths)]
  batch = jnp.concatenate([jnp.pad(p, ((0, 0), (0, T - p.shape[1])), constant_values=9)
                           for p in prompts])
  out = np.asarray(decode.generate(model, batch, lengths=lengths, max_new_tokens=n_new))
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    alone = np.asarray(decode.generate(model, p, max_new_tokens=n_new))[0]
    np.testing.assert_array_equal(out[i, :n + n_new], alone, err_msg=f"row {i}")
    assert np.all(out[i, n + n_new:] == 0)


def test_mixed_pattern_structure_counts_and_flops():
  cfg = _cfg(MIXED, n_layers=6)
  counts = count_params(cfg)
  kinds = counts["by_kind"]
  assert set(kinds) == {"attention", "sisa", "sliding_window:nomlp"}
  assert {k: v["layers"] for k, v in kinds.items()} == {
      "attention": 2, "sisa": 2, "sliding_window:nomlp": 2}
  assert kinds["sliding_window:nomlp"]["mlp"] == 0 and kinds["attention"]["mlp"] == 2 * 3 * 32 * 48
  assert counts["mixer"] + counts["mlp"] + sum(v["norms"] for v in kinds.values()) + 32 \
      == counts["non_embedding"]
  state = init_state(cfg, 2, 16)
  assert len(state) == 6 and state[0].k.shape == (2, 4, 16, 8)   # per layer: [B, K, S, D]
  assert state[2].k.shape == (2, 4, 4, 8)                        # the ring: the window
  assert state[5].k.shape == (2, 4, 4, 8) and state[3].k is not state[0].k   # own buffers
  from attn_jax.train import flops
  n = count_params(cfg)
  per_layer = {s.mixer: get_mixer(s.mixer).flops_per_token(cfg, cfg.options_for(s.mixer), 64)
               for s in cfg.period}
  assert flops.forward_flops_per_token(cfg, n, 64) == pytest.approx(
      2.0 * (n["non_embedding"] + 32 * VOCAB) + 2 * sum(per_layer.values()))
  assert per_layer["sliding_window"] < per_layer["attention"] < per_layer["sisa"]


# The SSM runs compile the chunked scan forward and backward, the costliest compiles: slow.
TRAINED = [MIXED] + [pytest.param(p, marks=pytest.mark.slow) for p in (
    ("mamba2:nomlp",), ("mamba3:nomlp",), ("hybrid_heads",), ("attention", "mamba2:nomlp"),
    ("sinkhorn",))]


@pytest.mark.parametrize("pattern", TRAINED, ids=lambda p: "+".join(p) if isinstance(p, tuple)
                         else None)
def test_trains_on_the_quickstart_data_with_falling_loss(tmp_path, pattern):
  from configs import quickstart
  from attn_jax.train.trainer import train_and_evaluate
  c = quickstart.get_config()
  c.model.update(mixer="attention", pattern=pattern, n_layers=len(pattern) * (2 if len(
      pattern) < 3 else 1))
  c.model.sliding_window.window = 16
  c.model.sisa.d_state = 8
  for name in ("mamba2", "mamba3", "hybrid_heads"):
    c.model[name].update(d_state=16, head_dim=16, chunk_size=16)
  c.model.sinkhorn.update(block_size=16, sortnet_width=32, sort_dim=8)
  c.data.global_batch_size = 16
  c.train.update(steps=60, log_every=10, progress_bar=False)
  c.optim.warmup_steps = 10
  c.checkpoint.every_steps = 60
  c.eval.every_steps = 0
  train_and_evaluate(c, str(tmp_path))
  from attn_jax.train.metrics import read_metrics
  losses = [r["loss"] for r in read_metrics(str(tmp_path)) if "loss" in r]
  assert losses[-1] < losses[0] - 0.5, losses


# ---------------------------------------------------------------- bounded states

def test_sliding_window_generates_past_its_capacity_in_constant_memory():
  """A 1-layer window-4 model generates 4x past its ring (16 slots of work in 4): constant state
  shapes, and each logit equals a fresh forward over just the last `window` tokens."""
  cfg = _cfg(("sliding_window:nomlp",), n_layers=1)
  w = cfg.options_for("sliding_window").window
  model = _model(cfg, seed=3)
  B, n = 2, 4 * w + 3
  tokens = _tokens(4, (B, n))
  state = model.init_state(B, capacity=2)   # capacity is irrelevant to a ring
  shapes = jax.tree.map(lambda a: a.shape, state)
  full = _full(model, tokens)
  for t in range(n):
    logits, state = _step(model, tokens[:, t:t + 1], jnp.full((B, 1), t, jnp.int32), state)
    assert jax.tree.map(lambda a: a.shape, state) == shapes
    fresh = _full(model, tokens[:, max(0, t - w + 1):t + 1])[:, -1]
    _close(logits[:, 0], fresh)
    _close(logits[:, 0], full[:, t])
  # generate() knows the ring is bounded: 4x past any cache length
  out = decode.generate(model, tokens[:, :3], max_new_tokens=4 * w, cache_len=2)
  assert out.shape == (B, 3 + 4 * w)


def test_prefill_longer_than_a_ring_goes_in_chunks():
  cfg = _cfg(("attention", "sliding_window"), n_layers=2)
  model = _model(cfg, seed=5)
  tokens = _tokens(6, (2, 13))                     # 13 > window 4: chunks of 4
  last, _ = nnx.jit(lambda m, t: decode.prefill(m, t, capacity=16))(model, tokens)
  _close(last, _full(model, tokens)[:, -1])


# ---------------------------------------------------------------- compile time flat in depth

def test_program_size_is_flat_in_depth():
  """The train step of 12 and 24 layers of a 2-kind pattern lowers to programs of nearly the
  same size: the period is scanned, never unrolled (compile time: experiments/bench_compile.py)."""
  from configs import quickstart
  from attn_jax.train.setup import build_setup
  sizes = {}
  for n_layers in (12, 24):
    c = quickstart.get_config()
    c.model.update(pattern=("attention", "sliding_window"), n_layers=n_layers)
    c.mesh.shape = (1, 1, 1)
    setup = build_setup(c, devices=jax.devices()[:1])
    batch = {k: jax.ShapeDtypeStruct((1, 4, 64), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "weights")}
    sizes[n_layers] = len(setup.step_fn.lower(setup.abstract_state, batch).as_text())
  assert abs(sizes[24] - sizes[12]) / sizes[12] < 0.02, sizes


# ---------------------------------------------------------------- RNG and mode

@register_mixer("_test_noise")
class _NoiseMixer(Mixer):
  """Identity projection plus uniform noise in training: shows where the rng comes from."""

  def __init__(self, cfg, opts, *, rngs):
    self.lin = Linear((cfg.d_model,), (cfg.d_model,), in_axes=("embed",), out_axes=("embed",),
                      rngs=rngs, dtype=jnp.float32)

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del segment_ids_BT   # token-wise: nothing crosses a document boundary
    y = self.lin(x_BTD)
    if train and rng is not None:
      y = y + jax.random.uniform(rng, y.shape)
    return y, state, {}

  @classmethod
  def flops_per_token(cls, cfg, opts, seq_len):
    return 0.0


def test_mixers_get_a_per_layer_rng_and_the_train_flag():
  cfg = _cfg(("_test_noise",), n_layers=2)
  model = _model(cfg)
  tokens = _tokens(7, (1, 5))
  f = nnx.jit(lambda m, t, k, train: m(t, rng=k, train=train), static_argnums=3)
  k0, k1 = jax.random.key(0), jax.random.key(1)
  chex.assert_trees_all_equal(f(model, tokens, k0, True), f(model, tokens, k0, True))
  assert not np.allclose(f(model, tokens, k0, True), f(model, tokens, k1, True))
  chex.assert_trees_all_equal(f(model, tokens, k0, False), f(model, tokens, None, False))
  assert not np.allclose(f(model, tokens, k0, True), f(model, tokens, None, False))


def test_train_step_noise_is_a_function_of_the_step():
  """Same state, same batch: the same step number gives the same loss; another step number
  gives other noise (so a resumed run redraws exactly what it would have drawn)."""
  from configs import quickstart
  from attn_jax.train.setup import build_setup
  c = quickstart.get_config()
  c.model.update(mixer="_test_noise", pattern=(), n_layers=2)
  c.mesh.shape = (1, 1, 1)
  setup = build_setup(c, devices=jax.devices()[:1])
  state = setup.init_fn()
  batch = {"inputs": _tokens(8, (1, 4, 64)) % 32, "targets": _tokens(9, (1, 4, 64)) % 32,
           "weights": jnp.ones((1, 4, 64), jnp.float32)}
  copy = lambda s: jax.tree.map(jnp.array, s)
  _, m_a = setup.step_fn(copy(state), batch)
  _, m_b = setup.step_fn(copy(state), batch)
  later = dict(copy(state), step=jnp.asarray(5, jnp.int32))
  _, m_c = setup.step_fn(later, batch)
  assert float(m_a["loss"]) == float(m_b["loss"])
  assert float(m_a["loss"]) != float(m_c["loss"])


# ---------------------------------------------------------------- optimizer metadata

def test_sisa_lambda_gets_a_tenth_of_the_lr_and_no_decay_through_metadata():
  """End to end through the trainer's optimizer: with unit gradients Adam's first update is
  -lr * 1 per entry (bias-corrected m / sqrt(v) = 1), so lambda_raw moves by exactly 0.1 lr,
  a norm scale (1-D, no decay) by lr, and a matrix by lr (1 + wd * p)."""
  from configs import quickstart
  from attn_jax.train.setup import build_setup
  c = quickstart.get_config()
  c.model.update(mixer="sisa", pattern=())
  c.optim.update(warmup_steps=0, lr=1e-2, weight_decay=0.1, clip_norm=0.0, eps=1e-12)
  c.mesh.shape = (1, 1, 1)
  setup = build_setup(c, devices=jax.devices()[:1])
  state = setup.init_fn()
  params = state["params"]
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = setup.tx.update(grads, state["opt_state"], params)
  lr = float(setup.lr_schedule(0))
  mixer_u = updates["blocks"]["layers"][0]["mixer"]
  mixer_p = params["blocks"]["layers"][0]["mixer"]
  np.testing.assert_allclose(mixer_u["lambda_raw"], -0.1 * lr, rtol=1e-5)
  np.testing.assert_allclose(updates["final_norm"]["scale"], -lr, rtol=1e-5)
  w = mixer_p["proj"]["q"]["kernel"]
  np.testing.assert_allclose(mixer_u["proj"]["q"]["kernel"], -lr * (1 + 0.1 * w), rtol=1e-4)


def test_mixer_options_are_validated_with_the_field_name():
  from configs import base
  c = base.get_config()
  c.model.sliding_window.window = 0
  c.model.mixer = "sliding_window"
  with pytest.raises(ValueError, match=r"config\.model\.sliding_window\.window: must be"):
    ModelConfig.from_config(c.model)
  c = base.get_config()
  c.model.sisa.bogus = 1
  with pytest.raises(ValueError, match=r"config\.model\.sisa\.bogus: unknown option"):
    ModelConfig.from_config(c.model)
  c = base.get_config()
  c.model.update(pattern=("attention", "sisa"), n_layers=3)
  with pytest.raises(ValueError, match=r"config\.model\.n_layers: .*multiple of the pattern"):
    ModelConfig.from_config(c.model)
  c.model.update(pattern=("attention:mlp",), n_layers=4)
  with pytest.raises(ValueError, match=r"config\.model\.pattern: bad layer spec"):
    ModelConfig.from_config(c.model)


# ---------------------------------------------------------------- layering

def _module_imports(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """{module: the package's modules it imports at module level} (imports inside functions are
  the deliberate lazy ones and do not make a cycle at import time)."""
  import ast
  files = {}
  for path in (root / package).rglob("*.py"):
    parts = path.relative_to(root).with_suffix("").parts
    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {}
  for mod, path in files.items():
    deps = set()
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        # `from pkg import submodule` needs the submodule, `from pkg import name` the package
        subs = [f"{node.module}.{a.name}" for a in node.names]
        names = [n for n in subs if n in files] or [node.module]
      else:
        continue
      deps |= {n for n in names if n in files and n != mod}
    graph[mod] = deps
  return graph


def test_no_import_cycles():
  graph = _module_imports(pathlib.Path(__file__).resolve().parents[1], "attn_jax")
  assert len(graph) > 50
  done, stack = set(), []

  def visit(mod):
    if mod in stack:
      raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(mod):] + [mod]))
    if mod in done:
      return
    stack.append(mod)
    for dep in sorted(graph[mod]):
      visit(dep)
    stack.pop()
    done.add(mod)

  for mod in sorted(graph):
    visit(mod)


def test_inference_loading_restores_parameters_only(tmp_path):
  from configs import quickstart
  from attn_jax.train.checkpoint import load_for_inference
  from attn_jax.train.trainer import train_and_evaluate
  c = quickstart.get_config()
  c.train.update(steps=3, progress_bar=False)
  c.checkpoint.every_steps = 3
  c.eval.every_steps = 0
  train_and_evaluate(c, str(tmp_path))
  model, config, step = load_for_inference(str(tmp_path))
  assert step == 3 and config.model.d_model == 64
  assert not [p for p, _ in nnx.to_flat_state(nnx.state(model)) if "opt" in str(p)]
  tokens = _tokens(3, (2, 8)) % 32
  chex.assert_tree_all_finite(model(tokens))


# ---------------------------------------------------------------- the KV cache, jit and no jit

class KVStateTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_rows_advance_independently_and_padding_is_never_written(self):
    from attn_jax.attention import cache as cache_lib
    st = cache_lib.init_cache(cache_lib.LINEAR, 2, 4, 1, 2, 2, jnp.float32)
    k = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 1, 2)
    pos = jnp.asarray([[0, 1, 2], [0, -1, -1]], jnp.int32)     # row 1: one token + padding
    write = self.variant(lambda st, k, pos: st.write(k, k, pos))
    st = write(st, k, pos)
    chex.assert_trees_all_equal(st.ptr, jnp.asarray([3, 1], jnp.int32))
    chex.assert_trees_all_equal(st.pos, jnp.asarray([[0, 1, 2, -1], [0, -1, -1, -1]]))
    chex.assert_trees_all_equal(st.k[1, :, 1:], jnp.zeros((1, 3, 2)))   # head-major [B, K, S, D]
    chex.assert_trees_all_equal(st.k[0, 0, :3], k[0, :, 0])
    # a ring wraps: row 0's next two tokens go to slots 3 and 0
    st = write(st.replace(policy=cache_lib.Ring(4)), k[:, :2],
               jnp.asarray([[3, 4], [1, 2]], jnp.int32))
    chex.assert_trees_all_equal(st.pos[0], jnp.asarray([4, 1, 2, 3], jnp.int32))
    chex.assert_trees_all_equal(st.pos[1], jnp.asarray([0, 1, 2, -1], jnp.int32))


def test_build_setup_reads_the_model_config_once(monkeypatch):
  """`build_setup` makes the typed model config once (`config.validate`) and hands it on: the
  mesh rules and the parameter count take it (and the abstract model) instead of building
  their own."""
  from configs import quickstart
  from attn_jax.model_config import ModelConfig
  from attn_jax.train.setup import build_setup
  calls = []
  made = ModelConfig.from_config.__func__

  def counted(cls, model_config):
    calls.append(1)
    return made(cls, model_config)

  monkeypatch.setattr(ModelConfig, "from_config", classmethod(counted))
  c = quickstart.get_config()
  c.mesh.shape = (1, 1, 1)
  setup = build_setup(c, devices=jax.devices()[:1])
  assert len(calls) == 1 and setup.n_params["total"] > 0
