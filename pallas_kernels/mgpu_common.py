"""What the Mosaic GPU kernels (mgpu_flash.py, mgpu_topk.py) share besides their bodies: the
Config and the checks of what they can run, the compiler / interpreter parameters across JAX
versions, the key tiles and the ring that streams them, Ops, the few operations that differ
between the GPU and jax's Mosaic GPU interpreter on CPU, and Turns, the compute warpgroups' order.

JAX 0.10 -> 0.11 differences met here: the default lowering semantics changed from Lane to
Warpgroup (Config.semantics pins one; None keeps the version's default); `transpose_ref` is
deprecated for `ref.transpose` (both versions have the latter); the interpreter is private in
both (`jax._src.pallas.mosaic_gpu.interpret`), and 0.11's also checks SMEM proxy fences.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import quant

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover  (a jaxlib without Mosaic GPU)
  plgpu = None

COMPUTE_WGS = 2
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on an H100/H200
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
# 8-bit WGMMA operands (Hopper: twice the bf16 rate): s8 x s8 -> s32, e4m3 x e4m3 -> f32.
EIGHT_BIT = (jnp.int8, jnp.float8_e4m3fn)
# An int32 x with |x| < 2^22 is exact in fp32 as bits(x + MAGIC) - MAGIC_F: the sum's low 23
# bits are the mantissa of 1.5 * 2^23 + x. An integer add and a float subtract, both at the full
# rate, where cvt.rn.f32.s32 runs at a quarter of it (an 8-bit product of d <= 128 terms is at
# most 128 * 127 * 127 < 2^21 in magnitude). The top-k's subtract and key scale as one fma
# (bits * a - MAGIC_F * a) issued 8.5% fewer instructions but ran 6% slower at 1M keys (H200).
MAGIC = 0x4B400000
MAGIC_F = 12582912.0


@dataclasses.dataclass(frozen=True)
class Config:
  """block_q: query rows per compute warpgroup (a CTA covers warpgroups * block_q); block_kv:
  keys per tile; stages: K/V tiles in flight; semantics: Mosaic GPU lowering, "lane" |
  "warpgroup" | None (this JAX's default: lane in 0.10, warpgroup since 0.11); warpgroups: the
  compute warpgroups a CTA, 2 or 3 (3: the top-k kernel only, mgpu_topk.py says when)."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  semantics: str | None = None
  warpgroups: int = COMPUTE_WGS

  def __post_init__(self):
    if self.block_q % 64 or self.block_kv % 64:
      raise ValueError(f"block_q {self.block_q} and block_kv {self.block_kv} must be multiples "
                       "of 64 (one WGMMA row block per warpgroup)")
    if self.stages < 2:
      raise ValueError(f"stages {self.stages} must be at least 2 (load one tile, use another)")
    if self.semantics not in (None, "lane", "warpgroup"):
      raise ValueError(f"semantics {self.semantics!r} must be None, 'lane' or 'warpgroup'")
    if self.warpgroups not in (2, 3):
      raise ValueError(f"warpgroups {self.warpgroups} must be 2 or 3")


def smem_bytes(config: Config, d: int, itemsize: int = 2, quantized: bool = False) -> int:
  """Shared memory of one CTA: Q/O per compute warpgroup, the K and V rings, the LSE rows, and
  up to 1 KiB of barriers and alignment (Mosaic's lowering counted 120-700 bytes; its cross-warp
  reduction scratch is set to 0: a WGMMA tile's row max / sum stay within a warp, as in
  tokamax's FA3). quantized: plus the 8-bit K and V tile and their scales as they land (the
  rings hold them dequantized). Lowering checks the real size against the 227 KiB a CTA may use."""
  tiles = COMPUTE_WGS * config.block_q * d + 2 * config.stages * config.block_kv * d
  landed = 2 * config.block_kv * (d + 4) if quantized else 0
  return tiles * itemsize + landed + COMPUTE_WGS * config.block_q * 4 + 1024


def unsupported(q, k, v, *, kv_layout: str, config: Config) -> str | None:
  """Why the flash-attention kernel cannot run the call (None: it can); k, v arrays or
  quant.Quantized (8-bit)."""
  lq, d = q.shape[1], q.shape[3]
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  quantized = quant.is_quantized(k)
  if plgpu is None:
    return "this jaxlib has no Mosaic GPU"
  if quantized:
    if q.dtype not in DTYPES or k.dtype.name not in quant.EIGHT_BIT or v.dtype != k.dtype:
      return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: needs bf16 or fp16 q and 8-bit k, v"
  elif q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: needs q, k, v all bf16 or all fp16"
  if d not in HEAD_DIMS:
    return f"head dim {d} not in {HEAD_DIMS}"
  if config.warpgroups != COMPUTE_WGS:
    return f"{config.warpgroups} compute warpgroups: flash attention runs {COMPUTE_WGS}"
  if lq < config.block_q or t < config.block_kv:
    return f"{lq} queries / {t} keys: needs at least block_q={config.block_q} / " \
           f"block_kv={config.block_kv}"
  # TMA tiles the second-minor axis by 8: 300 queries failed to lower on the H200
  # (benchmarks/kernels.py), and so do BHTD keys of 999 (BTHD keys have the heads there).
  if lq % 8:
    return f"{lq} queries: needs a multiple of 8"
  if kv_layout == "BHTD" and t % 8:
    return f"{t} keys in the BHTD layout: needs a multiple of 8"
  if (need := smem_bytes(config, d, quantized=quantized)) > SMEM_LIMIT:
    return f"{config} needs {need} bytes of SMEM at d={d} (> {SMEM_LIMIT})"
  return None


def operand_transforms(dtype, d: int):
  """The WGMMA operand layout of a [rows, d] SMEM tile: tiled (8, one swizzle of elements) and
  swizzled by min(128, the row's bytes)."""
  swizzle = min(128, d * jnp.dtype(dtype).itemsize)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def scale_rows(scale, kv_layout: str):
  """Scales [B, T, KV] or [B, KV, T] -> [B, KV, T'] fp32, each (batch, kv head) a row for 1-D TMA
  copies (a strided box cannot hold one float per row); T' = T rounded up to 8 (a TMA stride is
  a multiple of 16 bytes; the extra scales are never read). A copy only in BTHD (4 bytes a key
  and head)."""
  scale = scale.astype(jnp.float32)
  if kv_layout == "BTHD":
    scale = jnp.swapaxes(scale, 1, 2)
  t = scale.shape[2]
  return jnp.pad(scale, ((0, 0), (0, 0), (0, -t % 8)), constant_values=1.0)


def int_to_f32(x):
  """int32 x (|x| < 2^22) -> fp32, exactly, by the MAGIC bit trick (no int-to-float unit)."""
  return lax.bitcast_convert_type(x + MAGIC, jnp.float32) - MAGIC_F


def compiler_params(config: Config, reduction_scratch_bytes: int = 0):
  """reduction_scratch_bytes: SMEM for reductions across the warps of a warpgroup (a row vector
  to a scalar); Mosaic gives every warpgroup the same scratch, so the kernel must keep two
  warpgroups from reducing at the same time (mgpu_topk does, by its turns)."""
  kw = dict(approx_math=True,  # exp2 / reciprocal as the fast hardware approximations
            reduction_scratch_bytes=reduction_scratch_bytes)  # 0: see smem_bytes
  if config.semantics is not None:
    kw["lowering_semantics"] = {"lane": plgpu.LoweringSemantics.Lane,
                                "warpgroup": plgpu.LoweringSemantics.Warpgroup}[config.semantics]
  return plgpu.CompilerParams(**kw)


def _interpreter_params_class():
  """(InterpretGPUParams, None) from jax's private Mosaic GPU interpreter, or (None, why not).
  Guarded like the kernels' other private entries: a jax that moved or dropped it only loses
  interpreting these kernels off a GPU (tests skip, an explicit request fails clearly)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:
    return None, f"no Mosaic GPU interpreter in jax {jax.__version__}: {e}"
  return InterpretGPUParams, None


def interpreter_available() -> str | None:
  """None if jax's Mosaic GPU interpreter (private in JAX 0.10/0.11) imports, else why not."""
  return _interpreter_params_class()[1]


def returns_when_done_if_interpreted(kernel):
  """A kernel entry (jitted, with an `interpret` argument) that, interpreted and called eagerly,
  returns only once the interpreter is done. jax's Mosaic GPU interpreter dispatches jax
  computations from inside its callbacks (`jnp.array` in its SMEM allocation callback); under
  the CPU client's asynchronous dispatch, a computation the caller dispatched next, on the
  kernel's outputs, could block in its dispatch while that callback waited behind it, forever
  (a CI run hung so; py-spy showed the two threads). Under an outer jit the wait is a no-op."""
  @functools.wraps(kernel)
  def call(*args, interpret=False, **kw):
    out = kernel(*args, interpret=interpret, **kw)
    return out if interpret is False else jax.block_until_ready(out)

  return call


def interpret_params(interpret):
  if interpret is False:
    return None
  if interpret is True:
    params, why = _interpreter_params_class()
    if params is None:
      raise NotImplementedError(f"cannot interpret the Mosaic GPU kernels off a GPU: {why}; "
                                "run them on a Hopper GPU, or use tiling.impl='triton'")
    return params()
  return interpret  # the caller's InterpretGPUParams (e.g. detect_races=True)


def rows(x, shape):
  """Per-row values [n] broadcast along the columns of `shape`."""
  return lax.broadcast_in_dim(x, shape, [0])


def rendezvous(barrier):
  """Arrive at a barrier all compute warpgroups use and wait for its phase to complete."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def tile_start(step, bk: int, t: int):
  """First key of tile `step`; the last tile is clamped to end at T (keys before step * bk in it
  were seen by the previous tile and get masked)."""
  return jnp.minimum(step * bk, t - bk)


def keyrows(ref, kv_layout: str, b, kvh, start, bk: int):
  """[bk, d] view of keys start.. of kv head kvh in either layout (a strided TMA box in BTHD)."""
  if kv_layout == "BTHD":
    return ref.at[b, pl.ds(start, bk), kvh]
  return ref.at[b, kvh, pl.ds(start, bk)]


def dequantize_tile(x8, scale, out, *, native: bool):
  """out [n, d] (bf16 / fp16, WGMMA-tiled SMEM) = x8 [n, d] (int8 / E4M3 SMEM, tiled (8, 64))
  times each row's scale (`scale` [n] fp32 SMEM), as `quant.dequantize` to out's dtype, in
  64 x 64 chunks (the memory warpgroup's few registers; a WGMMA layout spans 64 rows). The
  product is fp32 and rounded once, as the reference's: a bf16 product (the scale rounded to
  bf16) moved every score of a key by the same relative 2^-9, 0.08 in the LSE with 50x outlier
  channels. int8 goes to fp32 through bf16 (Mosaic converts int8 to bf16 by integer operations,
  bf16 to fp32 is a shift: no slow int-to-float conversions), E4M3 through fp16 (it has no
  direct conversion to bf16 or fp32 before PTX ISA 9.2)."""
  n, d = out.shape
  for r in range(0, n, 64):
    row = pl.ds(r, 64)
    s = (plgpu.load(scale.at[row], (), layout=plgpu.Layout.WGMMA.reduce(1)) if native
         else scale[row])
    for c in range(0, d, 64):
      chunk = x8.at[row, pl.ds(c, 64)]
      x = plgpu.load(chunk, (), layout=plgpu.Layout.WGMMA) if native else chunk[...]
      x = x.astype(jnp.bfloat16 if x.dtype == jnp.int8 else jnp.float16).astype(jnp.float32)
      out.at[row, pl.ds(c, 64)][...] = (x * rows(s, x.shape)).astype(out.dtype)


def fill_ring(steps, stages: int, streams):
  """Memory warpgroup: load(step, slot) for step in [0, steps) of every (load, freed) stream,
  into slot step % stages, once the compute warpgroups released the slot (`freed[slot]`, all of
  them arrive). Then awaits the release of the last tiles too: idle time on the GPU (the compute
  warpgroups are still busy), and it lets jax's interpreter check every barrier phase was seen."""
  for i in range(stages):  # fill the ring (only with tiles that will be used)
    @pl.when(i < steps)
    def _():
      for load, _ in streams:
        load(i, i)

  @pl.loop(stages, jnp.maximum(steps, stages))
  def _(step):
    slot = lax.rem(step, jnp.int32(stages))
    for load, freed in streams:
      plgpu.barrier_wait(freed.at[slot])  # tile step - stages released
      load(step, slot)

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _(step):
    slot = lax.rem(step, jnp.int32(stages))
    for _, freed in streams:
      plgpu.barrier_wait(freed.at[slot])


class Ops:
  """The softmax state's registers and the two matrix products, where the GPU and jax's CPU
  interpreter differ: register layouts (`layout_cast` has no CPU rule) and WGMMA natively, dot
  products of the SMEM tiles in the interpreter (which in JAX 0.10 runs neither a transposed nor
  a register WGMMA operand, nor run_state)."""

  def __init__(self, native: bool, cfg: Config, d: int):
    self.native, self.bq, self.bk, self.d = native, cfg.block_q, cfg.block_kv, d

  def layout(self, x, layout):
    return plgpu.layout_cast(x, layout) if self.native else x

  def iota(self, dim: int):
    x = lax.broadcasted_iota(jnp.int32, (self.bq, self.bk), dim)
    return self.layout(x, plgpu.Layout.WGMMA)

  def init_state(self):
    row = plgpu.Layout.WGMMA.reduce(1)
    return (self.layout(jnp.zeros((self.bq, self.d), jnp.float32), plgpu.Layout.WGMMA),
            self.layout(jnp.full((self.bq,), NEG_INF, jnp.float32), row),
            self.layout(jnp.zeros((self.bq,), jnp.float32), row))

  def scores(self, q_smem, k_tile, *, after_issue):
    """Q [bq, d] . K [bk, d]^T -> fp32 [bq, bk]; after_issue runs while the product is in flight.
    int8 tiles multiply into int32 (exact), converted by `int_to_f32`; E4M3 and 16-bit tiles
    accumulate in fp32."""
    acc = jnp.int32 if q_smem.dtype == jnp.int8 else jnp.float32
    if not self.native:
      s = lax.dot_general(q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                          preferred_element_type=acc)
      self.fence_reads()
      after_issue()
    else:
      def product(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))  # K^T: a view
        after_issue()
        return acc_ref[...]

      s = pl.run_scoped(product, plgpu.ACC((self.bq, self.bk), acc))
    return int_to_f32(s) if acc == jnp.int32 else s

  def column_vector(self, ref):
    """A [bk] fp32 SMEM row (per-key values: 8-bit keys' scales) in the layout of a score
    tile's columns."""
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0)) if self.native else ref[...]

  def columns(self, x, shape):
    """A column vector (`column_vector`) broadcast along the rows of `shape` [bq, bk], in the
    WGMMA layout of the scores it multiplies."""
    return self.layout(lax.broadcast_in_dim(x, shape, [1]), plgpu.Layout.WGMMA)

  @staticmethod
  def fence_reads():
    """WGMMA reads SMEM through the async proxy, as TMA writes it; the interpreter's plain loads
    go through the generic proxy, which needs a proxy fence before TMA refills the slot (jax
    0.11's interpreter checks this; without it, it reports the refill as a race)."""
    plgpu.commit_smem()

  def accumulate(self, acc, p, v_tile, *, after_issue):
    """acc + P [bq, bk] . V [bk, d] in fp32."""
    if not self.native:
      pv = lax.dot_general(p, v_tile[...], (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
      self.fence_reads()
      after_issue()
      return acc + pv

    def product(acc_ref):
      plgpu.wgmma(acc_ref, p, v_tile)
      after_issue()

    return pl.run_state(product)(plgpu.ACC.init(acc))

  def finish(self, acc, m, l):
    """-> (out [bq, d] fp32, natural-log LSE [bq]); rows that saw no key: (0, -inf)."""
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    lse = jnp.where(seen, m * LN2 + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    return acc * rows(inv, acc.shape), lse


class Turns:
  """The compute warpgroups' order of work on the tensor cores, by their `turn` barrier
  (`barrier(n)`; mgpu_topk.py's).
  Two (FlashAttention-3's alternation): a rendezvous after each product's issue and after each
  selection, so one warpgroup selects while the other's product runs, and their selections,
  which may reduce across warps through Mosaic's one scratch, never overlap. Three or more: a
  token passed round them at each issue (warpgroup i issues a tile's product after i - 1 did,
  warpgroup 0 after the last did the previous tile's), the selections free."""

  def __init__(self, turn, wg, n: int):
    self.turn, self.wg, self.n = turn, wg, n

  @staticmethod
  def barrier(n: int):
    return (plgpu.Barrier(num_arrivals=2) if n == 2
            else plgpu.Barrier(num_arrivals=1, num_barriers=n))

  def _meet(self):
    rendezvous(self.turn)

  def start(self):
    if self.n == 2:  # warpgroup 0 goes first; from here on they alternate
      pl.when(self.wg == 1)(self._meet)
    else:  # the token starts at warpgroup 0
      pl.when(self.wg == self.n - 1)(lambda: plgpu.barrier_arrive(self.turn.at[0]))

  def before_issue(self):
    if self.n > 2:
      plgpu.barrier_wait(self.turn.at[self.wg])

  def after_issue(self):
    if self.n == 2:
      self._meet()
    else:
      plgpu.barrier_arrive(self.turn.at[lax.rem(self.wg + 1, self.n)])

  def after_selection(self):
    if self.n == 2:  # selection done: the other warpgroup's turn
      self._meet()

  def end(self):
    if self.n == 2:
      pl.when(self.wg == 0)(self._meet)
    else:  # the last pass of the token, to warpgroup 0, taken (every phase is seen)
      pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(self.turn.at[0]))
