"""Resuming a run: the newest usable checkpoint restored, and a changed config either refused
(the model's arrays differ: an error naming the config fields that changed, nothing moved) or
allowed and said (e.g. more steps; a changed learning-rate schedule gets its own warning)."""

from __future__ import annotations

import logging

from attn_jax import jsonio
from attn_jax.config import RunConfig, is_default
from attn_jax.run_layout import RunLayout
from attn_jax.train.checkpoint import Checkpointer, CheckpointMismatchError


def config_changes(saved: dict, now: dict) -> list[str]:
  """"field: saved -> now" for every config field that differs (JSON forms of two configs). A
  field the saved config lacks (declared in attn_jax/config.py since it was saved) is not a
  change while `now` holds its default: the run was made with that value."""
  a, b = jsonio.flatten(saved, "."), jsonio.flatten(now, ".")
  return [f"config.{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}"
          for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)
          and not (k not in a and k in b and is_default(k, b[k]))]


_SCHEDULE_FIELDS = ("config.train.steps", "config.optim.lr", "config.optim.warmup_steps",
                    "config.optim.min_lr_ratio")


def restore(ckpt: Checkpointer, setup, data_it, config: RunConfig):
  """The latest usable checkpoint (or None); a state that does not match this config's model is
  an error naming the differing arrays and config fields, with every checkpoint left as it was.
  On any error the checkpointer is closed before it propagates (no orbax work left at exit)."""
  try:
    return _restore_or_explain(ckpt, setup, data_it, config)
  except BaseException:
    try:
      ckpt.close()
    except Exception as e:  # the restore error is the one that matters
      logging.error("closing the checkpointer after a failed restore: %s", e)
    raise


def _restore_or_explain(ckpt: Checkpointer, setup, data_it, config):
  try:
    return ckpt.restore(setup.abstract_state, data_it)
  except CheckpointMismatchError as e:
    raise _explained(ckpt, e, config) from None


def _explained(ckpt: Checkpointer, e: CheckpointMismatchError, config: RunConfig
               ) -> BaseException:
  """`e` with the config fields that differ from the checkpoint's saved config named."""
  try:
    saved = ckpt.restore_meta(e.step).get("config", {})
    changes = config_changes(saved, config.to_json())
  except Exception:  # the saved config is unreadable: the arrays alone must do
    changes = []
  if not changes:
    return e
  return CheckpointMismatchError(
      f"checkpoint step {e.step} in {ckpt.directory} was saved with another config: "
      f"{', '.join(changes[:8])}. Nothing was moved or changed: resume with the saved config, "
      f"or use another --workdir for the new one. Stored vs requested arrays: "
      f"{'; '.join(e.differences)}", step=e.step, differences=e.differences)


def check_resumable(workdir: str, setup, config: RunConfig) -> None:
  """Before anything is compiled: the newest checkpoint's stored arrays (orbax's metadata, no
  array read) against the state this config builds; CheckpointMismatchError naming the changed
  config fields. A step whose metadata cannot be read is left to the restore, which judges
  corruption. Opened read-only: nothing is cleaned or moved here."""
  if not RunLayout.of(workdir).checkpoints.is_dir():
    return
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    step = ckpt.latest_step()
    if step is not None:
      ckpt.check_matches(step, setup.abstract_state)
  except CheckpointMismatchError as e:
    raise _explained(ckpt, e, config) from None
  finally:
    ckpt.close()


def warn_config_changes(saved: dict, now: dict, step: int) -> None:
  """Resuming with a changed config is allowed (e.g. more steps) but never silent."""
  changes = config_changes(saved, now) if saved else []
  if not changes:
    return
  logging.warning("resuming at step %d with a config that differs from the checkpoint's: %s",
                  step, "; ".join(changes[:12]))
  if any(c.split(":")[0] in _SCHEDULE_FIELDS for c in changes):
    logging.warning("the learning-rate schedule (warm-up + cosine over config.train.steps) "
                    "changed with it: from step %d on the run follows the new schedule, not "
                    "the one it started with", step)
