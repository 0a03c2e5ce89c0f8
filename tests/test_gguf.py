"""GGUF files of each family (fabricated with GGUFWriter): biases and q/k norms kept, q/k
un-permuted only for llama.cpp's llama architecture, rope_freqs read as llama3 scaling, unknown
tensors refused; the tokenizer's pre-tokenizer splits against transformers' GGUF tokenizer."""

import os

import jax
import numpy as np
import pytest

from checkpoints_convert import CheckpointError, load_source
from jax_longctx.core.config import ConfigError, RopeScaling
from jax_longctx.model import random_params
from jax_longctx.core.rope import _base_inv_freq, _llama3_inv_freq
from tests.conftest import tiny_config
from tests.helpers.gguf_fixtures import write_gguf

# hidden 64 and intermediate 96 are multiples of Q8_0's block (32), so the MLP can be quantized.
SHAPE = dict(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=96, max_position_embeddings=128)


def _same(a, b, atol=0.0):
  ok = jax.tree.map(lambda x, y: bool(np.allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)),
                    a, b)
  return all(jax.tree.leaves(ok))


@pytest.mark.parametrize("arch, extra", [
    ("qwen2", dict(attention_bias=True)),  # untied: llama.cpp stores output.weight apart
    ("qwen3", dict(qk_norm=True, head_dim=32)),
    ("llama", dict(tie_word_embeddings=True)),
])
def test_gguf_family_loads_exactly(tmp_path, arch, extra):
  cfg = tiny_config(**{**SHAPE, **extra}, architecture=arch, rope_theta=1e6, rms_norm_eps=1e-6)
  params = jax.tree.map(np.asarray, random_params(cfg, seed=2))
  write_gguf(tmp_path / "m.gguf", cfg, params, arch)
  got_cfg, got, _ = load_source(str(tmp_path / "m.gguf"))
  assert (got_cfg.architecture, got_cfg.attention_bias, got_cfg.qk_norm, got_cfg.head_dim,
          got_cfg.tie_word_embeddings) == (arch, cfg.attention_bias, cfg.qk_norm, cfg.head_dim,
                                           cfg.tie_word_embeddings)
  assert _same(got, params)  # F32 tensors: bit exact, q/k un-permuted for llama only


def test_gguf_quantized_tensors_dequantize(tmp_path):
  import gguf
  cfg = tiny_config(**SHAPE, architecture="qwen2", attention_bias=True)
  params = jax.tree.map(np.asarray, random_params(cfg, seed=4))
  write_gguf(tmp_path / "m.gguf", cfg, params, "qwen2", quantize=("ffn_up.weight",))
  _, got, _ = load_source(str(tmp_path / "m.gguf"))
  up = params["layers"][0]["mlp"]["up_proj"]
  q8 = gguf.quants.quantize(np.ascontiguousarray(up.T), gguf.GGMLQuantizationType.Q8_0)
  want = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).T
  assert np.array_equal(got["layers"][0]["mlp"]["up_proj"], want)
  assert 0 < np.max(np.abs(want - up)) < 0.01 * np.max(np.abs(up))  # really quantized


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path):
  scaling = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
  cfg = tiny_config(**SHAPE, rope_theta=500000.0, rope_scaling=scaling)
  params = jax.tree.map(np.asarray, random_params(cfg, seed=2))
  divisors = _base_inv_freq(cfg.head_dim, cfg.rope_theta) / _llama3_inv_freq(cfg)
  write_gguf(tmp_path / "m.gguf", cfg, params, "llama", rope_freqs=divisors)
  got_cfg, got, _ = load_source(str(tmp_path / "m.gguf"))
  assert got_cfg.rope_scaling == scaling and _same(got, params)
  write_gguf(tmp_path / "odd.gguf", cfg, params, "llama", rope_freqs=divisors * 1.5)
  with pytest.raises(ConfigError, match="rope_freqs.weight matches no llama3"):
    load_source(str(tmp_path / "odd.gguf"))


def test_gguf_unknown_tensor_is_an_error(tmp_path):
  cfg = tiny_config(**SHAPE, architecture="qwen2", attention_bias=True)
  params = jax.tree.map(np.asarray, random_params(cfg, seed=2))
  write_gguf(tmp_path / "m.gguf", cfg, params, "qwen2",
             extra={"blk.0.attn_output.bias": np.zeros(64), "blk.1.ffn_gate_inp.weight": np.zeros(8)})
  with pytest.raises(CheckpointError, match=r"2 tensors .* does not use: "
                     r"model\.layers\.0\.self_attn\.o_proj\.bias, blk\.1\.ffn_gate_inp\.weight"):
    load_source(str(tmp_path / "m.gguf"))
  write_gguf(tmp_path / "l.gguf", cfg, params, "llama")  # biases in a llama file
  with pytest.raises(CheckpointError, match=r"q_proj\.bias"):
    load_source(str(tmp_path / "l.gguf"))


