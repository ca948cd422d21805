"""Two CPU processes on one machine form one JAX cluster (localhost coordinator) and compute the
same global result as one process; each host reads only its rows of the global batch."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from attn_jax import distributed

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
print("RESULT " + json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                              "devices": jax.device_count(), "rows": [rows.start, rows.stop],
                              "sum": float(total)}), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(env_extra, devices):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **env_extra)
  for k in ("SLURM_NTASKS", "SLURM_NPROCS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
            "TPU_WORKER_HOSTNAMES"):
    env.pop(k, None)
  return subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _result(p):
  out, err = p.communicate(timeout=120)
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
  for r in results:
    np.testing.assert_allclose(r["sum"], single["sum"], rtol=1e-6)


def test_single_process_and_argument_errors():
  assert distributed.cluster_detected({}) is None
  assert distributed.cluster_detected({"SLURM_NTASKS": "4"}) == "slurm"
  assert distributed.cluster_detected({"SLURM_NTASKS": "1"}) is None
  assert distributed.cluster_detected({"TPU_WORKER_HOSTNAMES": "a,b"}) == "cloud_tpu"
  assert distributed.initialize(env={}) is False                 # nothing configured: no-op
  assert distributed.initialize(num_processes=1, env={}) is False
  with pytest.raises(ValueError, match="process_id not given"):
    distributed.initialize(coordinator_address="h:1", num_processes=2, env={})
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    distributed.initialize("h:1", 2, 2, env={})
  with pytest.raises(ValueError, match="ATTN_JAX_NUM_PROCESSES must be an integer"):
    distributed.initialize(env={distributed.ENV_NUM_PROCESSES: "two"})
