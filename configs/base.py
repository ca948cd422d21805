"""Base configuration: every preset starts from `get_config()` here and edits it.

Mesh axes and logical->mesh rules are tuples (config_flags cannot override lists).
"""

import ml_collections

from attn_jax.registry import available_mixers, default_options
from attn_jax.sharding import TRUNK_RULES


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # ---------------------------------------------------------------- model
  m = c.model = ml_collections.ConfigDict()
  m.mixer = "attention"          # registry name (attn_jax.registry.available_mixers())
  m.vocab_size = 50277           # GPT-NeoX-20B tokenizer
  m.vocab_multiple = 128         # tables padded to 50304 rows (shardable); logits stay 50277
  m.d_model = 768
  m.n_layers = 12
  m.n_heads = 12
  m.n_kv_heads = 0               # 0 = same as n_heads (MHA); else grouped-query attention
  m.d_ff = 3072                  # SwiGLU hidden width
  m.max_seq_len = 2048
  m.rope_theta = 10000.0
  m.tie_embeddings = True
  m.norm_eps = 1e-5
  m.init_std = 0.02
  m.embed_init_std = 0.0         # the token table's init std; 0 = init_std (GPT-2, mamba_ssm's LM)
  m.dtype = "bfloat16"           # compute dtype
  m.param_dtype = "float32"      # master weights
  m.remat = "none"               # none | full | dots (save matmul outputs)
  m.scan_layers = True
  m.attention_impl = "auto"      # auto | xla | cudnn | einsum (see attention/core.py)
  m.sink_tokens = 0              # learnable sink tokens prepended to every sequence (model.py)
  m.pattern = ()                 # repeating period of layer specs, "mixer" or "mixer:nomlp",
                                 # e.g. ("attention", "mamba2:nomlp"); () = (mixer,)
  # Mixer options live in sub-dicts named after the mixer, built from each mixer's own
  # `Options` defaults (one source of truth), e.g. --config.model.sisa.d_state=16.
  # `available_mixers()` imports every mixer module (the registry discovers them): this is
  # deliberate, so that every mixer's options exist in the config and a command-line override
  # or a pattern naming any mixer finds its sub-dict; the modules are light to import.
  for name in available_mixers():
    m[name] = ml_collections.ConfigDict(default_options(name))

  # ---------------------------------------------------------------- data
  d = c.data = ml_collections.ConfigDict()
  d.source = "synthetic"         # synthetic | text | jsonl | shards
  d.paths = ""                   # text/jsonl: comma-separated files; shards: the folder written
                                 # by experiments/prepare_data.py (index.json + shard_*.bin)
  d.text_field = "text"          # JSONL field holding the document
  d.tokenizer = "bytes"          # "bytes" or a path to a tokenizers JSON file
  d.seq_len = 2048
  d.global_batch_size = 32       # sequences per micro-batch, summed over hosts
  d.shuffle = True
  d.num_workers = 0
  d.synthetic_task = "mqar"      # mqar | random (for throughput runs)
  d.mqar_num_pairs = 8
  d.mqar_num_queries = 4
  d.mqar_vocab = 64
  d.random_vocab = 256           # synthetic_task=random: tokens uniform in [0, random_vocab)
  d.text_document = "line"       # source=text: "line" = one document per non-blank line; "file" = per file
  d.eval_fraction = 0.01         # text/jsonl: last fraction of packed sequences held out for eval
  d.document_mask = False        # packed rows: False = plain concatenation (documents joined by
                                 # EOS, every mixer reads across them: what the SISA paper's
                                 # authors trained with); True = each document exact as if alone
                                 # (batches add `segment_ids`, `positions` restarting at 0; the
                                 # EOS ending a document is the next one's BOS; data/documents.py)
  d.window_offset = "none"       # text/jsonl/shards training windows: "none" = at multiples of
                                 # seq_len; "random" = each at a random token, new every epoch
                                 # (data/offsets.py; the eval split stays aligned)
  d.verify_mb = 2048             # shards: MB re-hashed against index.json at every start (all
                                 # of a smaller corpus; else the least recently verified first;
                                 # new or changed shards always; -1 = all; data/shards.py)
  d.read_threads = 4             # grain threads building batches (0 = in the training thread)
  d.prefetch_batches = 8         # batches read ahead per process

  # ---------------------------------------------------------------- training
  t = c.train = ml_collections.ConfigDict()
  t.steps = 10_000
  t.grad_accum = 1               # micro-batches per optimizer step
  t.log_every = 10
  t.progress_bar = True
  t.profile_steps = ""           # "20:25": a jax.profiler trace of steps 20-24 in
                                 # <workdir>/profile (TensorBoard / Perfetto; docs/guide.md)
  t.peak_flops = 0.0             # per device, FLOP/s; 0 = look up from the device kind
  t.auto_microbatch = False      # step does not fit the device: pick the largest micro-batch
                                 # that does (same tokens per step via grad_accum); else stop
  t.device_memory_gb = 0.0       # > 0: size the run for this much memory per device
  t.nonfinite = "skip"           # a step with a NaN/Inf loss, gradient or update is never
                                 # applied; "skip": count it and go on, "halt": stop and name
                                 # the last finite step and the latest checkpoint
  t.nonfinite_max_consecutive = 10  # skip: halt after this many non-finite steps in a row
  t.spike_window = 100           # loss-spike detector: running window of finite losses (0 = off)
  t.spike_threshold = 6.0        # spike: loss > mean + spike_threshold * std of the window
  t.init_from = ""               # fine-tune: a run directory whose parameters start this run
                                 # (experiments/convert.py or train.py; train/init_from.py)
  t.init_step = -1               # its checkpoint step; -1 = the newest usable one
  t.trainable = "all"            # all | new (the parameters a conversion added) | new+norms
  t.new_scalar_lr_mult = 1.0     # lr multiplier of the scalars/biases a conversion added

  w = c.metrics = ml_collections.ConfigDict()
  w.wandb_project = ""           # Weights & Biases project: log the run there too ("" = off;
                                 # pip install 'attn_jax[wandb]'; train/wandb_writer.py)
  w.wandb_entity = ""            # its team or user ("" = wandb's default)

  o = c.optim = ml_collections.ConfigDict()
  o.lr = 6e-4
  o.min_lr_ratio = 0.1
  o.warmup_steps = 500
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.clip_norm = 1.0

  k = c.checkpoint = ml_collections.ConfigDict()
  k.every_steps = 1000
  k.max_to_keep = 3
  k.allow_unverified = False     # resume from a step without its checksum manifest (copied
                                 # without it, written by other code): its bytes cannot be checked

  e = c.eval = ml_collections.ConfigDict()
  e.every_steps = 0              # 0 = only at the end of training
  e.tasks = ""                   # extra tasks at eval steps, comma-separated, e.g. "mqar,niah"
  e.batch_size = 8
  e.data_dir = ""                # benchmark files laid out like shared/data (lambada/, arc/, ...)
  e.max_len = 0                  # 0 = data.seq_len
  e.limit = 0                    # 0 = every document
  e.niah_lengths = (256, 512)    # context lengths (tokens) of the needle grid
  e.niah_depths = (0.0, 0.25, 0.5, 0.75, 1.0)
  e.niah_samples = 2             # needles per (length, depth) cell

  # ---------------------------------------------------------------- sharding
  s = c.mesh = ml_collections.ConfigDict()
  s.shape = (-1, 1, 1)           # -1 = all remaining devices
  s.axis_names = ("data", "fsdp", "tensor")
  s.replicate_indivisible = ()   # fnmatch patterns (parameter path or logical axis name) allowed
                                 # to replicate when their size does not divide their mesh axes;
                                 # anything else is an error naming the parameter
  # logical axis -> mesh axis (or None = replicated). Batch goes over data+fsdp.
  # Mixers' own axes come from their `axis_rules` (config.config_rules); a rule here, for
  # either kind, overrides.
  s.rules = TRUNK_RULES
  return c


def sisa_matched(c: ml_collections.ConfigDict, config_string: str = ""
                 ) -> ml_collections.ConfigDict:
  """A Transformer preset turned into its SISA twin: mixer "sisa", d_state from the preset
  override (`--config=configs/sisa_152m.py:16` or `:d_state=16`; default 32), and the SwiGLU
  narrowed by `matched_d_ff` (from the Transformer's width) so the parameter count matches."""
  from attn_jax.attention.sisa import matched_d_ff

  d_state = int(config_string.split("=")[-1]) if config_string else 32
  d_ff = matched_d_ff(c.model, d_state)   # from the Transformer's width, before editing
  c.model.update(mixer="sisa", d_ff=d_ff)
  c.model.sisa.d_state = d_state
  return c
