"""Model files are untrusted: nothing in them runs as code, and nothing in them sizes an
allocation or names a path unchecked.

A chat template renders in Jinja's sandbox: one that reaches for Python (through `cycler`,
`joiner`, `namespace` or `__subclasses__`) is one error line naming the model file, and the
command it asked for never runs (each escape is first shown to run under a plain Environment, as
templates rendered before). Real templates render as before (SmolLM2's, from the default GGUF)
and as transformers renders them (Qwen-style templates with tojson, namespace, loop controls,
raise_exception). Shard names that leave the checkpoint directory, absurd config sizes and
headers that lie about their tensors are refused before anything is read or allocated.
"""

import json
import os
import struct
import subprocess
import sys

import jax
import jinja2
import numpy as np
import pytest

from checkpoints_convert import CheckpointError, convert, export_hf, load_source
from jax_longctx.app.tokenizer import Tokenizer, TokenizerError
from jax_longctx.checkpoints import pipeline
from jax_longctx.checkpoints.gguf_tokenizer import write_tokenizer_files
from jax_longctx.checkpoints.sources import open_source
from jax_longctx.core.config import ConfigError, LlamaConfig, load_config_file
from jax_longctx.model import random_params
from tests.conftest import tiny_config
from tests.helpers.gguf_fixtures import byte_tokens, write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HI = [{"role": "user", "content": "hi"}]
SHAPE = dict(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=96, max_position_embeddings=128)

# Each runs `{cmd}` in a shell when rendered by a plain jinja2.Environment.
ESCAPES = {
    "cycler": "{{ cycler.__init__.__globals__.os.popen('{cmd}').read() }}",
    "joiner": "{{ joiner.__init__.__globals__.os.popen('{cmd}').read() }}",
    "namespace": "{{ namespace.__init__.__globals__.os.popen('{cmd}').read() }}",
    "subclasses": ("{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
                   "{% if c.__name__ == '_wrap_close' %}"
                   "{{ c.__init__.__globals__['popen']('{cmd}').read() }}{% endif %}{% endfor %}"),
}


def _escape(name, marker):
  return ESCAPES[name].replace("{cmd}", f"touch {marker}")


def _plain_render(template, messages, tok, add_generation_prompt=True):
  """How chat templates were rendered before the sandbox."""
  env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(template).render(
      messages=messages, add_generation_prompt=add_generation_prompt,
      bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")


def _tokenizer_dir(path, template, tokens=None):
  """A tokenizer directory as a GGUF's metadata writes it (without naming a GGUF)."""
  tokens = tokens or byte_tokens(256) + ["<|im_start|>", "<|im_end|>"]
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.token_type": [1] * 256 + [3] * (len(tokens) - 256),
          "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.chat_template": template}
  path.mkdir(exist_ok=True)
  write_tokenizer_files(meta, str(path))
  return path


def _one_line_naming(err, where):
  text = str(err.value)
  assert "\n" not in text and text.startswith(f"{where}: "), text
  assert isinstance(err.value, ValueError)  # what the CLI prints as one line
  return text


# ---- chat templates -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_template_that_reaches_for_python_is_refused_and_runs_nothing(tmp_path, name):
  marker = tmp_path / "pwned"
  tok = Tokenizer(str(_tokenizer_dir(tmp_path / "tok", _escape(name, marker))))
  _plain_render(tok.chat_template, HI, tok)  # the escape is real: a plain Environment runs it
  assert marker.exists()
  marker.unlink()
  with pytest.raises(TokenizerError) as err:
    tok.apply_chat_template(HI)
  text = _one_line_naming(err, tmp_path / "tok" / "tokenizer_config.json")
  assert "chat template refused" in text and "unsafe" in text
  assert not marker.exists()


@pytest.mark.parametrize("template, reason", [
    ("{{ cycler.__init__ }}", "refused"),  # a probe that only prints is refused as well
    ("{% set ns = namespace() %}{% set ns.__html__ = 1 %}", "refused"),
    ("{% set x = [] %}{{ x.append(1) }}", "refused"),  # the immutable sandbox
    ("{{ 'x' * 10 ** 9 }}", "refused"),
    ("{{ 10 ** 100000 }}", "refused"),
    ("{% if %}", "has a syntax error at line 1"),
    ("{{ raise_exception('Roles must\nalternate') }}", "refuses this conversation: Roles must "
     "alternate"),
    ("{{ messages[0].content.nope() }}", "fails (UndefinedError)"),
])
def test_every_template_failure_is_one_line(tmp_path, template, reason):
  tok = Tokenizer(str(_tokenizer_dir(tmp_path, template)))
  with pytest.raises(TokenizerError) as err:
    tok.apply_chat_template(HI)
  assert reason in _one_line_naming(err, tmp_path / "tokenizer_config.json")


