"""The README's front page stays true: its Python example runs and gives the shapes it states,
its local links point at files that exist, and it stays a front page (<= 200 lines)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_example_runs_with_the_stated_shape():
  (block,) = re.findall(r"```python\n(import jax.*?)```", README, flags=re.S)
  scope = {}
  exec(compile(block, "README.md", "exec"), scope)   # noqa: S102 (our own README)
  assert scope["logits_BTV"].shape == (2, 64, 256)


def test_local_links_exist():
  for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
    if not target.startswith("http"):
      assert (ROOT / target).exists(), target


def test_front_page_length():
  assert len(README.splitlines()) <= 200
