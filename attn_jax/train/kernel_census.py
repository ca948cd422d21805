"""The attention kernels' compiled inner loops, counted without a GPU: the kernel census.

Each pass of the decayed-attention Pallas kernel (`kernels/decayed.py`: fwd, dq, dkv; called as
the SISA, FoX and ALiBi mixers call it) and JAX's own Pallas-Triton flash attention
(`jax.experimental.pallas.ops.gpu.attention.mha`, fwd and bwd: the reference row) is compiled
for an H100 through `attn_jax.targets` (compile-only devices), with XLA's dump
(`xla_dump_to`) into a temporary folder. From the dump:

  PTX (`*.ptx`)          one `.entry` per Triton kernel, named after its Pallas call
                         (decayed_fwd, decayed_dq, decayed_dkv, mha_forward, mha_backward);
  thunk sequence         each kernel's launch: grid, threads, dynamic shared memory (the PTX
                         declares `global_smem[]` without a size);

and from the traced program (`pallas_calls`, its jaxpr): each Pallas call's warps, stages and
the tile of each loop in its kernel body, the output shape [M, N] of the first matmul in the
loop body (the score tile q k^T of a flash-attention loop: [block_q, block_k]).

Convention (what a figure means):
- a *loop* of a kernel's PTX is a back-edge: a branch to a label at or before the branch; its
  blocks are the instructions from the label to the branch. Only innermost loops (no back-edge
  inside) are counted: Triton's software pipelining leaves one loop per `fori_loop` of the
  Pallas kernel, with its prologue and epilogue outside it. One iteration is a path through
  the loop's blocks from the label to a back-edge: a loop of one block (every kernel here at
  7a9c5ce) runs all of it; with a branch inside (a `lax.cond` / `pl.when`), the figures are
  those of the *longest* path (the most one iteration can cost; `Loop.shortest` and
  `Loop.static`, all its blocks, are kept beside it);
- an *instruction* is one PTX statement (text up to ';') that is not a directive (`.reg`, `.loc`,
  ...), a label, a comment or a brace: `@%p bra` and `mov` count, as do the statements of
  inline assembly (`wgmma.fence`, `wgmma.wait_group`);
- instructions per (query, key) element of a loop = its instructions (per thread, one
  iteration) x the kernel's threads / (M N), the loop's tile: every thread runs the loop's
  code once per tile of M x N elements;
- a kernel's loops form *chains* (`PallasCall.chains`, from the traced kernel): loops that
  hand one accumulation on (the carry one returns reaches the next one's operands) split the
  tiles between them, loops with accumulations of their own each visit every element (JAX's
  `mha_backward`: dk / dv over query tiles, then dq over key tiles). Chains are summed; the
  loops of one chain are weighted by their share of the tiles the chain visits over the
  launch (one iteration a tile), sum_l v_l x instructions_l x threads / sum_l v_l M_l N_l,
  v_l the tiles loop l visits. The decayed kernel runs one loop per tile class in each pass
  (`kernels/decayed.py`: FULL, then MASKED_FACTORED for SISA without FoX, then PARTIAL; EMPTY
  tiles are never visited), and v_l is its own schedule for the census's inputs
  (`decayed.tile_visits`, `_visits`): one document of T tokens (no packing, no padding, T a
  multiple of the tiles or padded as the kernel pads), causal, no window, g_t = -0.01 t (a
  cumulative log-decay falling 0.01 nats a token, `DECAY_PER_TOKEN`; FoX's and ALiBi's
  classes do not depend on g, SISA's do). The classes follow from positions, segments and g
  alone, so these counts are the launch's on any q, k, v (and SISA's c, b) of that shape. At T 2048 with the head-dim-64 tiles a pass visits the 240 off-diagonal tiles of the
  lower triangle in its FULL loop and the 32 meeting the diagonal in its MASKED_FACTORED
  (SISA) or PARTIAL (FoX, ALiBi) loop. SISA's PARTIAL loop (the per-element fallback: document
  boundaries, padding, a decay span beyond `decayed.FACTOR_SPAN` nats within a tile pair)
  depends on the data: for one document with gentle decay it visits no tile and weighs 0 in
  the figure (its cost alone is in `Pass.loop_instructions`); packed documents or strong
  decay give it a share. A kernel with no visit counts (JAX's `mha`, one loop per chain) takes
  each chain's largest loop;
- `ex2` per element the same for MUFU `ex2.approx` (libdevice's `expf` is one `ex2` among
  ~10 instructions; `exp2` with log2 e folded into the scale is the `ex2` alone);
- MMA: the loop's `wgmma.mma_async` (Hopper's warpgroup MMA) and `mma.sync` (Ampere's warp
  MMA, what Triton emits when a matmul's M is below 64 per warpgroup) instructions, by shape,
  per iteration (static count).

Counted statically, from the code: PTX is not SASS: ptxas schedules, fuses and may unroll
further, so these are the compiler's input, comparable between kernels compiled alike, not
cycle counts.

Checked against a hand count at 7a9c5ce (main, T 2048, head dim 64, bf16), this module's
counts: SISA fwd 66.1 / dq 55.6 / dkv 97.7 instructions per element (hand count: 66 / 56 / 98), ex2
3 / 2 / 4 (9 summed), dkv 160 `mma.sync` m16n8k16 an iteration (its matmuls over the 128 x 32
tile transposed, M = 32) beside 20 wgmma; FoX 54.1 / 40.3 / 63.7 (hand count: 54 / 41 / 64); JAX
`mha` fwd 10.1, bwd 43.8 (hand count: 10, 44). ALiBi is compiled here as the ALiBi mixer calls the
kernel today: through `score_bias.ScoreBiasAttention`, g a double word (hi, lo) like FoX's, so its
kernel and its counts are FoX's; the hand count's ALiBi row (51 / 37 / 60, 147 summed) is the kernel
given a single-word g (no lo): 50.5 / 36.8 / 59.5 here, 146.8 summed
(`DecayedCall(fox=True, single_word_g=True)`). The counts need XLA's backend optimisations,
which the test suite turns off (`_optimized`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import os
import re
import tempfile
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax import kernel_choice, targets
from attn_jax.kernels import decayed, ssd_chunks

# ---------------------------------------------------------------- PTX

_ENTRY_RE = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_NTID_RE = re.compile(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_LABEL_RE = re.compile(r"^\s*([\w$]+):")


def _statement(opcode: str) -> re.Pattern:
  """A PTX statement starting with `opcode` (a regex), under a guard predicate or not
  (`@%p1 bra ...`, `@!%p2 ex2...`)."""
  return re.compile(r"^(?:@!?%\w+\s+)?" + opcode)


_BRANCH_RE = _statement(r"bra(?:\.uni)?\s+([\w$]+)\s*$")
_EX2_RE = _statement(r"ex2\.approx")
_MMA_RE = _statement(r"((?:wgmma\.mma_async|mma\.sync)[\w.]*)")


@dataclasses.dataclass(frozen=True)
class Loop:
  """One innermost loop of a kernel's PTX: per iteration and thread, along its longest path
  (module docstring), its instructions, MUFU `ex2` and MMA instructions (by opcode:
  `wgmma.mma_async...m64n32k16...`, `mma.sync...`); `shortest`: the instructions of its
  shortest path; `static`: all the instructions of its blocks (branches inside the loop make
  the three differ)."""
  instructions: int
  ex2: int
  mma: dict[str, int]
  shortest: int = 0
  static: int = 0


@dataclasses.dataclass(frozen=True)
class KernelCode:
  """One `.entry` of a PTX module: its threads per block (`.reqntid` / `.maxntid`), its
  instructions and MMA instructions in all, and its innermost loops in program order."""
  name: str
  threads: int | None
  instructions: int
  mma: dict[str, int]
  loops: tuple[Loop, ...]
  ex2: int = 0          # MUFU ex2 in the whole kernel


def _statements(body: str) -> tuple[list[str], dict[str, int]]:
  """The instructions of a function body (module docstring: what counts) and each label's
  position (the index of the instruction after it)."""
  out, labels, pending = [], {}, ""
  for raw in body.splitlines():
    line = raw.split("//", 1)[0].strip()
    while line:
      m = _LABEL_RE.match(line)
      if m and not pending:
        labels[m.group(1)] = len(out)
        line = line[m.end():].strip()
        continue
      if line[0] in "{}" and not pending:
        line = line[1:].strip()
        continue
      stmt, sep, line = line.partition(";")
      pending = f"{pending} {stmt}".strip()
      if not sep:
        break
      if pending and not pending.startswith("."):
        out.append(" ".join(pending.split()))
      pending = ""
      line = line.strip()
  return out, labels


def _innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """The spans (first, last instruction; one per loop header, the farthest back-edge) that
  contain no other span, in program order."""
  by_head: dict[int, int] = {}
  for a, b in spans:
    by_head[a] = max(b, by_head.get(a, b))
  merged = sorted(by_head.items())
  return [(a, b) for a, b in merged
          if not any((a, b) != (c, d) and a <= c and d <= b for c, d in merged)]


def _count(stmts: Iterable[str]) -> tuple[int, int, dict[str, int]]:
  stmts = list(stmts)
  mma = collections.Counter(m.group(1) for s in stmts if (m := _MMA_RE.match(s)))
  return len(stmts), sum(bool(_EX2_RE.match(s)) for s in stmts), dict(sorted(mma.items()))


def _body(text: str, start: int) -> tuple[str, str]:
  """(the header between `.entry` and its body's '{', the body) of the entry at `start`."""
  open_ = text.index("{", text.index(")", start))
  depth, i = 0, open_
  while True:
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return text[start:open_], text[open_ + 1:i]
    i += 1


def _blocks(stmts: list[str], labels: dict[str, int], a: int, b: int) -> dict[int, tuple]:
  """The basic blocks of the loop [a, b]: {start: (end, successors, ends the iteration)},
  successors being the blocks a branch or the fall-through reach inside the loop; a block whose
  branch goes back to the header `a` ends an iteration."""
  inside = {pos for pos in labels.values() if a < pos <= b}
  starts = sorted({a} | inside | {i + 1 for i in range(a, b) if _BRANCH_RE.match(stmts[i])})
  out = {}
  for s, e in zip(starts, starts[1:] + [b + 1]):
    last = stmts[e - 1]
    m = _BRANCH_RE.match(last)
    succ, back = [], False
    if m:
      target = labels.get(m.group(1))
      back = target == a
      if target is not None and a < target <= b:
        succ.append(target)
    if (not m or last.startswith("@")) and e <= b:
      succ.append(e)
    out[s] = (e, succ, back)
  return out


def _paths(stmts: list[str], labels: dict[str, int], a: int, b: int):
  """(the instructions of the longest path from the header to a back-edge, the length of the
  shortest): the work of one iteration at most and at least. Paths that leave the loop (its
  exit) are not iterations."""
  blocks = _blocks(stmts, labels, a, b)
  INF = float("inf")
  longest: dict[int, tuple[float, list[int]]] = {}    # (instructions, blocks) to a back-edge
  shortest: dict[int, float] = {}
  for s in sorted(blocks, reverse=True):     # forward edges only: successors are solved first
    e, succ, back = blocks[s]
    rest = [longest[t] for t in succ if t > s] + ([(0, [])] if back else [])
    n, path = max(rest, key=lambda r: r[0], default=(-INF, []))
    longest[s] = (n + e - s, [s] + path)
    shortest[s] = (e - s) + min([shortest[t] for t in succ if t > s] + [0 if back else INF])
  n, path = longest[a]
  if n == -INF:
    return [], 0
  return [x for s in path for x in stmts[s:blocks[s][0]]], shortest[a]


def _loop(stmts: list[str], labels: dict[str, int], a: int, b: int) -> Loop:
  path, shortest = _paths(stmts, labels, a, b)
  n, ex2, mma = _count(path)
  return Loop(n, ex2, mma, int(shortest), b - a + 1)


def read_ptx(text: str) -> dict[str, KernelCode]:
  """Every kernel (`.entry`) of a PTX module, by name (module docstring: the convention)."""
  out = {}
  for m in _ENTRY_RE.finditer(text):
    header, body = _body(text, m.start())
    nt = _NTID_RE.search(header)
    threads = int(np.prod([int(x) for x in nt.groups() if x])) if nt else None
    stmts, labels = _statements(body)
    spans = []
    for i, s in enumerate(stmts):
      b = _BRANCH_RE.match(s)
      if b and b.group(1) in labels and labels[b.group(1)] <= i:
        spans.append((labels[b.group(1)], i))
    loops = tuple(_loop(stmts, labels, a, b) for a, b in _innermost(spans))
    n, ex2, mma = _count(stmts)
    out[m.group(1)] = KernelCode(m.group(1), threads, n, mma, loops, ex2)
  return out


# ---------------------------------------------------------------- launches

_THUNK_RE = re.compile(r"kCustomKernel\b.*?\]\s+([\w.$-]+)\s+grid:\s*\[([\d,\s]+)\]\s+"
                       r"threads:\s*\[([\d,\s]+)\]\s+shared_memory:\s*(\d+)\s*bytes")


@dataclasses.dataclass(frozen=True)
class Launch:
  """A kernel's launch as XLA's thunk sequence gives it."""
  grid: tuple[int, ...]
  threads: int
  shared_bytes: int


def read_launches(text: str) -> dict[str, Launch]:
  """{kernel name: its launch} of a `*.thunk_sequence*.txt` dump."""
  out = {}
  for m in _THUNK_RE.finditer(text):
    grid = tuple(int(x) for x in m.group(2).split(","))
    threads = int(np.prod([int(x) for x in m.group(3).split(",")]))
    out[m.group(1)] = Launch(grid, threads, int(m.group(4)))
  return out


# ---------------------------------------------------------------- the traced Pallas calls

@dataclasses.dataclass(frozen=True)
class PallasCall:
  """A Pallas call of a traced program: its name, Triton warps / stages (None elsewhere), the
  tile [M, N] of each innermost loop of its kernel, in program order, and each loop's chain:
  loops of one chain carry one accumulation from one to the next (a loop over full tiles, then
  one over partial tiles), loops of different chains accumulate apart (JAX's `mha_backward`:
  dk / dv, then dq). Empty: every loop its own chain."""
  name: str
  warps: int | None
  stages: int | None
  tiles: tuple[tuple[int, int], ...]
  chains: tuple[int, ...] = ()

  def chain_of(self) -> tuple[int, ...]:
    return self.chains or tuple(range(len(self.tiles)))


def _subjaxprs(params: dict):
  from jax.extend import core as jcore
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def _first_dot(jaxpr) -> tuple[int, int] | None:
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      shape = e.outvars[0].aval.shape
      return int(np.prod(shape[:-1])), int(shape[-1])
    for sub in _subjaxprs(e.params):
      if (t := _first_dot(sub)) is not None:
        return t
  return None


# a loop primitive -> its body's parameter (`fori_loop` is a `while`, or a `scan` when its bounds
# are static)
_LOOP_BODY = {"while": "body_jaxpr", "scan": "jaxpr"}


def _loops_of(jaxpr, next_chain: list[int]) -> list[tuple[tuple[int, int], int]]:
  """(tile, chain) of each innermost loop of a kernel body, in program order. Two loops of one
  jaxpr are of one chain when a value the first returns reaches the second's operands (the
  carry handed on); `next_chain` numbers the chains of the whole kernel."""
  out, level = [], []
  for idx, e in enumerate(jaxpr.eqns):
    inner = [x for sub in _subjaxprs(e.params) for x in _loops_of(sub, next_chain)]
    if e.primitive.name in _LOOP_BODY and not inner:
      tile = _first_dot(e.params[_LOOP_BODY[e.primitive.name]].jaxpr)
      if tile is not None:
        level.append((idx, len(out)))
        out.append((tile, -1))
    out += inner
  root = list(range(len(level)))
  for a, (idx, _) in enumerate(level):
    tainted = set(jaxpr.eqns[idx].outvars)
    for e in jaxpr.eqns[idx + 1:]:
      if any(v in tainted for v in e.invars if not hasattr(v, "val")):
        tainted.update(e.outvars)
    for b, (jdx, _) in enumerate(level[a + 1:], a + 1):
      if any(v in tainted for v in jaxpr.eqns[jdx].invars if not hasattr(v, "val")):
        root[b] = root[a]
  ids: dict[int, int] = {}
  for a, (_, pos) in enumerate(level):
    if root[a] not in ids:
      ids[root[a]] = next_chain[0]
      next_chain[0] += 1
    out[pos] = (out[pos][0], ids[root[a]])
  return out


def _loop_tiles(jaxpr) -> list[tuple[int, int]]:
  """The tile of each innermost loop of a kernel body, in program order."""
  return [t for t, _ in _loops_of(jaxpr, [0])]


def pallas_calls(jaxpr) -> list[PallasCall]:
  """Every Pallas call of a (closed) jaxpr, nested ones included, in program order."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      cp = e.params.get("compiler_params")
      cp = next(iter(cp.values()), None) if isinstance(cp, dict) else cp
      loops = _loops_of(e.params["jaxpr"], [0])
      out.append(PallasCall(str(e.params.get("name") or e.params["name_and_src_info"].name),
                            getattr(cp, "num_warps", None), getattr(cp, "num_stages", None),
                            tuple(t for t, _ in loops), tuple(c for _, c in loops)))
    else:
      for sub in _subjaxprs(e.params):
        out += pallas_calls(sub)
  return out


# ---------------------------------------------------------------- one pass's figures

@dataclasses.dataclass(frozen=True)
class Pass:
  """One compiled kernel of a census row (module docstring: what each figure means)."""
  variant: str
  kernel: str
  tiles: tuple[tuple[int, int], ...]
  warps: int | None
  stages: int | None
  threads: int
  shared_bytes: int | None
  instructions: float     # per (query, key) element of the kernel's loops (`_per_element`)
  ex2: float              # per element
  loop_mma: dict[str, int]     # per iteration of the loops, by opcode
  kernel_mma: dict[str, int]   # in the whole kernel
  shortest: float = 0.0        # instructions per element along the loops' shortest paths
  chains: tuple[int, ...] = ()            # each loop's chain (`PallasCall`)
  trips: tuple[int | None, ...] = ()      # the tiles each loop visits over the launch, if known
  loop_instructions: tuple[float, ...] = ()   # per element, each loop alone

  def mma_kinds(self) -> dict[str, int]:
    """{"wgmma": n, "mma.sync": n} in the loops (an iteration each)."""
    out: collections.Counter = collections.Counter()
    for op, n in self.loop_mma.items():
      out["wgmma" if op.startswith("wgmma") else "mma.sync"] += n
    return dict(out)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "Pass":
    d = dict(d, tiles=tuple(tuple(t) for t in d["tiles"]), chains=tuple(d.get("chains", ())),
             trips=tuple(d.get("trips", ())),
             loop_instructions=tuple(d.get("loop_instructions", ())))
    return cls(**d)


def _per_element(values: list[float], tiles, chains, trips, threads: int) -> float:
  """A per-iteration figure of each loop per (query, key) element of the kernel: each chain's
  loops (one accumulation over disjoint tiles) weighted by the tiles each visits (`trips`, one
  iteration a tile), sum_l trips_l v_l threads / sum_l trips_l M_l N_l, or the largest loop's
  when the visits are not known; the chains (accumulations of their own over every element)
  summed."""
  out = 0.0
  for c in sorted(set(chains)):
    idx = [i for i, ci in enumerate(chains) if ci == c]
    per = [values[i] * threads / (tiles[i][0] * tiles[i][1]) for i in idx]
    ts = [trips[i] if trips else None for i in idx]
    if len(idx) > 1 and None not in ts and sum(ts) > 0:
      out += (sum(t * values[i] * threads for t, i in zip(ts, idx))
              / sum(t * tiles[i][0] * tiles[i][1] for t, i in zip(ts, idx)))
    else:
      out += max(per)
  return out


def combine(variant: str, code: KernelCode, call: PallasCall, launch: Launch | None,
            trips: tuple[int | None, ...] = ()) -> Pass:
  """A kernel's figures from its PTX, its Pallas call, its launch and (optional) the tiles each
  loop visits (`_per_element`). The loops of the PTX and of the Pallas kernel must match one to
  one (else: an error naming both counts)."""
  if len(code.loops) != len(call.tiles):
    raise ValueError(f"{code.name}: {len(code.loops)} innermost loop(s) in the PTX against "
                     f"{len(call.tiles)} in the Pallas kernel ({call.tiles}): the census "
                     "cannot tell which tile each PTX loop iterates over")
  threads = launch.threads if launch else code.threads
  if threads is None:
    raise ValueError(f"{code.name}: no threads per block in the PTX nor the thunk sequence")
  chains = call.chain_of()
  per = functools.partial(_per_element, tiles=call.tiles, chains=chains, trips=trips,
                          threads=threads)
  mma: collections.Counter = collections.Counter()
  for loop in code.loops:
    mma.update(loop.mma)
  return Pass(variant, code.name, call.tiles, call.warps, call.stages, threads,
              launch.shared_bytes if launch else None,
              per([lp.instructions for lp in code.loops]), per([lp.ex2 for lp in code.loops]),
              dict(sorted(mma.items())), code.mma, per([lp.shortest for lp in code.loops]),
              chains, tuple(trips),
              tuple(lp.instructions * threads / (m * n)
                    for lp, (m, n) in zip(code.loops, call.tiles)))


def read_dump(folder: str) -> tuple[dict[str, KernelCode], dict[str, Launch]]:
  """The kernels of every PTX file of an XLA dump folder and their launches."""
  codes, launches = {}, {}
  for path in sorted(glob.glob(os.path.join(folder, "*.ptx"))):
    with open(path) as f:
      codes.update(read_ptx(f.read()))
  for path in sorted(glob.glob(os.path.join(folder, "*thunk_sequence*.txt"))):
    with open(path) as f:
      launches.update(read_launches(f.read()))
  return codes, launches


@contextlib.contextmanager
def _optimized():
  """XLA's backend (LLVM) optimisations on inside the block: the census counts the code a run
  gets, also where JAX_DISABLE_MOST_OPTIMIZATIONS is set (the test suite's tests/conftest.py;
  without them the same loops read ~1.8x the instructions)."""
  flag = "jax_disable_most_optimizations"
  before = jax.config.read(flag)
  jax.config.update(flag, False)
  try:
    yield
  finally:
    jax.config.update(flag, before)


def compile_dump(fn: Callable, args: tuple, device):
  """(the Pallas calls of `jax.jit(fn)(*args)`, the kernels of its PTX, their launches),
  compiled for `device` (a compile-only GPU device) with XLA's dump into a temporary folder."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  with kernel_choice.use_platform(device):
    calls = pallas_calls(jax.make_jaxpr(fn)(*args))
    mesh = Mesh(np.array([device]), ("x",))
    with tempfile.TemporaryDirectory(prefix="kernel_census_") as folder, \
        targets.no_persistent_cache(), _optimized():
      jax.jit(fn, in_shardings=NamedSharding(mesh, P())).lower(*args).compile(
          {"xla_dump_to": folder})
      codes, launches = read_dump(folder)
  return calls, codes, launches


def census_of(variant: str, fn: Callable, args: tuple, device,
              visits: dict[str, tuple[int, ...]] | None = None) -> list[Pass]:
  """The Pallas kernels of `jax.jit(fn)(*args)` compiled for `device` (a compile-only GPU
  device of `attn_jax.targets`), one Pass each, in program order. `visits`: {kernel name: the
  tiles each of its innermost loops visits over the launch, in program order} (`_visits`),
  which weight the loops of a chain (`_per_element`); a kernel absent from it has none (its
  chains take their largest loop's figure)."""
  calls, codes, launches = compile_dump(fn, args, device)
  visits = visits or {}
  out = []
  for call in calls:
    if call.name not in codes:
      raise ValueError(f"{variant}: Pallas call {call.name!r} has no kernel in the PTX of the "
                       f"dump (kernels there: {', '.join(sorted(codes))})")
    if call.tiles:    # a kernel without a loop (a preprocessing pass) is no census row
      ts = tuple(visits.get(call.name, ()))
      if ts and len(ts) != len(call.tiles):
        raise ValueError(f"{variant}: {call.name} has {len(call.tiles)} innermost loop(s) "
                         f"({call.tiles}) against {len(ts)} visit counts {ts}: the census "
                         "cannot tell which loop visits which tiles")
      out.append(combine(variant, codes[call.name], call, launches.get(call.name), ts))
  return out


# ---------------------------------------------------------------- the programs counted

@dataclasses.dataclass(frozen=True)
class DecayedCall:
  """How a mixer calls `decayed.decayed_attention` (the census compiles the same call):
  SISA's factors c, b (bf16 like q, d_state wide; g fp32), FoX's double-word g (hi, lo) with
  the logit bias (`fox=True`). `single_word_g`: g without its low word (not a mixer's call:
  what the hand count's ALiBi row measured)."""
  sisa: bool = False
  fox: bool = False
  single_word_g: bool = False


VARIANTS = {"SISA": DecayedCall(sisa=True), "FoX": DecayedCall(fox=True),
            # ALiBi: `fox.ScoreBiasAttention` with log f = -slope, called as FoX (hi, lo)
            "ALiBi": DecayedCall(fox=True)}
REFERENCE = "JAX mha"
D_STATE = 32     # SISA's d_state in the 152M / 369M presets (configs/sisa_152m.py)


def _decayed_program(call: DecayedCall, T: int, D: int, dtype, d_state: int = D_STATE):
  """(loss, abstract args): fwd + bwd of one head of the kernel, every input's gradient."""
  sds, f32 = jax.ShapeDtypeStruct, jnp.float32
  qkv = (sds((1, T, 1, D), dtype),) * 3
  args = qkv + (sds((1, T, 1), f32),)
  if call.fox and not call.single_word_g:
    args += (sds((1, T, 1), f32),)
  if call.sisa:
    args += (sds((1, T, 1, d_state), dtype),) * 2

  def loss(q, k, v, g, *rest):
    kw = dict(g_BTH=g, fox=call.fox)
    if call.fox and not call.single_word_g:
      kw["g_lo_BTH"], rest = rest[0], rest[1:]
    if call.sisa:
      kw["c_BTHS"], kw["b_BTHS"] = rest
    o = decayed.decayed_attention(q, k, v, scale=D ** -0.5, **kw)
    return jnp.sum(o.astype(f32) ** 2)
  return jax.grad(loss, argnums=tuple(range(len(args)))), args


def _reference_program(T: int, D: int, dtype):
  """JAX's Pallas-Triton flash attention, causal, at its default tiles and warps."""
  from jax.experimental.pallas.ops.gpu import attention
  sds = jax.ShapeDtypeStruct

  def loss(q, k, v):
    o = attention.mha(q, k, v, None, sm_scale=D ** -0.5, causal=True)
    return jnp.sum(o.astype(jnp.float32) ** 2)
  return jax.grad(loss, argnums=(0, 1, 2)), (sds((1, T, 1, D), dtype),) * 3


DECAY_PER_TOKEN = 0.01   # the census's log-decay: g_t = -0.01 t (a pair 100 tokens apart: e^-1)


def _visits(call: DecayedCall, T: int, D: int, *, gpu_tuning: decayed.GpuTuning | None = None,
            decay_per_token: float = DECAY_PER_TOKEN) -> dict[str, tuple[int, ...]]:
  """{kernel name: the tiles each loop of the pass visits, in program order} for the census's
  inputs (module docstring): the kernel's own schedule, `decayed.tile_visits`, one unpacked
  causal row of T tokens, g decaying by `decay_per_token` a token, the head dim's tiles
  (`gpu_tuning`: those of a call that names its own). Its loops are one per class
  in the order (FULL, MASKED_FACTORED, PARTIAL), the MASKED_FACTORED one only for SISA without
  FoX (`tile_visits`), where the class exists."""
  masked = call.sisa and not call.fox
  out = {}
  for name, (full, factored, partial) in decayed.tile_visits(
      T, D, fox=call.fox, sisa=call.sisa, gpu_tuning=gpu_tuning,
      decay_per_token=decay_per_token).items():
    if factored and not masked:
      raise ValueError(f"decayed.tile_visits: {factored} MASKED_FACTORED tiles in the {name} "
                       f"pass of a kernel without that loop ({call})")
    out[f"decayed_{name}"] = (full, factored, partial) if masked else (full, partial)
  return out


def _programs(name: str, T: int, D: int, dtype):
  """(fn, abstract args, the visits of its kernels' loops: `census_of`) of a census row."""
  if name == REFERENCE:
    return (*_reference_program(T, D, dtype), None)
  call = VARIANTS[name]
  return (*_decayed_program(call, T, D, dtype), _visits(call, T, D))


def _first_gpu(target: str):
  """The first device of GPU `target`; the census reads Triton's PTX, so a GPU is needed."""
  if targets.get(target).platform != "gpu":
    raise ValueError(f"the kernel census reads Triton's PTX: {target!r} is not a GPU target")
  return targets.devices(target)[0]


def census(target: str = "h100x1", *, seq_len: int = 2048, head_dim: int = 64,
           dtype=jnp.bfloat16, variants: Iterable[str] = (*VARIANTS, REFERENCE),
           progress: Callable[[str], None] | None = None) -> list[Pass]:
  """Every pass of the decayed kernel for each variant, and JAX's `mha`, compiled for the
  first device of GPU `target` at one batch row and one head of [seq_len, head_dim] (the
  counts are per element: the batch and heads change the grid, not the loops; the length
  changes the loops' code a little, e.g. SISA's dkv 97.9 at T 256, 97.7 at 2048 on main at
  7a9c5ce, and the share of tiles each loop visits: `_visits`)."""
  device = _first_gpu(target)
  out = []
  for name in variants:
    if progress:
      progress(f"kernel census: compiling {name} for {target} ...")
    fn, args, visits = _programs(name, seq_len, head_dim, dtype)
    out += census_of(name, fn, args, device, visits)
  return out


# ---------------------------------------------------------------- the SSD kernels

@dataclasses.dataclass(frozen=True)
class SsdCall:
  """How a mixer calls `kernels/ssd_chunks.py` (the census compiles the same call): R input
  arrays x_i B_i^T (`ssd_kernel`), or MIMO's `rank` (2r input, r output columns:
  `mimo_kernel`), J heads per B/C group, chunk Q."""
  inputs: int = 1
  rank: int = 0
  per_group: int = 1
  chunk: int = 64

  def tile(self) -> tuple[int, int]:
    """A chunk's [output rows, input rows] (`ssd_chunks`' L): [Q, Q], MIMO's [Q r, Q 2r]."""
    return (self.chunk * max(1, self.rank), self.chunk * max(1, 2 * self.rank))


SSD_HEADS = 4      # heads compiled (the loops' code is the same for more; a group's loop trips)
SSD_VARIANTS = {
    "Mamba-2": SsdCall(per_group=SSD_HEADS),     # one B/C group (the presets' n_groups 1)
    "Mamba-3": SsdCall(inputs=2),                # the trapezoid's two inputs, B/C per head
    "Mamba-3 MIMO": SsdCall(rank=4, chunk=16),   # the paper's rank 4 with chunk 64 / r
}


def _ssd_program(call: SsdCall, T: int, P: int, N: int, dtype):
  """(loss, abstract args): fwd + bwd of one row of `SSD_HEADS` heads through the kernels
  (`ssd_kernel`, or `mimo_kernel` for a rank), every input's gradient."""
  sds, f32, H = jax.ShapeDtypeStruct, jnp.float32, SSD_HEADS
  a = sds((1, T, H), f32)
  if call.rank:
    r = call.rank
    args = (sds((1, T, H, 2 * r, P), dtype), a, sds((1, T, H, 2 * r, N), dtype),
            sds((1, T, H, r, N), dtype))
    run = lambda u, a, k, q: ssd_chunks.mimo_kernel(u, a, k, q, chunk=call.chunk,
                                                    dot_dtype=dtype)
  else:
    G = H // call.per_group
    args = (sds((1, T, H, P), dtype), a, sds((1, T, G, N), dtype), sds((1, T, G, N), dtype))
    args += (sds((1, T, H, P), dtype), sds((1, T, G, N), dtype)) * (call.inputs - 1)

    def run(x, a, b, c, *extra):
      return ssd_chunks.ssd_kernel(x, a, b, c, chunk=call.chunk, dot_dtype=dtype,
                                   extra=tuple(extra) or None)

  def loss(*z):
    y, h = run(*z)
    return jnp.sum(y ** 2) + jnp.sum(h)
  return jax.grad(loss, argnums=tuple(range(len(args)))), args


def ssd_pass(variant: str, code: KernelCode, call: PallasCall, launch: Launch | None,
             tile: tuple[int, int]) -> Pass:
  """One SSD kernel's figures per element of a chunk's [output rows, input rows] tile, per head
  (`ssd_census`): its one innermost loop (a chunk or a group's head an iteration), or the
  whole kernel where it has none (one program a chunk and head)."""
  if len(code.loops) > 1:
    raise ValueError(f"{code.name}: {len(code.loops)} innermost loops in the PTX; the SSD "
                     "census counts one (a chunk or a head an iteration) or none")
  threads = launch.threads if launch else code.threads
  if threads is None:
    raise ValueError(f"{code.name}: no threads per block in the PTX nor the thunk sequence")
  per = threads / (tile[0] * tile[1])
  if code.loops:
    lp = code.loops[0]
    n, ex2, mma, short = lp.instructions, lp.ex2, lp.mma, lp.shortest
  else:
    n, ex2, mma, short = code.instructions, code.ex2, code.mma, code.instructions
  return Pass(variant, code.name, (tile,), call.warps, call.stages, threads,
              launch.shared_bytes if launch else None, n * per, ex2 * per, dict(mma), code.mma,
              short * per, (0,), (), ())


_MNK_RE = re.compile(r"\.m(\d+)n(\d+)k(\d+)\.")


def tensor_macs(p: Pass) -> float:
  """Tensor-core multiply-adds per element of a one-tile pass (an SSD kernel): its loop's (or
  kernel's) MMA instructions by shape, m n k each, a `wgmma` per warpgroup (128 threads), an
  `mma.sync` per warp, x the warpgroups / warps, over the tile's elements."""
  macs = 0.0
  for op, n in p.loop_mma.items():
    m = _MNK_RE.search(op)
    if m is None:
      raise ValueError(f"{p.kernel}: no m/n/k shape in MMA {op!r}")
    per = p.threads / (128 if op.startswith("wgmma") else 32)
    macs += n * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * per
  (M, N), = p.tiles
  return macs / (M * N)


def per_64_macs(passes: Iterable[Pass]) -> dict[str, float]:
  """{variant: its passes' instructions per element / (their tensor-core multiply-adds per
  element / 64)}: instructions per head-dim-64 matmul's worth of MMA work (`ssd_census`)."""
  out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  for p in passes:
    out[p.variant][0] += p.instructions
    out[p.variant][1] += tensor_macs(p)
  return {v: n / (m / 64) for v, (n, m) in out.items() if m}


def ssd_census(target: str = "h100x1", *, seq_len: int = 2048, head_dim: int = 64,
               d_state: int = 64, dtype=jnp.bfloat16, variants: Iterable[str] = tuple(SSD_VARIANTS),
               progress: Callable[[str], None] | None = None) -> list[Pass]:
  """Every kernel of the fused chunked SSD (`kernels/ssd_chunks.py`: states, scan, dstates,
  dchunk) as each mixer calls it (`SSD_VARIANTS`), compiled for the first device of GPU
  `target` at one row of `SSD_HEADS` heads of [seq_len, head_dim], d_state wide, with XLA's
  dump (as `census`).

  Convention: figures per element of a chunk's tile, per head: the tile is the intra-chunk
  matrix L's [output rows, input rows], [Q, Q] (a (t, s) pair of tokens), MIMO's [Q r, Q 2r]
  (a pair of a token's output column and a token's input column, `ssd_chunks.mimo_kernel`); a
  kernel's instructions (and `ex2`) per thread for one chunk of one head x its threads / the
  tile's elements. The states and dstates kernels pass the state along the chunks in one loop
  (an iteration a chunk), dchunk loops over a group's heads (an iteration a head) when a group
  has several (Mamba-2), so their figure is their loop's (the set-up before the loop, shared
  by the chunks or heads, is left out, as the attention census leaves out a loop's prologue);
  the scan (one program a chunk and head) and a dchunk of one head a group (Mamba-3) count the
  whole kernel. The four figures summed are one element's forward and backward: comparable
  with flash attention's per (query, key) element (a chunk's Q x Q block is a tile of the
  causal matrix, its lower half used). `per_64_macs` divides them by the tensor-core work per
  element (`tensor_macs`, in units of a head-dim-64 matmul's 64 multiply-adds): the SSD does
  ~3x attention's matmul work per element (C B^T, its product with x, the states, the state
  output, their backward products, and the split segment sums), so that ratio is the figure
  to hold against flash attention's.

  At 0f2bf8a (the kernels' first form here, T 2048, P = N = 64, bf16): Mamba-2 213.0 per
  element (states 27.4, scan 50.5, dstates 27.5, dchunk 107.7), Mamba-3 271.4, every MMA a
  wgmma: the per-chunk sums A, E, z were cross-lane reductions in every kernel then (~400 of
  877 instructions of the states loop were shuffles and adds); made once by the states kernel
  since, on the tensor cores (`ssd_chunks._row_sums`): Mamba-2 153.9, Mamba-3 216.7, MIMO 93.1."""
  device = _first_gpu(target)
  out = []
  for name in variants:
    if progress:
      progress(f"kernel census: compiling the SSD kernels as {name} calls them for {target} ...")
    call = SSD_VARIANTS[name]
    fn, args = _ssd_program(call, seq_len, head_dim, d_state, dtype)
    calls, codes, launches = compile_dump(fn, args, device)
    for c in calls:
      if c.name not in codes:
        raise ValueError(f"{name}: Pallas call {c.name!r} has no kernel in the PTX of the dump")
      out.append(ssd_pass(name, codes[c.name], c, launches.get(c.name), call.tile()))
  return out


# ---------------------------------------------------------------- reading the census

@dataclasses.dataclass(frozen=True)
class Total:
  """A variant's passes summed: instructions and ex2 per element, `mma.sync` per iteration."""
  instructions: float
  ex2: float
  mma_sync: int


def totals(passes: Iterable[Pass]) -> dict[str, Total]:
  out: dict[str, list[Pass]] = collections.defaultdict(list)
  for p in passes:
    out[p.variant].append(p)
  return {v: Total(sum(p.instructions for p in ps), sum(p.ex2 for p in ps),
                   sum(p.mma_kinds().get("mma.sync", 0) for p in ps))
          for v, ps in out.items()}


def _pass_name(kernel: str) -> str:
  return kernel.removeprefix("decayed_").removeprefix("ssd_")


def _mma(p: Pass) -> str:
  return ", ".join(f"{n} {k}" for k, n in sorted(p.mma_kinds().items())) or "none"


def _instructions(p: Pass) -> str:
  """'66.1', or '66.1 (41.0 shortest)' when a branch inside the loop gives paths of two costs."""
  short = f" ({p.shortest:.1f} shortest)" if round(p.shortest, 1) < round(p.instructions, 1) \
      else ""
  return f"{p.instructions:.1f}{short}"


def _tiles(p: Pass) -> str:
  """'128x32'; loops of one chain joined by '>', chains by '+', each loop's iterations over the
  launch (the tiles it visits) in brackets where known: '128x64 [240] > 128x64 [32]'."""
  chains = p.chains or tuple(range(len(p.tiles)))
  out = ""
  for i, (m, n) in enumerate(p.tiles):
    if i:
      out += " > " if chains[i] == chains[i - 1] else " + "
    out += f"{m}x{n}" + (f" [{p.trips[i]}]" if p.trips and p.trips[i] is not None else "")
  return out


def _each_loop(p: Pass) -> str:
  """Each loop's instructions per element alone ('10.1 > 33.2': one chain; '+': chains), for
  a kernel of several loops; '' for one loop."""
  if len(p.loop_instructions) < 2:
    return ""
  chains = p.chains or tuple(range(len(p.tiles)))
  out = f"{p.loop_instructions[0]:.1f}"
  for i in range(1, len(p.loop_instructions)):
    out += (" > " if chains[i] == chains[i - 1] else " + ") + f"{p.loop_instructions[i]:.1f}"
  return out


def _loops_line(p: Pass) -> str | None:
  each = _each_loop(p)
  return f"  {'':8s} {'':14s} each loop alone: {each} instr" if each else None


ATTENTION_UNIT = "per (query, key) element of each pass's inner loop(s)"
SSD_UNIT = "per (t, s) element of a chunk and head (`ssd_census`)"


def format_census(passes: list[Pass], where: str = "", unit: str = ATTENTION_UNIT) -> str:
  """The census as lines a person reads (experiments/train.py --compile_only prints it)."""
  lines = [f"kernel census{where}: {unit} (train/kernel_census.py)"]
  for p in passes:
    smem = "?" if p.shared_bytes is None else f"{p.shared_bytes / 1024:.0f} KiB"
    lines.append(f"  {p.variant:8s} {_pass_name(p.kernel):14s} {_instructions(p):>6s} instr"
                 f"  {p.ex2:4.2f} ex2  MMA/iter: {_mma(p):24s} tiles {_tiles(p):9s} "
                 f"warps {p.warps} stages {p.stages}  smem {smem}")
    if (loops := _loops_line(p)) is not None:
      lines.append(loops)
  for v, t in totals(passes).items():
    lines.append(f"  {v:8s} {'sum':14s} {t.instructions:6.1f} instr  {t.ex2:4.2f} ex2  "
                 f"mma.sync/iter {t.mma_sync}")
  return "\n".join(lines)


def markdown(passes: list[Pass]) -> list[str]:
  """The census as a markdown table (docs/hardware.md), one row per pass and one per sum."""
  lines = ["| variant | pass | instructions / element | ex2 / element | MMA per iteration "
           "| tiles [iterations] | warps | stages | shared memory |",
           "|---|---|---|---|---|---|---|---|---|"]
  tot = totals(passes)
  for v in tot:
    for p in (p for p in passes if p.variant == v):
      smem = "?" if p.shared_bytes is None else f"{p.shared_bytes / 1024:.0f} KiB"
      each = _each_loop(p)
      each = f" (loops: {each})" if each else ""
      lines.append(f"| {v} | {_pass_name(p.kernel)} | {_instructions(p)}{each} | {p.ex2:.2f} | "
                   f"{_mma(p)} | {_tiles(p)} | {p.warps} | {p.stages} | {smem} |")
    t = tot[v]
    lines.append(f"| **{v}** | **sum** | **{t.instructions:.1f}** | **{t.ex2:.2f}** | "
                 f"mma.sync {t.mma_sync} | | | | |")
  return lines


def passes_json(passes: list[Pass]) -> list[dict[str, Any]]:
  return [p.to_json() for p in passes]
