"""What experiments/bench.py benches: its options (one field per flag), the configs named on its
command line ("module", "module@chunked", "module@a.b=v,...", "module@window|streaming") with
the shared overrides applied, and a study's variants plus cache-policy rows.

The model is changed only through dotted config paths, read and applied as training's
`--config.<path>=<value>` overrides are (`attn_jax.config_flags.apply_overrides`: the field
must exist, the value is parsed as its type). The shared overrides, in order (a later one wins):
`--scale` (SCALES), `--preset` (its "set" in PRESETS), then `--set=a.b=v,...`; every config of
the run gets them, then its own "@a.b=v" suffix. --scale=tiny keeps the architecture family at
CPU size: d_model 256, 4 heads (d_h 64, as at 152M), 4 layers, vocab 4096, d_ff 1024 (4 d). An
override of model.d_model does not move model.d_ff: set both.

Parameter-matched twins are re-matched after the shared overrides: a config module named
"<mixer>_<size>" whose model.mixer is "sisa" or "fox" (sisa_152m, sisa_152m_sink, fox_50m, ...)
gets the same overrides applied to its Transformer, configs/transformer_<size>.py, and its
model.d_ff recomputed from it (SISA: `sisa.matched_d_ff` at its, possibly overridden, d_state;
FoX: `fox.matched_d_ff` of its gate's `extra_params`), as the twin's config module does. So
model.d_ff in the shared overrides is the Transformer's width, and the twins keep its
parameter count. A config's own "@a.b=v" suffix comes after this and is not re-matched.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

from attn_jax.attention import cache as cache_lib
from attn_jax.attention import fox, sisa
from attn_jax.config_flags import apply_overrides, split_overrides
from attn_jax.model_config import make_options
from attn_jax.study import matching

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Options:
  """The benchmark's settings; each field is the experiments/bench.py flag of that name (the
  flag's help says what it does), with the flag's default."""
  configs: tuple = ("transformer_152m", "sisa_152m")
  seq_lens: tuple = ("1024", "4096")
  batch_tokens: int = 8192
  steps: int = 5
  warmup: int = 2
  repeats: int = 1
  scale: str = "full"
  set: str = ""
  preset: str = ""
  decode_tokens: int = 128
  decode_batch: int = 4
  decode_step_batches: tuple = ("1", "32")
  decode_step_prompt: int = 128
  decode_steps: int = 32
  decode_only: bool = False
  peak_n: int = 0
  json: str = ""
  study: str = ""
  policy_mixers: tuple = ("transformer", "sisa_ds8")
  policy_window: int = 256
  document_mask: bool = False
  document_len: int = 0
  profile_top: int = 0
  profile_dir: str = ""

  def with_preset(self, given=()) -> "Options":
    """The preset's values for every field not in `given` (the flags set on the command line);
    its "set" overrides go before this run's `set` (which therefore wins)."""
    if not self.preset:
      return self
    preset = PRESETS[self.preset]
    values = {k: v for k, v in preset.items() if k not in given and k != "set"}
    joined = ",".join(filter(None, (preset.get("set", ""), self.set)))
    return dataclasses.replace(self, set=joined, **values)

  def overrides(self) -> list[str]:
    """The "a.b=v" overrides every config gets: the scale's, then `set`."""
    return split_overrides(SCALES[self.scale]) + split_overrides(self.set)


SCALES = {"full": "",
          "tiny": "model.d_model=256,model.n_heads=4,model.n_layers=4,model.vocab_size=4096,"
                  "model.d_ff=1024"}

# The 152M configs at the 50M Transformer's shapes (configs/transformer_50m.py), fp32.
PRESETS = {"cpu_50m_fp32": dict(configs=["transformer_152m", "sisa_152m", "sisa_152m@fast"],
                                seq_lens=["1024"], batch_tokens=4096,
                                set="model.d_model=512,model.n_heads=8,model.n_layers=6,"
                                    "model.vocab_size=50277,model.d_ff=2048,model.dtype=float32")}

ROW_POLICIES = ("window", "streaming")


def _twin_d_ff(model, reference) -> int:
  """The d_ff that gives a SISA / FoX model the parameter count of its Transformer."""
  if model.mixer == "sisa":
    return sisa.matched_d_ff(reference, model.sisa.d_state)
  opts = make_options("fox", model.fox.to_dict())
  kv_heads = reference.n_kv_heads or reference.n_heads
  return fox.matched_d_ff(reference, fox.extra_params(reference.d_model, reference.n_heads,
                                                      kv_heads, opts))


def _rematch(module: str, config, overrides: list[str]) -> None:
  """A twin's d_ff re-matched to its overridden Transformer (the module docstring's rule)."""
  mixer, _, size = module.partition("_")
  if mixer not in ("sisa", "fox") or config.model.mixer != mixer:
    return
  reference = _config_module(module, f"transformer_{size}").get_config()
  apply_overrides(reference, overrides)
  config.model.d_ff = _twin_d_ff(config.model, reference.model)


def _config_module(name: str, module: str):
  """configs/<module>.py, or a ValueError naming the config and the ones there are."""
  if not module.isidentifier() or importlib.util.find_spec(f"configs.{module}") is None:
    root = os.path.join(_ROOT, "configs")
    have = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py") and f[0] != "_")
    raise ValueError(f"--configs: unknown config {name!r}: there is no configs/{module}.py "
                     f"(configs: {', '.join(have)})")
  return importlib.import_module(f"configs.{module}")


def named_config(name: str, options: Options = Options()):
  """"module", "module@chunked" (SISA path, as before), "module@a.b=v,c.d=w" (any fields) or
  "module@window" / "module@streaming" (the same model, decoded under that cache policy:
  `row_policy`); `options`' shared overrides first (the module docstring)."""
  module, _, suffix = name.partition("@")
  config = _config_module(name, module).get_config()
  overrides = options.overrides()
  if overrides:
    apply_overrides(config, overrides)
    _rematch(module, config, overrides)
  for item in split_overrides(suffix):
    if "=" in item:
      apply_overrides(config, [item])
    elif item not in ROW_POLICIES:
      config.model.sisa.path = item
  return config


def study_configs(path: str, options: Options = Options()) -> dict:
  """{row name: config} for every study variant (parameters matched to the study's baseline,
  attn_jax.study.matching) plus cache-policy rows of `options.policy_mixers`."""
  import runpy

  study = runpy.run_path(path)["get_config"]()
  rows = {name: cfg for name, (cfg, _) in matching.all_variant_configs(study).items()}
  for name in options.policy_mixers:
    for policy in ROW_POLICIES:   # the same model; `row_policy` says how it decodes
      rows[f"{name}@{policy}"] = rows[name].copy_and_resolve_references()
  return rows


def row_policy(name: str, window: int = Options.policy_window):
  """The decode-time cache policy of a row: "<variant>@window" / "@streaming" (a ring of
  `window` slots, 4 of them sinks), else None (linear)."""
  policy = name.rsplit("@", 1)[-1] if "@" in name else ""
  return {"window": lambda: cache_lib.Ring(window),
          "streaming": lambda: cache_lib.SinksRing(4, window)}.get(policy, lambda: None)()
