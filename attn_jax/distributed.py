"""Multi-process (multi-host) start-up: one call before anything touches a JAX device.

    from attn_jax import distributed
    distributed.initialize()          # no-op for a single process

Where the cluster is described, in order:
  1. explicit arguments (experiments/train.py passes --coordinator_address, --num_processes,
     --process_id);
  2. environment variables ATTN_JAX_COORDINATOR_ADDRESS ("host:port" of process 0),
     ATTN_JAX_NUM_PROCESSES, ATTN_JAX_PROCESS_ID (and optional ATTN_JAX_LOCAL_DEVICE_IDS,
     comma-separated), for launchers that only set variables;
  3. JAX's own cluster detection (`jax.distributed.initialize()` with no arguments) when a
     multi-process environment it configures itself from is visible (`cluster_detected`, the
     same signals as jax/_src/clusters):
       * SLURM: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS (> 1), SLURM_PROCID and
         SLURM_LOCALID, all of which `srun` sets (an `sbatch` script outside `srun` has no
         step and is one process);
       * a TPU slice on GKE: a TPU VM whose TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES
         names more than one host (GKE's TPU webhook sets them);
       * a plain multi-host TPU VM (`gcloud compute tpus tpu-vm ssh --worker=all`): no
         variable at all; JAX asks the VM's metadata server (`agent-worker-number`,
         `worker-network-endpoints`), so this does too, and only on a machine with TPU chips
         and without TPU_SKIP_MDS_QUERY (elsewhere there is no such server to wait for);
       * Open MPI / MPICH (mpirun) with more than one rank; a Kubernetes JobSet with
         JAX_NUM_PROCESSES > 1;
  4. otherwise: a single process, nothing to do.
After it, `jax.devices()` lists every device of the cluster and `jax.process_index()` /
`jax.process_count()` identify this host; see docs/multihost.md for launch recipes.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from typing import Callable, Mapping, Sequence

import jax

from attn_jax import native_logs

ENV_COORDINATOR = "ATTN_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ATTN_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ATTN_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "ATTN_JAX_LOCAL_DEVICE_IDS"


def _int(value, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name} must be an integer, got {value!r}") from None


SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")   # what JAX's SLURM cluster reads; srun sets every one
METADATA_URL = "http://{host}/computeMetadata/v1/instance/attributes/{key}"


def tpu_metadata(key: str, env: Mapping[str, str] = os.environ) -> str | None:
  """A TPU VM's metadata attribute `key` (None when the server does not answer with it)."""
  host = env.get("GCE_METADATA_IP", "metadata.google.internal")
  request = urllib.request.Request(METADATA_URL.format(host=host, key=key),
                                   headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=10) as r:
      return r.read().decode()
  except OSError:
    return None


def _hosts(value: str) -> int:
  return len([h for h in value.split(",") if h.strip()])


def cluster_detected(env: Mapping[str, str] = os.environ, *, tpu_vm: bool | None = None,
                     metadata: Callable[[str], str | None] | None = None) -> str | None:
  """The multi-process environment JAX can configure itself from, if any (module docstring).
  `tpu_vm` (default: whether the kernel exposes TPU chips) and `metadata` (default: the VM's
  metadata server) are arguments for tests."""
  if all(v in env for v in SLURM_STEP_VARS) and int(env["SLURM_NTASKS"] or 1) > 1:
    return "slurm"
  if tpu_vm is None:
    tpu_vm = native_logs.has_tpu_device()
  if tpu_vm:
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts is not None:
      return "gke_tpu" if _hosts(hosts) > 1 else None
    if env.get("TPU_SKIP_MDS_QUERY") is None:
      ask = metadata or (lambda key: tpu_metadata(key, env))
      if ask("agent-worker-number") is not None and _hosts(
          ask("worker-network-endpoints") or "") > 1:
        return "tpu_vm"
  if int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE", "1")) or 1) > 1:
    return "mpi"
  if env.get("JOBSET_NAME") and int(env.get("JAX_NUM_PROCESSES", "1") or 1) > 1:
    return "jobset"
  return None


def launched_as(env: Mapping[str, str] = os.environ) -> tuple[int, str]:
  """(how many processes a launcher started this program as, which launcher): (1, "") for a
  program started alone."""
  counts = (("srun", int(env["SLURM_NTASKS"] or 1) if all(v in env for v in SLURM_STEP_VARS)
             else 1),
            ("mpirun", int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE", "1")) or 1)),
            (ENV_NUM_PROCESSES, _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES) or 1),
            ("a JobSet", int(env.get("JAX_NUM_PROCESSES", "1") or 1)
             if env.get("JOBSET_NAME") else 1))
  for how, n in counts:
    if n > 1:
      return n, how
  return 1, ""


def require_one_process(program: str, env: Mapping[str, str] = os.environ) -> None:
  """Readers of a run (experiments/eval.py, stream.py) run as one process on one host: they
  never join a cluster, and every copy would score the whole run alone and write the same
  results. ValueError when a launcher started this one as one of several."""
  n, how = launched_as(env)
  if n > 1:
    raise ValueError(
        f"{program} runs as one process on one host, and {how} started it as one of {n}: "
        "each would evaluate the whole run alone and write the same results. Start it once "
        "(e.g. `srun --ntasks=1 ...`, or on one machine of the slice / node list), reading "
        "the run from its shared workdir (every host's checkpoint shards are there)")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               *, env: Mapping[str, str] = os.environ, **kwargs) -> bool:
  """Joins the JAX cluster; True if this is a multi-process run. Idempotent."""
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _int(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID)
  if local_device_ids is None and env.get(ENV_LOCAL_DEVICE_IDS):
    local_device_ids = [int(i) for i in env[ENV_LOCAL_DEVICE_IDS].split(",")]
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if num_processes == 1 and not coordinator_address:
      return False
    missing = [n for n, v in zip(("coordinator_address", "num_processes", "process_id"),
                                 explicit) if v is None]
    if missing:
      raise ValueError(f"multi-process run: {', '.join(missing)} not given (flags "
                       f"--coordinator_address/--num_processes/--process_id or env "
                       f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               local_device_ids=local_device_ids, **kwargs)
  else:
    detected = cluster_detected(env)
    if detected is None:
      return False
    logging.info("multi-process environment detected (%s): jax.distributed auto-configures",
                 detected)
    jax.distributed.initialize(local_device_ids=local_device_ids, **kwargs)
  logging.info("process %d of %d; %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return jax.process_count() > 1
