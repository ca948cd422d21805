"""Name -> token-mixer class. Adding a variant = one new module that registers itself + a config.

Every module under `attn_jax/attention/` and `attn_jax/ssm/` is imported on the first lookup
(`pkgutil` over the two packages), so `@register_mixer("name")` on the class is all a new
variant needs: there is no hand-written list.

The contract a mixer meets (its signature, class hooks and their defaults) is one base class,
`attn_jax.mixer.Mixer`; `register_mixer` (defined there, beside the contract, so that a mixer
module imports nothing above it) refuses a class that does not subclass it. The decoder,
trainer, decoding and evaluator use a mixer only through that interface and never branch on a
mixer's name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from attn_jax.mixer import REGISTERED

_PACKAGES = ("attn_jax.attention", "attn_jax.ssm")
_discovered = False


def _discover() -> None:
  """Import every module of the mixer packages once (importing registers them)."""
  global _discovered
  if _discovered:
    return
  _discovered = True
  for pkg_name in _PACKAGES:
    pkg = importlib.import_module(pkg_name)
    for info in pkgutil.iter_modules(pkg.__path__):
      importlib.import_module(f"{pkg_name}.{info.name}")


def get_mixer(name: str) -> type:
  _discover()
  if name not in REGISTERED:
    raise ValueError(f"unknown mixer {name!r}; registered mixers: "
                     f"{', '.join(sorted(REGISTERED))}")
  return REGISTERED[name]


def available_mixers(include_private: bool = False) -> list[str]:
  """Registered names; names starting with "_" (test doubles) only with `include_private`."""
  _discover()
  return sorted(n for n in REGISTERED if include_private or not n.startswith("_"))


def default_options(name: str) -> dict:
  """The mixer's option defaults as a plain dict (`config.default_config` builds its sub-dicts
  from it)."""
  return {f.name: getattr(get_mixer(name).Options(), f.name)
          for f in dataclasses.fields(get_mixer(name).Options)}


def axis_rules(names) -> dict:
  """The logical-axis rules the named mixers declare (`Mixer.axis_rules`), merged; two mixers
  giving one axis different mesh axes is an error naming both."""
  out, owner = {}, {}
  for name in sorted(set(names)):
    for axis, mesh_axes in get_mixer(name).axis_rules:
      if axis in out and out[axis] != mesh_axes:
        raise ValueError(f"logical axis {axis!r}: mixer {name!r} maps it to {mesh_axes!r}, "
                         f"mixer {owner[axis]!r} to {out[axis]!r}")
      out[axis], owner[axis] = mesh_axes, name
  return out
