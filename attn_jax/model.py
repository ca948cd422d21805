"""Decoder-only language model: embed -> layers -> norm -> head, with a layer *pattern*.

    block(x) = x + mixer(RMSNorm(x)) [+ SwiGLU(RMSNorm(.)) unless the spec says "nomlp"]

`cfg.period` is the repeating period of layer specs (e.g. ("attention",) — a homogeneous stack —
or ("mamba2:nomlp",) * 7 + ("attention",), Jamba-like). One `Period` module holds the P blocks
of a period; R = n_layers / P copies of it are created stacked (one leading `layers` axis on
every parameter, via `nnx.vmap`) and run with `jax.lax.scan` (MaxText's way with mixed layers),
so compile time depends on P, not on depth. `cfg.remat` picks the rematerialisation policy of
one period. Decoding unrolls the repeats instead (`step`: a few ops per layer, in-place state
updates; compile time grows with depth there).

Per-layer results: the decoding state is a tuple with one entry per layer, each in buffers of
its own (so a donated state is updated in place); monitors (aux) are a tuple over the period,
each stacked over the R repeats. Entry points return one type each:
`__call__` -> logits, `hidden` -> final-norm hidden states, `logits_and_aux`, `step` (decoding
with a state) -> (logits, state).

Sink tokens (`cfg.sink_tokens` = K > 0; docs/papers.md §3.3, a learnable sink token in
pre-training): K learned embedding rows are prepended to every sequence before the layers and
their outputs dropped after the final norm, so every entry point returns one output per real
token. They take stream positions 0..K-1 and real tokens shift to K, K+1, ... (RoPE is relative,
so the shift only matters for caches that keep the first tokens: a StreamingLLM cache,
`cache.SinksRing(n, W)`, keeps the sink tokens with n >= K). When decoding, a call whose row
contains stream position 0 (the start of that row's stream) carries the K sink tokens; in any
later call they are padding (position -1), so the state holds them exactly once. Decoding
states get K extra slots of capacity, and the longest stateful chunk shrinks by K.

Packed rows (`segment_ids_BT`, full forwards only; `layers.SHARED_SEGMENT`): several documents
share a row; every token carries its document id (from 1) and its position in its document
(restarting at 0), and every mixer makes the boundary exact — the outputs of a document equal
those of the document run alone in a row of its own (mixer.py). Sink tokens are the shared
prefix of every document (segment 0): each document reads them exactly as it would alone.

RNG: each layer gets `fold_in(fold_in(rng, repeat), index in period)`, so the noise of a layer
depends only on the caller's key (the train step derives it from the step: the same step gets
the same noise after a resume).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attn_jax.layers import SHARED_SEGMENT, Linear, RMSNorm, SwiGLU, dtype_of, param
from attn_jax.model_config import LayerSpec, ModelConfig, validate_model
from attn_jax.registry import get_mixer
from attn_jax.sharding import constrain, pad_vocab

# The residual stream's logical axes: activation sharding constraints (a no-op outside
# `sharding.use_rules`, which the trainer enters when it compiles) keep XLA from choosing
# layouts that all-gather the batch.
RESIDUAL_AXES = ("batch", None, "embed")

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    norm = lambda: RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt)
    self.mixer_norm = norm()
    self.mixer = get_mixer(spec.mixer)(cfg, cfg.options_for(spec.mixer), rngs=rngs)
    self.has_mlp = spec.mlp and cfg.d_ff > 0
    if self.has_mlp:
      self.mlp_norm = norm()
      self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, rngs=rngs, init_std=cfg.init_std,
                        out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers), dtype=dt,
                        param_dtype=pdt)

  def __call__(self, x_BTD, *, positions_BT, state, rng, train, segment_ids_BT=None):
    h, state, aux = self.mixer(self.mixer_norm(x_BTD), positions_BT=positions_BT,
                               segment_ids_BT=segment_ids_BT, state=state, rng=rng, train=train)
    x_BTD = x_BTD + h.astype(x_BTD.dtype)
    if self.has_mlp:
      x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD)).astype(x_BTD.dtype)
    return x_BTD, state, aux


class Period(nnx.Module):
  """The P blocks of one period of the layer pattern."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.layers = nnx.List([Block(cfg, spec, rngs=rngs) for spec in cfg.period])

  def __call__(self, x_BTD, *, positions_BT, states, rng, train, segment_ids_BT=None):
    new_states, auxes = [], []
    for p, blk in enumerate(self.layers):
      key = None if rng is None else jax.random.fold_in(rng, p)
      x_BTD, st, aux = blk(x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                           state=states[p], rng=key, train=train)
      new_states.append(st)
      auxes.append(aux)
    return x_BTD, tuple(new_states), tuple(auxes)


