"""Two CPU processes on one machine form one JAX cluster (localhost coordinator) and compute the
same global result as one process; each host reads only its rows of the global batch (from the
sharding, also when a tensor axis spans the hosts). They train the tiny config together through
the real trainer with the per-step losses of one process, write one set of metrics, and leave a
checkpoint that restores in one process; (slow) a SIGTERM to one of them stops both at the same
step and a new pair resumes; tensor parallelism across the two hosts trains like one process."""

import json
import os
import socket
import subprocess
import sys

import chex
import numpy as np
import pytest

from attn_jax import distributed
from attn_jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, sys
import numpy as np
from attn_jax import distributed
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from attn_jax import sharding as shd
multi = distributed.initialize()
assert distributed.initialize() == multi          # idempotent
mesh = shd.make_mesh((-1,), ("data",))
sh = NamedSharding(mesh, P("data", None))
shape = (8, 5)
global_x = np.arange(40, dtype=np.float32).reshape(shape) ** 1.5
rows = shd.host_batch_rows(sh, shape)
x = jax.make_array_from_process_local_data(sh, global_x[rows], shape)
total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
# A non-batch axis across hosts: "tensor" first, so each host holds both "data" shards.
mesh_tp = shd.make_mesh((2, -1), ("tensor", "data"))
sh_tp = NamedSharding(mesh_tp, P("data", None))
rows_tp = shd.host_batch_rows(sh_tp, shape)
x_tp = jax.make_array_from_process_local_data(sh_tp, global_x[rows_tp], shape)
total_tp = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh_tp, P()))(x_tp)
print("RESULT " + json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                              "devices": jax.device_count(), "rows": [rows.start, rows.stop],
                              "sum": float(total), "rows_tp": [rows_tp.start, rows_tp.stop],
                              "sum_tp": float(total_tp)}), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(env_extra, devices, script=WORKER, args=()):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **env_extra)
  for k in ("SLURM_NTASKS", "SLURM_NPROCS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
            "TPU_WORKER_HOSTNAMES"):
    env.pop(k, None)
  return subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _result(p):
  out, err = p.communicate(timeout=300)
  assert p.returncode == 0, err[-3000:]
  return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def test_two_processes_form_one_cluster_and_match_one_process():
  single = _result(_run({}, devices=4))
  assert single["count"] == 1 and single["rows"] == [0, 8]
  port = _free_port()
  procs = [_run({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                 distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(i)},
                devices=2) for i in range(2)]
  results = sorted((_result(p) for p in procs), key=lambda r: r["process"])
  assert [r["count"] for r in results] == [2, 2]
  assert [r["devices"] for r in results] == [4, 4]
  assert [r["rows"] for r in results] == [[0, 4], [4, 8]]   # from the sharding: disjoint halves
  # "tensor" across the hosts: each host's devices hold every row (not process_index * B/P)
  assert [r["rows_tp"] for r in results] == [[0, 8], [0, 8]]
  for r in results:
    np.testing.assert_allclose(r["sum"], single["sum"], rtol=1e-6)
    np.testing.assert_allclose(r["sum_tp"], single["sum"], rtol=1e-6)


def test_single_process_and_argument_errors():
  assert distributed.cluster_detected({}, tpu_vm=False) is None
  assert distributed.initialize(env={}) is False                 # nothing configured: no-op
  assert distributed.initialize(num_processes=1, env={}) is False
  with pytest.raises(ValueError, match="process_id not given"):
    distributed.initialize(coordinator_address="h:1", num_processes=2, env={})
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    distributed.initialize("h:1", 2, 2, env={})
  with pytest.raises(ValueError, match="ATTN_JAX_NUM_PROCESSES must be an integer"):
    distributed.initialize(env={distributed.ENV_NUM_PROCESSES: "two"})


# ------------------------------------------------------------------ training on two hosts

