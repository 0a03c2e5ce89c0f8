"""A decode step's write into a 4-bit cache (quant4: KIVI's layout), one token per sequence, as
one in-place kernel (GPU).

The jnp write (quant4.write_grouped_keys for the keys, a per-token quantization and a scatter
for the values) compiles per layer into a dozen small kernels: the residual laid out and the
new key placed, the group's min and max, its codes, three scatters into `main`, the residual's
select, the value row's reductions and its three scatters (~0.75 ms a step over the 8B's 32
layers on an H200 at 32K, as much as the attention's extra time over bf16). Here one program
per (sequence, kv head) does all of it where the buffers lie (input_output_aliases):

  - the new key goes into the residual group at its slot (one row written); if that was the
    group's last slot, the group is quantized per channel over its G tokens and stored in
    `main` (codes, scale, zero) and the residual is cleared for the next group;
  - the new value row is quantized per token over its channel groups and stored at its slot.

The arithmetic is quant4.quantize's, in fp32 (scales and zero points rounded as stored, the codes
computed against them): IEEE division and rounding to nearest even (PTX
div.rn and cvt.rni on the GPU: Triton's own division is approximate and it lowers no rounding).
Interpreted, every entry equals the jnp write's; on an H200 the scales came out within one ulp
of the jnp write as XLA compiles it (1.2e-7 relative; zero points and residual equal) and 48
and 35 of 2.03M key and value codes one level apart, where the two straddle a level's edge
(benchmarks/int4_kernels.py, write; measured on this kernel's first form, which rewrote the
whole residual every step). A position outside [0, T) writes nothing. KVCache.write asks
`applies`: other backends, and shapes whose channel or group counts are not powers of two
(Triton's tensors), take its jnp write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu, quant4
from pallas_kernels.route import Route

SQ = gpu.SQ


def _fits(keys: quant4.GroupedKeys, values: quant4.Int4) -> bool:
  pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
  d, g, gv = keys.shape[3], keys.main.group, values.group
  return pow2(d) and pow2(g) and pow2(gv) and d >= 4 and gv <= d


def applies(keys: quant4.GroupedKeys, values: quant4.Int4, route: Route) -> bool:
  """Whether the run's route writes a one-token step into this cache with the kernel: a GPU
  cache-write backend, and head dim and groups powers of two. (Else KVCache.write's jnp write,
  which the kernel is tested equal to.)"""
  return (route.cache_write_backend is not None
          and backend_lib.resolve(route.cache_write_backend).kind == "gpu"
          and _fits(keys, values))


def write_one_token(keys: quant4.GroupedKeys, values: quant4.Int4, positions, k_new, v_new, *,
                    route: Route):
  """keys/values: one layer's 4-bit cache [B, KV, T, d] (where `applies`); positions [B]
  (outside [0, T): not written); k/v_new [B, KV, d] -> (keys, values) with each sequence's
  token appended, in place (the buffers are updated where they lie when the caller's can be
  reused, as inside a jitted step)."""
  b, kvh, t, d = keys.shape
  if k_new.shape != (b, kvh, d) or v_new.shape != k_new.shape or positions.shape != (b,):
    raise ValueError(f"k_new {k_new.shape} / v_new {v_new.shape} must be [B, KV, d] = "
                     f"{(b, kvh, d)} and positions {positions.shape} [B]")
  if not applies(keys, values, route):
    raise ValueError("int4_write: the route has no GPU cache-write backend, or the cache's "
                     f"head dim / groups ({d}, {keys.main.group}, {values.group}) are not "
                     "powers of two: KVCache.write's jnp write takes it")
  variant = backend_lib.resolve(route.cache_write_backend)
  g = keys.main.group
  pos = positions.astype(jnp.int32)
  valid = (pos >= 0) & (pos < t)
  meta = jnp.stack([pos, keys.residual_group], axis=1).astype(jnp.int32)  # [B, 2]
  out = _write(meta, k_new, v_new, keys.main.codes, keys.main.scale, keys.main.zero,
               keys.residual, values.codes, values.scale, values.zero, group=g,
               value_group=values.group, interpret=variant.interpret_arg())
  kc, ka, kz, kres, vc, vs, vz = out
  # the groups written whole after this token: the residual's moves on when it fills
  full = jnp.where(valid, (pos + 1) // g, keys.residual_group).astype(jnp.int32)
  return (quant4.GroupedKeys(quant4.Int4(kc, ka, kz, 2, g), kres, full),
          quant4.Int4(vc, vs, vz, values.axis, values.group))


def _ptx(instruction: str, *args):
  from jax.experimental.pallas import triton as pltriton
  return pltriton.elementwise_inline_asm(
      instruction, args=list(args), constraints=",".join(["=r"] + ["r"] * len(args)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


def _exact_div(x, y, native: bool):
  """x / y rounded as IEEE's (Triton's own f32 division is PTX div.full, 2 ulp off)."""
  return _ptx("div.rn.f32 $0, $1, $2;", x, y) if native else x / y


def _rint(x, native: bool):
  """x rounded to the nearest integer, ties to even (jnp.round's; Triton lowers no round)."""
  return _ptx("cvt.rni.f32.f32 $0, $1;", x) if native else jnp.round(x)


def _scale(width, native: bool):
  """A group's scale from its range's width (quant4.quantize's; a flat group: 1)."""
  return jnp.where(width > 0, _exact_div(width, jnp.full_like(width, quant4.LEVELS - 1.0),
                                         native), 1.0)


def _codes(x, lo, scale, native: bool):
  """x's codes fp32 0..15 in the group of minimum `lo` and `scale` (quant4.quantize's)."""
  ratio = _exact_div(x - lo, jnp.broadcast_to(scale, x.shape), native)
  return jnp.clip(_rint(ratio, native), 0.0, quant4.LEVELS - 1.0)


def _quantize(x, axis: int, native: bool, dtype):
  """quant4.quantize of x fp32 over `axis` -> (codes fp32 0..15, scale, zero as stored in
  `dtype`) (reduced axis kept, size 1)."""
  lo = jnp.min(x, axis=axis, keepdims=True)
  return _quantized_range(x, lo, jnp.max(x, axis=axis, keepdims=True), native, dtype)


def _quantized_range(x, lo, hi, native: bool, dtype):
  """x's codes against the group of range [lo, hi], with its scale and zero point as stored
  (quant4.as_stored: rounded to `dtype`; the codes are computed against them)."""
  scale, zero = quant4.as_stored(_scale(hi - lo, native), lo, dtype)
  return _codes(x, zero, scale, native), scale, zero


def _pack(lo_codes, hi_codes):
  """fp32 codes of channels j and j + d / 2 -> their byte (quant4.pack)."""
  return lo_codes.astype(jnp.uint8) | (hi_codes.astype(jnp.uint8) << 4)


@functools.partial(jax.jit, static_argnames=("group", "value_group", "interpret"))
def _write(meta, k_new, v_new, kc, ka, kz, kres, vc, vs, vz, *, group, value_group, interpret):
  b, kvh, t, d = k_new.shape[0], k_new.shape[1], kc.shape[2], k_new.shape[2]
  g, half = group, d // 2
  nv = d // value_group
  native = not interpret
  # value channel groups: within each half (groups of a half apart), or one spanning both
  per_half = max(half // value_group, 1)
  gv = min(value_group, half)

  def kernel(meta_ref, kn_ref, vn_ref, _kc, _ka, _kz, kres_in, _vc, _vs, _vz,
             kc_ref, ka_ref, kz_ref, kres_ref, vc_ref, vs_ref, vz_ref):
    pos, rg = meta_ref[0], meta_ref[1]
    valid = (pos >= 0) & (pos < t)
    slot = pos - rg * g  # the new key's row in the residual group
    done = valid & (slot == g - 1)
    new_key = [kn_ref[pl.ds(c, half)].astype(jnp.float32)[None, :] for c in (0, half)]

    @pl.when(valid & ~done)
    def _():  # the common step: one row of the residual
      for c, x in zip((0, half), new_key):
        kres_ref[pl.ds(slot, 1), pl.ds(c, half)] = x.astype(kres_ref.dtype)

    @pl.when(done)
    def _():  # the group is full: to main, quantized per channel over its tokens; the residual
      at = jax.lax.broadcasted_iota(jnp.int32, (g, 1), 0) == slot  # cleared for the next group
      (c1, a1, z1), (c2, a2, z2) = (
          _quantize(jnp.where(at, x, kres_in[:, pl.ds(c, half)].astype(jnp.float32)), 0, native,
                    ka_ref.dtype)
          for c, x in zip((0, half), new_key))
      kc_ref[pl.ds(rg * g, g), :] = _pack(c1, c2)
      for c, a, z in ((0, a1, z1), (half, a2, z2)):
        ka_ref[pl.ds(rg, 1), pl.ds(c, half)] = a.astype(ka_ref.dtype)
        kz_ref[pl.ds(rg, 1), pl.ds(c, half)] = z.astype(kz_ref.dtype)
        kres_ref[:, pl.ds(c, half)] = jnp.zeros((g, half), kres_ref.dtype)

    @pl.when(valid)
    def _():
      if value_group <= half:  # groups within each half: [d / 2] -> [groups, gv]
        parts = [_quantize(vn_ref[pl.ds(c, half)].astype(jnp.float32).reshape(per_half, gv), 1,
                           native, vs_ref.dtype) for c in (0, half)]
        codes = [p[0].reshape(1, half) for p in parts]
        for i, (_, a, z) in enumerate(parts):
          vs_ref[pl.ds(pos, 1), pl.ds(i * per_half, per_half)] = (
              a.reshape(1, per_half).astype(vs_ref.dtype))
          vz_ref[pl.ds(pos, 1), pl.ds(i * per_half, per_half)] = (
              z.reshape(1, per_half).astype(vz_ref.dtype))
      else:  # one group of all d channels, over both halves
        x = [vn_ref[pl.ds(c, half)].astype(jnp.float32).reshape(1, half) for c in (0, half)]
        lo = jnp.minimum(jnp.min(x[0], axis=1, keepdims=True), jnp.min(x[1], axis=1,
                                                                        keepdims=True))
        hi = jnp.maximum(jnp.max(x[0], axis=1, keepdims=True), jnp.max(x[1], axis=1,
                                                                        keepdims=True))
        (c1, scale, zero), (c2, _, _) = (_quantized_range(xi, lo, hi, native, vs_ref.dtype)
                                               for xi in x)
        codes = [c1, c2]
        vs_ref[pl.ds(pos, 1), :] = scale.astype(vs_ref.dtype)
        vz_ref[pl.ds(pos, 1), :] = zero.astype(vz_ref.dtype)
      vc_ref[pl.ds(pos, 1), :] = _pack(*codes)

  def whole(rows, cols):  # one (batch, kv head)'s [rows, cols] of a [B, KV, rows, cols] buffer
    return gpu.whole_keys_spec("BHTD", rows, cols, kvh)

  new = pl.BlockSpec((SQ, SQ, d), lambda bh: (bh // kvh, bh % kvh, 0))
  buffers = [whole(t, half), whole(t // g, d), whole(t // g, d), whole(g, d), whole(t, half),
             whole(t, nv), whole(t, nv)]
  bufs = (kc, ka, kz, kres, vc, vs, vz)
  return gpu.pallas_call(
      kernel, interpret, num_warps=1, num_stages=1, grid=(b * kvh,),
      in_specs=[gpu.per_batch_spec(kvh, 2), new, new, *buffers],
      out_specs=buffers,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in bufs],
      input_output_aliases={3 + i: i for i in range(len(bufs))},
  )(meta, k_new, v_new, *bufs)
