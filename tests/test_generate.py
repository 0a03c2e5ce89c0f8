"""Chunked prefill, cached decoding, batching and compile counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run import generation as gen
from jax_longctx.app.api import LM
from jax_longctx.methods import get
from jax_longctx.run.driver import generate
from jax_longctx.core.options import RunOptions
from tests.conftest import chunked_then_decoded_logits

FULL = get("full")


def _uncached(cfg, params, ids):
  return np.asarray(LM(cfg, params, None).logits(ids))


@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
def test_chunked_prefill_and_decode_match_uncached(tiny, chunk):
  cfg, params = tiny
  rng = np.random.default_rng(chunk)
  ids = rng.integers(0, cfg.vocab_size, (2, 29))
  ref = _uncached(cfg, params, ids)
  # prefill 21 tokens in chunks, then decode the remaining 8 one by one
  logits, cache = chunked_then_decoded_logits(cfg, params, ids, 21, chunk, 40)
  np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
  assert cache.lengths.tolist() == [29, 29]


def test_blocked_attention_matches_dense(tiny, monkeypatch):
  """The key-blocked online-softmax path (long contexts) equals the dense one."""
  from jax_longctx.ops import attention
  cfg, params = tiny
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 45))
  ref = _uncached(cfg, params, ids)
  monkeypatch.setattr(attention, "_DENSE_LIMIT", 0)
  monkeypatch.setattr(attention, "_KEY_BLOCK", 16)  # 45 slots: the last block overlaps
  np.testing.assert_allclose(_uncached(cfg, params, ids), ref, atol=1e-5, rtol=0)


def test_prefill_logits_are_last_prompt_token(tiny):
  cfg, params = tiny
  prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
  cache, last = gen.prefill(params, cfg, prompts, FULL, cache_len=16,
                            options=RunOptions(prefill_chunk=4))
  for i, p in enumerate(prompts):
    ref = _uncached(cfg, params, [p])[0, -1]
    np.testing.assert_allclose(np.asarray(last[i]), ref, atol=1e-4, rtol=0)
  assert cache.lengths.tolist() == [7, 3]


def test_batched_generation_equals_each_alone(tiny):
  cfg, params = tiny
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 11, 6)]
  chunk4 = RunOptions(prefill_chunk=4)
  batched = generate(params, cfg, prompts, FULL, max_new_tokens=10, options=chunk4).tokens
  for p, row in zip(prompts, batched):
    alone = generate(params, cfg, [p], FULL, max_new_tokens=10, options=chunk4).tokens[0]
    assert row == alone


def test_default_model_batched_equals_alone(default_lm):
  prompts = ["The capital of France is", "List three colors: red,", "1, 2, 3, 4,"]
  batched = default_lm.generate(prompts, max_new_tokens=8, chunk_size=8)
  for p, text in zip(prompts, batched):
    assert default_lm.generate(p, max_new_tokens=8, chunk_size=8) == [text]
  # a method by name with keyword hyper-parameters, and as an object
  by_name = default_lm.generate(prompts, "h2o", budget=64, max_new_tokens=8, chunk_size=8)
  assert by_name == default_lm.generate(prompts, get("h2o", budget=64), max_new_tokens=8,
                                        chunk_size=8)


def test_greedy_generation_matches_uncached_argmax(tiny):
  cfg, params = tiny
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  out = generate(params, cfg, [prompt], FULL, max_new_tokens=6).tokens[0]
  seq = list(prompt)
  for _ in range(6):
    seq.append(int(np.argmax(_uncached(cfg, params, [seq])[0, -1])))
  assert out == seq[len(prompt):]


def test_decode_loop_compiles_once(tiny):
  cfg, params = tiny
  before = gen.DECODE_TRACES[0]
  rng = np.random.default_rng(3)
  for _ in range(3):  # different prompts of the same shape: one compile for all generations
    prompts = [rng.integers(0, cfg.vocab_size, 9).tolist(), rng.integers(0, 97, 5).tolist()]
    generate(params, cfg, prompts, get("full"), max_new_tokens=12, cache_len=32)
  assert gen.DECODE_TRACES[0] - before == 1


def test_stop_tokens_end_rows(tiny):
  cfg, params = tiny
  prompt = [3, 1, 4, 1, 5]
  free = generate(params, cfg, [prompt], FULL, max_new_tokens=8).tokens[0]
  stop = free[3]
  cut = generate(params, cfg, [prompt], FULL, max_new_tokens=8, stop_tokens=(stop,)).tokens[0]
  assert cut == free[:free.index(stop)]


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny):
  cfg, params = tiny
  prompt = [[2, 7, 1, 8, 2, 8]]
  kw = dict(max_new_tokens=12)
  s1 = generate(params, cfg, prompt, FULL, sampling=gen.Sampling(1.0, 1.0, 11), **kw).tokens
  s2 = generate(params, cfg, prompt, FULL, sampling=gen.Sampling(1.0, 1.0, 11), **kw).tokens
  s3 = generate(params, cfg, prompt, FULL, sampling=gen.Sampling(1.0, 1.0, 12), **kw).tokens
  assert s1 == s2 and s1 != s3
  greedy = generate(params, cfg, prompt, FULL, **kw).tokens
  nucleus = generate(params, cfg, prompt, FULL, sampling=gen.Sampling(1.0, 1e-6, 5), **kw)
  assert nucleus.tokens == greedy


def test_bf16_runs_and_stays_close(tiny):
  import jax
  cfg, params = tiny
  ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 20))
  ref = _uncached(cfg, params, ids)
  cfg16 = cfg.replace(dtype="bfloat16")
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  out = _uncached(cfg16, p16, ids)
  assert np.max(np.abs(out - ref)) < 0.05 * np.max(np.abs(ref)) + 0.05


@pytest.mark.parametrize("name", ["full", "reattention", "snapkv"])
@pytest.mark.parametrize("placed", [False, True])
def test_decode_loop_compiles_during_the_prefill(tiny, name, placed):
  """`generate` compiles the decode loop on a host thread after the first of several prompt
  chunks (DecodeAhead), and the loop's call runs that program: no compile on the caller's
  thread, whether the weights lie committed on a device (as loaded on a GPU) or not. SnapKV,
  whose end of prefill makes a smaller cache, compiles it after the prefill. The tokens are
  those of the same prompts in one chunk, which compiles nothing ahead."""
  import jax
  from tests.helpers.compiles import compiled_on
  from tests.test_methods import _method

  cfg, params = tiny
  params = jax.device_put(params, jax.devices()[0]) if placed else params
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (29, 19)]
  method = _method(name, 24)
  run = lambda chunk: generate(params, cfg, prompts, method, max_new_tokens=5,  # noqa: E731
                               cache_len=64, options=RunOptions(prefill_chunk=chunk)).tokens
  with compiled_on("decode_loop") as threads:
    chunked = run(8)
  ahead = not method.ends_prefill and (method.prefill_chunk or 8) < 29
  assert threads == (["compile-ahead"] if ahead else ["MainThread"])
  assert chunked == run(64)