TRAIN_WORKER = r"""
import json, sys
from attn_jax import distributed
distributed.initialize()
import jax
import numpy as np
from attn_jax.train import trainer
from attn_jax.train import setup as setup_lib
from configs import quickstart

spec = json.loads(sys.argv[1])
c = quickstart.get_config()
c.model.update(d_model=32, n_heads=2, d_ff=64, n_layers=2, pattern=())   # a Transformer
c.data.update(seq_len=32, global_batch_size=8, mqar_num_pairs=4, mqar_num_queries=4)
c.train.update(steps=spec["steps"], log_every=1, progress_bar=False, grad_accum=2)
c.checkpoint.every_steps = 2
c.eval.every_steps = 0                  # held-out loss at the end only
c.optim.warmup_steps = 2
c.mesh.shape = (2, 2, 1)                # data x fsdp over all 4 devices of the cluster
if spec.get("tensor_across_hosts"):     # tensor x data, "tensor" first: it spans the hosts
  c.mesh.axis_names = ("tensor", "data", "fsdp")
if spec.get("sigterm", {}).get("process") == jax.process_index():
  import signal, threading              # this process alone is told to stop during a step
  real_next, calls = setup_lib.next_batch, [0]
  def next_batch(*a, **k):
    calls[0] += 1
    if calls[0] == spec["sigterm"]["step"]:   # to the main thread: handled before it returns
      signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    return real_next(*a, **k)
  setup_lib.next_batch = next_batch
res = trainer.train_and_evaluate(c, spec["workdir"])
out = {"process": jax.process_index(), "count": jax.process_count(),
       "devices": jax.device_count(), "eval_loss": res.get("eval/loss"),
       "preempted": res.get("preempted"), "step": res.get("step")}
if spec.get("restore"):                 # one process: restore both runs' final checkpoints
  from attn_jax.train.checkpoint import Checkpointer, load_for_inference
  from flax import nnx
  setup = setup_lib.build_setup(c)
  flat = {}
  for name in ("one", "pair"):
    ck = Checkpointer(spec[name])
    state = ck.restore(setup.abstract_state)          # params, opt_state, step (no data: per host)
    out[name + "_step"] = ck.restored_step
    ck.close()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      flat[name + jax.tree_util.keystr(path)] = np.asarray(jax.device_get(leaf))
  model, _, step = load_for_inference(spec["pair"])   # the evaluator's path
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    flat["inference" + jax.tree_util.keystr(path)] = np.asarray(leaf)
  out["inference_step"] = step
  np.savez(spec["restore"], **flat)
print("RESULT " + json.dumps(out), flush=True)
"""


def _train(spec, env_extra, devices):
  return _run(env_extra, devices, script=TRAIN_WORKER, args=[json.dumps(spec)])


def _train_pair(workdir, steps, **spec):
  port = _free_port()
  procs = [_train({"workdir": workdir, "steps": steps, **spec},
                  {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                   distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(i)},
                  devices=2) for i in range(2)]
  pair = sorted((_result(p) for p in procs), key=lambda r: r["process"])
  assert [(r["count"], r["devices"]) for r in pair] == [(2, 4), (2, 4)]
  return pair


def _losses(workdir):
  return [(m["step"], m["loss"]) for m in read_metrics(workdir) if "loss" in m]


def _split(flat, prefix):
  return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix + "[")}


def test_two_processes_train_together_like_one(tmp_path):
  """Two processes x 2 CPU devices train the tiny config on a data x fsdp mesh (2, 2, 1) that
  spans both; each feeds only its rows; the per-step losses, the held-out loss and the final
  checkpoint equal one process with 4 devices, and the pair's checkpoint restores in one
  process."""
  steps = 3
  pair_dir, one_dir = str(tmp_path / "pair"), str(tmp_path / "one")
  pair = _train_pair(pair_dir, steps)
  npz = str(tmp_path / "states.npz")
  one = _result(_train({"workdir": one_dir, "steps": steps, "restore": npz, "one": one_dir,
                        "pair": pair_dir}, {}, devices=4))
  assert (one["count"], one["devices"]) == (1, 4)

  # Only process 0 wrote metrics: every step exactly once, one TensorBoard event file.
  loss_pair, loss_one = _losses(pair_dir), _losses(one_dir)
  assert [s for s, _ in loss_pair] == list(range(1, steps + 1))
  events = [f for f in os.listdir(os.path.join(pair_dir, "tb")) if f.startswith("events.out")]
  assert len(events) == 1, os.listdir(os.path.join(pair_dir, "tb"))   # beside the writer lock
  np.testing.assert_allclose([l for _, l in loss_pair], [l for _, l in loss_one], rtol=1e-5)
  for r in pair:   # both processes computed the same global held-out loss
    np.testing.assert_allclose(r["eval_loss"], one["eval_loss"], rtol=1e-5)

  # The pair's final checkpoint (each process wrote its shards) restores in one process and
  # holds the state of the one-process run: parameters, optimizer moments, step.
  assert one["one_step"] == one["pair_step"] == one["inference_step"] == steps
  flat = dict(np.load(npz))
  pair_state, one_state = _split(flat, "pair"), _split(flat, "one")
  assert pair_state.keys() == one_state.keys() and len(pair_state) > 10
  chex.assert_trees_all_close(pair_state, one_state, rtol=1e-5, atol=1e-7)
  inference = _split(flat, "inference")
  for k, v in inference.items():
    np.testing.assert_array_equal(v, pair_state["['params']" + k], err_msg=k)


