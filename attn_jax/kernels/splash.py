"""TPU splash attention (the Pallas kernel shipped with JAX) as a core of `entry.attend`:
per-device calls, document ids, and a `shard_map` over the mesh the program is traced for.

Per device (`local_attention`): `jax.experimental.pallas.ops.tpu.splash_attention`'s MQA
kernel, vmapped over the batch and the kv heads (the G query heads of a kv head are its heads),
with a block-sparse causal mask (the upper triangle's blocks are skipped; with a sliding
window of w tokens, the kernel's local mask: key j visible to query i iff i - (w - 1) <= j <= i,
so only the blocks that meet the band are visited and memory and work are O(T w)), the sink
logit as
the kernel's native per-head `sinks`, and V narrower than Q/K taken as it is (the kernel has a
head dim of its own for V). Scores are q.k * scale with the scale folded into q.

Document ids (`segment_ids`): the kernel's `SegmentIds(q, kv)` shows key j to query i iff
q_ids[i] == kv_ids[j] (AND its causal mask). That expresses "same document" exactly, and
padding too: a token at position -1 gets PAD_SEGMENT on both sides, so no real query sees a
padding key (a padding query sees padding keys; `entry.attend` zeroes its output, as every
other path returns zeros for a query that sees no key). It cannot express the shared prefix
of `masks.segment_mask`, "same document OR segment 0": that relation is not an equality of
per-token labels (queries of documents 1 and 2 both see a segment-0 key, but not each other's
keys), and the kernel's static mask is ANDed with the ids, never ORed. So a call whose keys
may hold `SHARED_SEGMENT` keeps the XLA fallback (`entry.attend(shared_prefix=True)`, what the
decoder's sink tokens with packed rows need); every other packed call takes the kernel. Index
order is the causal order, so the caller must promise one stream (`prefix_causal`: valid
positions increase along the row, padding -1).

Sharding (`sharded`): Mosaic kernels are not partitioned by XLA ("Mosaic kernels cannot be
automatically partitioned. Please wrap the call in a shard_map"), so the kernel runs under
`jax.shard_map` over the mesh of the active rules (`sharding.use_rules`, which the trainer,
evaluator and decoder enter while tracing), with the specs the same logical rules give the
rest of the model (`sharding.activation_spec`): rows over the `batch` rule's axes, query heads
over the `heads` rule's and kv heads over the `kv_heads` rule's. Query head h reads kv head
h // G, so heads are split only when both rules name the same mesh axes and both head counts
divide them (then a device's query heads read exactly its kv heads); otherwise heads are
replicated (each device computes all heads of its rows). A dimension that does not divide its
axes is replicated, as `constrain` does. Outside `use_rules` (eager use, one device) the kernel
is called directly.

Off TPU (`kernel_choice.pallas_interpret("tpu")`: tests on CPU) the same kernel runs in the Pallas
interpreter: slow, but the kernel's own code, so its numerics and the shard_map specs are
tested without a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from attn_jax import kernel_choice, sharding

BLOCK = 128                     # the kernel's default block: T must be a multiple
PAD_SEGMENT = int(np.iinfo(np.int32).min)   # document id of padding (position -1) tokens


def segment_ids(q_positions, kv_positions, q_segments, kv_segments):
  """(q ids, kv ids) [B, T] int32 for the kernel's `SegmentIds`, or (None, None) when every
  key is visible to every causal query. Documents keep their ids; padding (position < 0) gets
  PAD_SEGMENT (module docstring). The caller guarantees no SHARED_SEGMENT key."""
  if q_segments is None and q_positions is None and kv_positions is None:
    return None, None

  def ids(seg, pos, like):
    out = jnp.zeros(like.shape, jnp.int32) if seg is None else seg.astype(jnp.int32)
    return out if pos is None else jnp.where(pos >= 0, out, PAD_SEGMENT)

  like_q = q_positions if q_segments is None else q_segments
  like_kv = kv_positions if kv_segments is None else kv_segments
  if like_q is None:
    like_q = like_kv
  if like_kv is None:
    like_kv = like_q
  return ids(q_segments, q_positions, like_q), ids(kv_segments, kv_positions, like_kv)


def _kernel(T: int, G: int, interpret: bool, window: int | None = None):
  """The MQA kernel for T x T causal attention of G query heads per kv head (`window`: keys
  i - window < j <= i only, in index order). Made in the trace that uses it (its block tables
  become that trace's constants; a kernel cached across traces would carry one trace's values
  into another)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  if window is None or window >= T:
    one = sa.CausalMask((T, T))
  else:   # left reach w - 1, right reach 0: the causal band of w keys, the query included
    one = sa.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
  mask = sa.MultiHeadMask([one] * G)
  return sa.make_splash_mqa_single_device(mask=mask, interpret=interpret)