def test_a_gguf_template_escape_names_the_gguf_loaded_or_converted(tmp_path):
  """Through the CLI on the GGUF itself (one line, exit 2), and in the library on the checkpoint
  converted from it: both name the GGUF."""
  marker = tmp_path / "pwned"
  cfg = tiny_config(**SHAPE, architecture="qwen2", attention_bias=True)
  gguf_path = tmp_path / "m.gguf"
  write_gguf(gguf_path, cfg, jax.tree.map(np.asarray, random_params(cfg, seed=2)), "qwen2",
             chat_template=_escape("cycler", marker))
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_LONGCTX_QUIET="1", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "jax_longctx", "generate", "--model",
                        str(gguf_path), "--prompt", "hi", "--chat", "--max-new-tokens", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and str(gguf_path) in lines[0] and "chat template refused" in lines[0]
  convert(str(gguf_path), str(tmp_path / "ckpt"))
  import jax_longctx
  lm = jax_longctx.load(str(tmp_path / "ckpt"))
  with pytest.raises(TokenizerError) as err:
    lm.tokenizer.apply_chat_template(HI)
  _one_line_naming(err, gguf_path)
  assert not marker.exists()


CONVERSATIONS = [
    HI,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&'x\" 日本"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


def test_the_default_models_prompts_render_as_before(tmp_path):
  from jax_longctx.app.default_model import DefaultModelMissing, gguf_path
  try:
    path = gguf_path()
  except DefaultModelMissing as e:
    pytest.skip(str(e))
  open_source(path).write_tokenizer(str(tmp_path))
  tok = Tokenizer(str(tmp_path))
  assert tok.origin == os.path.abspath(path) and "<|im_start|>" in tok.chat_template
  for messages in CONVERSATIONS:
    for gen in (True, False):
      assert tok.apply_chat_template(messages, gen) == _plain_render(
          tok.chat_template, messages, tok, gen)


# Small templates in the style of Qwen2.5's (tool calls through tojson), Qwen3's (a namespace
# found by a reversed loop, {% break %}) and Llama 2 / Mistral's (raise_exception on roles).
QWEN25 = r"""{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([]) %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

QWEN3 = r"""{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{% break %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == "assistant" and loop.index0 > ns.last_query_index %}
{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

ALTERNATING = r"""{{- bos_token }}
{%- for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}
{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}
{%- endfor %}"""

ARGUMENTS = {"city": "Zürich", "unit": "<C>", "n": [1, 2]}  # not ASCII, not HTML-safe, unsorted
TOOL_CALL = [{"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "weather", "arguments": ARGUMENTS}}]},
             {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("template", [QWEN25, QWEN3, ALTERNATING], ids=["qwen2.5", "qwen3",
                                                                          "alternating"])
def test_qwen_style_templates_render_as_transformers_does(tmp_path, template):
  pytest.importorskip("transformers")
  from transformers.utils.chat_template_utils import render_jinja_template

  tok = Tokenizer(str(_tokenizer_dir(tmp_path, template)))
  conversations = CONVERSATIONS[1:] + ([TOOL_CALL] if template == QWEN25 else [])
  if template == ALTERNATING:
    conversations = [[m for m in c if m["role"] != "system"] for c in conversations]
  for messages in conversations:
    ref = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
    ours = tok.apply_chat_template(messages)
    assert ours == (ref[0] if isinstance(ref, tuple) else ref)[0]
    # What rendered before renders the same: Jinja's own tojson (escaping '<', sorting keys)
    # differs, and {% break %} was a syntax error.
    if messages is not TOOL_CALL and template != QWEN3:
      assert ours == _plain_render(template, messages, tok)
  if template == QWEN25:
    assert f'"arguments": {json.dumps(ARGUMENTS, ensure_ascii=False)}' in tok.apply_chat_template(
        TOOL_CALL)
  if template == ALTERNATING:
    with pytest.raises(TokenizerError, match="refuses this conversation: Conversation roles must"):
      tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_the_template_is_compiled_once(tmp_path):
  tok = Tokenizer(str(_tokenizer_dir(tmp_path, QWEN3)))
  first = tok._template()
  tok.apply_chat_template(HI)
  assert tok._template() is first


# ---- checkpoint files ---------------------------------------------------------------------------
def _hf_dir(path, monkeypatch, shard_bytes=20_000):
  cfg = tiny_config()
  monkeypatch.setattr(pipeline, "_SHARD_BYTES", shard_bytes)
  export_hf(jax.tree.map(np.asarray, random_params(cfg, seed=5)), cfg, str(path))
  return path


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "a/../../b", 7])
def test_a_shard_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, monkeypatch,
                                                                        shard):
  src = _hf_dir(tmp_path / "src", monkeypatch)
  index = src / "model.safetensors.index.json"
  data = json.loads(index.read_text())
  data["weight_map"][next(iter(data["weight_map"]))] = shard
  index.write_text(json.dumps(data))
  with pytest.raises(CheckpointError) as err:
    load_source(str(src))
  assert "is not a file name inside the checkpoint directory" in _one_line_naming(err, index)


def _config_json(tmp_path, **changes):
  hf = tiny_config().to_hf()
  for key, value in changes.items():
    if value is None:
      hf.pop(key)
    else:
      hf[key] = value
  path = tmp_path / "config.json"
  path.write_text(json.dumps(hf))
  return path


@pytest.mark.parametrize("changes, reason", [
    (dict(num_hidden_layers=-1), "num_layers=-1 is not a whole number"),
    (dict(num_hidden_layers=0), "num_layers=0 is not a whole number"),
    (dict(num_hidden_layers=2.5), "num_layers=2.5"),
    (dict(num_hidden_layers="32"), "num_layers='32'"),
    (dict(num_hidden_layers=10 ** 9), "from 1 to 4096"),
    (dict(vocab_size=10 ** 12), "vocab_size=1000000000000"),
    (dict(hidden_size=0, head_dim=None), "hidden_size=0"),
    (dict(num_attention_heads=0, head_dim=None), "num_attention_heads=0 is not a whole number"),
    (dict(intermediate_size=True), "intermediate_size=True"),
    (dict(max_position_embeddings=-5), "max_position_embeddings=-5"),
    (dict(max_position_embeddings="lots"), "invalid literal"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -2.0}), "rope_scaling.factor=-2.0"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                           "high_freq_factor": 2.0}), "divides by their difference"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "rope_theta=0.0"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps=-1.0"),
    (dict(eos_token_id=-2), "not non-negative integers"),
    (dict(vocab_size=None), "lacks 'vocab_size'"),
])
def test_absurd_config_sizes_are_refused_in_one_line(tmp_path, changes, reason):
  path = _config_json(tmp_path, **changes)
  with pytest.raises(ConfigError) as err:
    LlamaConfig.from_hf_json(str(path))
  assert reason in _one_line_naming(err, path)


