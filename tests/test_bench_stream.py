"""experiments/bench_stream.py (attn_jax/bench/stream.py) end to end at tiny sizes: per-token
rows for both mixers, and the long-stream check with constant cache bytes and its drift control
(a subprocess: the script defines its own absl flags)."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_stream_runs_and_reports_constant_memory_and_the_control(tmp_path):
  out = tmp_path / "bench_stream.json"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_stream.py"), "--caches=64",
         "--reps=2", "--repeats=1", f"--long={6 * 1020}", "--chunk=1020", f"--out={out}"]
  run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  res = json.loads(out.read_text())
  assert [(r["mixer"], r["cache"]) for r in res["per_token"]] == [("attention", 64), ("sisa", 64)]
  assert all(r["streaming_ms"] > 0 and r["speedup"] > 0 for r in res["per_token"])
  for r in res["memory"]:
    assert len(set(r["cache_bytes"].values())) == 1          # same bytes at every checkpoint
    for key in ("last_over_first", "first_tenth_over_control", "last_tenth_over_control"):
      assert np.isfinite(r[key]) and r[key] > 0, (key, r)
