"""Checks for the typed config (its sections, the model, mixer `Options.validate`): one error
format, naming the config field, the number tests every option needs, and the type check every
field gets from its declared type (`check_fields`).

The type rules (`type_problem`), for a value read from a config file, the command line or a
saved config (JSON):
  int     an integer, not a bool (Python's bool is an int subclass: True would pass as 1) and
          not a float, even a whole one (3.0 where steps are counted is a mistake that used to
          pass every check and crash inside the training loop);
  float   any real number but a bool: an int is a float's value exactly (lr=1);
  bool    True or False only (not 0 / 1, not "false");
  str     a string;
  tuple   a tuple or a list (JSON has no tuples); `tuple[T, ...]`: each element of type T.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing


def is_int(v, lo: int | None = None) -> bool:
  """An integer (not a bool), at least `lo`."""
  return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)


def is_number(v, lo: float | None = None) -> bool:
  """A finite real number (not a bool), at least `lo`."""
  return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (lo is None or v >= lo))


def field_check(where: str):
  """need(cond, field, msg): raise ValueError("<where>.<field>: <msg>") unless cond."""
  def need(cond: bool, field: str, msg: str) -> None:
    if not cond:
      raise ValueError(f"{where}.{field}: {msg}")
  return need


def type_problem(value, want) -> str | None:
  """Why `value` is not of the declared type `want` (module docstring), else None. A type the
  rules do not cover (Any, a nested structure) is not checked here."""
  if want is bool:
    ok = isinstance(value, bool)
  elif want is int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  elif want is float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  elif want is str:
    ok = isinstance(value, str)
  elif want is tuple or typing.get_origin(want) is tuple:
    if not isinstance(value, (tuple, list)):
      return f"must be a tuple, got {_shown(value)}"
    args = typing.get_args(want)
    if len(args) == 2 and args[1] is Ellipsis:
      for i, item in enumerate(value):
        why = type_problem(item, args[0])
        if why:
          return f"element {i}: {why} (in {tuple(value)!r})"
    return None
  else:
    return None
  return None if ok else f"must be {_TYPE_WORDS[want]}, got {_shown(value)}"


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


def _shown(value) -> str:
  return f"{value!r} ({type(value).__name__})"


@functools.lru_cache(maxsize=None)
def declared_types(cls: type) -> dict[str, typing.Any]:
  """{field: its declared type} of a dataclass (its annotations resolved)."""
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_fields(cls: type, values: typing.Mapping[str, typing.Any], where: str) -> None:
  """Raise ValueError("<where>.<field>: must be an integer, got '3' (str)") for the first value
  of `values` (field -> value, fields of dataclass `cls`) that is not of its declared type."""
  types = declared_types(cls)
  for name, value in values.items():
    if name in types:
      why = type_problem(value, types[name])
      if why:
        raise ValueError(f"{where}.{name}: {why}")
