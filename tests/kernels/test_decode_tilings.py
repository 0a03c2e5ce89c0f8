"""The decode-attention tilings that benchmarks/decode_profile.py's split variants set through
Route.decode_tiling: each gives the reference's result (GPU variant, Pallas interpret mode)
and lowers to Triton for CUDA with its real launch options (no GPU needed).

Tolerances as tests/kernels/test_attention_kernels.py: bf16 2e-2 on outputs, 1e-4 on the LSE.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.decode_profile import VARIANTS
from pallas_kernels import Route, Tiling, flash_attention
from pallas_kernels.attention import flash as fa_module
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal
from tests.kernels.test_attention_kernels import assert_close

TILINGS = {name: v.decode_tiling for name, v in VARIANTS.items() if v.decode_tiling}


def test_split_variants_exist():
  assert {"split16", "split64", "bk64_split64", "bk32_s4_split128"} <= set(TILINGS)


@pytest.mark.parametrize("name", sorted(TILINGS))
def test_decode_tiling_matches_reference(name):
  rng = np.random.default_rng(len(name))
  b, h, kvh, t, d = 2, 8, 2, 1100, 128  # t no multiple of any block: the last tile is clamped
  q = normal(rng, (b, 1, h, d), jnp.bfloat16)
  k, v = (normal(rng, (b, kvh, t, d), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray([1037, 300])  # per-sequence lengths, one past a split's edge
  kw = dict(causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD")
  got = flash_attention(q, k, v, route=Route(backend="gpu"), tiling=Tiling(**TILINGS[name]), **kw)
  assert_close(got, flash_attention(q, k, v, route=Route(backend="reference"), **kw), jnp.bfloat16)


@pytest.mark.parametrize("name", sorted(TILINGS))
def test_decode_tiling_lowers_to_triton(name):
  """The kernel call `flash_attention` makes for a Llama-8B-shaped decode step (32 heads over 8
  kv heads: 16 padded rows per group) under this tiling, lowered for CUDA, not interpreted."""
  tl = Tiling(**TILINGS[name]).pick(block_rows=16, block_keys=128, num_warps=4, num_stages=2,
                                    prefetch=False)
  t = 4096
  qr = jnp.ones((1, 8, 16, 128), jnp.bfloat16)
  k = jnp.ones((1, 8, t, 128), jnp.bfloat16)
  meta = jnp.zeros((1, 2), jnp.int32)
  span, splits = fa_module.gpu.split_plan(8, t, tl.block_keys, tl.key_splits)

  def call(qr, k, v, meta):
    return fa_module._gpu(qr, k, v, meta, group=4, span=span, splits=splits, causal=True,
                          scale=0.088, kv_layout="BHTD", tiling=tl, interpret=False)

  assert "triton" in cuda_text(call, qr, k, k, meta)



@pytest.mark.parametrize("sequences,want", [(1, 32), (2, 16), (4, 8), (6, 5), (8, 4), (14, 2),
                                            (40, 1)])
def test_the_split_plan_fills_one_wave_of_two_programs_a_core(monkeypatch, sequences, want):
  """The plan on a 132-core GPU (8 KV heads, 128K keys, 128-key tiles): the most splits whose
  programs fit 2 a core, rounded down (rounded up, 4 sequences took 9 splits, 288 programs,
  and ran a second wave), at least one, fewer where the span rounds up to whole tiles (33 ->
  32 at batch 1); at least 4 tiles a split."""
  from pallas_kernels import backend
  monkeypatch.setattr(backend, "num_cores", lambda: 132)
  programs = sequences * 8
  span, splits = fa_module.gpu.split_plan(programs, 131072, 128, None)
  assert splits == want and span % 128 == 0 and span * splits >= 131072
  assert programs * splits <= 2 * 132 or splits == 1
  assert fa_module.gpu.split_plan(8, 1024, 128, None)[1] == 2  # 1024 keys: 4 tiles a split
  assert fa_module.gpu.split_plan(programs, 131072, 128, 7)[1] == 7  # asked
