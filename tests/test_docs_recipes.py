"""docs/multihost.md's launch recipes run as written: every `experiments/{train,eval,stream}.py`
command on the page parses with that entry point's own flags (absl + the config overrides,
each field checked to exist), its config validates, and a preset trains on the data it names
(`data.source`, `data.paths`, `data.tokenizer` all given: without them it would train on
generated MQAR). Shell parts are stood in for: `$VAR` and `$(...)` by sample values. The commands
of the GKE JobSet manifests (YAML) are checked the same way.

The recipes create what they need and give each process what the scheduler promises: the
SLURM log folder is made before `sbatch`; the TPU VM copy is the repository's tracked files
(`git archive`, run here), not a local .venv; each JobSet pod finds pod 0 as its coordinator
with a distinct process id, and the devices of all pods make the mesh the command asks for."""

import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from attn_jax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "multihost.md")
COMMAND = re.compile(r"(?:\S*python3?) (experiments/(?:train|eval|stream)\.py)([^'\n;&|>]*)")
SAMPLE = {"HOME": "/home/user", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
          "SLURM_JOB_NODELIST": "gpu[01-04]"}

PARSE = r"""
import importlib.util, json, sys
from absl import flags
script, argv = sys.argv[1], json.loads(sys.argv[2])
sys.argv = [script] + argv   # ml_collections registers the --config.* overrides it finds here
spec = importlib.util.spec_from_file_location("entry_point", script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)          # defines the flags; main() is not run
flags.FLAGS([script] + argv)
out = {"flags": sorted(a.lstrip("-").split("=")[0] for a in argv)}
if "config" in flags.FLAGS:
  from attn_jax import config_flags
  from attn_jax.config import validate
  name = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
  config_flags.check_overrides(config_flags.load_config_file(name), [script] + argv)
  c = flags.FLAGS.config
  validate(c)
  out.update(source=c.data.source, paths=c.data.paths, tokenizer=c.data.tokenizer, config=name)
print(json.dumps(out))
"""


def _commands() -> list[tuple[str, list[str]]]:
  text = open(DOC).read().replace("\\\n", " ")
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  out = []
  for block in blocks:
    block = re.sub(r"\$\([^)]*\)", "node01", block)
    block = re.sub(r"\$(\w+)", lambda m: SAMPLE.get(m.group(1), m.group(0)), block)
    for script, args in COMMAND.findall(block):
      out.append((script, shlex.split(args)))
  return out


def _jobsets() -> list[dict]:
  text = open(DOC).read()
  return [d for block in re.findall(r"```yaml\n(.*?)```", text, re.S)
          for d in [yaml.safe_load(block)] if d.get("kind") == "JobSet"]


def _container(jobset: dict) -> tuple[dict, dict, dict]:
  """(the replicated job, its Job spec, its one container)."""
  [rjob] = jobset["spec"]["replicatedJobs"]
  job = rjob["template"]["spec"]
  [container] = job["template"]["spec"]["containers"]
  return rjob, job, container


def _yaml_commands() -> list[tuple[str, list[str]]]:
  out = []
  for jobset in _jobsets():
    command = _container(jobset)[2]["command"]
    assert command[0] == "python"
    out.append((command[1], command[2:]))
  return out


def test_the_page_has_the_recipes():
  scripts = [s for s, _ in _commands()]
  assert scripts.count("experiments/train.py") >= 5 and "experiments/eval.py" in scripts
  assert len(_yaml_commands()) == 2


