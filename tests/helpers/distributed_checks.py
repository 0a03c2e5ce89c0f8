"""Multi-device checks, run in a subprocess with 8 fake CPU devices (tests/test_distributed.py):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.distributed_checks NAME...
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels
from pallas_kernels import Route
from jax_longctx.ops.mesh_attention import merge_across, ring_attention
from jax_longctx.core.options import RunOptions
from tests.helpers import check_main

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("sp",))


def _qkv(seed, b, t, h, kvh, d):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.float32))


def ring(causal: bool):
  q, k, v = _qkv(0, 2, N * 16, 6, 2, 16)
  spec = P(None, "sp")
  f = jax.jit(jax.shard_map(functools.partial(ring_attention, axis_name="sp", causal=causal,
                                              route=Route()),
                            mesh=MESH, in_specs=(spec, spec, spec), out_specs=(spec, spec),
                            check_vma=False))
  out, lse = f(q, k, v)
  want, want_lse = pallas_kernels.flash_attention(q, k, v, causal=causal,
                                                  route=Route(backend="reference"))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)


def star_phase2():
  """A 4-token query over a context spread over 8 devices; the last device also holds the
  query's own keys. Equals exact attention over [context, query] with causality among the query."""
  b, tb, s, h, kvh, d = 2, 16, 4, 6, 2, 16
  _, k_ctx, v_ctx = _qkv(1, b, N * tb, h, kvh, d)
  q, k_q, v_q = _qkv(2, b, s, h, kvh, d)

  def local(q, k_ctx, v_ctx, k_q, v_q):
    last = jax.lax.axis_index("sp") == N - 1
    k = jnp.concatenate([k_ctx, k_q], axis=1)  # every device has room for the query's keys
    v = jnp.concatenate([v_ctx, v_q], axis=1)
    # Context-only devices: every query sees every local key; the query device: causal among
    # the query tokens, which sit after its context block.
    kv_len = jnp.where(last, tb + s, tb)
    out, lse = pallas_kernels.flash_attention(q, k, v, causal=True, kv_len=kv_len,
                                              q_offset=jnp.where(last, tb, tb + s),
                                              route=Route(backend="reference"))
    return merge_across(out, lse, "sp")

  ctx = P(None, "sp")
  f = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=(P(), ctx, ctx, P(), P()),
                            out_specs=(P(), P()), check_vma=False))
  out, lse = f(q, k_ctx, v_ctx, k_q, v_q)
  k_all = jnp.concatenate([k_ctx, k_q], axis=1)
  v_all = jnp.concatenate([v_ctx, v_q], axis=1)
  want, want_lse = pallas_kernels.flash_attention(q, k_all, v_all, causal=True, q_offset=N * tb,
                                                  route=Route(backend="reference"))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)


def _tiny():
  from jax_longctx.model import random_params
  from tests.conftest import TINY_LLAMA3, mesh_config
  cfg = mesh_config(**TINY_LLAMA3)  # GQA: 6 query heads over 2 kv heads
  return cfg, random_params(cfg, seed=1)


def _full_reference(cfg, params, contexts, queries, new):
  """Last query-token logits and greedy tokens of plain full attention on one device."""
  from jax_longctx.run import generation as gen
  from jax_longctx.methods import get
  prompts = [c + q for c, q in zip(contexts, queries)]
  from jax_longctx.run.driver import generate
  cache, last = gen.prefill(params, cfg, prompts, get("full"), cache_len=128,
                            options=RunOptions(prefill_chunk=16))
  tokens = generate(params, cfg, prompts, get("full"), max_new_tokens=new, cache_len=128)
  return np.asarray(last), tokens.tokens


def star_run(params, cfg, contexts, queries, n_dev, name="star", new=4, **settings):
  """(greedy tokens, the query's last-token logits) of Star (or ring) over `n_dev` devices, by
  the one driver."""
  from jax_longctx.methods import get
  from jax_longctx.run.driver import generate
  run = generate(params, cfg, contexts, get(name, **settings), max_new_tokens=new,
                 instructions=queries, options=RunOptions(mesh=f"ctx={n_dev}"))
  return run.tokens, run.logits


def end_to_end(method, block_size=None, shared_anchor=True):
  """Equal to full attention (logits, greedy tokens) for a batch of contexts of different
  lengths on 8 devices: ring prefill; Star with one block; Star with two blocks, the second
  anchored by the first, which is then exactly causal attention (6 of the 8 blocks are empty)."""
  cfg, params = _tiny()
  rng = np.random.default_rng(0)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 50)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 3)]
  settings = {} if method == "ring" else dict(block_size=block_size or 0,
                                              shared_anchor=shared_anchor)
  rows, logits = star_run(params, cfg, contexts, queries, N, method, 6, **settings)
  want_logits, want_rows = _full_reference(cfg, params, contexts, queries, 6)
  np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)
  assert rows == want_rows


