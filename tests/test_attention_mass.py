"""eval/attention_mass.py: the attention maps it reports are the ones each layer applies (maps
times V, through the output projection, equal the mixer's own output), rows are causal
distributions over [keys ; sink column], and `run` writes the JSON table and the PNG."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.eval import attention_mass
from attn_jax.eval.maps import layer_inputs
from attn_jax.model import build_model
from configs import base


def _model(mixer, sink_logit):
  c = base.get_config()
  c.model.update(mixer=mixer, d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=64,
                 dtype="float32", max_seq_len=64, init_std=0.3)
  c.model[mixer].sink_logit = sink_logit
  if mixer == "sisa":
    c.model.sisa.d_state = 8
  if mixer == "sliding_window":
    c.model.sliding_window.window = 5
  return build_model(c.model, seed=0)


@pytest.mark.parametrize("mixer,sink", [("attention", "learned"), ("sisa", "softmax1"),
                                        ("sliding_window", "none")])
def test_maps_are_what_each_layer_applies(mixer, sink):
  model = _model(mixer, sink)
  if sink == "learned":   # stacked over the layers: [layers, H]
    sink_param = model.blocks.layers[0].mixer.sink_logit
    sink_param[...] = jnp.broadcast_to(jnp.asarray([-1.0, 0.0, 1.0, 2.0]), sink_param.shape)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  maps = attention_mass.attention_maps(model, toks)
  assert len(maps) == 2
  for (_, m, x), p in zip(layer_inputs(model, toks), maps):
    T = x.shape[1]
    np.testing.assert_allclose(np.asarray(p.sum(-1)), 1.0, atol=1e-5)
    assert float(jnp.max(jnp.triu(p[..., :T], k=1))) == 0.0          # causal
    if sink == "none":
      assert float(jnp.max(p[..., T])) == 0.0
    v = m.proj.v(x)                                                   # [B, T, K, D]
    v = jnp.repeat(v, m.cfg.n_heads // m.cfg.kv_heads, axis=2)
    want = m.proj.o(jnp.einsum("bhts,bshd->bthd", p[..., :T], v))
    got, _, _ = m(x, positions_BT=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * float(
        jnp.max(jnp.abs(want))))


def test_run_writes_the_table_and_the_heatmap(tmp_path):
  model = _model("attention", "learned")
  tokens = np.random.default_rng(1).integers(0, 64, 200)
  paths = attention_mass.run(model, tokens, str(tmp_path), n_seqs=2, seq_len=40, min_query=8)
  table = json.load(open(paths["mass_json"]))
  assert [layer["softmax"] for layer in table["layers"]] == [True, True]
  for layer in table["layers"]:
    assert 0.0 <= layer["mass_first"]["1"] <= layer["mass_first"]["4"] <= 1.0
    assert 0.0 < layer["mass_null"] < 1.0                 # the learned sink column
  assert open(paths["mass_png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="min_query"):
    attention_mass.run(model, tokens[:8], str(tmp_path), min_query=16)