@pytest.mark.slow
def test_two_processes_stop_on_sigterm_and_resume_together(tmp_path):
  """SIGTERM reaches process 1 alone during step 3: both processes stop after step 3 (the stop
  flag is all-gathered) with a checkpoint (state shards from both, one grain iterator state
  per process); the same command on a new pair resumes to step 4: the same losses as one
  process training 4 steps straight, each step logged once."""
  pair_dir, one_dir = str(tmp_path / "pair"), str(tmp_path / "one")
  stopped = _train_pair(pair_dir, 4, sigterm={"process": 1, "step": 3})
  assert [r["step"] for r in stopped] == [3, 3] and stopped[1]["preempted"] == "SIGTERM"
  assert stopped[0]["preempted"]   # process 0 stops too (it only knows that some host was told)
  pair = _train_pair(pair_dir, 4)
  assert [r["preempted"] for r in pair] == [None, None]
  one = _result(_train({"workdir": one_dir, "steps": 4}, {}, devices=4))
  loss_pair, loss_one = _losses(pair_dir), _losses(one_dir)
  assert [s for s, _ in loss_pair] == [1, 2, 3, 4]
  np.testing.assert_allclose([l for _, l in loss_pair], [l for _, l in loss_one], rtol=1e-5)
  for r in pair:
    np.testing.assert_allclose(r["eval_loss"], one["eval_loss"], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_train_with_tensor_parallelism_across_hosts(tmp_path):
  """Mesh axes ("tensor", "data", "fsdp") = (2, 2, 1): the tensor axis spans the two processes,
  so each host's devices hold all rows of the batch and each feeds all of them; the losses equal
  one process with the same mesh."""
  pair_dir, one_dir = str(tmp_path / "pair"), str(tmp_path / "one")
  pair = _train_pair(pair_dir, 3, tensor_across_hosts=True)
  one = _result(_train({"workdir": one_dir, "steps": 3, "tensor_across_hosts": True}, {},
                       devices=4))
  loss_pair, loss_one = _losses(pair_dir), _losses(one_dir)
  assert [s for s, _ in loss_pair] == [1, 2, 3]
  np.testing.assert_allclose([l for _, l in loss_pair], [l for _, l in loss_one], rtol=1e-5)
  for r in pair:
    np.testing.assert_allclose(r["eval_loss"], one["eval_loss"], rtol=1e-5)


# ------------------------------------------------------------------ detecting a cluster
# One test per environment JAX's own cluster detection (jax/_src/clusters) configures itself
# from, with the variables (or metadata) that environment sets.

SRUN_2_TASKS = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "2",
                "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}


def _no_metadata(key):
  raise AssertionError(f"asked the metadata server for {key} off a TPU VM")


def test_slurm_is_detected_inside_srun_only():
  assert distributed.cluster_detected(SRUN_2_TASKS, tpu_vm=False) == "slurm"
  one = dict(SRUN_2_TASKS, SLURM_NTASKS="1")
  assert distributed.cluster_detected(one, tpu_vm=False, metadata=_no_metadata) is None
  # sbatch's script itself (no job step yet: no SLURM_STEP_NODELIST) is one process
  batch = {k: v for k, v in SRUN_2_TASKS.items() if k != "SLURM_STEP_NODELIST"}
  assert distributed.cluster_detected(batch, tpu_vm=False, metadata=_no_metadata) is None


def test_a_gke_tpu_slice_is_detected_from_the_webhooks_variables():
  env = {"TPU_WORKER_HOSTNAMES": "tpu-0.svc,tpu-1.svc,tpu-2.svc,tpu-3.svc", "TPU_WORKER_ID": "2"}
  assert distributed.cluster_detected(env, tpu_vm=True, metadata=_no_metadata) == "gke_tpu"
  env = {"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476", "TPU_WORKER_ID": "0"}
  assert distributed.cluster_detected(env, tpu_vm=True, metadata=_no_metadata) == "gke_tpu"
  one_host = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}
  assert distributed.cluster_detected(one_host, tpu_vm=True, metadata=_no_metadata) is None
  # the same variables off a TPU VM configure nothing (JAX's GKE cluster needs the chips)
  assert distributed.cluster_detected(env, tpu_vm=False, metadata=_no_metadata) is None


