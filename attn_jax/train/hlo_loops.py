"""Serial loop iterations and kernel launches of a compiled XLA program, read from its text.

XLA:GPU drives a `while` loop from the host: every iteration launches the body's kernels and
copies the loop's predicate back to the host before deciding on the next (~27 us an iteration
on an H200), so a step costs a term linear in the loop iterations it executes,
whatever the work inside them. `read(compiled.as_text())` (the optimized HLO) gives, for one
execution of the program:

  loops              every `while` instruction reached from the entry computation: its trip
                     count and its iterations per execution, the product of its own trips and
                     the trips of every loop it is nested in (a while inside a while's body or
                     condition). A loop inside a computation another instruction calls (a
                     fusion, a `call`, a conditional's branch, an async wrapper) belongs to the
                     computation of that instruction. Every branch of a conditional is counted
                     as if it ran: an upper bound.
  serial_iterations  the sum of the loops' iterations, over the loops whose count is known;
  unknown_loops      the loops whose count is not known (listed with trips None, not summed);
  conditionals       conditionals executed per execution, outside loops of unknown count
                     (XLA:GPU reads each predicate on the host too);
  launches           kernel launches per execution: the instructions of the computations the
                     program runs as control flow (the entry, loop bodies and conditions,
                     `call`ed computations, conditional branches), each times the iterations of
                     the loops around it, except those that launch nothing: parameters,
                     constants, tuples and their elements, bitcasts, the control-flow ops
                     themselves (their computations are counted instead) and the `-done` /
                     `-update` halves of async pairs. A fusion is one launch however many ops it
                     fuses, and so is a custom call (cuDNN, cuBLAS, Triton, Mosaic), a
                     collective, a copy. None when a launch sits in a loop of unknown count. On
                     a TPU the program runs on the chip without a host launch per op: there the
                     figure counts the top-level ops the chip runs, comparable across mixers,
                     not a host cost.

Trip counts: XLA's GPU and CPU compilers record `"known_trip_count":{"n":"12"}` in a loop's
backend_config. The TPU compiler does not; there the count is read from the loop when it has
the form a `lax.scan` / `fori_loop` compiles to: the condition's root compares one tuple
element i with a constant N (`i < N`), i enters the loop as a constant i0 and the body's i is
i + s for a constant s: ceil((N - i0) / s) trips (`WhileLoop.trips_from` says which). Any other
loop (a `lax.while_loop` on data) has an unknown count.

Each loop names its source, file:line of the innermost frame of the code that made it (the
program's stack-frame tables, or `source_file` / `source_line` in older metadata).
"""

from __future__ import annotations

import dataclasses
import math
import re

_HEADER_RE = re.compile(r"^(ENTRY )?%([\w.-]+) .*\{$")
_INSTR_RE = re.compile(r"^\s+(ROOT )?%([\w.-]+) = (.*)$", re.S)
_OPCODE_RE = re.compile(r"\s([a-z][a-z0-9-]*)\(")    # after the shape: "f32[4]{0} sine("
_NAME_RE = re.compile(r"%([\w.-]+)")
_TRIPS_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDEX_RE = re.compile(r"\bindex=(\d+)")
_FRAME_RE = re.compile(r"\bstack_frame_id=(\d+)")
_SOURCE_RE = re.compile(r'source_file="([^"]+)" source_line=(\d+)')
_TABLE_ROW_RE = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')
NO_LAUNCH = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                       "call", "conditional", "after-all", "add-dependency", "opt-barrier",
                       "domain"})