@pytest.mark.parametrize("script, argv", _commands() + _yaml_commands(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_recipe_command_parses_with_the_entry_points_flags(script, argv):
  r = subprocess.run([sys.executable, "-c", PARSE, script, json.dumps(argv)], cwd=ROOT,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, f"{script} {argv}: {r.stderr[-2000:]}"
  out = json.loads(r.stdout.strip().splitlines()[-1])
  if script.endswith("train.py") and "quickstart" not in out["config"]:
    assert out["source"] != "synthetic" and out["paths"] and out["tokenizer"], (argv, out)
    assert "workdir" in out["flags"]


def _blocks() -> list[str]:
  return re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)


def test_the_slurm_recipe_makes_its_log_folder_before_submitting():
  [script] = [b for b in _blocks() if "#SBATCH" in b]
  folder = os.path.dirname(re.search(r"#SBATCH --output=(\S+)", script).group(1))
  [submit] = [b for b in _blocks() if re.search(r"\bsbatch\b", b) and "#SBATCH" not in b]
  made = re.search(rf"mkdir -p {re.escape(folder)}\b.*sbatch train\.sbatch", submit)
  assert folder and made, submit
  assert "--ntasks-per-node=1" in script and "--gpus-per-node=8" in script


def test_the_tpu_vm_recipe_copies_the_tracked_files_only(tmp_path):
  """The archive line of the page, run here: it holds the tracked files (no .venv, runs or
  data), and it is what every worker gets and unpacks before installing."""
  [block] = [b for b in _blocks() if "tpu-vm scp" in b]
  assert "--recurse" not in block
  line = next(ln for ln in block.splitlines() if "git archive" in ln)
  archive = re.search(r"-o (\S+)", line).group(1)
  target = str(tmp_path / "attn_jax.tar.gz")
  subprocess.run(["bash", "-c", line.replace(archive, target)], cwd=ROOT, check=True)
  names = subprocess.run(["tar", "-tzf", target], capture_output=True, text=True,
                         check=True).stdout.split()
  tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split())
  assert {"pyproject.toml", "experiments/train.py", "attn_jax/distributed.py"} <= set(names)
  assert not any(n.startswith((".venv", "runs/")) for n in names)
  assert set(n for n in names if not n.endswith("/")) <= tracked
  name = os.path.basename(archive)
  assert re.search(rf"scp {re.escape(archive)} \$TPU:~/ ", block)
  assert re.search(rf"tar -xzf ~/{re.escape(name)} -C ~/attn_jax &&\s+cd ~/attn_jax && "
                   r"python3.11 -m venv", block)


def _mesh(argv: list[str], devices: int) -> int:
  shape = next(a.split("=", 1)[1] for a in argv if a.startswith("--config.mesh.shape="))
  dims = [int(d) for d in shape.strip("()").split(",")]
  if -1 in dims:
    dims[dims.index(-1)] = devices // -math.prod(dims)
  return math.prod(dims)


def test_the_gke_gpu_jobset_gives_every_pod_a_process_id_and_pod_0_as_coordinator():
  """What JobSet and the Indexed Job set in each pod, with the manifest's own variables, read
  by `distributed.jobset_cluster` (the path initialize takes): every pod finds pod 0's DNS
  name on the port the container opens, ids 0..n-1 once each; its GPUs make the mesh."""
  [gpu] = [j for j in _jobsets() if "nvidia.com/gpu" in str(j)]
  rjob, job, container = _container(gpu)
  name = gpu["metadata"]["name"]
  manifest_env = {e["name"]: e["value"] for e in container["env"]}
  n = int(manifest_env["JAX_NUM_PROCESSES"])
  assert n == job["parallelism"] * rjob["replicas"] == job["completions"] * rjob["replicas"]
  port = container["ports"][0]["containerPort"]
  seen = []
  for j in range(rjob["replicas"]):
    for i in range(job["completions"]):
      env = dict(manifest_env, JOBSET_NAME=name, REPLICATED_JOB_NAME=rjob["name"],
                 REPLICATED_JOB_REPLICAS=str(rjob["replicas"]), JOB_INDEX=str(j),
                 JOB_COMPLETION_INDEX=str(i), KUBERNETES_SERVICE_HOST="10.0.0.1")
      assert distributed.cluster_detected(env, tpu_vm=False) == "jobset"
      coordinator, count, pid = distributed.jobset_cluster(env)
      assert (coordinator, count) == (f"{name}-{rjob['name']}-0-0.{name}:{port}", n)
      seen.append(pid)
  assert sorted(seen) == list(range(n))
  gpus = container["resources"]["limits"]["nvidia.com/gpu"] * n
  assert _mesh(container["command"][2:], gpus) == gpus


def test_the_gke_tpu_jobset_asks_for_a_whole_slice():
  """One pod per TPU host of the topology, all its chips each, JAX's TPU coordinator port
  open, and the mesh spans the slice's chips."""
  from jax._src.clusters import cloud_tpu_cluster
  [tpu] = [j for j in _jobsets() if "google.com/tpu" in str(j)]
  rjob, job, container = _container(tpu)
  selector = job["template"]["spec"]["nodeSelector"]
  chips = math.prod(int(d) for d in selector["cloud.google.com/gke-tpu-topology"].split("x"))
  per_host = container["resources"]["limits"]["google.com/tpu"]
  assert job["parallelism"] == job["completions"] == chips // per_host
  assert int(cloud_tpu_cluster.coordinator_port) in [p["containerPort"]
                                                     for p in container["ports"]]
  assert _mesh(container["command"][2:], chips) == chips


def test_the_image_recipe_installs_extras_that_exist():
  import tomllib
  extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"][
      "optional-dependencies"]
  dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
  assert 'pip install --no-cache-dir -e ".[${EXTRAS}]"' in dockerfile
  [block] = [b for b in _blocks() if "docker build" in b]
  builds = re.findall(r"git archive HEAD \| docker build .*--build-arg EXTRAS=(\S+) -", block)
  assert len(builds) == 2
  for names in builds:
    assert set(names.split(",")) <= set(extras), names