class Decoder(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    # The table is padded to a multiple of `vocab_multiple` rows (shardable over a tensor axis,
    # tensor-core friendly); padded rows are never looked up and their logits are sliced off.
    vp = padded_vocab(cfg)
    self.embed = param(rngs, nnx.initializers.normal(cfg.embed_std), (vp, cfg.d_model),
                       ("vocab", "embed"), pdt, kind="embedding")

    @nnx.split_rngs(splits=cfg.n_repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_periods(rngs):
      return Period(cfg, rngs=rngs)

    self.blocks = make_periods(rngs)
    if cfg.sink_tokens:
      self.sink_embed = param(rngs, nnx.initializers.normal(cfg.init_std),
                              (cfg.sink_tokens, cfg.d_model), (None, "embed"), pdt,
                              kind="learned_input")
    self.final_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt)
    if not cfg.tie_embeddings:
      self.head = param(rngs, nnx.initializers.normal(cfg.init_std),
                        (cfg.d_model, vp), ("embed", "vocab"), pdt, kind="embedding")

  # ------------------------------------------------------------------ the stack
  def _layers(self, x_BTD, positions_BT, segment_ids_BT, states, rng, train, layer_params=None):
    """Scan the R repeats of the period (decoding: `_decode_layers`)."""
    cfg = self.cfg
    if states is not None:
      return self._decode_layers(x_BTD, positions_BT, states, layer_params)
    graphdef, block_state = nnx.split(self.blocks)
    states = (None,) * len(cfg.period)

    def body(x, layer):
      params, layer_states, r = layer
      key = None if rng is None else jax.random.fold_in(rng, r)
      period = nnx.merge(graphdef, params)
      x, new_states, aux = period(x, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                                  states=layer_states, rng=key, train=train)
      return constrain(x, RESIDUAL_AXES), (new_states, aux)

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat],
                            prevent_cse=not cfg.scan_layers)
    xs = (block_state, states, jnp.arange(cfg.n_repeats, dtype=jnp.uint32))
    if cfg.scan_layers:
      return jax.lax.scan(body, x_BTD, xs)
    outs = []
    for r in range(cfg.n_repeats):
      x_BTD, out = body(x_BTD, jax.tree.map(lambda a: a[r], xs))
      outs.append(out)
    return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *outs)

  def _decode_layers(self, x_BTD, positions_BT, states, layer_params=None):
    """The layers unrolled over per-layer states (`init_state`): each layer's state is a buffer
    of its own, so a donated state is updated in place (a scan over states stacked over the
    repeats slices each layer's state out and stacks it back: a copy of every cache per call).
    Repeat r reads `layer_params[r]` (default: its slice of the stacked parameters, which XLA
    copies every call; see `layer_params`)."""
    cfg, P = self.cfg, len(self.cfg.period)
    if len(states) != cfg.n_layers:
      raise ValueError(f"a decoding state holds one entry per layer ({cfg.n_layers}), got "
                       f"{len(states)}: make it with model.init_state")
    if layer_params is None:
      layer_params = self.layer_params()
    elif len(layer_params) != cfg.n_repeats:
      raise ValueError(f"layer_params holds one entry per repeat of the period "
                       f"({cfg.n_repeats}), got {len(layer_params)}: use model.layer_params()")
    graphdef = nnx.graphdef(self.blocks)
    new_states, auxes = [], []
    for r in range(cfg.n_repeats):
      period = nnx.merge(graphdef, layer_params[r])
      x_BTD, st, aux = period(x_BTD, positions_BT=positions_BT, states=states[r * P:(r + 1) * P],
                              rng=None, train=False)
      x_BTD = constrain(x_BTD, RESIDUAL_AXES)
      new_states.extend(st)
      auxes.append(aux)
    return x_BTD, (tuple(new_states), jax.tree.map(lambda *a: jnp.stack(a), *auxes))

  def _forward(self, tokens_BT, positions_BT, states, rng, train, segment_ids_BT=None,
               layer_params=None):
    """-> (final-norm hidden [B, T, D], new states, aux)."""
    if segment_ids_BT is not None:
      check_packed(tokens_BT, positions_BT, segment_ids_BT, states)
    x = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype_of(self.cfg.dtype))
    n = self.cfg.sink_tokens
    if n:
      x, positions_BT = self._prepend_sinks(x, positions_BT)
      if segment_ids_BT is not None:  # the sink rows: the shared prefix of every document
        segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (n, 0)), constant_values=SHARED_SEGMENT)
    x = constrain(x, RESIDUAL_AXES)
    x, (new_states, aux) = self._layers(x, positions_BT, segment_ids_BT, states, rng, train,
                                        layer_params)
    return self.final_norm(x[:, n:]), new_states, aux

  def _prepend_sinks(self, x_BTD, positions_BT):
    """[sink rows ; x] and their positions (see the module docstring)."""
    n, B = self.cfg.sink_tokens, x_BTD.shape[0]
    sinks = jnp.broadcast_to(self.sink_embed[...].astype(x_BTD.dtype), (B, n, x_BTD.shape[-1]))
    x_BTD = jnp.concatenate([sinks, x_BTD], axis=1)
    if positions_BT is None:   # plain 0..T-1: stays plain (0..n+T-1)
      return x_BTD, None
    starts_B = jnp.any(positions_BT == 0, axis=1)
    sink_pos = jnp.where(starts_B[:, None], jnp.arange(n, dtype=jnp.int32)[None, :], -1)
    real_pos = jnp.where(positions_BT >= 0, positions_BT + n, -1).astype(jnp.int32)
    return x_BTD, jnp.concatenate([sink_pos, real_pos], axis=1)

  # ------------------------------------------------------------------ entry points
  def __call__(self, tokens_BT: jax.Array, *, positions_BT=None, segment_ids_BT=None, rng=None,
               train: bool = False) -> jax.Array:
    """tokens [B, T] -> logits [B, T, V] fp32 (a full causal forward). Packed rows: pass each
    token's position in its document and its document id (module docstring)."""
    return self.unembed(self.hidden(tokens_BT, positions_BT=positions_BT,
                                    segment_ids_BT=segment_ids_BT, rng=rng, train=train))

  def hidden(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, rng=None,
             train=False) -> jax.Array:
    """Final-norm hidden states [B, T, D] (the LM head is `unembed`)."""
    return self._forward(tokens_BT, positions_BT, None, rng, train, segment_ids_BT)[0]

  def hidden_and_aux(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, rng=None,
                     train=False):
    """(final-norm hidden [B, T, D], aux monitors: see `aux_metrics`)."""
    h, _, aux = self._forward(tokens_BT, positions_BT, None, rng, train, segment_ids_BT)
    return h, self.aux_metrics(aux)

  def logits_and_aux(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, rng=None,
                     train=False):
    h, aux = self.hidden_and_aux(tokens_BT, positions_BT=positions_BT,
                                 segment_ids_BT=segment_ids_BT, rng=rng, train=train)
    return self.unembed(h), aux

  def step(self, tokens_BT, *, positions_BT, state, layer_params=None) -> tuple[jax.Array, Any]:
    """Decoding: T new tokens per row at `positions_BT` (-1 = padding) continue the streams
    held in `state` (from `init_state`). -> (logits [B, T, V] fp32, new state).
    `layer_params`: `self.layer_params()` made once for many steps (see there)."""
    h, state = self.step_hidden(tokens_BT, positions_BT=positions_BT, state=state,
                                layer_params=layer_params)
    return self.unembed(h), state

  def step_hidden(self, tokens_BT, *, positions_BT, state, layer_params=None):
    h, state, _ = self._forward(tokens_BT, positions_BT, state, None, False,
                                layer_params=layer_params)
    return h, state

  def layer_params(self) -> tuple:
    """The blocks' parameters split by repeat of the period (a tuple of R states, repeat r =
    every stacked parameter's slice r), for decoding: a step reads each layer's weights once,
    and XLA materialises a slice of the stacked arrays every time a step takes one, inside a
    decoding loop too (most of a batch-1 step at bench.py's cpu_50m_fp32 shapes). Made once,
    before a loop (or outside `jit`: a copy of the block parameters) and passed to every
    `step`."""
    block_state = nnx.state(self.blocks)
    return tuple(jax.tree.map(lambda a: a[r], block_state) for r in range(self.cfg.n_repeats))

  def for_decoding(self) -> "Decoder":
    """This model with each weight matrix stored in the dtype its forward computes in: every
    `Linear` kernel in its layer's dtype, the embedding and LM head in `cfg.dtype`. A step of
    a bf16 model otherwise converts its fp32 matrices on every call (on a GPU: read 4 bytes,
    write 2, read 2 per weight, most of a small-batch decoding step's memory traffic); cast
    once here, it reads 2. Outputs are identical (the same casts, made earlier: a gather then
    a cast equals a cast then a gather). Parameters the forward reads in fp32 (norms, SSM
    decays, convolutions) stay as they are. Then every module with a `fuse_for_decoding`
    replaces the kernels that read one input by their concatenation (`layers.fused_param`:
    q/k/v, the SwiGLU's gate/up), so a one-token step launches one matmul per input instead
    of one per kernel; the copy's parameter tree differs from the original's there. For
    inference only (a copy; the original's parameters are what training updates). Idempotent:
    a copy made by this method comes back unchanged (`decode.generate` calls it on whatever
    model it is given)."""
    graphdef, state = nnx.split(self)
    target = {path + ("kernel",): m.dtype for path, m in nnx.iter_graph(self)
              if isinstance(m, Linear)}
    target[("embed",)] = target[("head",)] = dtype_of(self.cfg.dtype)
    flat = nnx.to_flat_state(state)
    cast = []
    for path, var in flat:
      dt = target.get(tuple(path))
      if dt is not None and jnp.dtype(dt).itemsize < var[...].dtype.itemsize:
        var = var.replace(var[...].astype(dt))
      cast.append((path, var))
    copy = nnx.merge(graphdef, nnx.from_flat_state(cast))
    for _, m in list(nnx.iter_graph(copy)):
      if isinstance(m, nnx.Module) and hasattr(m, "fuse_for_decoding"):
        m.fuse_for_decoding()
    return copy

  def unembed_matrix(self) -> jax.Array:
    """The LM head as [D, V] (the embedding transposed when tied; padding rows dropped)."""
    w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
    return w[:, :self.cfg.vocab_size]

  def unembed(self, h: jax.Array) -> jax.Array:
    """Final hidden states [..., D] -> fp32 logits [..., V] (the LM head). The table is read as
    it is stored (the embedding [V', D] when tied, else the head [D, V']) and the padded
    vocabulary is sliced off the logits: `unembed_matrix` would materialise a transposed,
    sliced copy of the table per call, most of a batch-1 decoding step at 50K tokens."""
    if self.cfg.tie_embeddings:
      spec, table = "...d,vd->...v", self.embed[...]
    else:
      spec, table = "...d,dv->...v", self.head[...]
    z = jnp.einsum(spec, h, table.astype(h.dtype), preferred_element_type=jnp.float32)
    return z[..., :self.cfg.vocab_size]

  # ------------------------------------------------------------------ per-layer facts
  def init_state(self, batch: int, capacity: int, policy=None) -> tuple:
    """Decoding state: a tuple with one entry per layer (module `init_state`).
    `policy`: the KV-cache policy (`attention/cache.py`; None = linear), an inference-time
    choice: the same model decodes under any."""
    return init_state(self.cfg, batch, capacity, policy)

  def aux_metrics(self, aux: tuple) -> dict:
    """Monitors keyed by layer kind: {name: [R]} for a period of one, else
    {"<p>.<mixer>": {name: [R]}} (p = index in the period)."""
    period = self.cfg.period
    if len(period) == 1:
      return dict(aux[0])
    return {f"{p}.{spec.mixer}": dict(a) for p, (spec, a) in enumerate(zip(period, aux)) if a}


