"""What the SSD writes to memory between kernels, read from programs compiled for an H100
(compile-only, `attn_jax.targets`): no fp32 [B, chunks, H, P, N] (chunk states, their
cotangents) or [B, chunks, H, Q, Q] (the intra-chunk matrix) array is the output of any
instruction of the compiled program (fusions, custom calls, copies: what XLA writes), in the
fused kernels' SSD alone and in Mamba-2's and Mamba-3's train steps.

The check is by shape (`chunk_arrays`): an f32 array whose dims hold B, the chunk count, H and
(P, N) or (Q, Q), in any order and beside any others (a layer axis, split heads). The shapes are
chosen so that nothing else has them: B 2, T 2048 in chunks of 64 (32 chunks), 8 heads,
P = N = Q = 64. The detector is checked on the XLA SSD (`ssd.ssd_chunked`), which writes its
chunk states and intra-chunk matrices in fp32.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import sharding as shd, targets
from attn_jax.kernels import ssd_chunks
from attn_jax.ssm import ssd

B, T, H, P, N, Q = 2, 2048, 8, 64, 64, 64
NC = T // Q
_DEF_RE = re.compile(r"^\s+(?:ROOT )?%([\w.-]+) = (.*)$")
_F32_RE = re.compile(r"\bf32\[([\d,]+)\]")
_OP_RE = re.compile(r"\s([a-z][a-z0-9-]*)\(")


def chunk_arrays(text: str, b=B, nc=NC, h=H, pn=(P, N), qq=(Q, Q)) -> list[str]:
  """'f32[dims] opcode' of every instruction of an HLO text whose result (or a tuple element of
  it) is an fp32 array with the dims {b, nc, h} and pn or qq among its own."""
  wants = [collections.Counter((b, nc, h) + pn), collections.Counter((b, nc, h) + qq)]
  out = []
  for line in text.splitlines():
    m = _DEF_RE.match(line)
    if not m:
      continue
    rhs = m.group(2)
    op = _OP_RE.search(rhs)
    result = rhs[:op.start()] if op else rhs
    for dims in _F32_RE.findall(result):
      have = collections.Counter(int(d) for d in dims.split(","))
      if any(all(have[k] >= n for k, n in w.items()) for w in wants):
        out.append(f"f32[{dims}] {op.group(1) if op else '?'}")
  return out


def _need_h100():
  if not targets.available("h100x1"):
    pytest.skip("no compiler plugin for h100x1 (pip install -e '.[targets]')")


def _compiled(fn, args):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
  mesh = Mesh(np.array(targets.devices("h100x1")[:1]), ("x",))
  with shd.use_rules(mesh, {}), targets.no_persistent_cache():
    f = jax.jit(fn, in_shardings=NamedSharding(mesh, Ps()))
    return f.lower(*args).compile().as_text()


def _ssd_grad(impl):
  """fwd + bwd of one SSD call (bf16 x, B, C, bf16 dots, packed documents, an initial state)."""
  sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  args = (sds((B, T, H, P), bf), sds((B, T, H), jnp.float32), sds((B, T, 1, N), bf),
          sds((B, T, 1, N), bf), sds((B, H, P, N), jnp.float32), sds((B, T), jnp.bool_))

  def loss(x, a, b, c, h0, reset):
    y, h = impl(x, a, b, c, chunk=Q, h0_BHPN=h0, reset_BT=reset, dot_dtype=bf)
    return jnp.sum(y ** 2) + jnp.sum(h)
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args


def test_the_detector_finds_the_xla_ssds_fp32_chunk_arrays():
  _need_h100()
  found = chunk_arrays(_compiled(*_ssd_grad(ssd.ssd_chunked)))
  assert any(f"f32[{B},{NC},1,{H},{P},{N}]" in f or f"f32[{B},{NC},{H},{P},{N}]" in f
             for f in found), found


def test_the_kernels_write_no_fp32_chunk_arrays():
  """fwd + bwd through the kernels: states and state cotangents in bf16, no [.., Q, Q]."""
  _need_h100()
  text = _compiled(*_ssd_grad(ssd_chunks.ssd_kernel))
  assert "ssd_dchunk" in text and "ssd_states" in text
  assert chunk_arrays(text) == []
  assert f"bf16[{B},{H},{NC},{P},{N}]" in text      # the states entering each chunk


def _train_step_text(mixer: str) -> str:
  from configs import quickstart
  from attn_jax.train import setup as setup_lib
  c = quickstart.get_config()
  c.model.update(d_model=256, n_heads=4, d_ff=512, n_layers=2, pattern=(f"{mixer}:nomlp",),
                 max_seq_len=T, dtype="bfloat16", vocab_size=256)
  c.model[mixer].update(d_state=N, head_dim=P, expand=2.0, chunk_size=Q)     # 8 heads
  c.data.update(seq_len=T, global_batch_size=B)
  c.train.grad_accum = 1
  c.mesh.shape = (1, 1, 1)
  with targets.no_persistent_cache():
    setup = setup_lib.build_setup(c, devices=targets.devices("h100x1")[:1])
    batch = setup_lib.abstract_batch(setup, 1, B, T)
    return setup_lib.compile_step(setup, batch).as_text()


@pytest.mark.parametrize("mixer", ["mamba2", "mamba3"])
def test_train_step_writes_no_fp32_chunk_arrays(mixer):
  """Two layers at d_model 256 (8 heads of 64, d_state 64, chunks of 64), T 2048, batch 2: the
  train step (forward, rematerialised forward, backward) through the kernels, and no
  instruction of it writes an fp32 chunk-state or intra-chunk array (50-75 s each: slow)."""
  _need_h100()
  text = _train_step_text(mixer)
  assert "ssd_dchunk" in text
  assert chunk_arrays(text) == []