def test_gguf_unknown_pre_tokenizer_is_an_error():
  from jax_longctx.checkpoints.gguf_tokenizer import build_tokenizer
  from tests.helpers.gguf_fixtures import byte_tokens
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": byte_tokens(256),
          "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "made-up"}
  with pytest.raises(ConfigError, match="pre-tokenizer 'made-up'"):
    build_tokenizer(meta)


SPLIT_TEXTS = ["I'M DON'T you'll 12345678 x1y22z333", "def f(a, b):\n\treturn a+b  \n\n\n",
               "naïve café 日本語 😀 -- ...!!", "<tool_call>{\"a\": 1}</tool_call><|im_end|>x",
               "   lead\r\n trail   "]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_pre_tokenizer_matches_transformers_gguf_tokenizer(pre):
  """A small byte-level vocabulary: our tokenizer.json against the one transformers builds from
  the same GGUF fields (split regex, special and user-defined tokens)."""
  pytest.importorskip("transformers")
  from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

  from jax_longctx.checkpoints.gguf_tokenizer import build_tokenizer
  from tests.helpers.gguf_fixtures import byte_tokens
  base = byte_tokens(256)
  merges = ["Ġ t", "e r", "Ġt h", "1 2", "2 3", "a b", "Ġ Ġ", "ĊĊ Ċ", "Ċ Ċ", "r e", "' s"]
  tokens = base + [m.replace(" ", "") for m in merges] + ["<|im_end|>", "<tool_call>",
                                                           "</tool_call>"]
  types = [1] * (len(tokens) - 3) + [3, 4, 4]
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.token_type": types}
  ours = build_tokenizer(meta)
  ref, _ = convert_gguf_tokenizer("qwen2", {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre,
                                            "tokens": tokens, "merges": merges,
                                            "token_type": types})
  for text in SPLIT_TEXTS:
    assert ours.encode(text, add_special_tokens=False).ids == ref.encode(
        text, add_special_tokens=False).ids, text
  ids = ours.encode("<tool_call>", add_special_tokens=False).ids
  assert ids == [tokens.index("<tool_call>")]  # a user-defined token stays whole


def test_chat_template_with_bos_gets_one_bos(tmp_path):
  """Llama 3's template writes `{{- bos_token }}` and its GGUF sets add_bos_token: one BOS, as
  transformers' apply_chat_template gives."""
  from jax_longctx.checkpoints.gguf_tokenizer import write_tokenizer_files
  from jax_longctx.app.tokenizer import Tokenizer
  from tests.helpers.gguf_fixtures import byte_tokens
  tokens = byte_tokens(256) + ["<|begin_of_text|>", "<|eot_id|>"]
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "llama-bpe",
          "tokenizer.ggml.token_type": [1] * 256 + [3, 3], "tokenizer.ggml.bos_token_id": 256,
          "tokenizer.ggml.eos_token_id": 257, "tokenizer.ggml.add_bos_token": True,
          "tokenizer.chat_template": "{{- bos_token }}{% for m in messages %}{{ m['content'] }}"
                                     "<|eot_id|>{% endfor %}"}
  write_tokenizer_files(meta, str(tmp_path))
  tok = Tokenizer(str(tmp_path))
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
  assert ids[:2] == [256, tok.encode("h")[1]] and ids.count(256) == 1
  assert tok.encode("hi")[0] == 256  # plain text still gets its BOS


def test_loading_a_gguf_leaves_no_tokenizer_files_behind(tmp_path, monkeypatch):
  """The tokenizer a GGUF carries is written out only while it is read: every load made a
  temporary directory that nothing removed."""
  import tempfile

  import jax_longctx
  cfg = tiny_config(**SHAPE, architecture="qwen2", attention_bias=True)
  write_gguf(tmp_path / "m.gguf", cfg, jax.tree.map(np.asarray, random_params(cfg, seed=2)),
             "qwen2")
  (tmp_path / "tmp").mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  lm = jax_longctx.load(str(tmp_path / "m.gguf"))
  assert os.listdir(tmp_path / "tmp") == []
  assert lm.tokenizer.token_id(lm.tokenizer.eos_token) == cfg.vocab_size - 1
