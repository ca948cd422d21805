"""Where a run's files live: one path type for a local folder and for object storage.

Every path a run reads or writes (the workdir and what is inside it: checkpoints, metrics,
TensorBoard events, the lock; `data.paths`; `train.init_from`) goes through `run_path`, which
gives an `etils.epath.Path`: a local path made absolute, or a URI (`gs://bucket/run`, any
scheme etils and fsspec know) kept as it is. `os.path` is never applied to such a path: on a
URI it would make `<cwd>/gs:/bucket/run`, a local folder, and a preempted pod slice would lose
every checkpoint with its disk. Orbax and tensorstore take the same URIs (tensorstore reads
and writes the arrays itself; the small files go through epath, gcsfs for `gs://`).

What object storage lacks, and what stands in for it here:
  * No append: an object is written whole. `Appender` keeps the bytes of a file it appends to
    (read once at the first write) and writes the whole object again at each `flush`; a local
    file is appended to as before. The files appended to are small (metrics rows, scalar
    events), and a crash loses at most the rows after the last flush, which a resumed run logs
    again anyway.
  * No rename of a folder: `move` moves a folder object by object (a copy, then a delete).
    Only history rotation and a corrupt step set aside move anything; neither is on a hot path.
  * No advisory locks (flock): the workdir lock on object storage is an object holding the
    holder's host, pid and a lease renewed while it runs (train/workdir.py).
  * No free-space figure: messages name the bucket instead of a mount point.
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Union

from etils import epath

PathLike = Union[str, os.PathLike]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: PathLike) -> bool:
  """True for `gs://...`, `s3://...` (anything with a scheme); False for a local path."""
  return bool(_URI.match(os.fspath(path)))


def is_local(path: PathLike) -> bool:
  return not is_uri(path)


def run_path(path: PathLike) -> epath.Path:
  """The path as an epath.Path: a URI kept as written (a trailing '/' dropped), a local path
  made absolute with '~' expanded. The one place a run's path is made absolute."""
  text = os.fspath(path)
  if not text:
    raise ValueError("an empty path")
  if is_uri(text):
    return epath.Path(text.rstrip("/") if not text.endswith("://") else text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def name(path: PathLike) -> str:
  """How messages and result dicts name a path: `str(run_path(path))`."""
  return os.fspath(run_path(path))


def bucket(path: PathLike) -> str:
  """'gs://bucket' for a URI (what a message names instead of a disk)."""
  text = os.fspath(path)
  scheme, _, rest = text.partition("://")
  return f"{scheme}://{rest.split('/', 1)[0]}"


def open_for_write(path: PathLike, mode: str = "w", **kwargs):
  """`open(path, mode)` for a local file or an object (written when closed); the parent
  folder made first; text in UTF-8."""
  p = run_path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  if "b" not in mode:
    kwargs.setdefault("encoding", "utf-8")
  return p.open(mode, **kwargs)


def save_figure(fig, path: PathLike, **kwargs) -> None:
  """`fig.savefig` to a local file or an object (PNG)."""
  with open_for_write(path, "wb") as f:
    fig.savefig(f, format="png", **kwargs)


def files(root: PathLike) -> list[str]:
  """Every file under `root`, as paths relative to it ('/'-separated), sorted."""
  top = run_path(root)
  bare = lambda p: os.fspath(p).split("://", 1)[-1]   # epath's walk drops the scheme
  out = []
  for folder, _, names in top.walk():
    rel = bare(folder)[len(bare(top)):].strip("/")
    out += [f"{rel}/{n}" if rel else n for n in names]
  return sorted(out)


def info(path: PathLike) -> dict:
  """The storage's own record of a file or object (fsspec's `info`: size, and for an object
  its generation / etag / checksums)."""
  if is_local(path):
    st = os.stat(run_path(path))
    return {"size": st.st_size, "mtime": st.st_mtime_ns}
  from etils.epath import backend
  fs = backend.fsspec_backend.fs(os.fspath(path))
  return dict(fs.info(fs._strip_protocol(os.fspath(path))))


def move(src: PathLike, dst: PathLike) -> None:
  """Moves a file or a folder to `dst` (which must not exist). Locally one rename; on object
  storage a folder moves object by object, its files first, so that an interrupted move leaves
  every object in one of the two places, none lost."""
  src, dst = run_path(src), run_path(dst)
  if is_local(src):
    src.rename(dst)
    return
  from etils.epath import backend   # epath's own file system: its listings are the ones read
  fs = backend.fsspec_backend.fs(os.fspath(src))
  bare_src, bare_dst = fs._strip_protocol(os.fspath(src)), fs._strip_protocol(os.fspath(dst))
  if not fs.isdir(bare_src):
    fs.mv(bare_src, bare_dst)
    return
  for rel in files(src):
    fs.mv(f"{bare_src}/{rel}", f"{bare_dst}/{rel}")
  fs.invalidate_cache()   # listings cached before the move would still show `src`


def unwritable(folder: PathLike) -> str | None:
  """None when files can be written in `folder`, else why not. Nothing is left behind: the
  probe is a file created and removed in `folder`, or, locally when it does not exist yet, in
  its nearest existing parent (where the writer will make it). On object storage the probe is
  an object under `folder` (folders do not exist there before their first object)."""
  if is_local(folder):
    return _local_unwritable(os.fspath(run_path(folder)))
  probe = run_path(folder) / f".attn_jax_write_probe.{uuid.uuid4().hex[:12]}"
  try:
    probe.write_bytes(b"")
    probe.unlink()
  except Exception as e:  # noqa: BLE001 - auth, a missing bucket, permissions: all say why
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
  return None


def _local_unwritable(folder: str) -> str | None:
  import errno
  import tempfile
  existing = folder
  while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{os.strerror(errno.ENOTDIR)}: {existing} is a file"
  try:
    fd, probe = tempfile.mkstemp(prefix=".attn_jax_write_probe", dir=existing)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    return e.strerror or str(e)
  return None


class Appender:
  """Bytes appended to one file. Local: the file opened in "ab", `flush` fsyncs it. Object
  storage: the object's bytes kept in memory (read once, when the first write finds an existing
  object), and `flush` writes the whole object again (see the module docstring)."""

  def __init__(self, path: PathLike):
    self.path = run_path(path)
    self._local = is_local(self.path)
    self._f = None
    self._buffer: bytearray | None = None
    self._dirty = False

  def write(self, data: bytes) -> None:
    if self._local:
      if self._f is None:
        self._f = open(os.fspath(self.path), "ab")
      self._f.write(data)
      return
    if self._buffer is None:
      self._buffer = bytearray(self.path.read_bytes() if self.path.exists() else b"")
    self._buffer += data
    self._dirty = True

  def flush(self, *, sync: bool = False) -> None:
    if self._local:
      if self._f is not None:
        self._f.flush()
        if sync:
          os.fsync(self._f.fileno())
      return
    if self._dirty:
      self.path.write_bytes(bytes(self._buffer))
      self._dirty = False

  def close(self) -> None:
    self.flush(sync=True)
    if self._f is not None:
      self._f.close()
      self._f = None


def append_text(path: PathLike, text: str) -> None:
  """Appends `text` to one file at once (local: one open-append-close; object storage: the
  object read and written again whole)."""
  a = Appender(path)
  try:
    a.write(text.encode())
  finally:
    a.close()
