"""Command-line config overrides checked against the config before absl parses them.

`--config.model.foo=1` with no field `foo` makes ml_collections raise a bare AttributeError
("'foo'") from deep inside flag parsing. `check_overrides(config, argv)` walks every
`--config.<path>[=value]` (and absl's boolean `--noconfig.<path>`) through the loaded config and
raises `ConfigFieldError("config.model.foo: unknown field (known: ...)")` naming the full path,
the known fields and the closest match. `flags_parser()` plugs this into `absl.app.run`, so a
script prints one line and exits with status 2 instead of a traceback; so does a config file
that raises while it loads (`config_file_error`: the error and its file:line, not
ml_collections' traceback), and a flag value of the wrong type (`parse_flags`, which
`attn_jax.cli.run` uses for every entry point: absl alone exits 1).

`apply_overrides(config, ["model.d_model=512", ...])` is the same override as a list of strings,
for entry points that take overrides in one flag (experiments/bench.py's `--set`, its
"config@a.b=v" names): the path is checked by `check_path`, the value is read by the parser
`--config.<path>=<value>` would use for that field's type (ml_collections picks absl's integer,
float, boolean, string or its tuple parser by the field's current type; any other type: a Python
literal, else the string), and it is set through `config_path.set_value` as that flag sets it. A
value of the wrong type is a `ConfigFieldError` naming the field, its type and the value.
"""

from __future__ import annotations

import ast
import difflib
import linecache
import os
import sys
from typing import Any, Sequence

import ml_collections
from absl import flags
from ml_collections.config_flags import config_path, tuple_parser


class ConfigFieldError(ValueError):
  """An override names a field the config does not have."""


def _is_dict(node: Any) -> bool:
  return isinstance(node, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict, dict))


def check_path(config: Any, path: str, *, root: str = "config") -> None:
  """Raises ConfigFieldError unless `path` ("model.d_model") names a field of `config`."""
  node, done = config, root
  for key in path.split("."):
    if not _is_dict(node):
      raise ConfigFieldError(f"{done}: is a {type(node).__name__}, not a sub-config; cannot "
                             f"set {root}.{path}")
    keys = list(node.keys())
    if key not in keys:
      close = difflib.get_close_matches(key, keys, n=1)
      hint = f"; did you mean {done}.{close[0]}?" if close else ""
      raise ConfigFieldError(
          f"{done}.{key}: unknown field (known: {', '.join(sorted(keys))}){hint}")
    node, done = node[key], f"{done}.{key}"


# The parser ml_collections' config flag uses for a field of each type (`--config.<path>=v`).
_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser(),
            str: flags.ArgumentParser(), tuple: tuple_parser.TupleParser()}


def _literal(text: str) -> Any:
  """A field of any other type: a Python literal ("true" / "false" too), else the string."""
  try:
    return ast.literal_eval(text.capitalize() if text in ("true", "false") else text)
  except (ValueError, SyntaxError):
    return text


def split_overrides(text: str) -> list[str]:
  """"a.b=1,c=(2, 3)" -> ["a.b=1", "c=(2, 3)"]: commas inside brackets or quotes do not split."""
  items, depth, quote, start = [], 0, "", 0
  for i, ch in enumerate(text):
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      items.append(text[start:i])
      start = i + 1
  items.append(text[start:])
  return [item.strip() for item in items if item.strip()]


def parse_override(config: Any, item: str, *, root: str = "config") -> tuple[str, Any]:
  """"a.b=v" -> ("a.b", v): the path checked against `config`, v read as config.a.b's type."""
  path, eq, text = item.partition("=")
  path = path.strip()
  if not eq or not path:
    raise ConfigFieldError(f"override {item!r}: want <path>=<value>, e.g. model.d_model=512")
  check_path(config, path, root=root)
  field_type = config_path.get_type(path, config)
  parser = _PARSERS.get(field_type)
  try:
    return path, (parser.parse(text) if parser else _literal(text))
  except (ValueError, TypeError) as e:
    raise ConfigFieldError(f"{root}.{path}={text}: not a valid {field_type.__name__} "
                           f"({' '.join(map(str, e.args)) or type(e).__name__})") from None


def apply_overrides(config: Any, items: Sequence[str], *, root: str = "config") -> Any:
  """Sets each "path=value" of `items` on `config`, in order (a later item wins); returns it."""
  for item in items:
    path, value = parse_override(config, item, root=root)
    try:
      config_path.set_value(path, config, value)
    except TypeError as e:   # a ConfigDict field keeps its type
      raise ConfigFieldError(f"{root}.{path}={value!r}: {e}") from None
  return config