def check_packed(tokens_BT, positions_BT, segment_ids_BT, states) -> None:
  """Shape/usage checks of a packed-row call (a clear error instead of one from inside a mixer)."""
  if states is not None:
    raise ValueError("segment_ids_BT is for full forwards of packed rows; decoding states hold "
                     "one stream per row")
  for name, a in (("positions_BT", positions_BT), ("segment_ids_BT", segment_ids_BT)):
    if a is None or tuple(a.shape) != tuple(tokens_BT.shape):
      got = None if a is None else tuple(a.shape)
      raise ValueError(f"packed rows need {name} of the tokens' shape {tuple(tokens_BT.shape)} "
                       f"(got {got}): positions restart at 0 in every document")


def padded_vocab(cfg: ModelConfig) -> int:
  return pad_vocab(cfg.vocab_size, cfg.vocab_multiple)


def init_state(cfg: ModelConfig, batch: int, capacity: int, policy=None) -> tuple:
  """One entry per layer (layer i = repeat i // P, entry i % P of the period), each made by its
  mixer and held in buffers of its own (`Decoder._decode_layers`)."""
  capacity = capacity + cfg.sink_tokens   # the sink tokens occupy the first slots
  out = []
  for i in range(cfg.n_layers):
    spec = cfg.period[i % len(cfg.period)]
    cls = get_mixer(spec.mixer)
    out.append(cls.init_state(cfg, cfg.options_for(spec.mixer), batch, capacity,
                              dtype_of(cfg.dtype), policy=policy))
  return tuple(out)


