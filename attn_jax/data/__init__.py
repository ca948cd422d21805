"""Training data: `synthetic` (MQAR, random tokens), `text` (text/JSONL files, packed),
`shards` (pre-tokenised memory-mapped token shards from experiments/prepare_data.py),
`tokenizer` (bytes or a `tokenizers` JSON file) and `pipeline` (the grain iterator the trainer
uses: `make_train_iterator`, `make_eval_batches`, `vocab_size_needed`, checkpoint helpers)."""
