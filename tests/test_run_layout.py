"""The run directory has one owner (attn_jax/run_layout.py): the paths every entry point uses
come from `RunLayout.of(workdir)`, the same on a local disk and on gs://, and no other module
joins the layout's names onto a path (an AST scan of the library, the entry points and the
configs lists where they are joined)."""

import ast
import pathlib
import sys

import pytest

from attn_jax import paths, run_layout
from attn_jax.run_layout import RunLayout

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("attn_jax", "experiments", "configs")
NAMES = {run_layout.LOCK, run_layout.CHECKPOINTS, run_layout.METRICS, run_layout.TB,
         run_layout.TB_LOCK, *run_layout.RESULTS, run_layout.PROFILE, run_layout.WANDB_RUN_ID,
         run_layout.WANDB, run_layout.PRETRAINED_INFO, run_layout.TOKENIZER}
# The same file name for another format's own file: a Hugging Face folder's tokenizer (the
# converted run's copy is written by that writer: the last test holds the two names equal).
OTHER_FORMATS = {("attn_jax/pretrained/hf.py", "TOKENIZER")}


def _constants(tree: ast.Module) -> dict[str, str]:
  """The module's top-level NAME = "string" assignments."""
  out = {}
  for node in tree.body:
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)):
      out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
  return out


def _run_name(node: ast.AST, constants: dict[str, str]) -> str | None:
  """The layout name `node` spells: a string literal, a module constant holding one, or
  run_layout.<NAME>."""
  value = None
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    value = node.value
  elif isinstance(node, ast.Name):
    value = constants.get(node.id)
  elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == "run_layout"):
    value = getattr(run_layout, node.attr, None)
  return value if isinstance(value, str) and value in NAMES else None


def _is_join(call: ast.Call) -> bool:
  f = call.func
  return (isinstance(f, ast.Attribute) and f.attr == "join"
          and isinstance(f.value, ast.Attribute) and f.value.attr == "path")


def run_path_sites() -> dict[str, list[str]]:
  """{file: ["line: name", ...]} of every place a layout name is joined onto a path
  (`path / name`, `os.path.join(..., name)`) or defined as a module constant."""
  sites: dict[str, list[str]] = {}
  for folder in SOURCES:
    for file in sorted((ROOT / folder).rglob("*.py")):
      rel = str(file.relative_to(ROOT))
      tree = ast.parse(file.read_text())
      constants = {k: v for k, v in _constants(tree).items() if (rel, k) not in OTHER_FORMATS}
      found = [f"{n.lineno}: {name} defined" for n in tree.body
               if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
               for t in n.targets if isinstance(t, ast.Name) and (rel, t.id) not in OTHER_FORMATS
               for name in [_run_name(n.value, {})] if name]
      for node in ast.walk(tree):
        operands = ([node.left, node.right] if isinstance(node, ast.BinOp)
                    and isinstance(node.op, ast.Div) else
                    node.args[1:] if isinstance(node, ast.Call) and _is_join(node) else [])
        found += [f"{node.lineno}: {name} joined" for o in operands
                  for name in [_run_name(o, constants)] if name]
      if found:
        sites[rel] = found
  return sites


def test_only_the_layout_module_builds_run_paths():
  sites = run_path_sites()
  assert set(sites) == {"attn_jax/run_layout.py"}, sites
  layout = sites["attn_jax/run_layout.py"]
  assert sum("defined" in s for s in layout) == len(NAMES - set(run_layout.RESULTS))
  assert any("joined" in s for s in layout)   # the scan sees the joins it looks for


def test_the_scan_finds_a_path_spelled_elsewhere(tmp_path, monkeypatch):
  """The joins this repository used to write (`paths.run_path(w) / "checkpoints"`,
  `os.path.join(w, "tb")`, a module constant joined) are each found."""
  (tmp_path / "attn_jax").mkdir()
  (tmp_path / "attn_jax" / "spelled.py").write_text(
      'import os\nDIRNAME = "profile"\n'
      'a = paths.run_path(w) / "checkpoints"\nb = os.path.join(w, "tb")\nc = root / DIRNAME\n'
      'd = root / run_layout.METRICS\ne = os.path.join(w, "results.json")\n')
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  assert run_path_sites() == {"attn_jax/spelled.py": [
      "2: profile defined", "3: checkpoints joined", "4: tb joined", "5: profile joined",
      "6: metrics.jsonl joined"]}


@pytest.mark.parametrize("workdir", ["runs/x", "gs://bucket/runs/x/"])
def test_one_layout_for_a_local_folder_and_a_bucket(workdir):
  layout = RunLayout.of(workdir)
  root = paths.name(workdir)
  assert paths.name(layout.root) == root
  expected = {"lock": ".lock", "checkpoints": "checkpoints", "metrics": "metrics.jsonl",
              "tb": "tb", "tb_lock": "tb/.writer.lock", "profile": "profile",
              "wandb_run_id": "wandb_run_id", "wandb": "wandb",
              "pretrained_info": "pretrained.json", "tokenizer": "tokenizer.json"}
  for attribute, rel in expected.items():
    assert paths.name(getattr(layout, attribute)) == f"{root}/{rel}", attribute
  assert paths.name(layout.results("stream")) == f"{root}/stream"
  assert paths.name(layout.history("tb", 2)) == f"{root}/tb.2"
  assert paths.is_uri(layout.checkpoints) == paths.is_uri(workdir)
  with pytest.raises(ValueError, match="results of kind 'profile'"):
    layout.results("profile")
  with pytest.raises(ValueError, match="history of 'eval'"):
    layout.history("eval", 1)


def test_the_converted_runs_tokenizer_is_the_file_the_hf_writer_writes():
  from attn_jax.pretrained import hf
  assert run_layout.TOKENIZER == hf.TOKENIZER