def mixer_limits(cfg: ModelConfig, capacity: int, policy=None,
                 fresh: bool = False) -> tuple[int | None, int | None]:
  """(longest chunk one stateful call takes, longest stream the states hold) over all layer
  kinds under the cache `policy`; None = unbounded. `fresh`: the chunk of the first call into
  fresh states (`Mixer.max_fresh_chunk`)."""
  chunk = stream = None
  for spec in cfg.period:
    cls, opts = get_mixer(spec.mixer), cfg.options_for(spec.mixer)
    limit = cls.max_fresh_chunk if fresh else cls.max_chunk
    c = limit(cfg, opts, capacity, policy=policy)
    s = cls.stream_limit(cfg, opts, capacity, policy=policy)
    chunk = c if chunk is None else (chunk if c is None else min(chunk, c))
    stream = s if stream is None else (stream if s is None else min(stream, s))
  if chunk is not None and cfg.sink_tokens:   # a call may carry the sink tokens too
    if chunk <= cfg.sink_tokens:
      raise ValueError(f"config.model.sink_tokens={cfg.sink_tokens} leaves no room in a "
                       f"decoding chunk of {chunk} tokens (raise the cache window)")
    chunk -= cfg.sink_tokens
  return chunk, stream


def build_model(cfg: ModelConfig | ml_collections.ConfigDict, *, seed: int = 0) -> Decoder:
  if isinstance(cfg, ml_collections.ConfigDict):
    cfg = ModelConfig.from_config(cfg)   # validates
  else:
    validate_model(cfg)
  return Decoder(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig | ml_collections.ConfigDict) -> Decoder:
  """The model with ShapeDtypeStruct leaves: no memory allocated."""
  return nnx.eval_shape(lambda: build_model(cfg))


