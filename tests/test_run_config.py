"""The typed run config (attn_jax/config.py): every preset converts, its JSON is the ConfigDict's
(what checkpoints record), defaults live in one place, unknown fields are named, and nothing
below the config module re-reads a section with `.get(key, default)`."""

import ast
import dataclasses
import importlib
import pathlib

import pytest

from attn_jax import config as config_lib
from configs import base

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


def _preset(name):
  module = importlib.import_module(f"configs.{name}")
  if not hasattr(module, "get_config"):
    pytest.skip(f"configs/{name}.py has no get_config")
  try:
    return module.get_config()
  except TypeError:
    return module.get_config("")


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_converts_and_its_json_is_the_configdicts(name):
  c = _preset(name)
  run = config_lib.RunConfig.from_config(c)
  assert run.to_json() == config_lib.config_to_json(c)
  assert run.model.d_model == c.model.d_model and run.data.seq_len == c.data.seq_len


def test_the_base_config_is_the_sections_defaults():
  c = base.get_config()
  run = config_lib.RunConfig.from_config(c)
  for name, section_cls in config_lib.SECTIONS.items():
    assert getattr(run, name) == section_cls(), name
    assert set(c[name].keys()) == {f.name for f in dataclasses.fields(section_cls)}, name
  assert run.model.replace(options=()) == config_lib.ModelConfig()


def test_a_field_missing_from_an_older_config_takes_its_default():
  c = base.get_config()
  del c.data["window_offset"], c.train["spike_window"], c["metrics"]
  run = config_lib.RunConfig.from_config(c)
  assert run.data.window_offset == "none" and run.train.spike_window == 100
  assert run.metrics == config_lib.MetricsConfig()


def test_unknown_fields_are_named():
  c = base.get_config()
  c.train.stepz = 3
  with pytest.raises(ValueError, match=r"config\.train\.stepz: unknown field"):
    config_lib.validate(c)


def test_run_config_is_frozen_and_replace_in_copies():
  run = config_lib.validate(base.get_config())
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.train.steps = 3
  smaller = run.replace_in("data", global_batch_size=4)
  assert smaller.data.global_batch_size == 4 and run.data.global_batch_size == 32
  assert smaller.to_json()["data"]["global_batch_size"] == 4
  assert config_lib.as_run(run) is run


SECTION_NAMES = set(config_lib.SECTIONS) | {"model", "study"}


def _section_gets(path: pathlib.Path):
  """`<x>.<section>.get("key", default)` and `data_cfg.get("key", default)` calls in a file."""
  for node in ast.walk(ast.parse(path.read_text())):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)):
      continue
    receiver = node.func.value   # `config.train`, `self.config.data`, `data_cfg`
    if ((isinstance(receiver, ast.Attribute) and receiver.attr in SECTION_NAMES)
        or (isinstance(receiver, ast.Name) and receiver.id.endswith("_cfg"))):
      yield f"{path.relative_to(ROOT)}:{node.lineno}"


def test_no_section_is_read_with_a_default_outside_the_config_module():
  found = [hit for p in sorted((ROOT / "attn_jax").rglob("*.py"))
           if p.name not in ("config.py", "model_config.py") for hit in _section_gets(p)]
  assert not found, f"read the typed RunConfig instead: {found}"