def test_our_own_config_file_is_checked_too(tmp_path):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({**tiny_config().to_dict(), "num_layers": -3}))
  with pytest.raises(ConfigError) as err:
    load_config_file(str(path))
  assert "num_layers=-3" in _one_line_naming(err, path)


def _gguf(tmp_path, **kw):
  cfg = tiny_config(**SHAPE, architecture="qwen2", attention_bias=True)
  path = tmp_path / "m.gguf"
  write_gguf(path, cfg, jax.tree.map(np.asarray, random_params(cfg, seed=2)), "qwen2", **kw)
  return path


def _refuse(*_):
  raise AssertionError("allocated for a config that the file's tensors do not bear out")


def test_gguf_sizes_are_checked_before_anything_allocates(tmp_path):
  import gguf
  u32 = gguf.GGUFValueType.UINT32
  (tmp_path / "absurd").mkdir()
  path = _gguf(tmp_path / "absurd", kv={"qwen2.vocab_size": (10 ** 9, u32)})
  with pytest.raises(ConfigError) as err:
    load_source(str(path))
  assert "vocab_size=1000000000" in _one_line_naming(err, path)
  # Within the limits but not what the tensors hold: refused from the tensor table alone.
  path = _gguf(tmp_path, kv={"qwen2.vocab_size": (98, u32)})
  with pytest.raises(CheckpointError) as err:
    pipeline.assemble(open_source(str(path)), _refuse)
  assert "token_embd" not in str(err.value)  # named as the HF tensor it becomes
  assert "model.embed_tokens.weight has shape (97, 64)" in _one_line_naming(err, path)