def star_blocks():
  """Several blocks per device (block 4 -> 13 blocks padded to 16 on 8 devices): runs, differs
  from full attention (the blocks do not see each other), and a batch equals each alone."""
  cfg, params = _tiny()
  rng = np.random.default_rng(1)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (50, 29)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 6)]
  run = functools.partial(star_run, params, cfg, n_dev=N, block_size=4)
  rows, logits = run(contexts, queries)
  for i in range(2):
    alone_rows, alone_logits = run(contexts[i:i + 1], queries[i:i + 1])
    np.testing.assert_allclose(np.asarray(alone_logits)[0], np.asarray(logits)[i], atol=1e-4)
  want_logits, _ = _full_reference(cfg, params, contexts, queries, 4)
  assert np.max(np.abs(np.asarray(logits) - want_logits)) > 1e-3


def four_bit():
  """The 4-bit cache (each device's context quantized once encoded: quant4's layout) on 8
  devices: Star with blocks of 32 tokens (a device's context whole key groups) gives one
  device's logits and tokens (the same groups); Star and ring come within the 4-bit cache's
  tolerance of their runs in the model's dtype (tests/test_kv_int4.py's) and differ from them."""
  cfg, params = _tiny()
  rng = np.random.default_rng(2)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 50)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 3)]

  def run(name, n_dev, kv_dtype, **settings):
    from jax_longctx.methods import get
    from jax_longctx.run.driver import generate
    out = generate(params, cfg, contexts, get(name, **settings), max_new_tokens=4,
                   instructions=queries, options=RunOptions(mesh=f"ctx={n_dev}", kv_dtype=kv_dtype))
    return out.tokens, np.asarray(out.logits)

  rows, star_four = run("star", N, "int4", block_size=32)
  one_rows, one_logits = run("star", 1, "int4", block_size=32)
  np.testing.assert_allclose(star_four, one_logits, atol=1e-4, rtol=0)
  assert rows == one_rows
  for name, settings in (("star", dict(block_size=32)), ("ring", {})):
    _, whole = run(name, N, None, **settings)
    four = star_four if name == "star" else run(name, N, "int4", **settings)[1]
    np.testing.assert_allclose(four, whole, atol=0.04, rtol=0, err_msg=name)
    assert not np.array_equal(four, whole), f"{name}: the 4-bit run read whole keys"


def star_vs_transformers():
  """Star with blocks of 8 and an anchor of 5 (7 blocks over 8 devices; then 4 devices, two
  blocks each) equals Star written over transformers' Llama (tests/helpers/hf_reference.hf_star) for
  each sequence of a batch of two, with the anchor shared or run in every row."""
  import tempfile

  import torch
  from transformers import LlamaForCausalLM

  from checkpoints_convert import export_hf
  from tests.helpers.hf_reference import hf_star
  cfg, params = _tiny()
  rng = np.random.default_rng(2)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (54, 41)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 3)]
  hf_dir = tempfile.mkdtemp() + "/hf"
  export_hf(params, cfg, hf_dir)
  model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                           attn_implementation="eager").eval()
  want = [hf_star(model, c, q, 8, 5, 4) for c, q in zip(contexts, queries)]
  for n_dev, shared in ((N, True), (N, False), (4, True)):
    rows, logits = star_run(params, cfg, contexts, queries, n_dev, block_size=8, anchor_size=5,
                            shared_anchor=shared)
    for i, (want_logits, want_rows) in enumerate(want):
      np.testing.assert_allclose(np.asarray(logits)[i], want_logits, atol=1e-4, rtol=0)
      assert rows[i] == want_rows, (n_dev, shared, rows[i], want_rows)


CHECKS = {"ring_causal": functools.partial(ring, True), "ring_full": functools.partial(ring, False),
          "star_phase2": star_phase2, "star_vs_transformers": star_vs_transformers,
          "star_one_block": functools.partial(end_to_end, "star", 64),
          "star_two_blocks": functools.partial(end_to_end, "star", 32),
          "star_two_blocks_in_rows": functools.partial(end_to_end, "star", 32,
                                                       shared_anchor=False),
          "ring_end_to_end": functools.partial(end_to_end, "ring"), "star_blocks": star_blocks,
          "four_bit": four_bit}

if __name__ == "__main__":
  assert len(jax.devices()) >= N, f"needs {N} devices, got {len(jax.devices())}"
  check_main.main(CHECKS, sys.argv[1:])
