"""A pretrained Llama converted into an attention variant (attn_jax/pretrained/variants.py),
fine-tuned from its run (attn_jax/train/init_from.py), on a tiny random Llama written as a
Hugging Face folder by attn_jax itself (no torch needed):

- step 0: for every offered variant, the converted run's logits (loaded back from its run
  directory, as eval.py / train.py load it) equal the plain import's within 1e-5 relative in
  fp32; the record says what came from the checkpoint, what is new and what was expanded;
- refused variants: one line naming why, nothing written;
- fine-tuning from a converted run: trainable="new" moves only the new parameters, "all"
  moves the others too; the log says the optimizer state is fresh; resuming continues;
- bad input: a tokenizer other than the run's, a config of another architecture: one line
  naming both, nothing written.
"""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.pretrained import PretrainedError, export_hf, load
from attn_jax.pretrained import hf as hf_lib
from attn_jax.pretrained.convert import convert
from attn_jax.pretrained.variants import REFUSED, VARIANTS
from conftest import TEST_DATA, train_tiny_bpe

pytest.importorskip("safetensors", reason="safetensors is not installed (pretrained extra)")

REL_TOL = 1e-5   # fp32 logits, max |variant - plain| / max |plain|


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny_tok():
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  return train_tiny_bpe(text, vocab_size=300)


@pytest.fixture(scope="module")
def llama_dir(tiny_tok, tmp_path_factory):
  """A random Llama (GQA 4/2, random norms) as a HF folder with its tokenizer."""
  from attn_jax.model import build_model
  from attn_jax.pretrained.llama import model_config
  path = str(tmp_path_factory.mktemp("llama") / "hf")
  cfg = model_config(hf_lib.spec_from_config(
      {"model_type": "llama", "vocab_size": tiny_tok.get_vocab_size(), "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 500.0,
       "tie_word_embeddings": False}, "test"))
  export_hf(build_model(cfg.replace(init_std=0.1), seed=5), path, tokenizer=tiny_tok)
  return path


def base_config():
  from configs.base import get_config
  return get_config()


@pytest.fixture(scope="module")
def converted(llama_dir, tmp_path_factory):
  """{variant: run directory} for every offered variant."""
  root = tmp_path_factory.mktemp("runs")
  return {v: convert(llama_dir, workdir=str(root / v), base_config=base_config(), mixer=v)
          for v in VARIANTS}


def probe(vocab: int) -> np.ndarray:
  return np.random.default_rng(7).integers(0, vocab, (2, 200))


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_variant_equals_plain_import_at_step0(llama_dir, converted, variant):
  from attn_jax.train.checkpoint import load_for_inference
  plain = load(llama_dir)
  model, config, step = load_for_inference(converted[variant]["workdir"])
  assert step == 0
  want_mixer = {"sink_logit": "attention"}.get(variant, variant)
  assert model.cfg.mixer == want_mixer
  ids = jnp.asarray(probe(plain.cfg.vocab_size))
  err = rel_err(model(ids), plain.model(ids))
  assert err <= REL_TOL, (variant, err)
  assert converted[variant]["step0_rel_logit_diff"] <= REL_TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_run_records_what_is_new(converted, variant):
  run = converted[variant]["workdir"]
  with open(os.path.join(run, "pretrained.json")) as f:
    rec = json.load(f)["variant"]
  assert rec["variant"] == variant
  plain = {"embed", "head", "final_norm/scale"}
  assert plain <= set(rec["from_checkpoint"])
  assert not set(rec["new"]) & set(rec["from_checkpoint"])
  mixer = "blocks/layers/0/mixer/"
  want_new = {"attention": set(), "sink_logit": {mixer + "sink_logit"},
              "sisa": {mixer + n for n in ("b_proj/kernel", "c_proj/kernel", "decay_proj/kernel",
                                           "phase_proj/kernel", "decay_bias", "lambda_raw")},
              "fox": {mixer + "fgate/kernel", mixer + "fgate_bias"}}[variant]
  assert set(rec["new"]) == want_new
  # SISA has one key head per query head: the checkpoint's 2 K/V heads are repeated
  assert bool(rec["expanded"]) == (variant == "sisa")


def test_sisa_state_term_is_exactly_zero_and_trainable(converted):
  """C = 0 makes the state term vanish; B stays random so W_C gets a gradient."""
  from attn_jax.train.checkpoint import load_for_inference
  model, _, _ = load_for_inference(converted["sisa"]["workdir"])
  mixer = model.blocks.layers[0].mixer
  assert float(jnp.abs(mixer.c_proj.kernel[...]).max()) == 0.0
  assert float(jnp.abs(mixer.b_proj.kernel[...]).max()) > 0.0


@pytest.mark.parametrize("variant", sorted(REFUSED))
def test_refused_variants_name_why_and_write_nothing(llama_dir, tmp_path, variant):
  out = tmp_path / "run"
  with pytest.raises(PretrainedError) as e:
    convert(llama_dir, workdir=str(out), base_config=base_config(), mixer=variant)
  msg = str(e.value)
  assert "\n" not in msg and variant in msg and "cannot be converted exactly" in msg
  assert not out.exists() and not os.listdir(tmp_path)


