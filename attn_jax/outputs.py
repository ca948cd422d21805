"""Where the commands that compute results from a run write them (experiments/eval.py,
experiments/stream.py): a folder checked before any work, so results are never computed for
nothing.

    out = outputs.results_folder(workdir, "eval", explicit=out_dir, flag="--out_dir")
    ... the work ...
    outputs.write_or_print(lambda: write(out.path), text)

  * An explicit folder (`--out_dir`, `--out`) is probed before the model loads (a file created
    and removed in it, or in its nearest existing parent: nothing is left behind, and the
    folder is made when the results are written); one that cannot be written is an
    `OutputError` at once, naming the flag, the folder and why.
  * The default folder is inside the run directory (`<workdir>/eval`, `<workdir>/stream`; on
    object storage too, the probe then being an object: attn_jax/paths.py). A
    run directory the command cannot write (a read-only mount, a colleague's run shared
    read-only) does not stop it: the results go to a fallback folder, `<temp>/attn_jax/
    <run name>-<8 hex digits of the run's path>/<kind>` (`fallback_folder`; `<temp>` is
    $TMPDIR or /tmp), said in a warning at start and in the command's output. When that cannot
    be written either, `OutputError` at once naming the flag.
  * A write that still fails once the work is done (the disk filled meanwhile) prints the
    results on stdout, then stops with `OutputError` naming the folder (`write_or_print`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
from typing import Callable

from attn_jax import paths
from attn_jax.run_layout import RunLayout


class OutputError(OSError):
  """An output folder that cannot be written (the message names the flag and the folder)."""


@dataclasses.dataclass(frozen=True)
class Folder:
  path: str
  fallback: bool = False   # the run directory was not writable: `path` is the fallback


def unwritable(folder: str) -> str | None:
  """None when files can be written in `folder`, else why not (`paths.unwritable`: a probe
  file created and removed, nothing left behind; a URI's folder probed with an object)."""
  return paths.unwritable(folder)


def fallback_folder(workdir: str, kind: str) -> str:
  """The folder for `kind` results of a run directory that cannot be written."""
  real = paths.name(workdir) if paths.is_uri(workdir) else os.path.realpath(workdir)
  name = real.rstrip("/").rsplit("/", 1)[-1] or "run"
  digest = hashlib.sha1(real.encode()).hexdigest()[:8]
  return os.path.join(tempfile.gettempdir(), "attn_jax", f"{name}-{digest}", kind)


def results_folder(workdir: str, kind: str, *, explicit: str | None, flag: str) -> Folder:
  """The folder the results go to, checked writable (made when they are written); see the
  module docstring."""
  if explicit:
    why = unwritable(explicit)
    if why:
      raise OutputError(f"{flag}={explicit} cannot be written ({why}); nothing was computed. "
                        f"Point {flag} at a writable folder")
    return Folder(paths.name(explicit))
  default = paths.name(RunLayout.of(workdir).results(kind))
  why = unwritable(default)
  if why is None:
    return Folder(default)
  fallback = fallback_folder(workdir, kind)
  why_fallback = unwritable(fallback)
  if why_fallback:
    raise OutputError(f"the run directory {workdir} cannot be written ({default}: {why}), nor "
                      f"the fallback folder {fallback} ({why_fallback}); nothing was computed. "
                      f"Pass {flag}=<a writable folder>")
  logging.warning("the run directory %s cannot be written (%s: %s): the results go to %s "
                  "instead (%s=<folder> to choose)", workdir, default, why, fallback, flag)
  return Folder(fallback, fallback=True)


def write_or_print(write: Callable[[], dict], results_text: str, folder: str, *,
                   flag: str) -> dict:
  """`write()` (returns the paths written); when it fails, `results_text` is printed on stdout
  first, then OutputError naming the folder."""
  try:
    return write()
  except OSError as e:
    print(results_text, flush=True)
    raise OutputError(f"writing the results to {folder} failed ({e.strerror or e}); they are "
                      f"printed above. Pass {flag}=<a writable folder> to keep them in files"
                      ) from e
