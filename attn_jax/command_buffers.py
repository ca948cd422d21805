"""XLA:GPU command buffers (CUDA graphs) for decoding programs: the options, and what a compile
captures, read without a GPU.

A one-token decode step at batch 1 is a few hundred small kernels (~24 per Transformer layer)
whose device work is microseconds each: launched one by one from the host it is bound by the
launch cost, not by memory bandwidth. XLA:GPU can record a run of thunks (kernels, copies,
library calls) into a *command buffer*, a CUDA graph instantiated once and launched with one
call; with `WHILE` in the set, a whole `lax.while_loop` (condition and body) becomes a graph
node driven on the device by CUDA conditional nodes, so the generation loop of
`decode.generate` costs no host round trip per token.

The options (XLA `DebugOptions`; both JAX lines, read from the `*.config.pbtxt` of a dump):

  xla_gpu_enable_command_buffer   the thunk kinds that may be captured. Each name maps thunk
                                  kinds (XLA's `command_buffer_conversion_pass`): FUSION (XLA's
                                  own kernels, device-to-device copies, partition / replica
                                  ids), CUBLAS (gemm), CUBLASLT, CUDNN, CUSTOM_CALL (custom
                                  calls whose FFI handler says it is graph-safe), DYNAMIC_SLICE_
                                  FUSION, CONDITIONAL (`lax.cond` / `switch`, every branch
                                  captured), WHILE (`lax.while_loop` / `fori_loop`: condition
                                  and body captured), COLLECTIVES (all-reduce & co. as graph
                                  nodes), COLLECTIVES_KERNEL (0.12 only), CONVOLUTION. Default on
                                  jax 0.10.2: FUSION, CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL,
                                  DYNAMIC_SLICE_FUSION, CONDITIONAL; on jax 0.12.0.1 the same
                                  plus COLLECTIVES_KERNEL. WHILE is in neither.
  xla_gpu_graph_min_graph_size    the fewest consecutive capturable thunks made into one
                                  command buffer (default 5 on both lines); a shorter run stays
                                  thunk by thunk.
  xla_gpu_command_buffer_unroll_loops  a while loop of known trip count unrolled into the graph
                                  (default false).
  xla_gpu_command_buffer_update_mode / _scheduling_mode  how a graph is updated when its
                                  buffers move between runs (ALWAYS_UPDATE) and how thunks are
                                  grouped (LHS); left at their defaults.
  xla_gpu_graph_enable_concurrent_region  independent thunks as parallel branches of the graph
                                  (default false; a one-token step is mostly a chain). The
                                  older `xla_gpu_graph_level` and `_num_runs_to_instantiate`
                                  are reserved names on both lines: gone.

Per program. `jax.jit(f, compiler_options={...})` (or `.lower(...).compile({...})`) sets
options for one program; the value of `xla_gpu_enable_command_buffer` is then a full list of
names: the "+WHILE" form (add to the default) is accepted only in `XLA_FLAGS`, where it holds
for every program of the process. `compiler_options` below gives the full list: both lines'
common default plus WHILE, and on jax >= 0.12 its extra default COLLECTIVES_KERNEL (a name a
line does not know is a compile error, so 0.10.2 never gets it). Decoding programs
(`decode.jit_stateful`, `decode.generate`) are compiled with it on a GPU, through
`kernel_choice.stateful_compiler_options` (the platform is kernel_choice's to read); elsewhere it
is {}.
Turned off with `ATTN_JAX_DECODE_COMMAND_BUFFERS=0` (read when a program is jitted) or inside
`use(False)`; off, a decoding program gets XLA's default set (no WHILE), not an empty one. An
`XLA_FLAGS` that names the option wins (no per-program override).

Where it shows without a GPU. The conversion is a pass over the thunk sequence, after the HLO
is final: `compiled.as_text()` never shows it (no command-buffer computation on either line;
the HLO pass `command-buffer-scheduling` that once made them is gone). A dump does
(`xla_dump_to`): `*.thunk_sequence.txt` is the sequence before the thunk passes,
`*.thunk_sequence_after_thunk_passes.txt` after them (written only where a pass changed it),
with `kCommandBuffer` thunks holding the captured ones, indented (`read_thunks`). On jax
0.10.2 XLA also drops WHILE, CONDITIONAL and the traced kinds (CUBLAS, CUBLASLT, CUDNN,
CUSTOM_CALL, COLLECTIVES) when the device's CUDA driver or runtime is older than 12.3 or unknown;
a compile-only device states none unless its target config does (`targets.GpuSpec.cuda`), and
then captures kernels and copies only; jax 0.12.0.1 captures them without it.

Memory. Capture happens after buffer assignment: `memory_analysis()` is the same with and
without (`capture_report` reports both). What a graph costs at run time (the driver's memory
for instantiated graphs, the update of a graph's pointers when buffers move between calls) is
outside XLA's analysis and is measured only on a GPU (experiments/device_check.sh, step 2g).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import glob
import os
import re
import tempfile
from typing import Any, Callable, Iterator

import jax

from attn_jax import targets

FLAG = "xla_gpu_enable_command_buffer"
ENV = "ATTN_JAX_DECODE_COMMAND_BUFFERS"
# XLA's default set on both JAX lines (module docstring), in XLA's enum order
COMMON_DEFAULT = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL", "DYNAMIC_SLICE_FUSION",
                  "CONDITIONAL")
_OFF_WORDS = ("0", "off", "false", "no")
_ENABLED: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "attn_jax_decode_command_buffers", default=None)


# ------------------------------------------------------------------ the options

def default_commands() -> tuple[str, ...]:
  """XLA's default `xla_gpu_enable_command_buffer` on this JAX line (module docstring)."""
  extra = ("COLLECTIVES_KERNEL",) if jax.__version_info__ >= (0, 12) else ()
  return COMMON_DEFAULT + extra


