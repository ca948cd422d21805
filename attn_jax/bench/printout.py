"""experiments/bench.py's printed tables: train step per length (ratios to the first config),
decode steps against the copy-bandwidth bound, document masking (packed / plain)."""

from __future__ import annotations


def print_table(L, rows, names, options) -> None:
  """The train-step table at length `L`; sets each row's "ratio" / "cpu_ratio" to the first."""
  base = rows[names[0]]
  print(f"\nseq_len {L} (batch {base['batch']}, step: setup.build_setup)")
  print(f"{'config':<22}{'params':>12}{'d_ff':>6}{'step s':>9}{'tok/s':>9}{'ratio':>7}"
        f"{'cpu s':>8}{'cpu ratio':>10}{'GFLOP/tok':>10}{'FLOPs ratio':>12}{'TFLOP/s':>9}"
        f"{'MFU meas':>9}{'MFU sheet':>10}{'mem GiB':>8}{'decode tok/s':>13}{'compile s':>10}"
        "  aux (max over layers)")
  for name in names:
    r = rows[name]
    if "skipped" in r:
      print(f"{name:<22} skipped ({r['mem_gib']:.1f} GiB): {r['skipped']}")
      continue
    print(_train_line(name, r, base), flush=True)
  print_decode_steps(rows, names, options)


def print_progress(name, L, r, base=None) -> None:
  """One line per measured row as it is done (the table follows at the end of the length), so
  a run stopped by a time limit keeps what it measured; `base`: the first config's row at this
  length, if measured (the ratio's reference)."""
  if "skipped" in r:
    print(f"  [{name} T {L}] skipped: {r['skipped']}", flush=True)
    return
  mfu = "" if r.get("mfu") is None else f", MFU {r['mfu']:.1%} of the datasheet peak"
  ratio = "" if not base or "skipped" in base else f" ({r['tok_s'] / base['tok_s']:.3f}x)"
  print(f"  [{name} T {L}] step {r['step_s']:.4f} s, {r['tok_s']:.0f} tok/s{ratio}, host cpu "
        f"{r['cpu_s']:.3f} s/step{mfu} ({r['mfu_measured']:.1%} of the measured), compile "
        f"{r['compile_s']:.1f} s", flush=True)


def _train_line(name, r, base) -> str:
  aux = ", ".join(f"{k}={v:.3g}" for k, v in r["aux"].items())
  pct = lambda x: "n/a" if x is None else f"{x:.1%}"   # n/a: no datasheet peak (CPU)
  dec = "-" if r.get("decode_tok_s") is None else f"{r['decode_tok_s']:.1f}"
  ratio = cpu_ratio = "-"
  if "skipped" not in base:
    ratio = f"{r['tok_s'] / base['tok_s']:.3f}"
    cpu_ratio = f"{base['cpu_s'] / r['cpu_s']:.3f}"
    r["ratio"], r["cpu_ratio"] = r["tok_s"] / base["tok_s"], base["cpu_s"] / r["cpu_s"]
  flops_ratio = "-" if "skipped" in base else f"{r['flops_tok'] / base['flops_tok']:.3f}"
  return (f"{name:<22}{r['params']:>12,}{r['d_ff']:>6}{r['step_s']:>9.3f}{r['tok_s']:>9.0f}"
          f"{ratio:>7}{r['cpu_s']:>8.2f}{cpu_ratio:>10}{r['flops_tok'] / 1e9:>10.3f}"
          f"{flops_ratio:>12}{r['flops_s'] / 1e12:>9.3f}{pct(r['mfu_measured']):>9}"
          f"{pct(r['mfu']):>10}{r['mem_gib']:>8.2f}{dec:>13}{r['compile_s']:>10.1f}  {aux}")


def print_decode_steps(rows, names, options, header=True, width=22) -> None:
  """Decode-step tokens/s against the copy-bandwidth bound (attn_jax.bench.roofline)."""
  if not any(rows[n].get("decode_steps") for n in names):
    return
  width = max([width] + [len(n) + 1 for n in names])
  if header:
    _decode_header(width, options)
  for name in names:
    for d in rows[name].get("decode_steps") or ():
      print(f"{name:<{width}}{d['batch']:>6}{d['capacity']:>9}{d['param_bytes'] / 1e6:>9.1f}"
            f"{d['state_bytes'] / 1e6:>9.1f}{d['tok_s']:>10.1f}{d['bound_tok_s']:>12.1f}"
            f"{d['ratio']:>7.3f}", flush=True)


def _decode_header(width, options) -> None:
  print(f"\ndecode steps after an untimed prefill of {options.decode_step_prompt} tokens "
        f"({options.decode_steps} steps timed): bound = batch x bandwidth / (param bytes + "
        "state bytes)")
  print(f"{'config':<{width}}{'batch':>6}{'capacity':>9}{'param MB':>9}{'state MB':>9}"
        f"{'tok/s':>10}{'bound tok/s':>12}{'ratio':>7}")


def print_document_mask(rows) -> None:
  print("\ndocument masking: packed rows (data.document_mask) vs plain rows, same step and "
        "parameters; ratio = packed / plain (> 1: masking costs)")
  print(f"{'config':<26}{'seq_len':>8}{'batch':>6}{'doc len':>8}{'plain s':>9}{'packed s':>9}"
        f"{'ratio':>7}{'plain cpu':>10}{'packed cpu':>11}{'cpu ratio':>10}")
  for r in rows:
    head = f"{r['config']:<26}{r['seq_len']:>8}{r['batch']:>6}{r['doc_len']:>8}"
    if "skipped" in r:
      print(f"{head}  skipped: {r['skipped']}", flush=True)
      continue
    print(f"{head}{r['plain_s']:>9.3f}{r['packed_s']:>9.3f}{r['ratio']:>7.3f}"
          f"{r['plain_cpu_s']:>10.3f}{r['packed_cpu_s']:>11.3f}{r['cpu_ratio']:>10.3f}",
          flush=True)