def local_attention(q, k, v, sink_H=None, q_ids=None, kv_ids=None, *, scale: float,
                    window: int | None = None):
  """One device's splash call: q [B, T, H, D], k [B, T, K, D], v [B, T, K, E], sinks [H],
  ids [B, T] -> [B, T, H, E] in q's dtype (module docstring; `window`: `_kernel`)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  B, T, H, D = q.shape
  K = k.shape[2]
  G = H // K
  kernel = _kernel(T, G, kernel_choice.pallas_interpret("tpu"), window)
  q5 = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)   # [B, K, T, .]
  seg = None if q_ids is None else sa.SegmentIds(q_ids, kv_ids)
  sinks = None if sink_H is None else sink_H.astype(jnp.float32).reshape(K, G)

  def one(qq, kk, vv, ss, sg):   # one row, one kv head: [G, T, D], [T, D], [T, E]
    return kernel(qq, kk, vv, segment_ids=sg, sinks=ss)

  per_head = jax.vmap(one, in_axes=(0, 0, 0, 0, None))
  o = jax.vmap(per_head, in_axes=(0, 0, 0, None, 0))(q5, kt, vt, sinks, seg)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def shard_specs(q_shape, kv_shape, mesh, rules):
  """(q and output spec, k / v spec, sinks spec, ids spec) of the shard_map from the logical
  rules (module docstring: heads split only where query and kv heads split alike)."""
  qs = sharding.activation_spec(("batch", None, "heads", None), q_shape, mesh, rules)
  ks = sharding.activation_spec(("batch", None, "kv_heads", None), kv_shape, mesh, rules)
  heads = qs[2] if qs[2] == ks[2] else None
  return (P(qs[0], None, heads, None), P(ks[0], None, heads, None), P(heads), P(qs[0], None))


def sharded(fn, q, k, v, sink_H=None, q_ids=None, kv_ids=None):
  """fn(q, k, v, sink_H, q_ids, kv_ids) -> [B, T, H, E], run per device under `shard_map`
  over the active mesh with `shard_specs` (module docstring); a plain call outside
  `use_rules`. `fn` sees each device's rows and heads; absent (None) arguments stay None."""
  active = sharding.active()
  if active is None:
    return fn(q, k, v, sink_H, q_ids, kv_ids)
  mesh, rules = active
  q_spec, kv_spec, sink_spec, id_spec = shard_specs(q.shape, k.shape, mesh, rules)
  args = (q, k, v, sink_H, q_ids, kv_ids)
  specs = (q_spec, kv_spec, kv_spec, sink_spec, id_spec, id_spec)
  present = [i for i, a in enumerate(args) if a is not None]

  def body(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return fn(*full)

  return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[i] for i in present),
                       out_specs=q_spec, check_vma=False)(*(args[i] for i in present))


def splash_attention(q, k, v, *, scale: float, sink_H=None, q_ids=None, kv_ids=None,
                     window: int | None = None):
  """Causal splash attention of one stream per row, sharded over the active mesh: [B, T, H, E]
  in q's dtype. ids: `segment_ids` (None: every earlier key visible). `window`: only the keys
  i - window < j <= i (index order: the caller's positions are the indices)."""
  return sharded(functools.partial(local_attention, scale=scale, window=window), q, k, v,
                 sink_H, q_ids, kv_ids)


def splash_problem(*, causal: bool, T: int, S: int, bias, window, one_stream: bool,
                   segmented: bool, shared_prefix: bool, positioned: bool = False) -> str | None:
  """Why the splash kernel cannot take a call (None: it can). `one_stream`: the plain causal
  call, or positions / segments with `prefix_causal` (index order is the causal order).
  `positioned`: the call gives positions. The kernel's window is a band of indices, which is
  the band of positions only where positions are the indices; `prefix_causal` promises
  increasing positions, not consecutive ones, so a window with positions stays off."""
  if not causal or T != S:
    return "splash runs causal self-attention only (T == S)"
  if T % BLOCK:
    return f"splash needs T a multiple of {BLOCK}, got {T}"
  if bias is not None:
    return "splash takes no score bias"
  if window is not None and positioned:
    return ("splash's window is a band of indices: with positions given (not promised "
            "consecutive) the window stays off the kernel")
  if not one_stream:
    return "positions without prefix_causal: the causal order is not the index order"
  if segmented and shared_prefix:
    return ("segment ids with a possible shared prefix (segment 0, visible to every document): "
            "not expressible as splash's SegmentIds (pass shared_prefix=False when the row has "
            "none)")
  return None
