"""Forgetting Transformer (FoX), 152M: the Transformer 152M preset with mixer "fox" and the
SwiGLU narrowed so that the parameter count matches (the forget gate adds d H + H per layer:
d_ff 3072 -> 3068).

Preset override: `--config=configs/fox_152m.py:pro` turns on the paper's "Pro" block (QK-norm,
key/value shift, output norm and gate; the SwiGLU absorbs their parameters too).
"""

from attn_jax.attention import fox
from configs import transformer_152m

PRO = ("qk_norm", "key_shift", "value_shift", "output_norm", "output_gate")


def matched(c, config_string: str = ""):
  """A Transformer preset turned into its FoX twin (`config_string` "pro": the Pro block)."""
  if config_string not in ("", "pro"):
    raise ValueError(f"fox preset override: {config_string!r} (use nothing or 'pro')")
  for name in PRO:
    c.model.fox[name] = config_string == "pro"
  opts = fox.FoX.Options(**c.model.fox.to_dict())
  m = c.model
  extra = fox.extra_params(m.d_model, m.n_heads, m.n_kv_heads or m.n_heads, opts)
  c.model.update(mixer="fox", d_ff=fox.matched_d_ff(m, extra))
  return c


def get_config(config_string: str = ""):
  return matched(transformer_152m.get_config(), config_string)
