"""Helpers shared by the GPU kernels: whole-axis key refs, clamped key tiles, key-axis splits and
the pallas_call used for them.

Lowering: the GPU kernels use Pallas' Triton lowering (pinned through its CompilerParams), not
the default Mosaic GPU one. The same kernel bodies then run in the generic interpreter on CPU
(the tests), lower to Triton IR on a CPU machine (so the tests also catch lowering errors), and
run on any CUDA GPU, not only Hopper. docs/KERNELS.md records the trade-off.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import layout

SQ = pl.squeezed

# JAX 0.11 deprecated the Triton lowering and warns at every kernel's lowering. These kernels keep
# it only where it still wins or where no Mosaic GPU variant exists yet (docs/KERNELS.md says which),
# and the notice names nothing a user of this library could change, so it is not shown.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Overrides of a kernel's tuned tiling (tests and benchmarks); None keeps the default.

  block_rows: query rows (query x head of a group) per program; block_keys: keys per tile;
  key_splits: programs along the key axis (GPU); num_warps, num_stages: Triton launch options;
  prefetch: load the next key tile before working on the current one (GPU).
  impl: which GPU kernel for flash attention / topk_scores, "mosaic" (Hopper: mgpu_flash /
  mgpu_topk) or "triton"; with "mosaic", block_rows / block_keys / num_stages are its block_q /
  block_kv / stages and num_warps its compute warps (8 or, for the top-k, 12), key_splits stays
  the key splits for topk_scores.
  """
  block_rows: int | None = None
  block_keys: int | None = None
  key_splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  prefetch: bool | None = None
  impl: str | None = None

  def pick(self, **defaults):
    """Merged with per-call defaults: a Tiling with no None left for the given fields."""
    return dataclasses.replace(self, **{k: v for k, v in defaults.items()
                                        if getattr(self, k) is None})


# Shared memory one block may use on Hopper (227 KiB); the Triton pipeliner keeps num_stages K and
# V tiles there beside the query tile.
SMEM_BYTES = 232448


def mosaic_asked(variant, tiling, default: str) -> bool:
  """Whether a kernel with a Mosaic GPU variant runs it: per call by `tiling.impl`, else `default`
  ("mosaic" | "triton") on a native Hopper GPU; never off the GPU variant."""
  if variant.kind != "gpu":
    return False
  impl = tiling.impl if tiling is not None and tiling.impl else (
      default if not variant.interpret and backend_lib.is_hopper() else "triton")
  if impl not in ("mosaic", "triton"):
    raise ValueError(f"tiling.impl {impl!r} must be 'mosaic' or 'triton'")
  return impl == "mosaic"