def test_a_plain_multi_host_tpu_vm_is_detected_from_its_metadata_server():
  """`gcloud compute tpus tpu-vm ssh --worker=all` sets no variable: the worker number and the
  worker list come from the VM's metadata server, as in JAX's GCE TPU cluster."""
  answers = {"agent-worker-number": "1",
             "worker-network-endpoints": "unknown:unknown:10.130.0.2,unknown:unknown:10.130.0.3"}
  asked = []

  def metadata(key):
    asked.append(key)
    return answers.get(key)

  assert distributed.cluster_detected({}, tpu_vm=True, metadata=metadata) == "tpu_vm"
  assert asked == ["agent-worker-number", "worker-network-endpoints"]
  single = dict(answers, **{"worker-network-endpoints": "unknown:unknown:10.130.0.2"})
  assert distributed.cluster_detected({}, tpu_vm=True, metadata=single.get) is None   # v5e-8
  assert distributed.cluster_detected({}, tpu_vm=True, metadata=lambda k: None) is None
  skip = {"TPU_SKIP_MDS_QUERY": "1"}
  assert distributed.cluster_detected(skip, tpu_vm=True, metadata=_no_metadata) is None
  assert distributed.cluster_detected({}, tpu_vm=False, metadata=_no_metadata) is None


def test_the_metadata_server_is_asked_with_googles_header(monkeypatch):
  seen = {}

  class Answer:
    def __enter__(self):
      return self

    def __exit__(self, *a):
      return False

    def read(self):
      return b"3"

  def urlopen(request, timeout):
    seen.update(url=request.full_url, header=request.get_header("Metadata-flavor"))
    return Answer()

  monkeypatch.setattr(distributed.urllib.request, "urlopen", urlopen)
  assert distributed.tpu_metadata("agent-worker-number", {"GCE_METADATA_IP": "1.2.3.4"}) == "3"
  assert seen == {"url": "http://1.2.3.4/computeMetadata/v1/instance/attributes/"
                         "agent-worker-number", "header": "Google"}


def test_mpi_and_jobset_are_detected():
  assert distributed.cluster_detected({"OMPI_COMM_WORLD_SIZE": "4"}, tpu_vm=False) == "mpi"
  assert distributed.cluster_detected({"PMI_SIZE": "2"}, tpu_vm=False) == "mpi"
  env = {"JOBSET_NAME": "train", "JAX_NUM_PROCESSES": "2"}
  assert distributed.cluster_detected(env, tpu_vm=False) == "jobset"


def test_eval_and_stream_refuse_to_run_as_one_of_several_processes():
  """They read a run on one host (docs/multihost.md): under `srun --ntasks=2` each copy would
  score the whole run and write the same files, so both stop at once naming the launcher."""
  assert distributed.launched_as({}) == (1, "")
  assert distributed.launched_as(dict(SRUN_2_TASKS, SLURM_NTASKS="1")) == (1, "")
  distributed.require_one_process("eval.py", {})
  for env, how in ((SRUN_2_TASKS, "srun"), ({"OMPI_COMM_WORLD_SIZE": "8"}, "mpirun"),
                   ({distributed.ENV_NUM_PROCESSES: "2"}, distributed.ENV_NUM_PROCESSES)):
    with pytest.raises(ValueError, match=f"eval.py runs as one process on one host, and {how} "
                                         r"started it as one of \d"):
      distributed.require_one_process("eval.py", env)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, **SRUN_2_TASKS, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  for script, args in (("eval.py", ["--checkpoint=/nowhere"]),
                       ("stream.py", ["--workdir=/nowhere", "--text=/nowhere"])):
    r = subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{script} runs as one process on one host, and srun" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------ what each process joins
# For each scheduler, the variables it sets in a process: what `distributed.initialize` hands
# to jax.distributed.initialize (mocked), and what JAX's own detection makes of that on the
# same variables (jax/_src/clusters, as jax.distributed.initialize runs it): the coordinator,
# the process count and id, and the local devices the process drives (None: all it sees).

_SCHEDULER_VARS = ("SLURM_", "TPU_", "JOB", "JAX_", "CUDA_VISIBLE", "ROCR_", "HIP_", "OMPI_",
                   "PMI_", "MEGASCALE_", "REPLICATED_JOB", "ATTN_JAX_", "KUBERNETES_")