def count_params(cfg: ModelConfig | ml_collections.ConfigDict,
                 model: Decoder | None = None) -> dict[str, Any]:
  """Parameter counts from abstract shapes (a 369M model is counted in seconds, no allocation).

  `total` counts every parameter once (tied embeddings once); `non_embedding` excludes the
  token embedding (and an untied head), the usual convention for FLOPs (6 N per token).
  Padding rows of the vocabulary (`vocab_multiple`) are not counted: they are never used.
  `mixer` and `mlp` sum over all layers; `by_kind` breaks the blocks down per layer kind
  ("<mixer>" or "<mixer>:nomlp"): {kind: {"layers", "mixer", "mlp", "norms"}}. `model`: the
  (abstract) model of `cfg` when the caller has built it.
  """
  if isinstance(cfg, ml_collections.ConfigDict):
    cfg = ModelConfig.from_config(cfg)
  model = abstract_model(cfg) if model is None else model
  sizes = {"/".join(str(k) for k in path): math.prod(v.shape)
           for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  pad = (padded_vocab(cfg) - cfg.vocab_size) * cfg.d_model
  for name in ("embed", "head"):
    if name in sizes:
      sizes[name] -= pad
  total = sum(sizes.values())
  emb = sum(n for p, n in sizes.items() if p in ("embed", "head"))
  by_kind: dict[str, dict[str, int]] = {}
  for p, spec in enumerate(cfg.period):
    kind = spec.mixer + ("" if spec.mlp else ":nomlp")
    row = by_kind.setdefault(kind, {"layers": 0, "mixer": 0, "mlp": 0, "norms": 0})
    row["layers"] += cfg.n_repeats
    prefix = f"blocks/layers/{p}/"
    for path, n in sizes.items():
      if path.startswith(prefix):
        part = path[len(prefix):].split("/")[0]
        row[{"mixer": "mixer", "mlp": "mlp"}.get(part, "norms")] += n
  return {"total": total, "embedding": emb, "non_embedding": total - emb,
          "mixer": sum(r["mixer"] for r in by_kind.values()),
          "mlp": sum(r["mlp"] for r in by_kind.values()), "by_kind": by_kind}
