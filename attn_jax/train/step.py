"""The functional train step: loss, gradient accumulation, optimizer update, metrics.

`TrainState` is a plain dict of arrays (pure-dict params, optimizer state, step, rng) so that
jit shardings, donation and orbax checkpoints all see one simple pytree:

    {"params": {...}, "rest": {...non-trainable state...}, "opt_state": ..., "step": int32,
     "rng": key}

The model graph (`graphdef`) is split once; the step merges it with the params inside jit.

Non-finite guard: every step checks that the loss, every gradient entry and every updated
parameter are finite (`step_is_finite`, a few reductions fused into the step). If not, the
update is dropped on device: params and optimizer state come back unchanged (`jnp.where`, so
the program and its shardings are the same either way) while `step` still advances (the batch
was consumed, the data position and the schedule stay tied to the step). The metric
`nonfinite` (1.0/0.0) tells the trainer, which skips on or halts (`config.train.nonfinite`).
So a NaN/Inf never reaches the parameters, hence never a checkpoint. Checking the gradients
and the new parameters, not only the loss, matters: with a huge learning rate the loss of a
step can be finite while its gradient or its update is not.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attn_jax.train.loss import cross_entropy_from_hidden


def packing_kw(batch) -> dict:
  """The model's packed-row arguments of a batch: its `positions` and `segment_ids` when it
  has them (`data.document_mask`, data/documents.py), else none (one stream per row)."""
  if "segment_ids" not in batch:
    return {}
  return {"positions_BT": batch["positions"], "segment_ids_BT": batch["segment_ids"]}


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable:
  def loss_fn(params, rest, batch, total_weight, rng=None):
    model = nnx.merge(graphdef, params, rest)
    # Blockwise over sequence chunks (train/loss.py): no [B, T, V] fp32 logits ever exist.
    h, aux = model.hidden_and_aux(batch["inputs"], rng=rng, train=True, **packing_kw(batch))
    nll, w, hits = cross_entropy_from_hidden(h, model.unembed_matrix(), batch["targets"],
                                             batch["weights"])
    return nll / total_weight, (nll, w, hits, aux)
  return loss_fn


def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.bool_(True)]))


def step_is_finite(loss, grads, new_params) -> jax.Array:
  """bool scalar: loss, every gradient entry and every updated parameter are finite."""
  return jnp.isfinite(loss) & _all_finite(grads) & _all_finite(new_params)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    lr_schedule: Callable | None = None) -> Callable:
  """step(state, batch) -> (state, metrics). Batch arrays are [A, B, L] (A micro-batches);
  with `data.document_mask` the batch also holds `positions` and `segment_ids` (packed rows).

  The loss is the mean over *all* weighted tokens of the A micro-batches (not a mean of
  per-micro-batch means), so accumulation gives exactly the gradient of the big batch.

  Randomness (mixers' noise, dropout): micro-batch a of step s uses
  fold_in(fold_in(state["rng"], s), a) — a function of the step, so a resumed run draws the
  same noise as an uninterrupted one. `state["rng"]` itself never changes.

  A step whose loss, gradients or updated parameters are not all finite leaves params and
  optimizer state unchanged (see the module docstring); `metrics["nonfinite"]` is then 1.0.
  """
  loss_fn = make_loss_fn(graphdef)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    params, rest = state["params"], state["rest"]
    total_w = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
    n_micro = batch["inputs"].shape[0]
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])

    def micro(carry, mb_and_index):
      mb, a = mb_and_index
      g_acc, nll_acc, w_acc, hit_acc = carry
      (_, (nll, w, hits, aux)), g = grad_fn(params, rest, mb, total_w,
                                            jax.random.fold_in(step_key, a))
      g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
      return (g_acc, nll_acc + nll, w_acc + w, hit_acc + hits), aux

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (zeros, 0.0, 0.0, 0.0)
    if n_micro == 1:
      carry, aux = micro(init, (jax.tree.map(lambda a: a[0], batch), 0))
    else:
      carry, aux = jax.lax.scan(micro, init, (batch, jnp.arange(n_micro)))
      aux = jax.tree.map(lambda a: a[-1], aux)
    grads, nll, w, hits = carry
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    loss = nll / jnp.maximum(w, 1.0)
    ok = step_is_finite(loss, grads, new_params)
    keep = lambda new, old: jnp.where(ok, new, old)
    new_params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
    new_state = dict(state, params=new_params, opt_state=opt_state, step=state["step"] + 1)
    metrics = {
        "loss": loss,
        "nonfinite": 1.0 - ok.astype(jnp.float32),
        "accuracy": hits / jnp.maximum(w, 1.0),
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(params),
        "update_norm": optax.tree.norm(updates),
        "weighted_tokens": w,
    }
    if lr_schedule is not None:
      metrics["learning_rate"] = lr_schedule(state["step"])
    metrics["aux"] = aux   # per-layer monitoring from the mixers ({name: [n_layers]})
    return new_state, metrics

  return step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
  """eval(params, rest, batch [B, L]) -> (sum nll, sum weights, sum hits). Held-out windows
  of a `data.document_mask` run are packed the way training packs them (same segment ids)."""
  def eval_step(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    return cross_entropy_from_hidden(model.hidden(batch["inputs"], **packing_kw(batch)),
                                     model.unembed_matrix(), batch["targets"], batch["weights"])
  return eval_step