CONTROL = frozenset({"while", "call", "conditional"})   # their computations run as the program


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction: `%name = shape opcode(args), attrs`."""
  name: str
  opcode: str
  args: str          # the text between the opcode's parentheses (a constant's literal)
  attrs: str         # the text after them
  root: bool

  @property
  def operands(self) -> list[str]:
    return _NAME_RE.findall(self.args)


@dataclasses.dataclass(frozen=True)
class WhileLoop:
  name: str                  # the while instruction
  computation: str           # the computation it lives in
  trips: int | None          # per entry into the loop; None: unknown
  trips_from: str            # "xla" (known_trip_count), "condition" (i < N), "unknown"
  iterations: int | None     # per program execution: trips x those of the enclosing loops
  depth: int                 # enclosing loops
  source: str                # file:line of the code that made it ("" when not recorded)


@dataclasses.dataclass
class Loops:
  """What `read` finds in one program (module docstring)."""
  loops: list[WhileLoop] = dataclasses.field(default_factory=list)
  launches: int | None = 0
  conditionals: int = 0

  @property
  def serial_iterations(self) -> int:
    return sum(lp.iterations for lp in self.loops if lp.iterations is not None)

  @property
  def unknown_loops(self) -> int:
    return sum(lp.iterations is None for lp in self.loops)

  def by_source(self) -> dict[str, int | None]:
    """Iterations per execution by the loops' source, largest first (None: unknown count)."""
    out: dict[str, int | None] = {}
    for lp in self.loops:
      key = lp.source or lp.name
      prev = out.get(key, 0)
      out[key] = None if prev is None or lp.iterations is None else prev + lp.iterations
    return dict(sorted(out.items(), key=lambda kv: -1 if kv[1] is None else -kv[1]))


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
  """({computation: its instructions}, the entry computation's name) of an HLO module's text.
  An instruction may span lines (a custom call's backend_config holding newlines): a line of a
  computation that starts no instruction continues the one before."""
  comps: dict[str, list[Instr]] = {}
  entry, current, lines = "", None, []
  for line in text.splitlines():
    if current is None:
      m = _HEADER_RE.match(line)
      if m:
        current, lines = comps.setdefault(m.group(2), []), []
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.rstrip() == "}" or _INSTR_RE.match(line):
      ins = _instruction("\n".join(lines)) if lines else None
      current.extend([ins] if ins is not None else [])
      lines = [line]
      if line.rstrip() == "}":
        current = None
    elif lines:
      lines.append(line)
  return comps, entry


def _instruction(line: str) -> Instr | None:
  m = _INSTR_RE.match(line)
  if not m:
    return None
  rest = m.group(3)
  op = _OPCODE_RE.search(rest)
  if not op:
    return None
  start = op.end() - 1            # the opcode's "("
  depth, end = 0, len(rest)
  for i in range(start, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    if depth == 0:
      end = i
      break
  return Instr(m.group(2), op.group(1), rest[start + 1:end], rest[end + 1:], bool(m.group(1)))


def frame_sources(text: str) -> dict[int, str]:
  """{stack_frame_id: "file:line"} from the module's FileNames / FileLocations / StackFrames
  tables (a frame's own location: the innermost frame JAX kept)."""
  tables: dict[str, dict[int, str]] = {}
  table = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      table = tables.setdefault(line, {})
      continue
    m = _TABLE_ROW_RE.match(line) if table is not None else None
    if not m:
      table = None
      continue
    table[int(m.group(1))] = m.group(2) if m.group(2) is not None else m.group(3)
  files, locs = tables.get("FileNames", {}), tables.get("FileLocations", {})
  out = {}
  for fid, frame in tables.get("StackFrames", {}).items():
    loc = locs.get(_field(frame, "file_location_id"), "")
    path = files.get(_field(loc, "file_name_id"))
    if path is not None:
      out[fid] = f"{short_path(path)}:{_field(loc, 'line')}"
  return out


def _field(row: str, key: str) -> int:
  m = re.search(rf"\b{key}=(\d+)", row)
  return int(m.group(1)) if m else -1


def short_path(path: str) -> str:
  """A source path as the report names it: from the package down, else the file's name."""
  return path.split("/attn_jax/", 1)[1] if "/attn_jax/" in path else path.rsplit("/", 1)[-1]


class _Module:
  def __init__(self, text: str):
    self.comps, self.entry = parse(text)
    self.by_name = {i.name: i for instrs in self.comps.values() for i in instrs}
    self.frames = frame_sources(text)

  def callees(self, ins: Instr) -> list[str]:
    return [n for n in _NAME_RE.findall(ins.attrs) if n in self.comps]

  def attr_comp(self, ins: Instr, key: str) -> list[Instr]:
    m = re.search(rf"\b{key}=%([\w.-]+)", ins.attrs)
    return self.comps.get(m.group(1), []) if m else []

  def source(self, ins: Instr) -> str:
    m = _SOURCE_RE.search(ins.attrs)
    if m:
      return f"{short_path(m.group(1))}:{m.group(2)}"
    m = _FRAME_RE.search(ins.attrs)
    return self.frames.get(int(m.group(1)), "") if m else ""

  def through_copies(self, name: str) -> Instr | None:
    ins = self.by_name.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
      ins = self.by_name.get(ins.operands[0])
    return ins


def _int_constant(ins: Instr | None) -> int | None:
  if ins is None or ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.args.strip()):
    return None
  return int(ins.args)