def override_paths(argv: Sequence[str], flag_name: str = "config") -> list[str]:
  """The dotted paths of `--<flag_name>.<path>` overrides in `argv` (also `--no<flag>.<path>`)."""
  paths = []
  for arg in argv[1:]:
    if arg == "--":
      break
    name = arg.lstrip("-").split("=", 1)[0]
    if not arg.startswith("-"):
      continue
    for prefix in (f"{flag_name}.", f"no{flag_name}."):
      if name.startswith(prefix):
        paths.append(name[len(prefix):])
        break
  return paths


def config_argument(argv: Sequence[str], flag_name: str = "config",
                    default: str | None = None) -> str | None:
  """The value of `--<flag_name>` in `argv` (either `--config=x` or `--config x`)."""
  value = default
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      break
    name, eq, rest = arg.lstrip("-").partition("=")
    if arg.startswith("-") and name == flag_name:
      value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else value)
  return value


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """A config file as `--config` would load it ("configs/x.py" or "configs/x.py:args")."""
  from ml_collections.config_flags.config_flags import ConfigFileFlagParser
  return ConfigFileFlagParser(name="config").parse(spec)


def config_file_problem(config: Any, spec: str, flag_name: str = "config") -> str | None:
  """Why `--<flag_name>=<spec>` did not load (ml_collections returns a placeholder object that
  fails on first use, e.g. for a missing file), or None when it did."""
  error = getattr(config, "_error", None) if type(config).__name__ == "_ErrorConfig" else None
  if error is None:
    return None
  path = spec.split(":", 1)[0]
  if not os.path.exists(path):
    return f"--{flag_name}={spec}: config file not found: {path!r}"
  return f"--{flag_name}={spec}: {type(error).__name__}: {error}"


def check_overrides(config: Any, argv: Sequence[str], flag_name: str = "config") -> None:
  for path in override_paths(argv, flag_name):
    check_path(config, path, root=flag_name)


def flags_parser(flag_name: str = "config", default: str | None = None):
  """An `absl.app.run(..., flags_parser=...)` that rejects a config file that does not load and
  unknown override fields in one line (exit status 2)."""

  def parse(argv):
    spec = config_argument(argv, flag_name, default)
    if spec is not None:
      try:
        config = load_config_file(spec)
        problem = config_file_problem(config, spec, flag_name)
        if problem is None:
          check_overrides(config, argv, flag_name)
      except ConfigFieldError as e:
        problem = str(e)
      except Exception as e:  # the config file itself fails (syntax, import): name it
        problem = f"--{flag_name}={spec}: {config_file_error(e)}"
      if problem:
        _fatal(problem)
    return parse_flags(argv)

  return parse


# where a config file's own frames are not: Python, the libraries, this package
_NOT_CONFIG_FILES = ("<", sys.prefix, sys.base_prefix, os.path.dirname(os.path.abspath(__file__)))


def config_file_error(e: BaseException) -> str:
  """One line for an error raised while a config file loaded: the error itself, not
  ml_collections' re-raise of it ("Error whilst parsing config file:" and the traceback as its
  message), and the config file's line it came from, with that line's source
  ('configs/x.py:4 (c.train.steps = "3")', which names the field)."""
  if str(e).startswith("Error whilst parsing config file") and e.__context__ is not None:
    e = e.__context__
  where, tb, called = "", e.__traceback__, False
  while tb is not None:   # the frames below ml_collections' call of get_config: the config's
    name = tb.tb_frame.f_code.co_filename
    called = called or "ml_collections" in name
    if called and not name.startswith(_NOT_CONFIG_FILES) and "site-packages" not in name:
      line = linecache.getline(name, tb.tb_lineno).strip()
      shown = os.path.relpath(name) if name.startswith(os.getcwd() + os.sep) else name
      where = f"{shown}:{tb.tb_lineno}" + (f" ({line})" if line else "") + ": "
    tb = tb.tb_next
  return where + f"{type(e).__name__}: " + " ".join(str(e).split())


def _fatal(problem: str) -> None:
  print(f"FATAL Flags parsing error: {' '.join(problem.split())}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing (`app.parse_flags_with_usage`), except that a bad flag value
  (`--config.train.steps=abc`, `--config.train.steps=3.0`, an unknown flag) is one line and
  exit status 2, a user's mistake like every other (attn_jax/cli.py), not absl's status 1 and
  its usage hint. `cli.run`'s default flags parser."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fatal(str(e))
