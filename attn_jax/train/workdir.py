"""One run per --workdir: an exclusive lock file `<workdir>/.lock` holding the holder's pid.

Two runs writing the same checkpoints and metrics corrupt both, so the second one must stop at
once, naming the first. Choices:
  * The lock is `fcntl.flock` on the file, held for the life of the process: the kernel drops it
    when the holder dies in any way (SIGKILL, OOM), so a crashed run never blocks the next one.
    The pid/host/time written inside are for the messages only.
  * A lock file whose flock is free but that still names a pid is stale (its run crashed): it is
    taken over with a warning naming that pid. Released locks are emptied, not deleted (deleting
    would let two processes lock two different files of the same name).
  * Only process 0 of a multi-host run takes it (every host shares the workdir).
  * The TensorBoard folder `<workdir>/tb` gets a lock of its own (`tb/.writer.lock`,
    `lock_tensorboard`): two runs can only reach one folder through a symlink or a bind mount
    (their workdirs differ), and their curves would interleave in it, so the second run stops
    naming the first. TensorBoard reads only event files and ignores it.
  * A `tb` that is a link into another run's folder (a folder holding a `.lock`, `checkpoints/`
    or `metrics.jsonl`, other than this workdir) is refused even when that run has ended
    (`TensorBoardLinkError`): the run would interleave its curves with that run's, and a
    restart from step 0 would move that run's events into this workdir's `tb.<k>/`. A link to a
    folder of its own (a faster disk) is fine.
  * Readers (evaluation, streaming) take no lock: they never write a run's files.
  * On object storage (a `gs://` workdir, attn_jax/paths.py) there is no flock: the lock is the
    object `<workdir>/.lock` holding the holder's host, pid, start time and a lease renewed
    every `LEASE_S / 4` seconds by a thread of the holder (`ObjectLock`), and where its pid
    means something (`process_space`: the kernel's boot id and the pid namespace). A holder
    whose pid this process can check (same host, same space) is live while that pid lives
    and is taken over at once when it is gone (a SIGKILLed run resumed on its machine). A
    holder whose pid cannot be checked (another host, another container) is waited for, not
    refused: until its lease lapses (`LEASE_S` after its last renewal: a preempted VM's
    replacement, a TPU worker rerun), or, when it names this host and this very pid from
    another pid namespace (a container restarted in its pod comes back with the same host
    name and pid 1), for one renewal period and a margin (`RESTART_WATCH`): a live holder
    renews within it and the waiter stops naming it; a process's previous incarnation does
    not, and its lock is taken. Two live processes are so always refused: the second sees the
    first's pid alive, or sees it renew. A released lock is an empty object, as locally. Two
    runs starting within the same second on one workdir cannot be told apart by a plain object
    store (no compare-and-swap through fsspec): each writes its claim, reads it back after a
    pause, and the one that does not find its own claim stops. The TensorBoard folder has no
    lock of its own there: it cannot be a link, so only this workdir's run reaches it.
  * A shared file system without `flock` (Lustre mounted without `-o flock`, NFS without its
    lock daemon: ENOLCK, ENOSYS, EOPNOTSUPP) gets the lease lock of object storage on the same
    `.lock` file, with a warning saying why: the run is still protected from a second one
    (a kernel lock only frees a crashed holder's lock sooner), and the user needs no remount.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

from attn_jax import bounded, paths, run_layout, storage
from attn_jax.run_layout import RunLayout
from attn_jax.train.metrics import row_steps


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir."""


class TensorBoardLinkError(ValueError):
  """`<workdir>/tb` is a link into another run's folder."""