def test_variant_runs_refuse_llama_export(converted, tmp_path):
  for variant in ("sisa", "fox"):
    with pytest.raises(PretrainedError, match="cannot export as Llama"):
      convert(converted[variant]["workdir"], hf_out=str(tmp_path / variant))
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------------ fine-tuning from a run


def text_file(tmp_path) -> str:
  src = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  path = tmp_path / "train.txt"
  path.write_text(src[:20000], encoding="utf-8")
  return str(path)


def finetune_config(run: str, data: str, **train):
  from attn_jax.train.init_from import finetune_config as make
  c = make(run, base_config())
  c.model.dtype = "float32"
  c.data.update(source="text", paths=data, seq_len=32, global_batch_size=8, read_threads=0,
                prefetch_batches=0, eval_fraction=0.1)
  c.train.update(steps=3, log_every=1, progress_bar=False, **train)
  c.optim.update(lr=1e-2, warmup_steps=0)
  c.checkpoint.every_steps = 3
  c.eval.batch_size = 8
  return c


def params_of(workdir: str, step=None) -> dict:
  from flax import nnx

  from attn_jax.jsonio import flatten
  from attn_jax.train.checkpoint import load_for_inference
  model, _, _ = load_for_inference(workdir, step)
  params = flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)), "/")
  return {k: np.asarray(v) for k, v in params.items()}


def test_finetune_new_params_only(converted, tmp_path, caplog):
  from attn_jax.train.trainer import train_and_evaluate
  run = converted["sisa"]["workdir"]
  c = finetune_config(run, text_file(tmp_path), trainable="new")
  with caplog.at_level(logging.INFO):
    train_and_evaluate(c, str(tmp_path / "ft"))
  assert any("optimizer state fresh" in r.getMessage() for r in caplog.records)
  before, after = params_of(run), params_of(str(tmp_path / "ft"))
  with open(os.path.join(run, "pretrained.json")) as f:
    new = set(json.load(f)["variant"]["new"])
  moved = {k for k in before if not np.array_equal(before[k], after[k])}
  assert moved and moved <= new, moved - new
  assert "blocks/layers/0/mixer/c_proj/kernel" in moved   # the zero factor gets a gradient


def test_finetune_all_then_resume(converted, tmp_path):
  from attn_jax.train.trainer import train_and_evaluate
  run = converted["sink_logit"]["workdir"]
  c = finetune_config(run, text_file(tmp_path))
  c.optim.eps = 1e-15   # the sink's gradient (~e^-30 x ...) is far below the default 1e-8
  wd = str(tmp_path / "ft")
  train_and_evaluate(c, wd)
  before, after = params_of(run), params_of(wd)
  assert not np.array_equal(before["embed"], after["embed"])
  assert not np.array_equal(before["blocks/layers/0/mixer/sink_logit"],
                            after["blocks/layers/0/mixer/sink_logit"])
  c.train.steps = 5
  c.checkpoint.every_steps = 5
  out = train_and_evaluate(c, wd)       # resumes from step 3, init_from ignored
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
  assert np.isfinite(out["eval/loss"])


def test_finetune_refuses_another_vocabulary(converted, tmp_path, tiny_tok):
  from attn_jax.train.trainer import train_and_evaluate
  other = train_tiny_bpe("completely different text " * 50 + "zebra quartz", vocab_size=300)
  tok = tmp_path / "other.json"
  other.save(str(tok))
  c = finetune_config(converted["attention"]["workdir"], text_file(tmp_path))
  c.data.tokenizer = str(tok)
  wd = tmp_path / "ft"
  with pytest.raises(ValueError) as e:
    train_and_evaluate(c, str(wd))
  msg = str(e.value)
  assert "\n" not in msg and str(tok) in msg and converted["attention"]["workdir"] in msg
  assert not wd.exists()
  c.data.tokenizer = "bytes"
  with pytest.raises(ValueError, match="byte tokenizer"):
    train_and_evaluate(c, str(wd))
  assert not wd.exists()


def test_finetune_refuses_another_architecture(converted, tmp_path):
  from attn_jax.train.trainer import train_and_evaluate
  c = finetune_config(converted["sisa"]["workdir"], text_file(tmp_path))
  c.model.mixer = "attention"     # a SISA run into a plain Transformer config
  wd = tmp_path / "ft"
  with pytest.raises(ValueError) as e:
    train_and_evaluate(c, str(wd))
  msg = str(e.value)
  assert "\n" not in msg and "another architecture" in msg
  assert "mixer=sisa" in msg and "mixer=attention" in msg
  assert not wd.exists()


def test_trainable_new_needs_a_converted_run(llama_dir, tmp_path):
  from attn_jax.train.trainer import train_and_evaluate
  plain = convert(llama_dir, workdir=str(tmp_path / "plain"), base_config=base_config())
  c = finetune_config(plain["workdir"], text_file(tmp_path), trainable="new")
  with pytest.raises(ValueError, match="lists no new parameters"):
    train_and_evaluate(c, str(tmp_path / "ft"))
  assert not (tmp_path / "ft").exists()


