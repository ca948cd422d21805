"""Every preset in configs/ builds a valid config (a preset derived from another, e.g. a
Sinkhorn twin of the quickstart, must not inherit fields that contradict its own)."""

import importlib
import pkgutil

import pytest

import configs
from attn_jax.config import validate

PRESETS = sorted(m.name for m in pkgutil.iter_modules(configs.__path__)
                 if hasattr(importlib.import_module(f"configs.{m.name}"), "get_config"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates(name):
  validate(importlib.import_module(f"configs.{name}").get_config())
