"""experiments/bench.py's one library call: every config built first (an unknown name or field
is one line before anything compiles), then the table the options ask for, and the rows as
JSON when `options.json` names a file."""

from __future__ import annotations

import json

from attn_jax.bench import printout
from attn_jax.bench.configs import Options, named_config, study_configs
from attn_jax.bench.rows import (DeviceLimits, bench_document_mask, bench_one, decode_only_row,
                                 merge)
from attn_jax.provenance import machine_info

# The options written into the JSON file beside the rows.
JSON_OPTIONS = ("configs", "seq_lens", "batch_tokens", "scale", "set", "steps", "repeats",
                "preset", "study", "document_mask", "document_len")


def run(options: Options) -> list[dict]:
  """Benchmarks what `options` names, prints the tables; returns the rows."""
  o = options
  prepared = study_configs(o.study, o) if o.study else {}
  names = list(prepared) or list(o.configs)
  prepared = {n: prepared.get(n) or named_config(n, o) for n in names}
  machine = machine_info()
  print(f"backend {machine['backend']} x{machine['devices']}, "
        f"{machine['cpu_count']} CPU cores, batch_tokens {o.batch_tokens}", flush=True)
  limits = DeviceLimits(o.peak_n)
  if o.decode_only:
    for name in names:
      printout.print_decode_steps({name: decode_only_row(name, prepared[name], o, limits)},
                                [name], o, header=name == names[0],
                                width=max(len(n) + 1 for n in names))
    return []
  if o.document_mask:
    rows = [bench_document_mask(n, int(L), o, prepared[n]) for L in o.seq_lens for n in names]
    printout.print_document_mask(rows)
  else:
    rows = _train_rows(names, prepared, o, limits)
  write_json(rows, o, limits)
  return rows


def _train_rows(names, prepared, o: Options, limits) -> list[dict]:
  out = []
  for L in (int(s) for s in o.seq_lens):
    best = {}
    for rep in range(o.repeats):
      for name in names:
        if rep and "skipped" in best.get(name, {}):
          continue
        decode = rep == 0 and L == int(o.seq_lens[0])   # decode rows do not depend on L
        row = bench_one(name, L, o, limits, decode=decode, config=prepared[name])
        printout.print_progress(name, L, row, best.get(names[0]))
        best[name] = merge(best.get(name), row)
    printout.print_table(L, best, names, o)
    out += [best[n] for n in names]
  return out


def write_json(rows, options: Options, limits: DeviceLimits) -> None:
  if not options.json:
    return
  with open(options.json, "w") as f:
    json.dump({"flags": {k: getattr(options, k) for k in JSON_OPTIONS}, "rows": rows,
               "limits": limits.measured}, f, indent=1)
  print(f"wrote {options.json}")
