"""Per-variant configs of the study and parameter matching.

`config.study.variants` is a tuple of `(name, match_field, overrides[, setting])`:
  * `setting`: what the variant declares about its configuration (layout, block sizes,
    initialisation, ...) and the source it follows (paper, reference code); shown in the
    report next to its parameter count;
  * `overrides`: `((dotted path under config, value), ...)`, applied to a copy of the study's
    config, e.g. `(("model.mixer", "sisa"), ("model.sisa.d_state", 8))`;
  * `match_field`: what is adjusted so that the variant's total parameter count (tied
    embeddings once, vocabulary padding excluded: `attn_jax.model.count_params`) matches the
    baseline's (`config.study.baseline`, matched to nothing):
      ""                       no matching (the baseline itself);
      "model.d_ff"             the SwiGLU width, in steps of `config.study.d_ff_multiple`;
      "model.<mixer>.expand"   an SSM's expansion, in whole heads: expand = k * head_dim / d_model;
      "model.<mixer>.d_state"  an SSM's state size, in steps of 2 (Mamba-3 rotates pairs);
      "a,b"                    a first (coarse, e.g. expand), then b (fine, e.g. d_state): a
                               whole SSM head is several percent of a small model.

Each knob acts on an integer k (d_ff = k * multiple; k SSM heads; d_state = 2 k) on which the parameter count
is affine: each SwiGLU unit costs 3 d per MLP layer; each SSM head adds head_dim rows to every
projection into and out of d_inner plus its per-head scalars; each state unit adds a row to the
B and C projections (and their conv/norm channels). So two counts give the slope; the
solution is rounded and it and its two neighbours are counted (abstract shapes, nothing is
allocated) to take the closest. The relative difference is reported next to every count and
checked against `config.study.param_tolerance`.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_collections

from attn_jax.model import count_params


def variant_names(config: ml_collections.ConfigDict) -> list[str]:
  """The variants to run: `config.study.only` (comma-separated or a tuple; empty = all), in
  the order of `config.study.variants`, the baseline always first."""
  names = [v[0] for v in config.study.variants]
  if len(set(names)) != len(names):
    raise ValueError(f"config.study.variants: duplicate names in {names}")
  base = config.study.baseline
  if base not in names:
    raise ValueError(f"config.study.baseline: {base!r} is not one of the variants {names}")
  only = config.study.only
  only = [s.strip() for s in (only.split(",") if isinstance(only, str) else only) if s.strip()]
  unknown = sorted(set(only) - set(names))
  if unknown:
    raise ValueError(f"config.study.only: unknown variants {unknown}; known: {names}")
  chosen = [n for n in names if not only or n in only or n == base]
  return [base] + [n for n in chosen if n != base]


def _spec(config, name):
  """(match_field, overrides, setting) of the named variant."""
  for v in config.study.variants:
    if v[0] == name:
      if len(v) not in (3, 4):
        raise ValueError(f"config.study.variants[{name}]: want (name, match_field, overrides"
                         f"[, setting]), got {len(v)} entries")
      return v[1], v[2], (v[3] if len(v) == 4 else "")
  raise ValueError(f"config.study.variants: no variant named {name!r}")


def set_override(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """config.<path> = value in place (a list becomes a tuple); a path the config lacks is a
  clear error naming `config.study.variants`."""
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  if leaf not in node:
    raise ValueError(f"config.study.variants: override {path!r}: config.{path} does not exist")
  node[leaf] = tuple(value) if isinstance(value, list) else value


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(config.to_dict())
  for path, value in overrides:
    set_override(c, path, value)
  return c


def _knob(c: ml_collections.ConfigDict, field: str):
  """(value of the knob at integer k, current k) for a match field."""
  m = c.model
  if field == "model.d_ff":
    mult = int(c.study.d_ff_multiple)
    return (lambda k: int(k) * mult), max(1, round(m.d_ff / mult))
  parts = field.split(".")
  if len(parts) == 3 and parts[0] == "model" and parts[2] == "expand":
    opts = m[parts[1]]
    head_dim = int(opts.head_dim)
    return (lambda k: int(k) * head_dim / m.d_model), max(1, round(opts.expand * m.d_model
                                                                  / head_dim))
  if len(parts) == 3 and parts[0] == "model" and parts[2] == "d_state":
    return (lambda k: 2 * int(k)), max(1, m[parts[1]].d_state // 2)
  raise ValueError(f"config.study.variants: match field {field!r}: use '', 'model.d_ff', "
                   "'model.<mixer>.expand' or 'model.<mixer>.d_state' (or two of them, "
                   "comma-separated: coarse, then fine)")


def total_params(config: ml_collections.ConfigDict) -> int:
  return int(count_params(config.model)["total"])


def match_params(config: ml_collections.ConfigDict, field: str, target: int) -> tuple[Any, int]:
  """(knob value, total parameters) of the knob setting whose count is closest to `target`."""
  value_at, k0 = _knob(config, field)

  @functools.lru_cache(maxsize=None)
  def count(k: int) -> int:
    c = ml_collections.ConfigDict(config.to_dict())
    set_override(c, field, value_at(k))
    return total_params(c)

  k1 = k0 + 1
  slope = count(k1) - count(k0)
  if slope <= 0:
    raise ValueError(f"match field {field}: the parameter count does not grow with it")
  k_star = max(1, round(k0 + (target - count(k0)) / slope))
  best = min((k for k in (k_star - 1, k_star, k_star + 1) if k >= 1),
             key=lambda k: (abs(count(k) - target), k))
  return value_at(best), count(best)


def variant_config(config: ml_collections.ConfigDict, name: str, *, seed: int | None = None,
                   target: int | None = None) -> tuple[ml_collections.ConfigDict, dict]:
  """The variant's full config (overrides applied, parameters matched to `target`, default
  the baseline's count) and {params, target, diff_pct, match_field, match_value}."""
  field, overrides, setting = _spec(config, name)
  c = apply_overrides(config, overrides)
  if seed is not None:
    c.seed = int(seed)
  if target is None:
    base_name = config.study.baseline
    target = total_params(variant_config(config, base_name)[0]) if name != base_name else None
  info = {"match_field": field, "match_value": None, "setting": setting}
  if field and target is not None:
    values = []
    for f in field.split(","):   # coarse knob first, then the fine one
      value, n = match_params(c, f.strip(), target)
      set_override(c, f.strip(), value)
      values.append(value)
    info["match_value"] = values[0] if len(values) == 1 else ", ".join(map(str, values))
  else:
    n = total_params(c)
  target = n if target is None else target
  info.update(params=n, target=target, diff_pct=100.0 * (n - target) / target)
  return c, info


def all_variant_configs(config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{name: (config, info)} for `variant_names(config)`, matched to the baseline's count;
  raises when a variant misses `config.study.param_tolerance` (a fraction)."""
  names = variant_names(config)
  base_cfg, base_info = variant_config(config, names[0])
  out = {names[0]: (base_cfg, base_info)}
  tol = 100.0 * float(config.study.param_tolerance)
  for name in names[1:]:
    c, info = variant_config(config, name, target=base_info["params"])
    if abs(info["diff_pct"]) > tol:
      raise ValueError(f"config.study.variants[{name}]: {info['params']:,} parameters is "
                       f"{info['diff_pct']:+.2f}% from the baseline's {base_info['params']:,}, "
                       f"outside config.study.param_tolerance={config.study.param_tolerance}")
    out[name] = (c, info)
  return out
