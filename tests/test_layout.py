"""The package's layout rules: one file per stem, the library never reaches up into configs/,
mixer discovery imports the mixer packages only (no reference models), no import cycle
(counting the edges that discovery's `import_module` makes), the package's own imports in
module order, and no mixer module naming an attention core (the kernels room chooses)."""

import ast
import collections
import io
import pathlib
import re
import subprocess
import sys
import tokenize

from attn_jax import registry

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "attn_jax"
IMPORTS_CONFIGS = re.compile(r"^\s*(from configs\b|import configs\b)|import_module\(f?[\"']configs\.",
                             re.M)


def test_every_module_stem_is_unique():
  stems = collections.Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
  assert [s for s, n in stems.items() if n > 1] == []


def test_the_library_does_not_import_the_configs_folder():
  """Entry points (experiments/) load configs and pass them in. bench/configs.py, the
  benchmark's config names, is the one exception left (its names are configs/ files)."""
  readers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if IMPORTS_CONFIGS.search(p.read_text())}
  assert readers <= {"bench/configs.py"}, sorted(readers)


def test_mixer_discovery_imports_no_reference_model():
  code = ("import sys; from attn_jax.registry import available_mixers; available_mixers(); "
          "print(sorted(m for m in sys.modules if m.startswith('attn_jax.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""}).stdout
  assert "attn_jax.study" not in out and "mamba2_minimal" not in out
  assert "attn_jax.ssm.mamba2" in out and "attn_jax.attention.sisa" in out


def _import_nodes(statements):
  """Every import statement among `statements` and inside them (function-local ones too),
  except those under `if TYPE_CHECKING:` (never run)."""
  for node in statements:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                  "typing.TYPE_CHECKING"):
      yield from _import_nodes(node.orelse)
    else:
      yield from _import_nodes(ast.iter_child_nodes(node))


def _runtime_import_graph() -> dict[str, set[str]]:
  """{module: the attn_jax modules it imports when run}, plus the edges attn_jax.registry's
  discovery adds (`importlib.import_module` of every module of `_PACKAGES`). A package's
  `__init__` importing its own children is not counted."""
  files = {}
  for f in PACKAGE.rglob("*.py"):
    parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  graph = {m: set() for m in files}
  for mod, f in files.items():
    package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
    for node in _import_nodes(ast.parse(f.read_text()).body):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        base = node.module or ""
        if node.level:
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
      graph[mod] |= {n for n in names if n in files and n != mod
                     and not (n.startswith(mod + ".") or mod.startswith(n + "."))}
  for pkg in registry._PACKAGES:
    graph["attn_jax.registry"] |= {m for m in files if m.startswith(pkg + ".")}
  return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as a path [a, b, ..., a], or None (depth-first search)."""
  state, path = {}, []

  def visit(mod):
    state[mod] = "open"
    path.append(mod)
    for dep in sorted(graph[mod]):
      if state.get(dep) == "open":
        return path[path.index(dep):] + [dep]
      if dep not in state:
        found = visit(dep)
        if found:
          return found
    state[mod] = "done"
    path.pop()
    return None

  for mod in sorted(graph):
    if mod not in state:
      found = visit(mod)
      if found:
        return found
  return None


def test_no_import_cycle_through_the_registry_discovery():
  """The registry imports every mixer module on first lookup, so a mixer module (or anything it
  imports) that imports attn_jax.config, which imports the registry, closes a cycle that a
  plain import scan does not see. Annotation-only imports go under `if TYPE_CHECKING:`."""
  cycle = _a_cycle(_runtime_import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _local_imports():
  """(file:line, why) of every attn_jax import inside a function; `why` is the comment on its
  line or the line above, or the enclosing function's docstring sentence naming the import."""
  for path in sorted(PACKAGE.rglob("*.py")):
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    for fn in ast.walk(tree):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      doc = ast.get_docstring(fn) or ""
      for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attn_jax"):
          here = lines[node.lineno - 1] + lines[node.lineno - 2]
          why = here.partition("#")[2].strip() or ("import" in doc and doc)
          yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", why


def test_function_local_imports_are_few_and_say_why():
  """attn_jax imports sit at the top of a file, except where a cycle or start-up time needs
  otherwise (at most 15 places), and each such place says why."""
  found = list(_local_imports())
  assert len(found) <= 15, [where for where, _ in found]
  assert all(why for _, why in found), [where for where, why in found if not why]


def _unsorted_import_runs():
  """(file:line, modules) of every run of adjacent top-level `from attn_jax... import` /
  `import attn_jax...` statements (no other line between them) not in module order."""
  for path in sorted(PACKAGE.rglob("*.py")):
    run, last, start = [], None, None
    for node in ast.parse(path.read_text()).body + [None]:
      mod = None
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attn_jax"):
        mod = node.module
      elif isinstance(node, ast.Import) and node.names[0].name.startswith("attn_jax"):
        mod = node.names[0].name
      if mod is not None and last is not None and node.lineno == last + 1:
        run.append(mod)
      else:
        if run != sorted(run):
          yield f"{path.relative_to(PACKAGE.parent)}:{start}", run
        run, start = ([mod], node.lineno) if mod is not None else ([], None)
      last = node.end_lineno if mod is not None else None


def test_the_packages_own_imports_are_in_module_order():
  """Within each block of attn_jax imports, modules in alphabetical order (a reader finds one
  at a glance; a rename that leaves it out of place shows here)."""
  assert list(_unsorted_import_runs()) == []


def test_every_entry_point_stays_thin():
  """experiments/*.py: flags in, one library call out; the work lives in attn_jax, importable
  without flag parsing. Each stays within 200 lines (docstring included)."""
  entry_points = sorted((PACKAGE.parent / "experiments").glob("*.py"))
  assert len(entry_points) >= 20
  long = {p.name: n for p in entry_points if (n := len(p.read_text().splitlines())) > 200}
  assert long == {}, long


NAMES_A_CORE = re.compile(r"cudnn|splash|pallas|triton", re.I)


def _code_mentions(source: str, pattern: re.Pattern) -> list[tuple[int, str]]:
  """(line, token) of every token of `source` matching `pattern`, leaving out comments and
  docstrings (module, class and function ones); names and other strings (error messages,
  implementation names) count."""
  docs = set()
  for node in ast.walk(ast.parse(source)):
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      docs.update(range(body[0].lineno, body[0].end_lineno + 1))
  return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
          if t.type != tokenize.COMMENT and not (t.type == tokenize.STRING and t.start[0] in docs)
          and pattern.search(t.string)]


def test_the_code_scan_sees_names_and_strings_but_not_comments_or_docstrings():
  src = ('"""Runs on splash."""\n'
         'def f(impl):\n  """cuDNN or Triton."""\n  # pallas\n'
         '  return impl == "cudnn" or splash_core()\n')
  assert _code_mentions(src, NAMES_A_CORE) == [(5, '"cudnn"'), (5, "splash_core")]


def test_no_mixer_module_names_a_core():
  """Mixers (attention/, ssm/) compute features and call the kernels room's entry point
  (kernels/entry.py), which chooses the core through kernel_choice and calls it: no mixer code
  names a core or a kernel language (comments and docstrings may, to explain)."""
  found = {f"{p.relative_to(PACKAGE)}:{line}": tok
           for folder in ("attention", "ssm") for p in sorted((PACKAGE / folder).glob("*.py"))
           for line, tok in _code_mentions(p.read_text(), NAMES_A_CORE)}
  assert found == {}