def _joined(monkeypatch, env, *, tpu_vm=False, metadata=None, args=()):
  from jax._src import clusters
  from jax._src.clusters import cloud_tpu_cluster
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(distributed.native_logs, "has_tpu_device", lambda: tpu_vm)
  monkeypatch.setattr(distributed, "tpu_metadata", lambda key, env=None: (metadata or {}).get(key))
  # JAX's TPU clusters: a TPU VM, its metadata server, no DNS wait for the coordinator
  monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", tpu_vm)
  monkeypatch.setattr(clusters.cluster, "running_in_cloud_tpu_vm", tpu_vm)
  monkeypatch.setattr(cloud_tpu_cluster, "get_metadata",
                      lambda key: ((metadata or {}).get(key, ""), 200 if key in (metadata or {})
                                   else 404))
  monkeypatch.setattr(cloud_tpu_cluster.BaseTpuCluster, "wait_for_coordinator",
                      classmethod(lambda cls, address, timeout: None))
  for k in list(os.environ):
    if k.startswith(_SCHEDULER_VARS):
      monkeypatch.delenv(k)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert distributed.initialize(*args) is False   # the mock joined nothing
  [(a, k)] = calls
  coordinator, n, pid = (list(a) + [None] * 3)[:3]
  ids, method = k.get("local_device_ids"), k.get("cluster_detection_method")
  if method != "deactivate" and None in (coordinator, n, pid, ids):   # as jax does
    coordinator, n, pid, ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator, n, pid, ids, method, 300)
  return coordinator, n, pid, None if ids is None else list(ids)


SRUN_4_NODES = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[01-04]",
                "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]"}
SLURM_PORT = str(4242 % 2**12 + 65535 - 2**12 + 1)   # JAX's port from the job id


def test_slurm_one_task_per_node_drives_every_gpu_of_its_node(monkeypatch):
  """`--nodes=4 --ntasks-per-node=1 --gpus-per-node=8` (docs/multihost.md's recipe): task 2 on
  gpu03 sees 8 GPUs. JAX's default would give it GPU SLURM_LOCALID=0 only (jax#16788)."""
  env = dict(SRUN_4_NODES, SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="2",
             SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_STEP_TASKS_PER_NODE="1(x4)",
             SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  assert _joined(monkeypatch, env) == (f"gpu01:{SLURM_PORT}", 4, 2, list(range(8)))
  # SLURM with gres but no list in the environment: every GPU the process sees
  no_list = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
  assert _joined(monkeypatch, no_list)[3] == list(range(8))
  no_count = {k: v for k, v in no_list.items() if k != "SLURM_GPUS_ON_NODE"}
  assert _joined(monkeypatch, no_count)[3] == []   # JAX restricts nothing: all GPUs
  # only the step's tasks-per-node string (no --ntasks-per-node): the same
  step = {k: v for k, v in env.items() if k != "SLURM_NTASKS_PER_NODE"}
  assert _joined(monkeypatch, step)[3] == list(range(8))
  # the explicit recipe (flags from scontrol) under srun: still every GPU of the node
  assert _joined(monkeypatch, env, args=("gpu01:12345", 4, 2)) == ("gpu01:12345", 4, 2,
                                                                    list(range(8)))


def test_slurm_one_task_per_gpu_drives_its_own(monkeypatch):
  """`--ntasks-per-node=8`: with every GPU visible to every task, task SLURM_LOCALID drives
  GPU SLURM_LOCALID (JAX's own rule); with `--gpus-per-task=1` SLURM shows each task only
  its GPU, which is ordinal 0 in that task (JAX's default, 5, names a GPU it cannot see)."""
  env = dict(SRUN_4_NODES, SLURM_NTASKS="32", SLURM_NTASKS_PER_NODE="8", SLURM_PROCID="13",
             SLURM_LOCALID="5", SLURM_NODEID="1", SLURM_GPUS_ON_NODE="8",
             CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  assert _joined(monkeypatch, env) == (f"gpu01:{SLURM_PORT}", 32, 13, [5])
  bound = dict(env, CUDA_VISIBLE_DEVICES="5")
  assert _joined(monkeypatch, bound) == (f"gpu01:{SLURM_PORT}", 32, 13, [0])
  # 2 tasks per node sharing 8 visible GPUs: 4 each
  two = dict(env, SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID="3",
             SLURM_LOCALID="1")
  assert _joined(monkeypatch, two)[3] == [4, 5, 6, 7]
  uneven = dict(env, SLURM_NTASKS_PER_NODE="3", SLURM_LOCALID="1")
  with pytest.raises(ValueError, match="do not split evenly"):
    _joined(monkeypatch, uneven)
  # a CPU-only SLURM cluster: nothing to choose, JAX's default
  cpu = {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE")}
  assert _joined(monkeypatch, cpu)[3] == [5]


def test_slurm_tasks_per_node_strings():
  assert distributed._tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
                                     "SLURM_NODEID": "3"}) == 1
  assert distributed._tasks_on_node({"SLURM_TASKS_PER_NODE": "2(x3),1",
                                     "SLURM_NODEID": "1"}) == 2
  assert distributed._tasks_on_node({}) is None


JOBSET_GPU = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOBSET_NAME": "sisa152m",
              "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": "1", "JOB_INDEX": "0",
              "JOB_COMPLETION_INDEX": "3", "JAX_NUM_PROCESSES": "4",
              "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_a_gke_gpu_jobset_pod_finds_pod_0_without_the_kubernetes_package(monkeypatch):
  """JobSet's own variables name the coordinator (pod 0's DNS name) and the process id; JAX's
  Kubernetes detection (which would need the `kubernetes` package and API permissions) is not
  run, and each pod drives all its GPUs."""
  assert _joined(monkeypatch, JOBSET_GPU) == ("sisa152m-workers-0-0.sisa152m:8476", 4, 3, None)
  two_jobs = dict(JOBSET_GPU, REPLICATED_JOB_REPLICAS="2", JOB_INDEX="1",
                  JOB_COMPLETION_INDEX="1", JAX_COORDINATOR_PORT="1234")
  assert _joined(monkeypatch, two_jobs) == ("sisa152m-workers-0-0.sisa152m:1234", 4, 3, None)
  with pytest.raises(ValueError, match="Indexed"):
    _joined(monkeypatch, {k: v for k, v in JOBSET_GPU.items() if k != "JOB_COMPLETION_INDEX"})


def test_a_gke_tpu_jobset_pod_finds_worker_0_from_the_webhooks_variables(monkeypatch):
  """GKE's TPU webhook sets TPU_WORKER_HOSTNAMES / TPU_WORKER_ID: JAX's GKE TPU cluster reads
  them (no Kubernetes API); TPU processes are never restricted to some chips."""
  env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOBSET_NAME": "sisa152m",
         "REPLICATED_JOB_NAME": "slice", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "2",
         "TPU_WORKER_HOSTNAMES": "sisa152m-slice-0-0.sisa152m,sisa152m-slice-0-1.sisa152m,"
                                 "sisa152m-slice-0-2.sisa152m,sisa152m-slice-0-3.sisa152m",
         "TPU_WORKER_ID": "2"}
  assert _joined(monkeypatch, env, tpu_vm=True) == ("sisa152m-slice-0-0.sisa152m:8482", 4, 2,
                                                     None)