def decode_commands() -> tuple[str, ...]:
  """The set decoding programs are compiled with: the line's default plus WHILE."""
  return default_commands() + ("WHILE",)


def enabled() -> bool:
  """Whether decoding programs get `decode_commands`: the innermost `use(...)`, else
  $ATTN_JAX_DECODE_COMMAND_BUFFERS (on unless 0 / off / false / no)."""
  forced = _ENABLED.get()
  if forced is not None:
    return forced
  value = os.environ.get(ENV, "1").strip().lower()
  if value not in _OFF_WORDS + ("1", "on", "true", "yes", ""):
    raise ValueError(f"${ENV}={value!r}: expected 1 / on or 0 / off")
  return value not in _OFF_WORDS


@contextlib.contextmanager
def use(on: bool) -> Iterator[None]:
  """Within this block decoding programs jitted get (on) or do not get (off) the options."""
  token = _ENABLED.set(bool(on))
  try:
    yield
  finally:
    _ENABLED.reset(token)


def compiler_options(platform: str) -> dict[str, str]:
  """XLA options for a decoding program compiled for `platform` ("gpu", "cpu", "tpu"): the
  command buffers of `decode_commands` on a GPU when `enabled()`, else none. Where $XLA_FLAGS
  names the option the process's own choice holds (`--xla_gpu_enable_command_buffer=`, the
  empty set, is what XLA's out-of-memory error for graphs advises): none either."""
  if platform != "gpu" or not enabled() or FLAG in os.environ.get("XLA_FLAGS", ""):
    return {}
  return {FLAG: ",".join(decode_commands())}


# ------------------------------------------------------------------ reading a dump

_THUNK_RE = re.compile(r"^(?P<indent> *)(?P<id>\d+):\s+(?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<rest>.*)$")
_LABEL_RE = re.compile(r"^\s*([\w ]+?)\s*:\s*$")
# thunks that hold others and launch nothing themselves
STRUCTURAL = frozenset({"kCommandBuffer", "kWhile", "kConditional", "kSequential"})


