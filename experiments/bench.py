"""Train-step throughput of several configs side by side (tokens/s, ratio, analytic FLOPs, MFU,
compiled peak memory, decode tokens/s): flags in, `attn_jax.bench.run` out (what each figure
means: attn_jax/bench/__init__.py).

  python experiments/bench.py --preset=cpu_50m_fp32   # the 50M Transformer's shapes, fp32
  python experiments/bench.py --configs=transformer_152m,sisa_152m --seq_lens=1024,4096,16384
  python experiments/bench.py --scale=tiny --dtype=float32 --seq_lens=1024,4096 \
      --configs=transformer_152m,sisa_152m,sisa_152m@fast,sisa_152m@chunked   # a 2-core CPU
  python experiments/bench.py --study=configs/study_tiny.py --seq_lens=256,1024 # every mixer
  python experiments/bench.py --configs=transformer_152m,transformer_152m@model.n_layers=4

A config suffix `@a.b=v,...` sets any config fields; `@auto|@fast|@chunked` the SISA path;
`@window|@streaming` decodes the same model under that cache policy.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402
from attn_jax.bench import PRESETS, Options, run  # noqa: E402

flags.DEFINE_list("configs", ["transformer_152m", "sisa_152m"], "Config modules under "
                  "configs/; the first is the baseline. A suffix @auto|@fast|@chunked forces "
                  "the SISA path.")
flags.DEFINE_list("seq_lens", ["1024", "4096"], "Sequence lengths.")
flags.DEFINE_integer("batch_tokens", 8192, "Tokens per step (batch = this / L).")
flags.DEFINE_integer("steps", 5, "Timed steps per config (after warmup).")
flags.DEFINE_integer("warmup", 2, "Untimed steps (the first compiles).")
flags.DEFINE_integer("repeats", 1, "Alternate the configs this many times; best time per "
                     "config is reported (less noise on a shared CPU).")
flags.DEFINE_enum("scale", "full", ["full", "tiny"], "tiny: CPU-sized, see "
                  "attn_jax/bench/configs.py.")
flags.DEFINE_integer("d_model", 0, "Override d_model (0 = keep).")
flags.DEFINE_integer("n_heads", 0, "Override n_heads.")
flags.DEFINE_integer("n_layers", 0, "Override n_layers.")
flags.DEFINE_integer("vocab_size", 0, "Override vocab_size.")
flags.DEFINE_integer("d_ff", 0, "Transformer d_ff at the overridden width (0 = 4 d).")
flags.DEFINE_integer("d_state", 0, "Override SISA d_state (d_ff re-matched).")
flags.DEFINE_string("dtype", "", "Override the compute dtype (e.g. float32 on CPU).")
flags.DEFINE_enum("sisa_path", "", ["", "auto", "fast", "chunked"], "Force the SISA path.")
flags.DEFINE_float("sisa_decay_bias", None, "Override decay_bias_init (e.g. -2.63: half-life "
                   "~10 tokens, long decay range).")
flags.DEFINE_string("remat", "", "Override model.remat.")
flags.DEFINE_enum("preset", "", [""] + list(PRESETS), "cpu_50m_fp32: configs "
                  "transformer_152m, sisa_152m, sisa_152m@fast at the 50M shapes (d 512 / 8 "
                  "heads / 6 layers / vocab 50277), fp32, batch 4 x 1024 (explicit flags "
                  "still override).")
flags.DEFINE_integer("decode_tokens", 128, "Generated tokens (0 = no decode).")
flags.DEFINE_integer("decode_batch", 4, "Largest decode batch.")
flags.DEFINE_list("decode_step_batches", ["1", "32"], "Batches of the decode-step table "
                  "(bandwidth ratio); empty = no table.")
flags.DEFINE_integer("decode_step_prompt", 128, "Decode-step table: prompt length of the "
                     "untimed prefill.")
flags.DEFINE_integer("decode_steps", 32, "Decode-step table: timed steps.")
flags.DEFINE_bool("decode_only", False, "Only the decode-step table (freshly initialised "
                  "parameters, no train step).")
flags.DEFINE_integer("peak_n", 0, "Matmul side of the measured peak (0: 2048 on CPU, 8192 on "
                     "an accelerator).")
flags.DEFINE_string("json", "", "Write the rows to this JSON file.")
flags.DEFINE_string("study", "", "A study config (e.g. configs/study_tiny.py): bench every "
                    "variant of the study at its matched parameter count, plus the streaming "
                    "cache policies of --policy_mixers, in one table.")
flags.DEFINE_list("policy_mixers", ["transformer", "sisa_ds8"], "--study: variants also "
                  "decoded under the window and streaming cache policies (a bounded ring).")
flags.DEFINE_integer("policy_window", 256, "--study: ring window of the window / streaming "
                     "rows (streaming: 4 sinks).")
flags.DEFINE_bool("document_mask", False, "Only the document-masking table: each config's "
                  "step on packed rows next to plain rows.")
flags.DEFINE_integer("document_len", 0, "--document_mask: tokens per packed document (0 = "
                     "seq_len // 4).")
flags.DEFINE_integer("profile_top", 0, "Trace one more train step per row (jax.profiler) and "
                     "print its this many longest kernels by summed device time (0 = off).")
flags.DEFINE_string("profile_dir", "", "Where --profile_top's traces go (default: a temporary "
                    "folder); one subfolder per row.")

def main(argv):
  del argv
  names = [f.name for f in dataclasses.fields(Options)]
  given = {n for n in names if flags.FLAGS[n].present}
  run(Options(**{n: flags.FLAGS[n].value for n in names}).with_preset(given))


if __name__ == "__main__":
  cli.run(main)
