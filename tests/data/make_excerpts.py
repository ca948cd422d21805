"""Writes the excerpts under tests/data/ from the full benchmark files (tests/data/SOURCES.md).

    python tests/data/make_excerpts.py [FULL_DATA_DIR]   # default $ATTN_JAX_SHARED_DATA or ../shared/data

Each excerpt keeps whole lines of its source, byte for byte and in the source's order, so the
loaders and lm-eval's task definitions read it exactly as they read the full file:
the first FIRST records of every benchmark, plus every ARC question with other than four
choices (the loaders keep 3- and 5-choice questions; the test counts them), and the first
SHAKESPEARE_LINES lines of tinyshakespeare.
"""

import json
import os
import pathlib
import sys

FIRST = 40                  # records per benchmark (test_eval's oracle test scores 40)
ARC_CHALLENGE_FIRST = 12    # test_lm_eval's cross-check limit
SHAKESPEARE_LINES = 800     # ~22 KB: test_study_lm's held-out windows and test_data's batch

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _lines(path: pathlib.Path) -> list[str]:
  return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _arc_rows(official: pathlib.Path, first: int) -> list[int]:
  """Line numbers (0-based) kept of an ARC file: the first `first` and every non-4-choice one."""
  rows = [json.loads(line) for line in _lines(official)]
  return [i for i, r in enumerate(rows)
          if i < first or len(r["question"]["choices"]) != 4]


def _write(rel: str, lines: list[str]) -> None:
  out = HERE / rel
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(lines), encoding="utf-8", newline="")
  print(f"{rel}: {len(lines)} lines, {out.stat().st_size} bytes")


def main(root: pathlib.Path) -> None:
  for rel in ("lambada/lambada_test.jsonl", "hellaswag/hellaswag.jsonl",
              "winogrande/dev.jsonl", "winogrande/dev-labels.lst"):
    _write(rel, _lines(root / rel)[:FIRST])
  for name, first in (("Easy", FIRST), ("Challenge", ARC_CHALLENGE_FIRST)):
    keep = _arc_rows(root / "arc" / f"ARC-{name}-Test.jsonl", first)
    for rel in (f"arc/ARC-{name}-Test.jsonl", f"arc/hf_ai2_arc/ARC-{name}-test.jsonl"):
      src = _lines(root / rel)
      _write(rel, [src[i] for i in keep])
  _write("tinyshakespeare/input.txt",
         _lines(root / "tinyshakespeare" / "input.txt")[:SHAKESPEARE_LINES])


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                    os.environ.get("ATTN_JAX_SHARED_DATA") or DEFAULT))
