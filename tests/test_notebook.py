"""notebooks/tour.ipynb runs from top to bottom in a fresh Jupyter kernel (this Python), and the
helpers it plots (attn_jax/eval/maps.py) equal explicit references.

The notebook is stored without outputs (checked here, so diffs stay readable); strip them after
editing it in Jupyter with `python tests/test_notebook.py --strip`.

The kernel runs with the environment of this process except the forced 8-device CPU platform of
conftest.py (a newcomer's machine has one device); it reuses the tests' persistent compilation
cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.attention import sisa as sisa_lib
from attn_jax.eval import maps
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig
from attn_jax.registry import available_mixers, get_mixer

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "tour.ipynb"
# Plots the notebook must produce, by the section whose code cell draws them.
FIGURE_CELLS = ("attention_maps(models[name]", "sink_logit = \"learned\"", "sisa_score_parts",
                "sinkhorn_sort_matrix", "mamba2_decay", "train_and_evaluate(config")


def strip_outputs(path: pathlib.Path = NOTEBOOK) -> None:
  import nbformat
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
    cell.metadata.pop("execution", None)
  nbformat.write(nb, path)


# ------------------------------------------------------------------ the notebook

def test_notebook_is_valid_and_stored_without_outputs():
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code
  for c in code:
    assert c.outputs == [] and c.execution_count is None, c.source[:80]


def _kernel_spec(tmp_path: pathlib.Path) -> str:
  """A kernelspec for this interpreter in a private JUPYTER_PATH (a user-wide "python3" spec
  may point at another Python)."""
  name = "attn_jax_test"
  spec = tmp_path / "jupyter" / "kernels" / name
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "attn_jax test", "language": "python"}))
  return name


def test_notebook_executes_and_draws_every_figure(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  pytest.importorskip("matplotlib")
  kernel = _kernel_spec(tmp_path)
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  monkeypatch.setenv("TMPDIR", str(tmp_path))          # the notebook's training workdir
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  monkeypatch.setenv("XLA_FLAGS", flags.strip())
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))

  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=600,
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()   # raises CellExecutionError (with the cell and traceback) on any error

  code = [c for c in nb.cells if c.cell_type == "code"]
  for c in code:
    errors = [o for o in c.outputs if o.output_type == "error"]
    assert not errors, c.source[:80]
  for marker in FIGURE_CELLS:
    cells = [c for c in code if marker in c.source]
    assert len(cells) == 1, marker
    pngs = [o for o in cells[0].outputs
            if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(pngs) == 1, f"the cell with {marker!r} drew {len(pngs)} figures"
  text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
  # Section 1 built and ran every registered mixer.
  for name in available_mixers():
    assert f"\n{name} " in text, name
  assert "held-out loss" in text


# ------------------------------------------------------------------ attn_jax/eval/maps.py

def _cfg(mixer, **kw) -> ModelConfig:
  base = dict(mixer=mixer, vocab_size=64, vocab_multiple=8, d_model=32, n_layers=2, n_heads=4,
              d_ff=64, max_seq_len=64, dtype="float32")
  return ModelConfig(**{**base, **kw})


def _tokens(T=24, B=2, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, 64)


def _mixer(name, T=24, scale=1.0, **options):
  """The registered mixer `name` built directly (no decoder) and a random input [2, T, 32]."""
  cfg = _cfg(name).with_options(name, **options)
  mixer = get_mixer(name)(cfg, cfg.options_for(name), rngs=nnx.Rngs(0))
  x = scale * jax.random.normal(jax.random.key(1), (2, T, cfg.d_model), jnp.float32)
  return cfg, mixer, x


def test_layer_inputs_follow_the_models_layers_in_depth_order():
  """Each returned input is RMSNorm of the residual stream before that layer (repeat r, layer p
  of the period), checked against the blocks applied one by one; that loop ends at the
  model's own hidden states (its scanned forward)."""
  cfg = _cfg("attention", pattern=("attention", "sliding_window:nomlp"), n_layers=4)
  cfg = cfg.with_options("sliding_window", window=4)
  model = build_model(cfg, seed=0)
  toks = _tokens()
  layers = maps.layer_inputs(model, toks)
  assert [(i, type(m).mixer_name) for i, m, _ in layers] == [
      (0, "attention"), (1, "sliding_window"), (2, "attention"), (3, "sliding_window")]
  graphdef, stacked = nnx.split(model.blocks)
  x = jnp.take(model.embed[...], toks, axis=0)
  for r in range(2):
    period = nnx.merge(graphdef, jax.tree.map(lambda a: a[r], stacked))
    for p, blk in enumerate(period.layers):
      chex.assert_trees_all_close(layers[2 * r + p][2], blk.mixer_norm(x), rtol=1e-5, atol=1e-6)
      x, _, _ = blk(x, positions_BT=None, state=None, rng=None, train=False)
  chex.assert_trees_all_close(model.final_norm(x), model.hidden(toks), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_phase,use_decay", [(True, True), (False, True), (True, False)])
def test_sisa_score_parts_add_up_to_the_reference_scores(use_phase, use_decay):
  """qk + importance == sisa_attention_reference's scores (which forms C^T R(Phi_j - Phi_i) B
  pairwise), on inputs where both terms matter (x of scale 10: B, C and the term comparable to
  q.k; angles of a few radians per token) and with a visible decay."""
  _, mixer, x = _mixer("sisa", scale=10.0, d_state=8, decay_bias_init=-1.0, phase_init_std=0.03,
                       use_phase=use_phase, use_decay=use_decay)
  parts = maps.sisa_score_parts(mixer, x)
  q, k, v, c, b, loga, theta, lam = mixer.features(x, None)
  g, phi = sisa_lib.decay_and_phase(loga, theta)
  _, ref = sisa_lib.sisa_attention_reference(q, k, v, c, b, g, phi, lam)
  mask = np.asarray(parts["mask"])
  total = np.asarray(parts["qk"] + parts["importance"])
  np.testing.assert_allclose(total[..., mask], np.asarray(ref)[..., mask], rtol=1e-5, atol=1e-5)
  imp = np.abs(np.asarray(parts["importance"])[..., mask])
  assert imp.max() > 0.1 * np.abs(np.asarray(parts["qk"])[..., mask]).max()
  np.testing.assert_allclose(parts["importance"],
                             parts["lam"][None, :, None, None] * parts["decay"] * parts["match"],
                             rtol=1e-6, atol=1e-7)
  dec = np.asarray(parts["decay"])
  assert np.all(dec[..., ~mask] == 0) and np.allclose(np.diagonal(dec, axis1=-2, axis2=-1), 1)
  if use_decay:   # e^{g_i - g_j} = prod_{j < t <= i} a_t: neighbours get a_i
    a = np.exp(np.asarray(loga)).transpose(0, 2, 1)                      # [B, H, T]
    np.testing.assert_allclose(np.diagonal(dec, offset=-1, axis1=-2, axis2=-1), a[..., 1:],
                               rtol=1e-5)
  else:
    assert np.all(dec[..., mask] == 1)


def test_sinkhorn_sort_matrix_is_the_mixers_balanced_plan():
  """Causal: strictly lower-triangular, rows of blocks with a past sum to 1, and the soft plan
  the mixer uses in training is this P. Non-causal: doubly stochastic after enough iterations;
  the hard permutation is a permutation matrix."""
  opts = dict(block_size=4, sortnet_width=16, sort_dim=8, n_iters=30)
  cfg, mixer, x = _mixer("sinkhorn", T=32, **opts)
  out = maps.sinkhorn_sort_matrix(mixer, x)
  P = np.asarray(out["P"])
  N = P.shape[-1]
  assert P.shape == (2, cfg.kv_heads, N, N) and N == 8
  assert np.all(np.triu(P) == 0) and out["hard"] is None
  np.testing.assert_allclose(P.sum(-1)[..., 1:], 1.0, rtol=1e-5)
  # the mixer's own training plan (no Gumbel noise without an rng) mixes by the same P
  pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
  _, aux = mixer.core(x, pos, None, True)
  chex.assert_trees_all_close(out["P"], aux["plan"].P, rtol=1e-6, atol=1e-7)

  _, mixer, x = _mixer("sinkhorn", T=32, causal=False, temperature=0.2, **opts)
  out = maps.sinkhorn_sort_matrix(mixer, x)
  np.testing.assert_allclose(out["row_sums"], 1.0, rtol=1e-5)
  np.testing.assert_allclose(out["col_sums"], 1.0, atol=1e-3)
  hard = np.asarray(out["hard"])
  assert set(np.unique(hard)) <= {0.0, 1.0}
  np.testing.assert_array_equal(hard.sum(-1), 1)
  np.testing.assert_array_equal(hard.sum(-2), 1)


@pytest.mark.parametrize("mixer_name", ["mamba2", "hybrid_heads"])
def test_mamba2_decay_matrix_reproduces_the_mixers_output(mixer_name):
  """y = W_out GatedNorm((M x + D x) * SiLU(z)) with M from mamba2_decay equals the mixer's
  output (the SSD computed by the chunked scan), for a Mamba-2 layer and the SSM branch of a
  head hybrid; L is the product of the per-token decays."""
  cfg, mixer, x = _mixer(mixer_name, d_state=8, head_dim=16, chunk_size=8, n_groups=2,
                         expand=2.0)
  out = maps.mamba2_decay(mixer, x)
  m = getattr(mixer, "ssm", mixer)
  xs = out["x"]
  y = jnp.einsum("bhij,bjhp->bihp", out["M"], xs) + m.D[...][:, None] * xs
  y = y * jax.nn.silu(m.conv_inputs(x)[4])
  B, T, H, P = y.shape
  yg = y.reshape(B, T, m.G, H // m.G, P)
  yg = yg / jnp.sqrt(jnp.mean(yg ** 2, axis=(-2, -1), keepdims=True) + cfg.norm_eps)
  y = yg.reshape(y.shape) * m.norm_scale[...]
  hs, _ = m.ssm_heads(x, positions_BT=jnp.broadcast_to(jnp.arange(T), (B, T)))
  chex.assert_trees_all_close(m.out(y), m.out(hs), rtol=1e-4, atol=1e-6)
  if mixer_name == "mamba2":    # ssm_heads is what the mixer's forward projects out
    chex.assert_trees_all_close(mixer(x, positions_BT=None)[0], m.out(hs), rtol=1e-6, atol=1e-7)
  decay = np.asarray(out["decay"])
  assert np.all((decay > 0) & (decay <= 1))
  L = np.asarray(out["L"])
  i, j = 9, 3
  np.testing.assert_allclose(L[:, :, i, j], np.prod(decay[:, j + 1:i + 1], axis=1), rtol=1e-5)
  assert np.all(L[..., ~np.asarray(out["mask"])] == 0)



@pytest.mark.parametrize("mimo_rank", [0, 2])
def test_mamba3_implicit_attention_reproduces_the_mixers_output(mimo_rank):
  """y = W_out(sum_o w^o ((M x + D x) * SiLU(z w^z))) with M from the hook equals the mixer's
  output (the chunked trapezoid; SISO: one output column, no weights); L is the product of
  the per-token decays."""
  cfg, m, x = _mixer("mamba3", d_state=8, head_dim=16, chunk_size=8, n_groups=2, expand=2.0,
                     dt_min=0.05, dt_max=0.5, mimo_rank=mimo_rank)
  out = maps.implicit_attention(m, x)
  M, xs, D, z = out["M"], out["x"], m.D[...], m.projected(x)["z"]
  if mimo_rank:
    Y = jnp.einsum("bhtjoi,bjhip->bthop", M, xs) + D[:, None, None] * xs
    y = jnp.sum(m.mimo_o[...] * Y * jax.nn.silu(z[..., None, :] * m.mimo_z[...]), axis=3)
  else:
    y = (jnp.einsum("bhtj,bjhp->bthp", M, xs) + D[:, None] * xs) * jax.nn.silu(z)
  chex.assert_trees_all_close(m.out(y), m(x, positions_BT=None)[0], rtol=1e-4, atol=1e-6)
  decay = np.asarray(out["decay"])
  assert np.all((decay > 0) & (decay < 1))
  L, mask = np.asarray(out["L"]), np.asarray(out["mask"])
  i, j = 9, 3
  np.testing.assert_allclose(L[:, :, i, j], np.prod(decay[:, j + 1:i + 1], axis=1), rtol=1e-5)
  assert np.all(L[..., ~mask] == 0) and np.all(np.asarray(M)[:, :, ~mask] == 0)


def test_mamba3_implicit_attention_through_maps_only():
  """maps.implicit_attention reads nothing but the hook (a stand-in mixer with only the hook)."""
  class HookOnly:
    def implicit_attention(self, x_BTD):
      return {"M": x_BTD}
  x = jnp.ones((1, 2, 3))
  assert maps.implicit_attention(HookOnly(), x)["M"] is x


if __name__ == "__main__":
  if sys.argv[1:] == ["--strip"]:
    strip_outputs()
  else:
    sys.exit("usage: python tests/test_notebook.py --strip   (removes the notebook's outputs)")
