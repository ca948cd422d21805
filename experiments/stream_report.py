"""One table and one figure from several experiments/stream.py output folders (the policies of
one stream scored in separate runs, e.g. one run per cache size or per policy).

  python experiments/stream_report.py --runs=runs/s/cached_1024,runs/s/dense,... \
      --ranges=8192,16384 --bin=512 --mark=8192 --out=docs/pretrained --name=smollm2_stream

Reads each folder's losses.json (per-position losses; null = not scored), checks that they
scored the same stream (same token count), and writes under --out:
  <name>.md    a Markdown table: per policy, mean NLL / perplexity overall and per position
               range, and the mean at the positions a subsampled "recompute" scored (paired);
  <name>.png   mean NLL per bin of --bin positions against position, one panel per cache size;
  <name>_eviction.png   the first --zoom positions, running mean over --smooth (the first
               eviction of each cache);
  <name>_paired.png     per subsampled policy (recompute), each policy's loss of the same
               tokens against its loss;
  <name>.json  the numbers of the table.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_RUNS = flags.DEFINE_list("runs", None, "stream.py output folders (each holds losses.json).",
                          required=True)
_RANGES = flags.DEFINE_list("ranges", [], "Position boundaries of the per-range columns.")
_BIN = flags.DEFINE_integer("bin", 512, "Positions per point of the figure.")
_SMOOTH = flags.DEFINE_integer("smooth", 64, "Running-mean width of the eviction figure.")
_ZOOM = flags.DEFINE_integer("zoom", 4096, "Positions shown by the eviction figure.")
_MARK = flags.DEFINE_integer("mark", 0, "A position to mark (the model's max_seq_len).")
_OUT = flags.DEFINE_string("out", None, "Output folder.", required=True)
_NAME = flags.DEFINE_string("name", "stream", "Output file stem.")


def main(argv):
  del argv
  from attn_jax.eval import stream_reports
  edges = [int(e) for e in _RANGES.value]
  results, tokens = stream_reports.read_results(_RUNS.value)
  table = stream_reports.report_table(results, edges)
  os.makedirs(_OUT.value, exist_ok=True)
  stem = os.path.join(_OUT.value, _NAME.value)
  markdown = stream_reports.table_markdown(table, tokens) + "\n"
  with open(stem + ".md", "w") as f:
    f.write(markdown)
  with open(stem + ".json", "w") as f:
    json.dump({"tokens": tokens, "runs": _RUNS.value, "table": table}, f, indent=1)
  stream_reports.plot_report(stem + ".png", stem + "_eviction.png", results,
                             bin_width=_BIN.value, smooth=_SMOOTH.value, zoom=_ZOOM.value,
                             mark=_MARK.value, paired_path=stem + "_paired.png")
  print(markdown)


if __name__ == "__main__":
  cli.run(main)
