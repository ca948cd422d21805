"""The paper notes stay citable: every "docs/papers.md §N.M" in the code, configs, experiments,
tests and docs names a section that exists, every link into papers.md hits a heading's anchor,
and the repository cites nothing outside itself (no notes file of another checkout, no issue
numbers)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPERS = ROOT / "docs" / "papers.md"
CODE_DIRS = ("attn_jax", "configs", "experiments", "tests")
SUFFIXES = {".py", ".sh", ".txt", ".md", ".toml", ".cfg", ".yaml"}
# "papers.md" then one or more section numbers: "§3.2", "§3.2, §8.4", "§1 and §5.3"
CITATION = re.compile(r"papers\.md((?:(?:,|;|\sand)?\s*§\d+(?:\.\d+)?)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)
LINK = re.compile(r"\]\((?:docs/)?papers\.md#([^)]+)\)")


def _files(dirs):
  for d in dirs:
    for p in sorted((ROOT / d).rglob("*")):
      if p.is_file() and p.suffix in SUFFIXES and p.relative_to(ROOT).parts[:2] != ("tests", "data"):
        yield p


def _sections() -> set[str]:
  return set(HEADING.findall(PAPERS.read_text()))


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_headings_are_numbered_chapters_and_sections():
  found = HEADING.findall(PAPERS.read_text())
  chapters = [s for s in found if "." not in s]
  assert chapters == [str(i) for i in range(1, len(chapters) + 1)], chapters
  for s in found:
    if "." in s:
      assert s.split(".")[0] in chapters, s
  assert len(set(found)) == len(found), "a section number is used twice"


def test_every_citation_names_an_existing_section():
  sections = _sections()
  cited = 0
  for p in _files(CODE_DIRS + ("docs",)):
    text = p.read_text(errors="replace")
    for m in CITATION.finditer(text):
      for s in SECTION.findall(m.group(1)):
        line = text.count("\n", 0, m.start()) + 1
        assert s in sections, f"{p.relative_to(ROOT)}:{line} cites docs/papers.md §{s}"
        cited += 1
  assert cited >= 30   # the regex finds the citations (the modules, configs, tests, docs)


def test_links_into_the_notes_hit_a_heading():
  anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", PAPERS.read_text(), re.M)}
  for p in [ROOT / "README.md", *_files(("docs",))]:
    for anchor in LINK.findall(p.read_text()):
      assert anchor in anchors, f"{p.relative_to(ROOT)}: papers.md#{anchor}"


def test_nothing_outside_the_repository_is_cited():
  notes = "SPEC" + ".md"                          # the pre-repository notes file
  issue = re.compile(r"iss" r"ue[- ]?#?[0-9]", re.I)  # split: this file does not match itself
  found = []
  for p in _files(CODE_DIRS):
    for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
      if notes in line or issue.search(line):
        found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
  assert not found, "\n".join(found)
