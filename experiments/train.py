"""Train a model: flags in, `attn_jax.train.trainer.train_and_evaluate` out.

  python experiments/train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python experiments/train.py --config=configs/sisa_152m.py --config.data.source=jsonl \
      --config.data.paths=/data/train.jsonl --config.data.tokenizer=/data/20B_tokenizer.json

  python experiments/train.py --config=configs/sisa_152m.py --compile_only=v5e-8

Rerunning the same command resumes from the latest checkpoint in --workdir. An MQAR run (the
quickstart) ends with its held-out answer accuracy next to the no-lookup baselines and a few
held-out sequences with the model's answers (`attn_jax.eval.run.explain_checkpoint`). Multi-host
launches (SLURM, TPU pod slices): docs/multihost.md. Pre-tokenised corpora:
experiments/prepare_data.py, then --config.data.source=shards --config.data.paths=<folder>.
--compile_only=<target>: compile for a GPU/TPU target from any machine (docs/hardware.md).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SIGTERM / SIGINT / SIGHUP from the first second: a signal before the first step (JAX's start,
# a compile) ends the run with one line and its workdir lock released, not silently.
from attn_jax.train import early_signals  # noqa: E402

early_signals.install()
if any(a.split("=")[0] in ("--compile_only", "-compile_only") for a in sys.argv[1:]):
  # The target's devices are compile-only: this process computes on its CPU, whatever machine
  # it is (set before JAX starts, which happens when attn_jax.cli is imported).
  os.environ["JAX_PLATFORMS"] = "cpu"

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from attn_jax import cli  # noqa: E402
from attn_jax.run_layout import RunLayout  # noqa: E402
from attn_jax import config_flags as checked_flags  # noqa: E402

_DEFAULT_CONFIG = "configs/quickstart.py"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process: host:port of process 0 (or env "
    "ATTN_JAX_COORDINATOR_ADDRESS; SLURM / Cloud TPU / mpirun are detected automatically).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "Compile the config's train, eval and decode programs for these "
    "hardware targets (one or a comma-separated list, e.g. h100x8,v5e-8; attn_jax/targets.py) "
    "and report memory, fit, kernels and collectives for each (on a GPU whose step runs Pallas "
    "kernels, the kernel census: train/kernel_census.py); nothing is allocated or run (needs "
    "the targets extra).")


def main(argv):
  del argv   # cli.run drops the libraries' log chatter (cli.quiet_libraries)
  if _COMPILE_ONLY.value is not None and not _COMPILE_ONLY.value.strip():
    from attn_jax.targets import TARGETS   # an empty value used to train on the CPU, silently
    raise ValueError(f"--compile_only= is empty: name a hardware target ({', '.join(TARGETS)}), "
                     "or leave the flag out to train")
  if _COMPILE_ONLY.value:
    from attn_jax.train.aot import compile_only_main
    sys.exit(compile_only_main(_CONFIG.value, _COMPILE_ONLY.value, _config_name()))
  from attn_jax import distributed
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from attn_jax.config import validate
  from attn_jax.eval.run import task_callback
  from attn_jax.train.trainer import train_and_evaluate

  config = validate(_CONFIG.value)   # the typed run config, once: everything below reads it
  workdir = _WORKDIR.value or os.path.join("runs", _config_name())
  tasks = task_callback(config)   # config.eval.tasks, checked before training starts
  result = train_and_evaluate(config, workdir, eval_callbacks=[tasks] if tasks else [])
  import jax
  lead = jax.process_index() == 0      # one summary per job, not one per host
  if result.get("preempted"):  # SIGTERM/SIGINT/SIGHUP: checkpoint saved at a step boundary
    if lead:
      print("\n" + early_signals.stopped_line(
          result["preempted"], early_signals.BEFORE_TRAINING if result.get("before_training")
          else f"after step {result['step']} (checkpoint saved)"))
    signum = getattr(signal, str(result["preempted"]), signal.SIGTERM)
    sys.exit(128 + int(signum))   # the shell convention for "terminated by that signal"
  logging.info("done: %s", result)
  if lead:
    run = RunLayout.of(result["workdir"])   # a local folder or a gs:// URI
    print(f"\nmetrics:     {run.metrics}")
    print(f"tensorboard: {run.tb}")
    print(f"checkpoints: {result['checkpoint_dir']}")
    for k in ("loss", "accuracy", "eval/loss", "eval/accuracy"):
      if k in result:
        print(f"final {k}: {result[k]:.4f}")
  if config.data.source == "synthetic" and config.data.synthetic_task == "mqar":
    from attn_jax.eval.run import explain_checkpoint
    lines = explain_checkpoint(result["workdir"])  # every process loads (sharded restore)
    if lead:
      print("\n" + "\n".join(lines))


def _config_name() -> str:
  return os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]


if __name__ == "__main__":
  # Mistakes (config fields, data files, a busy workdir, unusable checkpoints, a full disk) end in
  # one line on stderr with exit status 2 (3: diverged / does not fit); --debug: the traceback.
  cli.run(main, flags_parser=checked_flags.flags_parser("config", _DEFAULT_CONFIG))
