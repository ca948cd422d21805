"""One JSON-object-per-line parsing with errors that name the file and line."""

from __future__ import annotations

import json


def parse_object(line: str, where: str) -> dict:
  """`line` as a JSON object; `where` ("path:line") prefixes every error."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  return record
