"""Rewrites tests/slow_tests.txt from a `pytest --durations=0` log (see that file's header).

    python tests/slow_tests.py durations.log [--threshold=7.8]

Keeps the header, the hand-kept entries (lines not starting with a number of seconds, e.g. the
users of a costly module fixture) and the measured ones (a default run does not time the tests
already listed); adds the tests of the log whose call took >= threshold seconds, except those
in KEEP (default-run tests no cheaper test covers) and the files in KEEP_FILES.
"""

import pathlib
import re
import sys

KEEP = ("test_resume_is_bit_identical", "test_train.py::test_sharded_equals_unsharded",
        "test_metrics_jsonl_and_loss_decreases", "attention-fsdp",
        "test_interrupt_in_the_middle_of_gradient_accumulation")
KEEP_FILES = ("tests/test_packing.py",)   # every mixer's document boundary: the packing evidence
_ROW = re.compile(r"^([0-9.]+)s call\s+(\S+)")


def main(log: str, threshold: float = 7.8) -> None:
  out = pathlib.Path(__file__).with_name("slow_tests.txt")
  old = out.read_text().splitlines()
  header = [l for l in old if l.startswith("#")]
  hand = [l for l in old if l.strip() and not l.startswith("#") and not re.match(r"^[0-9.]+s ", l)]
  listed = {l.split()[1]: float(l.split()[0][:-1]) for l in old if re.match(r"^[0-9.]+s ", l)}
  rows = [m.groups() for m in map(_ROW.match, pathlib.Path(log).read_text().splitlines()) if m]
  for sec, test in rows:
    if (float(sec) >= threshold and not any(k in test for k in KEEP)
        and not test.startswith(KEEP_FILES)):
      listed[test] = float(sec)
  measured = sorted(((s, t) for t, s in listed.items()), reverse=True)
  out.write_text("\n".join(header + [f"{s:.2f}s {t}" for s, t in measured] + hand) + "\n")
  print(f"{len(measured)} measured slow tests written to {out}")


if __name__ == "__main__":
  args = [a for a in sys.argv[1:] if not a.startswith("--threshold=")]
  thr = [float(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threshold=")]
  main(args[0], *thr)