def test_declared_layers_beyond_the_files_tensors_allocate_nothing(tmp_path, monkeypatch):
  src = _hf_dir(tmp_path / "src", monkeypatch)
  hf = json.loads((src / "config.json").read_text())
  (src / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 4000}))
  with pytest.raises(CheckpointError) as err:
    pipeline.assemble(open_source(str(src)), _refuse)
  assert "checkpoint lacks 35973 tensors" in _one_line_naming(err, src)


def test_gguf_token_ids_outside_the_vocabulary_are_refused(tmp_path):
  import gguf
  bos = (2 ** 32 - 1, gguf.GGUFValueType.UINT32)  # -1 as llama.cpp's unsigned id
  path = _gguf(tmp_path, kv={"tokenizer.ggml.bos_token_id": bos})
  with pytest.raises(ConfigError) as err:
    open_source(str(path)).write_tokenizer(str(tmp_path))
  assert "is not a token id of its 97 tokens" in _one_line_naming(err, path)


def _safetensors(path, header, data=b""):
  blob = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
  return path


@pytest.mark.parametrize("header, data, reason", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "runs past the end"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, "do not hold"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "malformed"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "malformed"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype"),
    ({"w": [1]}, b"", "no header entry"),
    ([1, 2], b"", "header is not an object"),
])
def test_safetensors_headers_that_lie_are_refused(tmp_path, header, data, reason):
  from jax_longctx.checkpoints import safetensors_io
  path = _safetensors(tmp_path / "m.safetensors", header, data)
  with pytest.raises(CheckpointError) as err:
    safetensors_io.read_header(str(path))
  assert reason in _one_line_naming(err, path)


def test_a_safetensors_header_size_beyond_the_file_is_refused_before_reading(tmp_path):
  from jax_longctx.checkpoints import safetensors_io
  path = tmp_path / "m.safetensors"
  path.write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")
  with pytest.raises(CheckpointError) as err:
    safetensors_io.read_header(str(path))
  assert "does not fit the file" in _one_line_naming(err, path)


def test_a_converted_config_edited_to_other_sizes_is_refused(tmp_path):
  """Orbax restores the shapes it stored whatever the config says: a config.json that no longer
  fits its params is an error, not a model whose config lies about its weights."""
  from checkpoints_convert import restore
  convert(str(_gguf(tmp_path)), str(tmp_path / "ckpt"))
  path = tmp_path / "ckpt" / "config.json"
  good = json.loads(path.read_text())
  for key, value in [("vocab_size", 1 << 14), ("intermediate_size", 48)]:
    path.write_text(json.dumps({**good, key: value}))
    with pytest.raises(CheckpointError) as err:
      restore(str(tmp_path / "ckpt"))
    assert "does not fit the params stored beside it" in _one_line_naming(err, path)
  path.write_text(json.dumps(good))
  assert restore(str(tmp_path / "ckpt"))[0].vocab_size == 97


def test_a_tensor_stored_in_another_layout_is_refused_before_anything_allocates(tmp_path,
                                                                                 monkeypatch):
  """The same number of elements, another shape: refused from the header alone."""
  src = _hf_dir(tmp_path / "src", monkeypatch, shard_bytes=1 << 30)
  path = src / "model.safetensors"
  raw = path.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + n])
  name = "model.layers.1.mlp.up_proj.weight"
  header[name]["shape"] = header[name]["shape"][::-1]  # [64, 48] -> [48, 64]: same length
  blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
  path.write_bytes(raw[:8] + blob + raw[8 + n:])
  with pytest.raises(CheckpointError) as err:
    pipeline.assemble(open_source(str(src)), _refuse)
  assert f"tensor {name} has shape (48, 64); the config makes it (64, 48)" in _one_line_naming(
      err, src)
