"""Decoding as CUDA graphs (`attn_jax.command_buffers`): what the one-token step and the
generation loop capture, with and without the command-buffer options, and on a GPU the decode
tokens/s of each.

  python experiments/decode_graphs.py --configs=transformer_152m,mamba2_152m   # compile-only H100
  python experiments/decode_graphs.py --target=local --check --time             # on a GPU

Capture (`train/decode_graphs.capture_report`): each config's `decode_step` and
`decode.generate` (prefill of --prompt tokens + the while loop of --new_tokens steps) compiled
with the options on and off, for --target (a compile-only GPU of `attn_jax.targets`, or
"local": this machine's first GPU), read from XLA's thunk dump; one line per program and
setting. --check exits 1 unless, with the options, every generation loop is inside a command
buffer and nothing of the step is outside one (what the tests assert on the compile-only H100,
here on the machine's own driver).

Timing (--time, a GPU only): for each setting, in a process of its own (a graph lives as long as
its executable; separate processes keep one setting's graphs and allocations out of the
other's figures), `bench.roofline.decode_step_tok_s` (--steps greedy one-token steps in one
jitted `fori_loop` after an untimed prefill, the bench's decode-step row) at each --batches, and
the device memory the CUDA driver reports free after it (cudaMemGetInfo, through the CUDA
runtime the jax wheels bring; "-" where it cannot be loaded). A table then gives tok/s on / off
and the ratio, and the free bytes on minus off (what the graphs took beyond XLA's allocator, to
the driver's granularity).
"""

import ctypes
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["transformer_152m"], "Config modules under configs/.")
_TARGET = flags.DEFINE_string("target", "h100x1", "A GPU target of attn_jax.targets, or 'local'.")
_BATCH = flags.DEFINE_integer("batch", 1, "Rows of the compiled programs (capture).")
_PROMPT = flags.DEFINE_integer("prompt", 128, "Prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "New tokens (capacity = prompt + new_tokens).")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 unless the options capture step and loop.")
_TIME = flags.DEFINE_bool("time", False, "Decode tokens/s with and without (a GPU only).")
_BATCHES = flags.DEFINE_list("batches", ["1", "32"], "Batches of the timed decode steps.")
_STEPS = flags.DEFINE_integer("steps", 64, "Timed one-token steps.")
_MARKDOWN = flags.DEFINE_bool("markdown", False, "Also print the capture as docs/hardware.md's "
                               "table rows.")
_ONE = flags.DEFINE_string("one", "", "Internal: time one setting (on / off) of one config and "
                           "print its JSON.")


def _model_config(name: str):
  from attn_jax.config_flags import load_config_file
  from attn_jax.model_config import ModelConfig
  return ModelConfig.from_config(load_config_file(f"configs/{name}.py").model)


def _capture(name: str) -> list[str]:
  """Lines of the capture report of config `name`; the problems --check finds."""
  import jax
  from attn_jax.train import decode_graphs
  device = jax.devices()[0] if _TARGET.value == "local" else None
  rows = decode_graphs.capture_report(_model_config(name), _TARGET.value, device=device,
                                      batch=_BATCH.value, prompt=_PROMPT.value,
                                      new_tokens=_NEW.value)
  where = "this machine's GPU" if device is not None else _TARGET.value
  print(f"{name} on {where}, batch {_BATCH.value}, prompt {_PROMPT.value} + "
        f"{_NEW.value} new tokens:")
  print("\n".join("  " + line for line in decode_graphs.format_rows(rows).splitlines()))
  if _MARKDOWN.value:
    print("\n".join(decode_graphs.markdown_rows(name, rows)))
  bad = []
  for r in rows:
    c = r.on.capture
    if r.program == "step" and (c.outside or not c.command_buffers):
      bad.append(f"{name} step: {c.outside} launching thunks outside command buffers, "
                 f"{c.command_buffers} command buffer(s)")
    if r.program == "generate" and not (c.loops and all(lp.captured for lp in c.loops)):
      bad.append(f"{name} generate: loops {[(lp.name, lp.captured) for lp in c.loops]}")
  return bad


def _free_device_bytes() -> int | None:
  """Free device memory as the CUDA driver reports it (cudaMemGetInfo), None when no CUDA
  runtime library loads."""
  try:
    import nvidia   # the CUDA wheels' namespace package
    roots = list(nvidia.__path__)
  except ImportError:
    roots = []
  names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
  for root in roots:
    names += sorted(glob.glob(os.path.join(root, "cuda_runtime", "lib", "libcudart.so*")))
  for lib in names:
    try:
      rt = ctypes.CDLL(lib)
    except OSError:
      continue
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
      return int(free.value)
  return None


def _time_one(name: str, on: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from attn_jax import command_buffers as cb
  from attn_jax.bench import roofline
  from attn_jax.model import build_model
  if jax.default_backend() != "gpu":
    raise SystemExit(f"--time needs a GPU: JAX's backend here is {jax.default_backend()}")
  model = build_model(_model_config(name))
  out = {"config": name, "on": on, "tok_s": {}}
  with cb.use(on):
    for b in map(int, _BATCHES.value):
      prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (b, _PROMPT.value))
      out["tok_s"][b] = roofline.decode_step_tok_s(model, jnp.asarray(prompt, jnp.int32),
                                                   _STEPS.value)
  out["free_bytes"] = _free_device_bytes()
  return out


def _time(name: str) -> list[str]:
  """Both settings of config `name`, one process each; the table lines."""
  got = {}
  for setting in ("on", "off"):
    cmd = [sys.executable, os.path.abspath(__file__), f"--one={setting}", f"--configs={name}",
           f"--prompt={_PROMPT.value}", f"--steps={_STEPS.value}",
           f"--batches={','.join(_BATCHES.value)}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in run.stdout.splitlines() if l.startswith("{")]
    if run.returncode or not lines:
      raise SystemExit(f"timing {name} with command buffers {setting} failed (exit "
                       f"{run.returncode}):\n{run.stderr[-3000:]}")
    got[setting] = json.loads(lines[-1])
  rows = []
  for b in got["on"]["tok_s"]:
    on, off = got["on"]["tok_s"][b], got["off"]["tok_s"][b]
    rows.append(f"  {name:20s} batch {b:>3s}: {on:9.1f} tok/s with, {off:9.1f} without, "
                f"{on / off:.2f}x")
  f_on, f_off = got["on"]["free_bytes"], got["off"]["free_bytes"]
  mem = "-" if None in (f_on, f_off) else f"{(f_off - f_on) / 2 ** 20:.0f} MiB"
  rows.append(f"  {name:20s} device memory the graphs took (free without - free with): {mem}")
  return rows


def main(argv):
  del argv
  if _ONE.value:
    print(json.dumps(_time_one(_CONFIGS.value[0], _ONE.value == "on")))
    return
  bad, table = [], []
  for name in _CONFIGS.value:
    bad += _capture(name)
    if _TIME.value:
      table += _time(name)
  if table:
    print(f"decode-step tokens/s ({_STEPS.value} steps after a {_PROMPT.value}-token prefill), "
          "command buffers with WHILE (on) vs XLA's default set (off):")
    print("\n".join(table))
  if _CHECK.value and bad:
    print("decode_graphs --check FAILED:\n  " + "\n  ".join(bad))
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
