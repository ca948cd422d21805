"""The GPU scripts on a machine without a GPU, and device_check.sh's steps when one fails.

experiments/device_check.sh runs under a stub `python3` (first on PATH) that reports the backend
JAX would see ($STUB_BACKEND), logs every command the script starts and fails the ones that
name a string in $STUB_FAIL: which steps ran, the first and last lines and the exit status are
the script's own. experiments/tune_decayed.py runs for real on this machine's CPU.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_STUB = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [[ "$*" == *"default_backend()"* ]]; then
  [[ -n "$STUB_BACKEND" ]] && echo "$STUB_BACKEND"
  exit 0
fi
if [[ "$1" == -c ]]; then echo "0.0 [StubDevice]"; exit 0; fi
for f in $STUB_FAIL; do
  if [[ "$*" == *"$f"* ]]; then echo "stub: failing $f"; exit 1; fi
done
echo "stub: ran"
"""


def _device_check(tmp_path, backend: str, fail: str = "", **env) -> tuple:
  """(exit status, output lines, the commands started) of device_check.sh under the stub."""
  stub_dir = tmp_path / "bin"
  stub_dir.mkdir(exist_ok=True)
  stub = stub_dir / "python3"
  stub.write_text(_STUB)
  stub.chmod(0o755)
  log = tmp_path / "commands.log"
  log.write_text("")
  clean = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "STEPS", "QUICK")}
  run_env = dict(clean, PATH=f"{stub_dir}:{os.environ['PATH']}", STUB_LOG=str(log),
                 STUB_BACKEND=backend, STUB_FAIL=fail, OUT=str(tmp_path / "out"), **env)
  r = subprocess.run(["bash", str(ROOT / "experiments" / "device_check.sh")], env=run_env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
  return r.returncode, r.stdout.splitlines(), log.read_text().splitlines()


def _steps_started(commands: list[str]) -> list[str]:
  """The script's programs, in order ("pytest", "bench.py", ...), without JAX's probes."""
  names = []
  for c in commands:
    if c.startswith("-c "):
      continue
    words = c.split()
    names.append("pytest" if words[:2] == ["-m", "pytest"] else os.path.basename(words[0]))
  return names


def test_device_check_without_a_gpu_says_so_first_and_runs_nothing(tmp_path):
  rc, lines, commands = _device_check(tmp_path, backend="cpu")
  assert rc == 2, lines
  assert len(lines) == 1 and lines[0].startswith("device_check.sh needs a GPU (or TPU): JAX "
                                                 "sees cpu here"), lines
  assert "JAX_PLATFORMS=cpu" in lines[0]                # how to ask for the CPU dry run
  assert _steps_started(commands) == []                 # no test, no benchmark
  assert not (tmp_path / "out").exists()                # nothing written


def test_device_check_where_jax_does_not_start_says_so_too(tmp_path):
  rc, lines, _ = _device_check(tmp_path, backend="")
  assert rc == 2 and lines[0].startswith("device_check.sh needs a GPU (or TPU): JAX sees no "
                                         "backend"), lines


def test_device_check_runs_every_step_and_names_the_failed_one(tmp_path):
  rc, lines, commands = _device_check(tmp_path, backend="gpu", fail="tests/test_kernels.py")
  assert rc == 1, lines
  # the default steps 1 2 2L 2b all ran after step 1 failed
  assert _steps_started(commands) == ["pytest", "bench.py", "bench.py", "bench.py"], commands
  assert "-x" not in commands[2].split()   # every numerics test runs, not up to the first failure
  assert lines[-1].startswith("device_check: steps 1 2 2L 2b done; FAILED: 1 (exit 1); "
                              "results in "), lines[-1]


def test_device_check_names_every_failed_step_and_passes_when_none_fails(tmp_path):
  rc, lines, _ = _device_check(tmp_path, backend="gpu", fail="--seq_lens=8192 --decode_only")
  assert rc == 1
  assert "FAILED: 2L (exit 1), 2b (exit 1);" in lines[-1], lines[-1]
  rc, lines, _ = _device_check(tmp_path, backend="gpu")
  assert rc == 0 and lines[-1].startswith("device_check: steps 1 2 2L 2b done; results in "), lines


def test_device_check_cpu_dry_run_when_asked_for(tmp_path):
  """The documented CPU dry run (JAX_PLATFORMS=cpu) runs its steps; the tuning step gets
  --dry_run, so no tuning file is written or used."""
  rc, lines, commands = _device_check(tmp_path, backend="cpu", JAX_PLATFORMS="cpu", STEPS="1 t")
  assert rc == 0, lines
  started = [c for c in commands if not c.startswith("-c ")]
  assert len(started) == 2 and started[0].startswith("-m pytest"), started
  assert started[1].startswith("experiments/tune_decayed.py ") and "--dry_run" in started[1]


def test_device_check_decode_graphs_step_checks_then_times_on_the_gpu_and_fails_loudly(tmp_path):
  """Step 2g: decode_graphs.py on this GPU with --check (exit 1 unless the loop is captured)
  and --time; its failure names the step. The dry run compiles for a compile-only H100 and
  times nothing."""
  rc, lines, commands = _device_check(tmp_path, backend="gpu", STEPS="2g")
  graphs = [c for c in commands if c.startswith("experiments/decode_graphs.py ")]
  assert rc == 0 and len(graphs) == 1, (lines, commands)
  assert {"--check", "--target=local", "--time"} <= set(graphs[0].split())
  rc, lines, _ = _device_check(tmp_path, backend="gpu", STEPS="2g", fail="decode_graphs.py")
  assert rc == 1 and "FAILED: 2g (exit 1);" in lines[-1], lines[-1]
  rc, lines, commands = _device_check(tmp_path, backend="cpu", JAX_PLATFORMS="cpu", STEPS="2g")
  graphs = [c for c in commands if c.startswith("experiments/decode_graphs.py ")]
  assert "--target=h100x1" in graphs[0].split() and "--time" not in graphs[0].split(), graphs


def _tune(*args):
  env = {k: v for k, v in os.environ.items() if k != "ATTN_JAX_DEBUG"}
  return subprocess.run([sys.executable, "experiments/tune_decayed.py", *args], cwd=ROOT,
                        env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                        timeout=300)


def test_tune_decayed_without_a_gpu_refuses_in_its_first_line(tmp_path):
  target = tmp_path / "tuning.json"
  r = _tune(f"--write={target}")
  assert r.returncode == 2, r.stderr[-2000:]
  lines = (r.stdout + r.stderr).splitlines()
  assert lines[0].startswith("error: tune_decayed.py needs a GPU: JAX's backend here is 'cpu'"), \
      lines[:3]
  assert "--dry_run" in lines[0] and r.stdout == ""
  assert not target.exists()


@pytest.mark.slow
def test_tune_decayed_dry_run_writes_nothing(tmp_path):
  target = tmp_path / "tuning.json"
  r = _tune("--dry_run", "--quick", "--kinds=sisa", "--seq_lens=128", "--tokens=256",
            "--steps=1", "--heads=2", "--d_state=8", f"--write={target}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines()[0].startswith("tune_decayed.py --dry_run on cpu: times of the "
                                             "Pallas interpreter, not a GPU's; nothing is written")
  assert not target.exists() and "best so far" not in r.stdout
