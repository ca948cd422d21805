"""Tokenise a local corpus once into memory-mapped token shards for `data.source = "shards"`.

  python experiments/prepare_data.py --input=/data/pile_subset --output=/data/pile_neox \
      --tokenizer=/data/20B_tokenizer.json --workers=16
  python experiments/train.py --config=configs/sisa_152m.py --config.data.source=shards \
      --config.data.paths=/data/pile_neox --config.data.tokenizer=/data/20B_tokenizer.json

  python experiments/prepare_data.py --hf_dataset=cerebras/SlimPajama-627B --hf_split=train \
      --output=/data/slimpajama_neox --tokenizer=/data/20B_tokenizer.json --workers=16

--input: files or folders (recursive) of .jsonl, .jsonl.zst, .parquet, .txt, comma-separated.
One worker process per input file at a time; a progress bar counts bytes and tokens.
--hf_dataset (instead of --input; needs network access and `pip install "attn_jax[hf]"`):
a Hugging Face dataset streamed through `datasets.load_dataset(..., streaming=True)` (nothing
downloaded in full), its --text_field tokenised into shards of --docs_per_shard documents by
--workers processes while it streams; --hf_dataset=json --hf_data_files=<urls or globs> streams
raw JSONL files the same way. With
--on_error=skip bad records (undecodable line, invalid JSON, missing field, empty file) are
counted and listed (file:line) instead of stopping. Format: see attn_jax/data/shard_prep.py
(writing), attn_jax/data/doc_reader.py (bad records) and attn_jax/data/shards.py (reading).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_INPUT = flags.DEFINE_string("input", None, "Input files/folders, comma-separated.")
_HF_DATASET = flags.DEFINE_string("hf_dataset", None, "A Hugging Face dataset name (streamed), "
                                  "instead of --input.")
_HF_CONFIG = flags.DEFINE_string("hf_config", None, "--hf_dataset: its configuration (subset).")
_HF_SPLIT = flags.DEFINE_string("hf_split", "train", "--hf_dataset: the split.")
_HF_DATA_FILES = flags.DEFINE_list("hf_data_files", None,
                                   "--hf_dataset: data_files for load_dataset (e.g. with json).")
_DOCS_PER_SHARD = flags.DEFINE_integer("docs_per_shard", 20_000,
                                       "--hf_dataset: documents per output shard.")
_OUTPUT = flags.DEFINE_string("output", None, "Output folder (shards + index.json).",
                              required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", '"bytes" or a tokenizers JSON file.')
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "JSONL field / Parquet column.")
_TEXT_DOCUMENT = flags.DEFINE_enum("text_document", "line", ["line", "file"],
                                   ".txt: one document per non-blank line, or per file.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Worker processes (0 = min(files, CPUs)).")
_ON_ERROR = flags.DEFINE_enum("on_error", "raise", ["raise", "skip"],
                              "Bad records: stop with file:line, or count and skip.")
_DOC_BOUNDARIES = flags.DEFINE_bool(
    "doc_boundaries", True, "Also write each shard's document end offsets (.docs.npy), which "
    "data.document_mask reads (--nodoc_boundaries: it falls back to EOS tokens).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing prepared folder.")
_VERIFY = flags.DEFINE_bool("verify", False, "Only re-hash the shards of --output and report.")


def main(argv):
  del argv
  from attn_jax.data import doc_reader, shard_prep, shards

  if _VERIFY.value:
    problems = shards.verify_shards(_OUTPUT.value)
    print("\n".join(problems) or f"{_OUTPUT.value}: all shards match the index")
    sys.exit(1 if problems else 0)
  if (_INPUT.value is None) == (_HF_DATASET.value is None):
    print("error: give exactly one of --input and --hf_dataset", file=sys.stderr)
    sys.exit(2)
  common = dict(tokenizer=_TOKENIZER.value, text_field=_TEXT_FIELD.value,
                workers=_WORKERS.value, on_error=_ON_ERROR.value,
                doc_boundaries=_DOC_BOUNDARIES.value, overwrite=_OVERWRITE.value)
  try:
    if _HF_DATASET.value is not None:
      out = shard_prep.prepare_hf(_HF_DATASET.value, _OUTPUT.value, split=_HF_SPLIT.value,
                                  config=_HF_CONFIG.value, data_files=_HF_DATA_FILES.value,
                                  docs_per_shard=_DOCS_PER_SHARD.value, **common)
    else:
      out = shard_prep.prepare(_INPUT.value, _OUTPUT.value, text_document=_TEXT_DOCUMENT.value,
                               **common)
  except (doc_reader.DataError, FileNotFoundError, FileExistsError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"{out['total_tokens']:,} tokens ({out['dtype']}) in {len(out['shards'])} shard(s), "
        f"{out['total_docs']:,} documents, {out['seconds']:.1f} s = "
        f"{out['tokens_per_sec']:,.0f} tokens/s -> {_OUTPUT.value}")
  if out["skipped_records"] or out["skipped_files"]:
    print(f"skipped {out['skipped_records']} record(s), files {out['skipped_files']}; first:")
    for line in out["skipped_examples"]:
      print("  " + line)


if __name__ == "__main__":
  cli.run(main)
