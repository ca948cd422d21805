"""Train-step throughput of several configs side by side (tokens/s, ratio, analytic FLOPs, MFU,
compiled peak memory, decode tokens/s): flags in, `attn_jax.bench.run` out (what each figure
means: attn_jax/bench/__init__.py).

  python experiments/bench.py --preset=cpu_50m_fp32   # the 50M Transformer's shapes, fp32
  python experiments/bench.py --configs=transformer_152m,sisa_152m --seq_lens=1024,4096,16384
  python experiments/bench.py --scale=tiny --set=model.dtype=float32 --seq_lens=1024,4096 \
      --configs=transformer_152m,sisa_152m,sisa_152m@fast,sisa_152m@chunked   # a 2-core CPU
  python experiments/bench.py --study=configs/study_tiny.py --seq_lens=256,1024 # every mixer
  python experiments/bench.py --configs=transformer_152m,transformer_152m@model.n_layers=4
  python experiments/bench.py --set=model.d_model=512,model.d_ff=2048,model.sisa.d_state=16

The model changes only through dotted config paths, parsed and checked as training's
--config.<path>=<value> overrides are: `--set=a.b=v,...` for every config (after --scale and
--preset, which are such overrides too: attn_jax/bench/configs.py, which also says how the SISA
and FoX twins are re-matched to their Transformer), a config suffix `@a.b=v,...` for that one;
`@auto|@fast|@chunked` sets the SISA path; `@window|@streaming` decodes the same model under
that cache policy.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402
from attn_jax.bench import PRESETS, SCALES, Options, run  # noqa: E402

flags.DEFINE_list("configs", ["transformer_152m", "sisa_152m"], "Config modules under "
                  "configs/; the first is the baseline. A suffix @auto|@fast|@chunked forces "
                  "the SISA path.")
flags.DEFINE_list("seq_lens", ["1024", "4096"], "Sequence lengths.")
flags.DEFINE_integer("batch_tokens", 8192, "Tokens per step (batch = this / L).")
flags.DEFINE_integer("steps", 5, "Timed steps per config (after warmup).")
flags.DEFINE_integer("warmup", 2, "Untimed steps (the first compiles).")
flags.DEFINE_integer("repeats", 1, "Alternate the configs this many times; best time per "
                     "config is reported (less noise on a shared CPU).")
flags.DEFINE_enum("scale", "full", list(SCALES), "tiny: CPU-sized (d 256 / 4 heads / 4 layers "
                  "/ vocab 4096 / d_ff 1024), overrides listed in attn_jax/bench/configs.py.")
flags.DEFINE_string("set", "", "Config overrides for every config, comma-separated dotted paths "
                    "as training's --config.<path>=<value>, e.g. model.d_model=512,"
                    "model.d_ff=2048,model.dtype=float32,model.sisa.d_state=16 (after --scale "
                    "and --preset; SISA / FoX d_ff re-matched to the Transformer's).")
flags.DEFINE_enum("preset", "", [""] + list(PRESETS), "cpu_50m_fp32: configs "
                  "transformer_152m, sisa_152m, sisa_152m@fast at the 50M shapes (d 512 / 8 "
                  "heads / 6 layers / vocab 50277 / d_ff 2048), fp32, batch 4 x 1024 (explicit "
                  "flags and --set still override).")
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
