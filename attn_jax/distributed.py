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
       * Open MPI / MPICH (mpirun) with more than one rank;
  4. a Kubernetes JobSet (GKE GPU nodes) with JAX_NUM_PROCESSES > 1: read here, not by JAX
     (`jobset_cluster`). JAX's own Kubernetes detection needs the `kubernetes` package and a
     service account allowed to list pods and services (it finds the coordinator through the
     API server); a JobSet's pods have names fixed by the JobSet itself
     (`<jobset>-<replicated job>-<job index>-<pod index>.<jobset>`) and each pod knows its
     index (JOB_INDEX, JOB_COMPLETION_INDEX), so the coordinator and the process id follow
     from the variables alone, with no dependency and no API permission;
  5. otherwise: a single process, nothing to do.

The GPUs each process drives (`local_device_ids`): JAX's SLURM detection assumes one task per
GPU and, when no ids are passed, restricts each process to GPU number SLURM_LOCALID
(jax-ml/jax#16788), so one task per node with 8 GPUs would drive one of them. Under SLURM the
ids are chosen here (`slurm_local_device_ids`) from the tasks on the node and the GPUs the task
sees: every visible GPU for one task per node, its own share for one task per GPU. Elsewhere
(explicit flags, a JobSet) nothing restricts a process: it drives every GPU it sees.
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


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
  """How many tasks of this SLURM step run on this node: SLURM_NTASKS_PER_NODE (set by
  --ntasks-per-node), else this node's entry of SLURM_STEP_TASKS_PER_NODE /
  SLURM_TASKS_PER_NODE ("8(x4)", "2(x3),1": counts with repeats, one per node in order,
  SLURM_NODEID picks ours)."""
  if env.get("SLURM_NTASKS_PER_NODE"):
    return _int(env["SLURM_NTASKS_PER_NODE"], "SLURM_NTASKS_PER_NODE")
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  if not spec:
    return None
  counts = []
  for part in spec.split(","):
    n, _, times = part.partition("(x")
    counts += [int(n)] * int(times.rstrip(")") or 1)
  node = _int(env.get("SLURM_NODEID"), "SLURM_NODEID") or 0
  return counts[node] if node < len(counts) else counts[-1]


def _visible_gpus(env: Mapping[str, str]) -> int | None:
  """How many GPUs this process sees: the entries of CUDA_VISIBLE_DEVICES (or ROCm's
  ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), else SLURM_GPUS_ON_NODE (SLURM allots them but
  sets no list); None when nothing says."""
  for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
    if env.get(name) is not None:
      return len([d for d in env[name].split(",") if d.strip()])
  return _int(env.get("SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE")


def slurm_local_device_ids(env: Mapping[str, str] = os.environ) -> list[int] | None:
  """The GPUs (ordinals among those this process sees) a SLURM task drives. With t tasks on
  the node and g GPUs visible to this task:
    * t = 1 (one task per node): all of them, range(g) ([] when g is unknown: JAX then
      restricts nothing, i.e. every GPU);
    * g < t, or g less than the node's SLURM_GPUS_ON_NODE (SLURM bound each task to its own
      GPUs, `--gpus-per-task`): all of its own, range(g) (ordinal 0 for one GPU per task;
      JAX's default SLURM_LOCALID would name a GPU the task cannot see);
    * all tasks see all GPUs, g = t * k: task SLURM_LOCALID drives its k, [id * k, (id + 1) * k)
      (k = 1: JAX's own default, one task per GPU).
  None outside a SLURM step, when the task count is unknown, or with no GPU in sight (a CPU
  or TPU cluster: nothing to choose)."""
  if not all(v in env for v in SLURM_STEP_VARS):
    return None
  tasks, visible = _tasks_on_node(env), _visible_gpus(env)
  if tasks is None or (visible is None and tasks > 1) or visible == 0:
    return None
  if tasks == 1:
    return list(range(visible)) if visible is not None else []
  on_node = _int(env.get("SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE")
  if visible < tasks or (on_node is not None and visible < on_node):
    return list(range(visible))
  if visible % tasks:
    raise ValueError(f"SLURM started {tasks} tasks on this node and each sees {visible} GPUs, "
                     "which do not split evenly: launch one task per node "
                     "(--ntasks-per-node=1) or one per GPU (--gpus-per-task=1), or name "
                     f"each task's GPUs in {ENV_LOCAL_DEVICE_IDS}")
  k, local = visible // tasks, int(env["SLURM_LOCALID"])
  return list(range(local * k, (local + 1) * k))


JOBSET_PORT = "8476"   # the coordinator's port in a JobSet (JAX_COORDINATOR_PORT overrides)


def jobset_cluster(env: Mapping[str, str] = os.environ) -> tuple[str, int, int] | None:
  """(coordinator address, number of processes, process id) of a pod of a Kubernetes JobSet
  with JAX_NUM_PROCESSES > 1, from the variables JobSet and the Indexed Job set in every pod
  (JOBSET_NAME, REPLICATED_JOB_NAME, REPLICATED_JOB_REPLICAS, JOB_INDEX,
  JOB_COMPLETION_INDEX); None otherwise. Process 0 is pod 0 of job 0, reached through the
  JobSet's DNS names `<jobset>-<replicated job>-0-0.<subdomain>` (the subdomain is the JobSet's
  name unless its manifest sets another: JOBSET_SUBDOMAIN then names it);
  JAX_COORDINATOR_ADDRESS, when the manifest sets it, wins. The processes of a replicated job
  with several jobs are numbered job by job."""
  name, job = env.get("JOBSET_NAME"), env.get("REPLICATED_JOB_NAME")
  n = _int(env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES") or 1
  if not name or n <= 1:
    return None
  if not job or env.get("JOB_COMPLETION_INDEX") is None:
    raise ValueError("a JobSet pod (JOBSET_NAME is set) without REPLICATED_JOB_NAME or "
                     "JOB_COMPLETION_INDEX: its jobs must be Indexed (completionMode: Indexed, "
                     "the JobSet default) for each pod to know its process id")
  replicas = _int(env.get("REPLICATED_JOB_REPLICAS"), "REPLICATED_JOB_REPLICAS") or 1
  if n % replicas:
    raise ValueError(f"JAX_NUM_PROCESSES={n} is not divisible by the {replicas} jobs of "
                     f"replicated job {job} (REPLICATED_JOB_REPLICAS)")
  job_index = _int(env.get("JOB_INDEX"), "JOB_INDEX") or 0
  process = job_index * (n // replicas) + int(env["JOB_COMPLETION_INDEX"])
  port = env.get("JAX_COORDINATOR_PORT") or JOBSET_PORT
  coordinator = (env.get("JAX_COORDINATOR_ADDRESS")
                 or f"{name}-{job}-0-0.{env.get('JOBSET_SUBDOMAIN') or name}:{port}")
  return coordinator, n, process


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
  if local_device_ids is None:
    local_device_ids = slurm_local_device_ids(env)
  explicit = (coordinator_address, num_processes, process_id)
  detected = None
  if not any(v is not None for v in explicit):
    detected = cluster_detected(env)
    if detected == "jobset":   # read here: JAX's Kubernetes detection needs an API client
      coordinator_address, num_processes, process_id = explicit = jobset_cluster(env)
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
    # Everything is given: JAX's detection would only fill local_device_ids, with SLURM_LOCALID
    kwargs.setdefault("cluster_detection_method", "deactivate")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               local_device_ids=local_device_ids, **kwargs)
  else:
    if detected is None:
      return False
    logging.info("multi-process environment detected (%s): jax.distributed auto-configures",
                 detected)
    jax.distributed.initialize(local_device_ids=local_device_ids, **kwargs)
  logging.info("process %d of %d; %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return jax.process_count() > 1


def devices_hint(needed: int) -> str:
  """Why a multi-process job may have fewer devices than its mesh needs: each process's share
  (empty for a single process, where the count is the machine's)."""
  processes = jax.process_count()
  if processes <= 1:
    return ""
  local = jax.local_device_count()
  hint = (f" ({processes} processes x {local} device{'s' * (local != 1)} each; "
          f"{needed} devices need {needed / processes:g} per process")
  if local * processes < needed:
    hint += (": each process drives fewer accelerators than its host has. Launch one "
             "process per host with all of its GPUs visible (SLURM: --ntasks-per-node=1 and "
             "--gpus-per-node; CUDA_VISIBLE_DEVICES unrestricted) or one process per GPU, or "
             f"name each process's devices in {ENV_LOCAL_DEVICE_IDS}")
  return hint + ")"