@dataclasses.dataclass
class Thunk:
  """One line of a thunk-sequence dump: its id, kind, name (a kernel's, else the rest of the
  line), the thunks it holds (a command buffer's captured ones, a loop's condition and body)
  with the region each is in ("condition", "body", a branch's label; "" directly)."""
  id: int
  kind: str
  name: str
  children: list["Thunk"] = dataclasses.field(default_factory=list)
  regions: list[str] = dataclasses.field(default_factory=list)

  def walk(self, captured: bool = False) -> Iterator[tuple["Thunk", bool]]:
    """(thunk, whether it is inside a command buffer) for its descendants."""
    inside = captured or self.kind == "kCommandBuffer"
    for c in self.children:
      yield c, inside
      yield from c.walk(inside)


def read_thunks(text: str) -> list[Thunk]:
  """The top-level thunks of a `*thunk_sequence*.txt` dump, nested by indentation: a thunk
  belongs to the closest thunk above it that is indented less, in the region its parent's last
  label line ("condition:", "body:") opened."""
  top: list[Thunk] = []
  stack: list[tuple[int, Thunk]] = []
  region: dict[int, str] = {}    # id(parent) -> the region its next children are in
  pending = ""
  for line in text.splitlines():
    m = _THUNK_RE.match(line)
    if m is None:
      if (lm := _LABEL_RE.match(line)) is not None:
        pending = lm.group(1)
      continue
    indent = len(m.group("indent"))
    name = m.group("rest").strip().split(" grid:")[0].strip() or m.group("kind")
    t = Thunk(int(m.group("id")), m.group("kind"), name)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if stack:
      parent = stack[-1][1]
      if pending:
        region[id(parent)] = pending
      parent.children.append(t)
      parent.regions.append(region.get(id(parent), ""))
    else:
      top.append(t)
    pending = ""
    stack.append((indent, t))
  return top


@dataclasses.dataclass(frozen=True)
class Loop:
  """A `kWhile` of the program: its name (the HLO instruction, from the thunk metadata),
  whether the loop itself is inside a command buffer (it then runs on the device: no host round
  trip per iteration), its condition's and body's launching thunks inside and outside command
  buffers (nested loops' included), and what the host launches per iteration of a loop it
  drives (`host_launches` of the condition and body sequences; 0 for a captured loop)."""
  name: str
  captured: bool
  inside: int
  outside: int
  per_iteration: int
@dataclasses.dataclass(frozen=True)
class Capture:
  """What a compiled program's thunks put in command buffers (counts of the dump, each thunk
  once: a loop body's thunks are not multiplied by its iterations).

  command_buffers   kCommandBuffer thunks (nested ones counted);
  inside / outside  launching thunks (every kind but `STRUCTURAL`: kernels, copies, library
                    calls) inside some command buffer / not;
  host_launches     what the host launches for one pass of the entry sequence: each top-level
                    command buffer once, each launching thunk outside them once (a loop outside
                    a command buffer adds `Loop.per_iteration` per iteration);
  by_kind           launching thunks by kind, as (inside, outside);
  loops             every kWhile, in program order."""
  command_buffers: int
  inside: int
  outside: int
  host_launches: int
  by_kind: dict[str, tuple[int, int]]
  loops: tuple[Loop, ...]

  def summary(self) -> str:
    loops = ", ".join(
        f"{lp.name}: " + ("captured" if lp.captured else
                          f"host-driven, {lp.per_iteration} host launches per iteration")
        + f" ({lp.inside} in / {lp.outside} out)" for lp in self.loops)
    return (f"{self.command_buffers} command buffer(s); {self.inside} launching thunks inside, "
            f"{self.outside} outside; {self.host_launches} host launches per pass"
            + (f"; loops: {loops}" if loops else ""))


def _launching(t: Thunk) -> bool:
  return t.kind not in STRUCTURAL


def host_launches(seq: list[Thunk]) -> int:
  """Launches the host makes for one pass of a sequence: its command buffers and its
  launching thunks (loops and conditionals it drives are not counted)."""
  return sum(1 for t in seq if t.kind == "kCommandBuffer" or _launching(t))