def test_a_tpu_vm_worker_finds_worker_0_through_the_metadata_server(monkeypatch):
  metadata = {"agent-worker-number": "3",
              "worker-network-endpoints": "unknown:unknown:10.130.0.2,unknown:unknown:10.130.0.3,"
                                          "unknown:unknown:10.130.0.4,unknown:unknown:10.130.0.5",
              "tpu-env": ""}
  assert _joined(monkeypatch, {}, tpu_vm=True, metadata=metadata) == ("10.130.0.2:8482", 4, 3,
                                                                       None)


def test_explicit_variables_restrict_no_device(monkeypatch):
  env = {"ATTN_JAX_COORDINATOR_ADDRESS": "10.0.0.1:12345", "ATTN_JAX_NUM_PROCESSES": "2",
         "ATTN_JAX_PROCESS_ID": "1"}
  assert _joined(monkeypatch, env) == ("10.0.0.1:12345", 2, 1, None)
  assert _joined(monkeypatch, dict(env, ATTN_JAX_LOCAL_DEVICE_IDS="2,3"))[3] == [2, 3]


def test_a_mesh_short_of_devices_names_each_processs_share(monkeypatch):
  """4 processes that each drive one GPU of 8: the error says so, and what to launch."""
  from attn_jax import sharding as shd
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 4)
  monkeypatch.setattr(distributed.jax, "local_device_count", lambda: 1)
  with pytest.raises(ValueError, match=r"needs 32 devices, have 8 \(4 processes x 1 device "
                                       r"each; 32 devices need 8 per process: each process "
                                       r"drives fewer accelerators .*--ntasks-per-node=1"):
    shd.make_mesh((4, 8, 1), ("data", "fsdp", "tensor"))