def _tuple_index(mod: _Module, ins: Instr | None) -> int | None:
  """k when `ins` is element k of its computation's parameter (through copies)."""
  if ins is None or ins.opcode != "get-tuple-element":
    return None
  src = mod.through_copies(ins.operands[0])
  m = _INDEX_RE.search(ins.attrs)
  return int(m.group(1)) if src is not None and src.opcode == "parameter" and m else None


def _trips_from_condition(mod: _Module, loop: Instr) -> int | None:
  """ceil((N - i0) / s) for a loop `i < N` entered with i = i0 whose body adds s (module
  docstring); None for any other loop."""
  root = next((i for i in mod.attr_comp(loop, "condition") if i.root), None)
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
    return None
  lhs, rhs = (mod.through_copies(n) for n in root.operands[:2])
  k, bound = _tuple_index(mod, lhs), _int_constant(rhs)
  init = mod.through_copies(loop.operands[0]) if loop.operands else None
  if k is None or bound is None or init is None or init.opcode != "tuple":
    return None
  start = _int_constant(mod.through_copies(init.operands[k]))
  step = _body_step(mod, loop, k)
  if start is None or not step or step < 0:
    return None
  return max(0, math.ceil((bound - start) / step))


def _body_step(mod: _Module, loop: Instr, k: int) -> int | None:
  """s when the body's root tuple holds element k + constant s at position k."""
  root = next((i for i in mod.attr_comp(loop, "body") if i.root), None)
  if root is None or root.opcode != "tuple" or len(root.operands) <= k:
    return None
  add = mod.through_copies(root.operands[k])
  if add is None or add.opcode != "add":
    return None
  a, b = (mod.through_copies(n) for n in add.operands[:2])
  if _tuple_index(mod, a) == k:
    return _int_constant(b)
  return _int_constant(a) if _tuple_index(mod, b) == k else None


def _trips(mod: _Module, loop: Instr) -> tuple[int | None, str]:
  m = _TRIPS_RE.search(loop.attrs)
  if m:
    return int(m.group(1)), "xla"
  n = _trips_from_condition(mod, loop)
  return (n, "condition") if n is not None else (None, "unknown")


def launches(ins: Instr) -> bool:
  """Whether a top-level instruction launches work (module docstring)."""
  return ins.opcode not in NO_LAUNCH and not ins.opcode.endswith(("-done", "-update"))


def _times(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a * b


def _walk(mod: _Module, comp: str, times: int | None, control: bool, depth: int,
          out: Loops) -> None:
  """Add computation `comp`'s loops and launches, run `times` per execution (None: unknown);
  `control`: its instructions run as the program (not inside a kernel)."""
  for ins in mod.comps.get(comp, []):
    inner, inner_depth = times, depth
    if ins.opcode == "while":
      trips, how = _trips(mod, ins)
      inner, inner_depth = _times(times, trips), depth + 1
      out.loops.append(WhileLoop(ins.name, comp, trips, how, inner, depth, mod.source(ins)))
    elif ins.opcode == "conditional" and control:
      out.conditionals += times or 0
    elif control and launches(ins):
      out.launches = None if out.launches is None or times is None else out.launches + times
    for callee in mod.callees(ins):
      _walk(mod, callee, inner, control and ins.opcode in CONTROL, inner_depth, out)


def read(text: str) -> Loops:
  """The loops, launches and conditionals of one execution of the program in `text`."""
  mod = _Module(text)
  out = Loops()
  if mod.entry:
    _walk(mod, mod.entry, 1, True, 0, out)
  return out


def summary(loops: Loops, top: int = 3) -> str:
  """One line: "24 serial iterations in 2 while loops (loss.py:207 x16, ...); ..."."""
  n = len(loops.loops)
  unknown = f" + {loops.unknown_loops} loop(s) of unknown count" if loops.unknown_loops else ""
  parts = [f"{src} x{'?' if it is None else it}" for src, it in
           list(loops.by_source().items())[:top]]
  more = ", ..." if len(loops.by_source()) > top else ""
  where = f" ({', '.join(parts)}{more})" if parts else ""
  launches = "?" if loops.launches is None else loops.launches
  return (f"{loops.serial_iterations} serial iterations{unknown} in {n} while loop"
          f"{'s' * (n != 1)}{where}; {launches} launches, {loops.conditionals} conditionals "
          "per run")