def _read(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = os.read(fd, 4096)
  try:
    return json.loads(raw) if raw.strip() else {}
  except ValueError:
    return {"raw": raw[:200].decode("utf-8", "replace")}


class WorkdirLock:
  """`with WorkdirLock(workdir): train(...)`; or `.acquire()` / `.release()`. `filename` and
  `what` (how messages name the folder) lock another folder the same way."""

  FILENAME = run_layout.LOCK

  def __init__(self, workdir: str, *, filename: str = FILENAME, what: str = "--workdir"):
    self.workdir = paths.name(workdir)
    self.path = os.path.join(self.workdir, filename)
    self.what = what
    self._fd: int | None = None
    self._lease: ObjectLock | None = None   # where the file system has no flock

  def acquire(self) -> "WorkdirLock":
    if self._fd is not None or self._lease is not None:
      return self
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise NotADirectoryError(f"{self.what} {self.workdir} is a file, not a directory")
    try:
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # unwritable (permissions, read-only file system, a file in the path)
      raise OSError(e.errno, f"{self.what} {self.workdir} is not usable: cannot create "
                    f"{self.path}: {e.strerror}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if not isinstance(e, BlockingIOError):
        os.close(fd)
        if e.errno not in NO_FLOCK:
          raise
        return self._lease_instead(e)
      holder = _read(fd)
      os.close(fd)
      raise WorkdirLockedError(
          f"{self.what} {self.workdir}{self._resolved()} is in use by pid "
          f"{holder.get('pid', '?')} on host {holder.get('host', '?')} (since "
          f"{holder.get('started', '?')}); lock file {self.path}. Stop that run or choose "
          "another --workdir.") from None
    previous = _read(fd)
    if previous.get("pid") is not None:
      logging.warning("taking over the stale lock of pid %s on host %s in %s (that run ended "
                      "without releasing it)", previous.get("pid"), previous.get("host"),
                      self.path)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def _lease_instead(self, e: OSError) -> "WorkdirLock":
    logging.warning("the file system of %s has no flock (%s: %s; e.g. Lustre mounted without "
                    "`-o flock`): this run holds %s as a lease, renewed every %.0f s, as on "
                    "object storage (a crashed run's lock is taken over when its lease lapses, "
                    "or at once on its host)", self.workdir, errno.errorcode.get(e.errno, "?"),
                    e.strerror, self.path, LEASE_S / 4)
    self._lease = ObjectLock(self.workdir, filename=os.path.basename(self.path),
                             what=self.what).acquire()
    return self

  def _resolved(self) -> str:
    real = os.path.realpath(self.workdir)
    return "" if real == self.workdir else f" (= {real})"

  def release(self) -> None:
    if self._lease is not None:
      self._lease.release()
      self._lease = None
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)   # an empty lock file is a released one
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


LEASE_S = 120.0   # an object lock not renewed for this long is stale (its holder died)
RELEASE_S = 5.0   # the most a release waits for the storage (a run that is ending)
_SETTLE_S = 1.0   # how long a claim waits before reading itself back
RESTART_WATCH = 5 / 16   # x LEASE_S after its last renewal: 1.25 renewal periods (see above)
NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def process_space() -> str:
  """Where a pid names this process: the kernel's boot id and the pid namespace ('' where
  /proc does not say). Two processes with the same space see the same pids."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
    return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
  except OSError:
    return ""


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, OverflowError):
    return True   # someone else's process, or not a pid: not ours to call dead
  return True


class ObjectLock:
  """The lock of a workdir on object storage (see the module docstring); the same interface
  and messages as WorkdirLock."""

  def __init__(self, workdir, *, filename: str = WorkdirLock.FILENAME, what: str = "--workdir",
               lease_s: float = LEASE_S, settle_s: float = _SETTLE_S):
    self.workdir = paths.name(workdir)
    self.path = paths.run_path(workdir) / filename
    self.what, self.lease_s, self.settle_s = what, float(lease_s), float(settle_s)
    self._token: str | None = None
    self._started = ""
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _holder(self) -> dict:
    try:
      raw = self.path.read_bytes()
    except FileNotFoundError:
      return {}
    try:
      return json.loads(raw) if raw.strip() else {}
    except ValueError:
      return {"raw": raw[:200].decode("utf-8", "replace")}

  def judge(self, holder: dict) -> tuple[str, str | float]:
    """What `holder` (the lock object's content, naming a pid) is: ("stale", why) for a run
    that is gone, ("live", "") for one that runs, ("wait", until) for one whose pid this
    process cannot check: it is gone if it does not renew its lease by time `until`."""
    try:
      renewed = float(holder.get("renewed"))
    except (TypeError, ValueError):
      return "stale", "it is not a lock this code wrote"
    if time.time() - renewed > self.lease_s:
      return "stale", f"its lease lapsed {time.time() - renewed:.0f} s ago"
    host, pid, space = holder.get("host"), holder.get("pid"), holder.get("space")
    mine = str(pid) == str(os.getpid())
    if host == socket.gethostname():
      here = process_space()
      if (space == here and here) or (space is None and not mine):   # None: older code's lock
        if mine or _pid_alive(pid):
          return "live", ""
        return "stale", "its process is gone"
      if mine:   # our host name and pid from another pid namespace: a restarted container?
        return "wait", renewed + self.lease_s * RESTART_WATCH
    return "wait", renewed + self.lease_s

  def _wait_for(self, holder: dict) -> None:
    """Returns once `holder` is gone (stale, released, lapsed); WorkdirLockedError when it is
    live or renews its lease while this waits (see the module docstring). The wait is bounded
    by the lease: a holder that stops renewing lapses."""
    said = False
    while holder.get("pid") is not None:
      kind, why = self.judge(holder)
      if kind == "wait" and time.time() >= why:
        kind, why = "stale", (f"it did not renew its lease for "
                              f"{time.time() - float(holder['renewed']):.0f} s")
      if kind == "live":
        raise self._locked_error(holder)
      if kind == "stale":
        logging.warning("taking over the stale lock of pid %s on host %s in %s (%s: that run "
                        "ended without releasing it)", holder.get("pid"), holder.get("host"),
                        self.path, why)
        return
      if not said:
        logging.warning("%s %s is held by pid %s on host %s, which this process cannot check: "
                        "waiting up to %.3g s for its lease to lapse (a live holder renews it "
                        "every %.3g s, and this run then stops)", self.what, self.workdir,
                        holder.get("pid"), holder.get("host"), why - time.time(),
                        self.lease_s / 4)
        said = True
      time.sleep(max(0.0, min(self.lease_s / 16, 5.0, why - time.time())) + 0.01)
      now = self._holder()
      if now.get("token") == holder.get("token") and now.get("renewed") != holder.get("renewed"):
        raise self._locked_error(now, waited=True)
      holder = now

  def _claim(self) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started,
            "renewed": time.time(), "token": self._token, "space": process_space()}

  def _locked_error(self, holder: dict, waited: bool = False) -> WorkdirLockedError:
    return WorkdirLockedError(
        f"{self.what} {self.workdir} is in use by pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')} (since {holder.get('started', '?')}"
        f"{'; it renewed its lease while this run waited' if waited else ''}); lock object "
        f"{self.path}, renewed every {self.lease_s / 4:.0f} s while that run lives (stale "
        f"after {self.lease_s:.0f} s without renewal). Stop that run or choose another "
        "--workdir.")

  def acquire(self) -> "ObjectLock":
    if self._token is not None:
      return self
    storage.check(self.workdir, self.what)   # no gcsfs, no network: one line, at once
    try:
      holder = self._holder()
    except Exception as e:  # noqa: BLE001 - a missing bucket, no credentials: say which
      raise OSError(f"{self.what} {self.workdir} is not usable: cannot read {self.path}: "
                    f"{type(e).__name__}: {e}") from None
    self._wait_for(holder)
    self._token = uuid.uuid4().hex
    self._started = time.strftime("%Y-%m-%d %H:%M:%S")
    claim = self._claim()
    try:
      self.path.write_text(json.dumps(claim))
    except Exception as e:  # noqa: BLE001
      self._token = None
      raise OSError(f"{self.what} {self.workdir} is not usable: cannot create {self.path}: "
                    f"{type(e).__name__}: {e}") from None
    time.sleep(self.settle_s)
    now = self._holder()
    if now.get("token") != self._token:
      self._token = None
      raise self._locked_error(now)
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew, name="attn_jax workdir lease",
                                    daemon=True)
    self._thread.start()
    return self

  def _renew(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        holder = self._holder()
        if holder.get("token") != self._token:   # taken over after a lapse: say so, stop
          logging.error("the workdir lock %s was taken over by pid %s on host %s after this "
                        "run's lease lapsed: two runs may now write %s", self.path,
                        holder.get("pid"), holder.get("host"), self.workdir)
          return
        self.path.write_text(json.dumps(self._claim()))
      except Exception as e:  # noqa: BLE001 - a lapse is retried; the run goes on
        logging.warning("could not renew the workdir lease %s: %s", self.path, e)

  def release(self) -> None:
    """Empties the lock object (when it is still this run's), within `RELEASE_S`: a run that
    is ending (a stalled bucket, a signal's grace) never waits longer on the storage here; a
    lock not released is stale once its lease lapses."""
    if self._token is None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(RELEASE_S / 2)
      self._thread = None

    def empty():
      if self._holder().get("token") == self._token:
        self.path.write_bytes(b"")   # an empty lock is a released one

    try:
      bounded.call(empty, RELEASE_S, f"releasing {self.path}")
    except Exception as e:  # noqa: BLE001 - the lease lapses on its own
      logging.warning("could not release the workdir lock %s (%s): it is taken over once its "
                      "lease lapses, %.0f s after its last renewal", self.path, e, self.lease_s)
    self._token = None

  def __enter__(self) -> "ObjectLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _on_process_0(lock, process_index: int | None) -> WorkdirLock | None:
  """`lock` taken on process 0; the other processes return None (every host shares it)."""
  if process_index is None:
    import jax
    process_index = jax.process_index()
  return lock.acquire() if process_index == 0 else None


def lock_workdir(workdir, *, process_index: int | None = None):
  """Takes the lock on process 0 (others return None); raises WorkdirLockedError if held. A
  WorkdirLock on a local disk, an ObjectLock on object storage."""
  lock = WorkdirLock(workdir) if paths.is_local(workdir) else ObjectLock(workdir)
  return _on_process_0(lock, process_index)


def lock_tensorboard(workdir: str, *, process_index: int | None = None) -> WorkdirLock | None:
  """Takes the lock of `<workdir>/tb` on process 0; WorkdirLockedError when another live run
  writes the same folder (reached through a symlink or a bind mount), TensorBoardLinkError
  when it is a link into another run's folder (`check_tensorboard_link`). None on object
  storage (no links there: the workdir's lock covers it)."""
  if paths.is_uri(workdir):
    return None
  tb = paths.name(RunLayout.of(workdir).tb)
  lock = _on_process_0(WorkdirLock(tb, filename=run_layout.TB_LOCK,
                                   what="the TensorBoard folder"), process_index)
  try:
    check_tensorboard_link(workdir)
  except TensorBoardLinkError:
    if lock is not None:
      lock.release()
    raise
  return lock


def check_tensorboard_link(workdir: str) -> None:
  """TensorBoardLinkError when `<workdir>/tb` resolves into another run's folder."""
  tb = paths.name(RunLayout.of(workdir).tb)
  real, home = os.path.realpath(tb), os.path.realpath(workdir)
  owner = os.path.dirname(real)
  if real == paths.name(RunLayout.of(home).tb) or owner == home:
    return
  found = [m for m, p in RunLayout.of(owner).markers().items() if os.path.exists(p)]
  if found:
    raise TensorBoardLinkError(
        f"the TensorBoard folder {tb} is a link to {real}, the TensorBoard folder of another "
        f"run ({owner} holds {', '.join(found)}): this run would mix its curves into that "
        "run's and could move that run's events into its own history. Remove the link (the "
        "run then makes its own tb/), or point it at a folder of its own")


# ------------------------------------------------------------------ history rotation

def _history_entries(workdir: str) -> dict[str, list[str]]:
  """{"metrics.jsonl": [it], "tb": [its event files...]} for the non-empty ones."""
  out = {}
  layout = RunLayout.of(workdir)
  if layout.metrics.is_file() and layout.metrics.stat().length > 0:
    out[run_layout.METRICS] = [paths.name(layout.metrics)]
  if layout.tb.is_dir():
    names = sorted(p.name for p in layout.tb.iterdir() if p.name != run_layout.TB_LOCK)
    if names:
      out[run_layout.TB] = [paths.name(layout.tb / n) for n in names]
  return out


def rotate_history(workdir: str, checkpoint_dir: str = "") -> dict[str, str]:
  """Before a run starts at step 0 in `workdir`: an earlier run's metrics.jsonl and TensorBoard
  events (its checkpoints are gone or were set aside as corrupt) are moved to metrics.jsonl.<k>
  and tb.<k>/ (k: the first number free for both), with a warning saying so; nothing is
  deleted. (The TensorBoard folder stays where it is with its lock; its files move.) Returns
  {old path: new path}."""
  found = _history_entries(workdir)
  if not found:
    return {}
  home = RunLayout.of(workdir)
  k = 1
  while any(home.history(n, k).exists() for n in run_layout.HISTORY):
    k += 1
  moved = {}
  if run_layout.METRICS in found:
    steps = [s for _, _, s in row_steps(found[run_layout.METRICS][0]) if s is not None]
    rows = (f"{len(steps)} metric rows" + (f", steps {min(steps)}-{max(steps)}" if steps
                                            else ""))
    moved[found[run_layout.METRICS][0]] = paths.name(home.history(run_layout.METRICS, k))
  else:
    rows = "TensorBoard events"
  if run_layout.TB in found:
    target = home.history(run_layout.TB, k)
    target.mkdir(parents=True)
    moved.update({p: paths.name(target / paths.run_path(p).name) for p in found[run_layout.TB]})
  for old, new in moved.items():
    paths.move(old, new)
  ckpts = paths.run_path(checkpoint_dir) if checkpoint_dir else None
  corrupt = sorted(p.name for p in (ckpts.iterdir() if ckpts and ckpts.is_dir() else ())
                   if ".corrupt" in p.name)
  why = (f"its checkpoints were set aside as corrupt ({', '.join(corrupt)})" if corrupt
         else "it left no checkpoint to resume from")
  logging.warning("starting at step 0 in %s, which holds an earlier run's history (%s; %s): "
                  "moved it aside to %s, nothing was deleted", workdir, rows, why,
                  " and ".join(sorted({paths.name(home.history(n, k)) for n in found})))
  return moved