def capture_of(top: list[Thunk], names: dict[int, str] | None = None) -> Capture:
  """The `Capture` of a thunk sequence (`read_thunks`); `names`: {thunk id: its profile
  annotation} (`read_names`) to name the loops."""
  names = names or {}
  root = Thunk(-1, "kSequential", "entry", list(top), [""] * len(top))
  by_kind: dict[str, list[int]] = {}
  buffers = 0
  loops = []
  for t, captured in root.walk():
    if t.kind == "kCommandBuffer":
      buffers += 1
    if _launching(t):
      by_kind.setdefault(t.kind, [0, 0])[0 if captured else 1] += 1
    if t.kind == "kWhile":
      body = [(c, cap) for c, cap in t.walk(captured) if _launching(c)]
      per = 0 if captured else host_launches(t.children)
      loops.append(Loop(names.get(t.id, f"while thunk {t.id}"), captured,
                        sum(cap for _, cap in body), sum(not cap for _, cap in body), per))
  inside = sum(v[0] for v in by_kind.values())
  outside = sum(v[1] for v in by_kind.values())
  return Capture(buffers, inside, outside, host_launches(top),
                 {k: (v[0], v[1]) for k, v in sorted(by_kind.items())}, tuple(loops))


_META_RE = re.compile(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)')


def read_names(text: str) -> dict[int, str]:
  """{thunk id: profile annotation (the HLO instruction)} of a `*.thunk_metadata.txt` dump."""
  return {int(i): name for name, i in _META_RE.findall(text)}


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def read_dump(folder: str) -> dict[str, Capture]:
  """{module name: its Capture} for every module of an XLA:GPU dump folder: the sequence after
  the thunk passes where one was written, else the sequence as emitted (no pass changed it)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(folder, "*.thunk_sequence.txt"))):
    stem = path[:-len(".thunk_sequence.txt")]
    after = stem + ".thunk_sequence_after_thunk_passes.txt"
    meta = stem + ".thunk_metadata.txt"
    names = read_names(_read(meta)) if os.path.exists(meta) else {}
    text = _read(after if os.path.exists(after) else path)
    out[os.path.basename(stem).split(".", 1)[1]] = capture_of(read_thunks(text), names)
  if not out:
    raise ValueError(f"no *.thunk_sequence.txt in {folder}: not an XLA:GPU dump (xla_dump_to)")
  return out


def dumped_commands(folder: str) -> dict[str, tuple[str, ...]]:
  """{module name: the `xla_gpu_enable_command_buffer` it was compiled with} from each
  `*.config.pbtxt` of a dump (the option as XLA applied it: defaults included)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(folder, "*.config.pbtxt"))):
    name = os.path.basename(path)[:-len(".config.pbtxt")].split(".", 1)[1]
    out[name] = tuple(re.findall(rf"^\s*{FLAG}:\s*(\w+)\s*$", _read(path), re.M))
  return out


# ------------------------------------------------------------------ compiling with a dump

@dataclasses.dataclass(frozen=True)
class Compiled:
  """One program compiled with a dump: its capture, the command-buffer set XLA applied and its
  memory analysis (bytes: arguments, outputs, aliased, temporaries)."""
  capture: Capture
  commands: tuple[str, ...]
  memory: dict[str, int]


def compile_with_dump(lower: Callable[[], Any], options: dict | None = None) -> Compiled:
  """Compile `lower()` (a `jax.stages.Lowered`) with `options` plus a dump into a temporary
  folder, and read it. The module is the one the dump holds (one compile, one module)."""
  with tempfile.TemporaryDirectory(prefix="command_buffers_") as folder, \
      targets.no_persistent_cache():
    compiled = lower().compile({**(options or {}), "xla_dump_to": folder})
    captures, commands = read_dump(folder), dumped_commands(folder)
  if len(captures) != 1:
    raise ValueError(f"expected one module in the dump, got {sorted(captures)}")
  (name, capture), = captures.items()
  m = compiled.memory_analysis()
  memory = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias",
                                                              "temp")}
  return Compiled(capture, commands.get(name, ()), memory)