def mosaic_tiling(config, tiling):
  """A Mosaic kernel's config with a per-call Tiling(impl="mosaic") applied: its block_rows,
  block_keys and num_stages are the kernel's block_q, block_kv and stages then, and num_warps
  its compute warps (4 a warpgroup)."""
  if tiling is None or tiling.impl != "mosaic":
    return config
  return dataclasses.replace(config, block_q=tiling.block_rows or config.block_q,
                             block_kv=tiling.block_keys or config.block_kv,
                             stages=tiling.num_stages or config.stages,
                             warpgroups=(tiling.num_warps or 4 * config.warpgroups) // 4)


def fitting_block_keys(block_keys: int, *, block_rows: int, d: int, itemsize: int,
                       num_stages: int, tensors: int = 2) -> int:
  """block_keys halved (down to 16) until the query tile and num_stages tiles of each of
  `tensors` key-indexed inputs (K and V: 2; K alone: 1) fit in shared memory: flash attention in
  fp32 at d=128 with 128-key tiles and 3 stages asked for 384 KiB and failed to launch."""
  while (block_keys > 16 and
         (num_stages * tensors * block_keys + block_rows) * d * itemsize > SMEM_BYTES):
    block_keys //= 2
  return block_keys


def tile_loop(first, last, load, step, init, prefetch: bool):
  """carry = step(j, load(j), carry) for first <= j < last.

  With prefetch, tile j+1 is loaded before tile j is worked on, so its memory latency overlaps
  the work (the Triton pipeliner does not pipeline loops that hold nested control flow).
  """
  if not prefetch:
    return lax.fori_loop(first, last, lambda j, c: step(j, load(j), c), init)

  def body(j, c):
    carry, cur = c
    nxt = load(jnp.minimum(j + 1, last - 1))
    return step(j, cur, carry), nxt

  return lax.fori_loop(first, last, body, (init, load(first)))[0]


# Pallas' Triton lowering computes a block's element offsets in int32: an operand of 2^31
# elements or more faults. Measured on an H200: the cache-write and gathered kernels over an
# int8 cache [1, 8, 2M + 64, 128] (ReAttention's decode at 2M tokens of the 3B shape) raised
# an illegal address; the Mosaic kernels (TMA: 64-bit addresses) ran.
MAX_TRITON_ELEMENTS = 2**31 - 1


def triton_indexable(*arrays) -> bool:
  """Whether every array (a quant.Quantized counts by its parts) has fewer than 2^31 elements,
  as a Triton kernel taking it whole needs; where not, the callers take another route."""
  return all(x.size <= MAX_TRITON_ELEMENTS for x in jax.tree_util.tree_leaves(arrays))


def words(x):
  """x [..., d] (int8 or bf16) as int32 words [..., d / per], per = 4 / itemsize elements a
  word (a bitcast: the same bytes), so that a Triton kernel taking it whole indexes `per` times
  fewer elements (triton_indexable); `from_words` reads them back in a kernel."""
  per = 4 // x.dtype.itemsize
  return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // per, per), jnp.int32)


def from_words(w, dtype) -> list:
  """In a kernel: words [..., c] of `words` over `dtype` (int8, bf16) as fp32 parts [..., c],
  part j holding the elements per * i + j, exactly (bytes sign-extended by shifts; a bf16 is
  the high half of its fp32)."""
  if jnp.dtype(dtype) == jnp.int8:
    return [jnp.right_shift(jnp.left_shift(w, 24 - 8 * j), 24).astype(jnp.float32)
            for j in range(4)]
  return [lax.bitcast_convert_type(jnp.left_shift(w, 16), jnp.float32),
          lax.bitcast_convert_type(w & jnp.int32(-65536), jnp.float32)]


def in_word_order(x, per: int):
  """x [..., d] reordered as from_words' parts: elements j, per + j, 2 per + j, ... for j = 0,
  then 1, ..."""
  return jnp.swapaxes(x.reshape(*x.shape[:-1], -1, per), -1, -2).reshape(x.shape)


def whole_keys_spec(kv_layout: str, t: int, d: int, kvh: int):
  """The whole key axis of one (batch, kv head) as a ref, for grids (batch*kv_head, ...)."""
  if kv_layout == "BTHD":
    return pl.BlockSpec((SQ, t, SQ, d), lambda bh, *_: (bh // kvh, 0, bh % kvh, 0))
  return pl.BlockSpec((SQ, SQ, t, d), lambda bh, *_: (bh // kvh, bh % kvh, 0, 0))


def whole_scales_spec(kv_layout: str, t: int, kvh: int):
  """The quantization scales ([B, T, KV] or [B, KV, T]) of one (batch, kv head), for the keys of
  `whole_keys_spec`."""
  if kv_layout == "BTHD":
    return pl.BlockSpec((SQ, t, SQ), lambda bh, *_: (bh // kvh, 0, bh % kvh))
  return pl.BlockSpec((SQ, SQ, t), lambda bh, *_: (bh // kvh, bh % kvh, 0))


def key_tile(nominal, bk: int, t: int):
  """Tile of bk keys meant to start at `nominal`. The last tile is clamped to end at t (so no
  read is out of bounds and t need not be a multiple of bk); keys below `nominal` in it were
  already seen and must be masked by the caller. Returns (slice, key indices [1, bk])."""
  start = jnp.minimum(nominal, t - bk)
  return pl.ds(start, bk), start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)


def split_plan(programs: int, t: int, bk: int, key_splits: int | None, per_core: int = 2):
  """(span, splits): the key axis cut into splits of `span` keys (a multiple of bk) so that
  programs * splits is at most per_core programs per GPU core (one wave where a core holds
  per_core of them), with at least 4 tiles per split.

  Rounded down: the int8 split-K decode kernel's programs took 168-230 registers a thread by shape
  (Nsight Compute, with int8 probabilities), so a core holds 2 or 3, and a plan rounded up (9
  splits for 4 sequences of 8 KV heads: 288 programs on 132 cores) ran a second, mostly idle wave.
  On an H200 at 128K keys (BENCHMARKS.md "Key splits rounded down"): int8 at 2 / 4 / 6 / 8
  sequences 17% / 20% / 19% / 11% less kernel time, bf16 at 2 / 4 sequences 4% / 6%, 14 sequences
  level; batch 1 (32 splits of 8 KV heads: 256 programs, the span rounded to whole tiles) is
  unchanged."""
  want = per_core * backend_lib.num_cores() // programs
  splits = key_splits or max(1, min(want, t // (4 * bk)))
  span = layout.round_up(-(-t // splits), bk)
  return span, -(-t // span)


def wave_splits(programs: int, t: int, bk: int, most: int = 16, fill: float = 0.95) -> int:
  """Key splits for `programs` CTAs of one a core (each split's CTAs sharing the candidates'
  tiles, mgpu_topk's balanced splits): the fewest whose CTAs fill their waves of the GPU's cores
  to `fill`, else the fullest; at most `most`, and at most one split per 4 tiles of t keys.
  (96 programs on 132 cores: 4 splits, 97% against 73% for one; 48: 8.)"""
  cores = backend_lib.num_cores()
  share = lambda s: programs * s / (cores * -(-(programs * s) // cores))  # noqa: E731
  splits = range(1, max(1, min(most, t // (4 * bk))) + 1)
  return next((s for s in splits if share(s) >= fill), max(splits, key=share))


def pallas_call(kernel, interpret, *, num_warps: int = 8, num_stages: int = 3, **kwargs):
  from jax.experimental.pallas import triton as pltriton
  params = None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                          num_stages=num_stages)
  return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)


def row_spec(kvh: int, bm: int, d: int):
  """Block of bm query rows (all query heads of one kv group) for grids (batch*kv_head, rows, ...)."""
  return pl.BlockSpec((SQ, SQ, bm, d), lambda bh, r, *_: (bh // kvh, bh % kvh, r, 0))


def per_batch_spec(kvh: int, n: int):
  """Row of a [B, n] per-sequence table (bounds, offsets) for grids (batch*kv_head, ...)."""
  return pl.BlockSpec((SQ, n), lambda bh, *_: (bh // kvh, 0))


