"""Where a step's device time goes: a jax.profiler trace of one call, summed per kernel.

`trace_call(fn, directory)` runs `fn()` (one train step, synchronised) under
`jax.profiler.start_trace(..., create_perfetto_trace=True)`; `top_kernels(path)` reads the
Perfetto JSON it wrote and sums the durations of the device's events by name: on a GPU or TPU
the tracks of the `/device:...` processes (one event per kernel launch: fusions, cuBLAS /
cuDNN / Triton calls, copies), on a CPU the XLA client threads' ops (`tf_XLA...` threads of
`/host:CPU`, without the executor events that enclose them), where the program runs.
Overlapping events on several streams each count their own duration, so the shares are of
summed kernel time, not of wall time; `busy_s` is that sum.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
from typing import Callable

_NUMBERED = re.compile(r"[._]\d+$")   # fusion.12 / loop_add_fusion_3: one family
_WRAPPERS = ("ThunkExecutor",)         # CPU events that enclose the ops they run


@dataclasses.dataclass(frozen=True)
class KernelTime:
  name: str
  seconds: float
  count: int


def trace_call(fn: Callable[[], object], directory: str) -> str:
  """Trace one synchronised call of `fn` into `directory`; the Perfetto JSON's path."""
  import jax
  os.makedirs(directory, exist_ok=True)
  jax.profiler.start_trace(directory, create_perfetto_trace=True)
  try:
    jax.block_until_ready(fn())
  finally:
    jax.profiler.stop_trace()
  paths = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
  return max(paths, key=os.path.getmtime)


def _tracks(events: list[dict]) -> tuple[dict, dict]:
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  return procs, threads


def _is_device(proc: str, thread: str, any_device: bool) -> bool:
  if any_device:
    return proc.startswith("/device:")
  return proc.startswith("/host:") and thread.startswith("tf_XLA")


def _wrapper(name: str) -> bool:
  return name.startswith(_WRAPPERS)


def top_kernels(path: str, top: int = 12, family: bool = True) -> tuple[list[KernelTime], float]:
  """(the `top` kernels by summed duration, all device events' summed seconds). `family`:
  numbered instances of one name (fusion.3, fusion.4) summed together."""
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = _tracks(events)
  # the device's tracks when any kernel ran on one (a compile-only device plugin loaded in the
  # process adds a /device: process with no events: the program then ran on the host)
  any_device = any(e.get("ph") == "X" and procs.get(e["pid"], "").startswith("/device:")
                   for e in events)
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    if not _is_device(procs.get(e["pid"], ""), threads.get((e["pid"], e.get("tid")), ""),
                      any_device) or _wrapper(e["name"]):
      continue
    name = _NUMBERED.sub("", e["name"]) if family else e["name"]
    total[name] += e.get("dur", 0.0) * 1e-6
    count[name] += 1
  rows = [KernelTime(n, s, count[n]) for n, s in total.most_common(top)]
  return rows, sum(total.values())


def format_top(label: str, rows: list[KernelTime], busy_s: float, wall_s: float) -> str:
  """One block of lines: the kernels' share of the summed device time and launches."""
  lines = [f"  [{label}] device kernels {busy_s * 1e3:.1f} ms summed in a {wall_s * 1e3:.1f} ms "
           f"step; top {len(rows)}:"]
  for r in rows:
    share = r.seconds / busy_s if busy_s else 0.0
    lines.append(f"    {r.seconds * 1e3:9.2f} ms {share:6.1%} {r.count:6d} x  {r.name[:90]}")
  return "\n".join(lines)
