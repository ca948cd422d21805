"""One decoding token per row: its RoPE, its cache write and its attention in one Pallas kernel.

    o, k_S, v_S, pos_S = decode_attend(qkv_BKJD, cos_BR, sin_BR, k_BKSD, v_BKSD, pos_BS,
                                       ptr_after_B, p_B, scale=...)

For a `cache.Linear` cache (head-major k [B, K, S, D], v [B, K, S, E], pos [B, S]) and one new
token per row at stream position p (-1 = padding: nothing written) going into slot `slot` =
the row's pointer before it (slot >= S: no room, nothing written), the kernel computes what
`cache.cached_attention` does on that path:

    q', k' = RoPE(q, p), RoPE(k, p)            (GPT-NeoX halves, fp32, rounded to the dtype)
    o      = softmax(scale * q' . [K_cache ; k'])  [V_cache ; v]
             over the cached slots j with 0 <= pos_j <= p, plus the new token itself
    k_S[slot], v_S[slot], pos_S[slot] = k', v, p

in one launch: a batch-1 step of the XLA path is a kernel for the k, v and pos writes each, one
for the scores and one for the softmax and the value product (a few us each on an H100 at
batch 1, whatever their size). The caches are aliased to the outputs
(`input_output_aliases`), so the write is in place and XLA copies nothing.

Layout: one program per (row, query head); the G = H / K query heads of a kv head read its
cache each (decoding is bound by reading the cache, and G is small), the first of them writes
the new key and value. The cached slots are visited in blocks of `block_s` (a power of two, the
last block masked) with an online softmax (running max m, sum l, fp32 accumulator), started from
the new token's own column, which every valid query sees: m = s_new, l = 1, acc = v. The slot
being written is excluded from the cached columns by index (a Linear cache's slot `ptr` holds
no token yet, so this changes nothing; it also keeps a program from reading a key another
program of the same kv head is writing). A padding query (p < 0) gets zeros, as the XLA path's
all-masked row does.

Against the XLA path: the same products in fp32, summed in another order, and the
probabilities are not rounded to the value dtype before the value product (the XLA path rounds
p to bf16 for a bf16 cache): bf16 results differ by a bf16 rounding, fp32 results by float
reassociation (tests/test_decode_attend.py). On a CPU the kernel runs in the Pallas interpreter
(tests only); `cache.cached_attention` takes it on a GPU (`kernel_choice.decode_kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attn_jax import kernel_choice

NEG_INF = -1e30
BLOCK_S = 64


def unsupported(n_heads: int, k_BKSD, v_BKSE, platform: str) -> str | None:
  """Why these shapes do not take the kernel (None: they do)."""
  if platform not in ("gpu", "cpu"):
    return f"no {platform} lowering (Triton only)"
  D, E = k_BKSD.shape[-1], v_BKSE.shape[-1]
  if D != E:
    return f"key width {D} != value width {E}"
  if D < 32 or D & (D - 1):
    return f"head_dim {D} is not a power of two >= 32 (Triton blocks of D / 2)"
  if n_heads % k_BKSD.shape[1]:
    return f"{n_heads} query heads are not a multiple of {k_BKSD.shape[1]} kv heads"
  if jnp.dtype(k_BKSD.dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"cache dtype {jnp.dtype(k_BKSD.dtype).name}"
  return None


def _rotated(ref, b, kh, j, c, s, dtype):
  """Halves (x1, x2) of ref[b, kh, j] after RoPE by (c, s), rounded to `dtype`, in fp32."""
  R = c.shape[0]
  x1 = ref[b, kh, j, pl.ds(0, R)].astype(jnp.float32)
  x2 = ref[b, kh, j, pl.ds(R, R)].astype(jnp.float32)
  r1 = (x1 * c - x2 * s).astype(dtype).astype(jnp.float32)
  r2 = (x2 * c + x1 * s).astype(dtype).astype(jnp.float32)
  return r1, r2


def _kernel(qkv_ref, cos_ref, sin_ref, ptr_ref, p_ref, kc_in, vc_in, pc_in,
            o_ref, kc_ref, vc_ref, pc_ref, *, scale, G, S, block_s):
  del kc_in, vc_in, pc_in   # aliased to kc_ref, vc_ref, pc_ref
  from jax.experimental.pallas import triton as pltriton
  load = pltriton.load
  b, h = pl.program_id(0), pl.program_id(1)
  kh, g = h // G, h % G
  R = cos_ref.shape[-1]
  c, s = cos_ref[b, :], sin_ref[b, :]
  p = p_ref[b]
  slot = jnp.where(p >= 0, ptr_ref[b] - 1, S)   # a Linear cache's token n in slot n
  q1, q2 = _rotated(qkv_ref, b, kh, g, c, s, qkv_ref.dtype)
  k1, k2 = _rotated(qkv_ref, b, kh, G, c, s, kc_ref.dtype)
  v_new = qkv_ref[b, kh, G + 1, :].astype(vc_ref.dtype)

  @pl.when((g == 0) & (slot < S))
  def _write():
    kc_ref[b, kh, pl.ds(slot, 1), pl.ds(0, R)] = k1.astype(kc_ref.dtype)[None, :]
    kc_ref[b, kh, pl.ds(slot, 1), pl.ds(R, R)] = k2.astype(kc_ref.dtype)[None, :]
    vc_ref[b, kh, pl.ds(slot, 1), :] = v_new[None, :]

    @pl.when(h == 0)
    def _write_pos():
      pc_ref[b, pl.ds(slot, 1)] = jnp.full((1,), p, pc_ref.dtype)

  s_new = (jnp.sum(q1 * k1) + jnp.sum(q2 * k2)) * scale

  def block(j, carry):
    m, l, acc = carry
    start = j * block_s
    idx = start + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)
    inb = idx < S
    pos = load(pc_ref.at[b, pl.ds(start, block_s)], mask=inb, other=-1)
    ok = inb & (pos >= 0) & (pos <= p) & (idx != slot)
    kk = lambda off: load(kc_ref.at[b, kh, pl.ds(start, block_s), pl.ds(off, R)],
                          mask=ok[:, None], other=0).astype(jnp.float32)
    sc = (jnp.sum(kk(0) * q1[None, :], axis=1) + jnp.sum(kk(R) * q2[None, :], axis=1)) * scale
    sc = jnp.where(ok, sc, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(sc))
    alpha = jnp.exp(m - m_new)
    e = jnp.where(ok, jnp.exp(sc - m_new), 0.0)
    vv = load(vc_ref.at[b, kh, pl.ds(start, block_s), :], mask=ok[:, None],
              other=0).astype(jnp.float32)
    return m_new, l * alpha + jnp.sum(e), acc * alpha + jnp.sum(e[:, None] * vv, axis=0)

  init = (s_new, jnp.float32(1.0), v_new.astype(jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, pl.cdiv(S, block_s), block, init)
  o_ref[b, h, :] = jnp.where(p >= 0, acc / l, 0.0).astype(o_ref.dtype)


def decode_attend(qkv_BKJD, cos_BR, sin_BR, k_BKSD, v_BKSD, pos_BS, ptr_after_B, p_B, *,
                  scale: float, block_s: int = BLOCK_S, interpret: bool | None = None):
  """-> (out [B, H, D] in qkv's dtype, k cache, v cache, pos) (module docstring).
  qkv [B, K, G + 2, D]: the new token's heads before RoPE, kv head j's G query heads, then its
  key, then its value (the decoding copy's fused projection lays them out so:
  `QKVProjection.fuse_for_decoding`); cos, sin [B, D/2] fp32: its RoPE angles (`rope_angles`);
  ptr [B]: each row's tokens written so far, the new one included (the pointer after the
  write: the caller advances it first, so XLA updates it in place and keeps no copy of the old
  one); p [B]: the token's stream position (-1: padding)."""
  B, K, J, D = qkv_BKJD.shape
  G, S = J - 2, k_BKSD.shape[2]
  if interpret is None:
    interpret = kernel_choice.pallas_interpret("gpu")
  block_s = min(block_s, pl.next_power_of_2(S))
  kernel = functools.partial(_kernel, scale=float(scale), G=G, S=S, block_s=block_s)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  ins = (qkv_BKJD, cos_BR.astype(jnp.float32), sin_BR.astype(jnp.float32),
         ptr_after_B.astype(jnp.int32), p_B.astype(jnp.int32), k_BKSD, v_BKSD, pos_BS)
  outs = (jax.ShapeDtypeStruct((B, K * G, D), qkv_BKJD.dtype),
          jax.ShapeDtypeStruct(k_BKSD.shape, k_BKSD.dtype),
          jax.ShapeDtypeStruct(v_BKSD.shape, v_BKSD.dtype),
          jax.ShapeDtypeStruct(pos_BS.shape, pos_BS.dtype))
  return pl.pallas_call(kernel, grid=(B, K * G), out_shape=outs, interpret=interpret,
                        input_output_aliases={5: 1, 6: 2, 7: 3}, compiler_params=params,
                        name="decode_attend")(*ins)