def test_new_scalar_lr_mult_scales_only_the_new_scalars(llama_dir, tmp_path):
  """One AdamW step (no decay on the sink, a scalar): the sink logit moves new_scalar_lr_mult times
  as far, every pretrained parameter exactly as far. (The sink starts at -2 here, so that its
  gradient is far above Adam's eps and its update far above the rounding of its value.)"""
  from attn_jax.pretrained.variants import VariantInit
  from attn_jax.train.trainer import train_and_evaluate
  run = convert(llama_dir, workdir=str(tmp_path / "sink"), base_config=base_config(),
                mixer="sink_logit", variant_init=VariantInit(sink_init=-2.0))["workdir"]
  data = text_file(tmp_path)
  moved = {}
  for mult in (1.0, 100.0):
    c = finetune_config(run, data, new_scalar_lr_mult=mult)
    c.train.steps = c.checkpoint.every_steps = 1
    c.optim.update(lr=1e-3, weight_decay=0.0)
    wd = str(tmp_path / f"ft{mult:g}")
    train_and_evaluate(c, wd)
    before, after = params_of(run), params_of(wd)
    moved[mult] = {k: after[k] - before[k] for k in before}
  sink = "blocks/layers/0/mixer/sink_logit"
  np.testing.assert_allclose(moved[100.0][sink], 100.0 * moved[1.0][sink], rtol=1e-3)
  assert np.abs(moved[1.0][sink]).max() > 0
  np.testing.assert_array_equal(moved[100.0]["embed"], moved[1.0]["embed"])


# ------------------------------------------------------------------ export back to HF


@pytest.fixture(scope="module")
def torch_tf():
  torch = pytest.importorskip("torch", reason="torch is not installed (dev extra)")
  transformers = pytest.importorskip("transformers", reason="transformers is not installed")
  return torch, transformers


def hf_logits(torch_tf, path, ids, **kw):
  torch, transformers = torch_tf
  model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids))).logits.numpy()


def test_sink_logit_run_exports_as_granite_swa(torch_tf, llama_dir, tmp_path):
  """A sink-logit run (the sinks at -2: they take real mass) written as transformers'
  GraniteSWA computes our logits; GGUF is refused naming why."""
  from attn_jax.pretrained.variants import VariantInit
  from attn_jax.train.checkpoint import load_for_inference
  run = convert(llama_dir, workdir=str(tmp_path / "run"), base_config=base_config(),
                mixer="sink_logit", variant_init=VariantInit(sink_init=-2.0))["workdir"]
  out = convert(run, hf_out=str(tmp_path / "hf"))["hf"]
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["model_type"] == "granite_swa"
  model, _, _ = load_for_inference(run)
  ids = probe(model.cfg.vocab_size)[:, :64]
  ours = np.asarray(model(jnp.asarray(ids)))
  assert rel_err(ours, np.asarray(load(llama_dir).model(jnp.asarray(ids)))) > 1e-3  # sinks act
  err = rel_err(hf_logits(torch_tf, out, ids, attn_implementation="eager"), ours)
  assert err <= REL_TOL, err
  with pytest.raises(PretrainedError, match="llama.cpp's llama architecture has no sinks"):
    convert(run, gguf_out=str(tmp_path / "m.gguf"))
  assert not (tmp_path / "m.gguf").exists()


def test_finetuned_plain_run_exports_as_llama(torch_tf, converted, tmp_path):
  from attn_jax.train.checkpoint import load_for_inference
  from attn_jax.train.trainer import train_and_evaluate
  c = finetune_config(converted["attention"]["workdir"], text_file(tmp_path))
  wd = str(tmp_path / "ft")
  train_and_evaluate(c, wd)
  out = convert(wd, hf_out=str(tmp_path / "hf"))["hf"]
  model, _, step = load_for_inference(wd)
  assert step == 3
  ids = probe(model.cfg.vocab_size)[:, :64]
  err = rel_err(hf_logits(torch_tf, out, ids), np.asarray(model(jnp.asarray(ids))))
  assert err <= REL_TOL, err


def test_trainable_masks_name_the_right_parameters(converted, tmp_path):
  """new: exactly the listed new parameters; new+norms: those and every norm scale."""
  from flax import nnx

  from attn_jax.jsonio import flatten
  from attn_jax.model import abstract_model
  from attn_jax.train.init_from import trainable_mask
  run = converted["fox"]["workdir"]
  with open(os.path.join(run, "pretrained.json")) as f:
    new = set(json.load(f)["variant"]["new"])
  for trainable in ("new", "new+norms"):
    c = finetune_config(run, text_file(tmp_path), trainable=trainable)
    abs_params = nnx.state(abstract_model(c.model), nnx.Param)
    mask = flatten(trainable_mask(c, abs_params), "/")
    on = {p for p, m in mask.items() if m}
    norms = {p for p in mask if p.endswith("norm/scale")}
    assert norms and on == (new | norms if trainable == "new+norms" else new)
