"""What experiments/bench.py benches: its options (one field per flag), the configs named on its
command line ("module", "module@chunked", "module@a.b=v,...", "module@window|streaming") with
the --scale / size overrides applied, and a study's variants plus cache-policy rows.

--scale=tiny keeps the architecture family at CPU size: d_model 256, 4 heads (d_h 64, as at
152M), 4 layers, vocab 4096, Transformer d_ff 4 d; SISA's d_ff is recomputed with
`matched_d_ff` so both models have the same parameter count. Explicit d_model, n_heads,
n_layers, vocab_size, d_ff (Transformer width; SISA and the Transformer twins with a `matched`
function, fox_*, re-matched) override it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.sisa import matched_d_ff
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
  d_model: int = 0
  n_heads: int = 0
  n_layers: int = 0
  vocab_size: int = 0
  d_ff: int = 0
  d_state: int = 0
  dtype: str = ""
  sisa_path: str = ""
  sisa_decay_bias: float | None = None
  remat: str = ""
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
    """The preset's values for every field not in `given` (the flags set on the command line)."""
    if not self.preset:
      return self
    return dataclasses.replace(self, **{k: v for k, v in PRESETS[self.preset].items()
                                        if k not in given})


PRESETS = {"cpu_50m_fp32": dict(configs=["transformer_152m", "sisa_152m", "sisa_152m@fast"],
                                seq_lens=["1024"], batch_tokens=4096, d_model=512, n_heads=8,
                                n_layers=6, vocab_size=50277, dtype="float32")}

ROW_POLICIES = ("window", "streaming")


def _model_overrides(name: str, m, o: Options) -> None:
  tiny = o.scale == "tiny"
  d = o.d_model or (256 if tiny else 0)
  h = o.n_heads or (4 if tiny else 0)
  n = o.n_layers or (4 if tiny else 0)
  vocab = o.vocab_size or (4096 if tiny else 0)
  if d:
    m.d_model = d
    m.d_ff = o.d_ff or 4 * d
  if h:
    m.n_heads = h
  if n:
    m.n_layers = n
  if vocab:
    m.vocab_size = vocab
  if o.dtype:
    m.dtype = o.dtype
  if o.remat:
    m.remat = o.remat
  if m.mixer == "sisa":
    _sisa_overrides(name, m, o, d, h)
  twin = importlib.import_module(f"configs.{name}")
  if hasattr(twin, "matched") and (d or h):  # a Transformer twin (fox_*): re-match its d_ff too
    ref = importlib.import_module(f"configs.transformer_{name.split('_', 1)[1]}").get_config()
    ref.model.update(d_model=m.d_model, d_ff=o.d_ff or 4 * m.d_model, n_heads=m.n_heads)
    m.d_ff = twin.matched(ref).model.d_ff


def _sisa_overrides(name: str, m, o: Options, d: int, h: int) -> None:
  if o.d_state:
    m.sisa.d_state = o.d_state
  if d or h or o.d_state:  # re-match the SwiGLU width to the (overridden) Transformer
    ref = importlib.import_module(f"configs.{name.replace('sisa_', 'transformer_')}")
    t = ref.get_config().model
    if d:
      t.d_model, t.d_ff = d, o.d_ff or 4 * d
    if h:
      t.n_heads = h
    m.d_ff = matched_d_ff(t, m.sisa.d_state)
  if o.sisa_path:
    m.sisa.path = o.sisa_path
  if o.sisa_decay_bias is not None:
    m.sisa.decay_bias_init = o.sisa_decay_bias


def _set_path(config, path: str, text: str) -> None:
  """config.<path> = the literal `text` (a Python literal, else the string)."""
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  *parents, leaf = path.split(".")
  node = config
  for p in parents + [leaf]:
    if p not in node:
      raise ValueError(f"config suffix {path}={text}: config.{path} is not a field")
    if p != leaf:
      node = node[p]
  node[leaf] = value


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
  `row_policy`)."""
  module, _, suffix = name.partition("@")
  config = _config_module(name, module).get_config()
  _model_overrides(module, config.model, options)
  for item in filter(None, suffix.split(",")):
    if "=" in item:
      _set_path(config, *item.split("=", 1))
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
