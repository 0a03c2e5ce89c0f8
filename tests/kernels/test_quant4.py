"""The 4-bit storage format (pallas_kernels/quant4.py) against numpy: packing round-trips and
pairs channel j with j + d / 2 in one byte; every group's error is at most half its step and its
ends are exact; keys grouped per channel along tokens hold normal channels beside outlier ones,
where a range per row does not; row ops move values and refuse token-grouped keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quant4

B, KV, T, D = 2, 3, 64, 128
G = quant4.GROUP


def _keys(seed=0, outliers=(5, 77)):
  """Normal keys [B, KV, T, D] whose `outliers` channels are ~40x larger for every token (the
  pattern per-token 4-bit grids lose to: KIVI's and KVQuant's observation)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, KV, T, D)).astype(np.float32)
  x[..., list(outliers)] = 40 + 5 * rng.normal(size=(B, KV, T, len(outliers)))
  return jnp.asarray(x)


def _grouped(x, axis):
  """x [B, KV, T, D] as [..., groups, G, ...] along axis (2: tokens, 3: channels)."""
  shape = list(x.shape)
  shape[axis:axis + 1] = [shape[axis] // G, G]
  return x.reshape(shape)


def test_packing_round_trips_and_pairs_rotate_half_channels():
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, (B, KV, T, D)).astype(np.uint8)
  packed = quant4.pack(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (B, KV, T, D // 2)
  np.testing.assert_array_equal(np.asarray(packed) & 15, codes[..., : D // 2])
  np.testing.assert_array_equal(np.asarray(packed) >> 4, codes[..., D // 2:])
  np.testing.assert_array_equal(np.asarray(quant4.unpack(packed)), codes)
  with pytest.raises(ValueError, match="must be even"):
    quant4.pack(jnp.zeros((3, 5), jnp.uint8))


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("axis", [2, -1])  # keys: per channel over tokens; values: per token
def test_each_group_is_within_half_a_step_and_hits_its_ends(axis, scale_dtype):
  x = np.asarray(_keys(2))
  q = quant4.quantize(jnp.asarray(x), axis=axis, scale_dtype=scale_dtype)
  assert q.shape == x.shape and q.axis == axis % 4
  want = list(x.shape)
  want[axis] //= G
  assert q.scale.shape == q.zero.shape == tuple(want)
  assert q.scale.dtype == q.zero.dtype == scale_dtype
  back = np.asarray(quant4.dequantize(q))
  a = axis % 4
  xg, bg = _grouped(x, a), _grouped(back, a)
  lo, hi = xg.min(a + 1, keepdims=True), xg.max(a + 1, keepdims=True)
  # the stored zero point and scale are rounded to scale_dtype (fp16's half ulp: 2^-11 relative
  # bounds fp32's), the codes computed against them: half a step, plus the zero point's rounding
  ulp = 2.0 ** -11 * (np.abs(lo) + (hi - lo))
  assert np.all(np.abs(bg - xg) <= (hi - lo) / 30 + ulp + 1e-5 * np.abs(x).max())
  assert np.all(np.abs(bg.min(a + 1, keepdims=True) - lo) <= ulp + 1e-5)  # level 0 and 15:
  assert np.all(np.abs(bg.max(a + 1, keepdims=True) - hi) <= ulp + 1e-4)  # no level wasted
  jitted = jax.jit(lambda y: quant4.quantize(y, axis=axis, scale_dtype=scale_dtype))(
      jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(jitted.codes), np.asarray(q.codes))


def test_a_flat_group_is_exact_and_bad_groups_are_refused():
  flat = quant4.quantize(jnp.full((1, D), 2.5))
  np.testing.assert_array_equal(np.asarray(quant4.dequantize(flat)), np.full((1, D), 2.5))
  with pytest.raises(ValueError, match="not whole groups of 32"):
    quant4.quantize(jnp.ones((2, 40, D)), axis=1)


def test_keys_per_channel_hold_normal_channels_beside_outliers_where_rows_do_not():
  x = _keys(3)
  normal = [c for c in range(D) if c not in (5, 77)]

  def err(q):
    return np.abs(np.asarray(quant4.dequantize(q)) - np.asarray(x))[..., normal].mean()
  per_channel, per_row = err(quant4.quantize(x, axis=2)), err(quant4.quantize(x, group=D))
  assert per_channel * 4 < per_row, (per_channel, per_row)


def test_row_ops_move_values_and_refuse_token_grouped_keys():
  x = _keys(4)
  values, keys = quant4.quantize(x), quant4.quantize(x, axis=2)
  slots = jnp.array([7, 0, 63, 7])
  moved = quant4.per_row(lambda a: a[:, :, slots], values)
  np.testing.assert_array_equal(np.asarray(quant4.dequantize(moved)),
                                np.asarray(quant4.dequantize(values))[:, :, slots])
  with pytest.raises(TypeError, match="move by whole groups"):
    quant4.per_row(lambda a: a[:, :, slots], keys)
  # a 128-channel row: 64 bytes of codes, 4 groups of (scale, zero) a value row, one (scale,
  # zero) a channel per 32 key rows: 96 bytes a row either way (fp32 scales), 37.5% of bf16
  pair = 2 * np.dtype(values.scale.dtype).itemsize
  assert quant4.nbytes(values) == B * KV * T * (64 + 4 * pair)
  assert quant4.nbytes(keys) == B * KV * T * 64 + B * KV * (T // G) * D * pair


@pytest.mark.parametrize("name", list(quant4.FORMATS))
def test_each_format_stores_the_bytes_it_states(name):
  """A format's buffers (keys grouped along tokens, values per token) hold Format.row_bytes a
  token and KV head, scales in its dtype: 192 / 160 / 144 bytes at d 128."""
  fmt = quant4.format_of(name)
  shape = (B, KV, 2 * fmt.group, D)
  keys = quant4.zeros_grouped_keys(shape, jnp.bfloat16, fmt.group, fmt.scale_dtype)
  values = quant4.zeros_values(shape, fmt.group, fmt.scale_dtype)
  assert keys.main.scale.dtype == values.zero.dtype == jnp.dtype(fmt.scale_dtype)
  stored = quant4.nbytes(keys.main) + quant4.nbytes(values)
  assert stored == B * KV * shape[2] * fmt.row_bytes(D)
  assert {n: quant4.format_of(n).row_bytes(128) for n in quant4.FORMATS} == {
      "int4": 192, "int4_fp16": 160, "int4_g64_fp16": 144}
  with pytest.raises(ValueError, match="not a 4-bit cache format"):
    quant4.format_of("int3")


def _expected_keys(keys, length):
  """keys [T, KV, d] of one sequence with `length` written, as KIVI stores them: each full group
  of G tokens quantized per channel with its own range, the rest whole; [KV, length, d]."""
  x = np.asarray(keys, np.float32)[:length].transpose(1, 0, 2)  # [KV, length, d]
  full = (length // G) * G
  out = x.copy()
  if full:
    out[:, :full] = np.asarray(quant4.dequantize(quant4.quantize(jnp.asarray(x[:, :full]),
                                                                 axis=1)))
  return out


def test_grouped_keys_quantize_each_group_once_it_fills_and_keep_the_rest_whole():
  """Three sequences appended in chunks of different sizes (one-token decode writes among them),
  each row its own length (a row's padding dropped): after every write the buffer reads back
  its full groups quantized with their own ranges and its newest group whole."""
  t, kvh, d = 160, 2, 64
  rng = np.random.default_rng(7)
  keys = rng.normal(size=(3, t, kvh, d)) * rng.uniform(0.5, 2, (3, 1, 1, 1))
  keys[..., 5] += 40  # an outlier channel, large for every token
  keys = jnp.asarray(keys, jnp.bfloat16)  # [B, T, KV, d], the model's dtype
  buf = quant4.zeros_grouped_keys((3, kvh, t, d), jnp.bfloat16)
  write = jax.jit(quant4.write_grouped_keys)
  lengths = np.zeros(3, int)
  for step, sizes in enumerate([(5, 33, 0), (40, 1, 64), (1, 1, 1), (1, 30, 2), (70, 2, 31),
                                (20, 60, 1)]):
    s = max(sizes)
    pos = np.full((3, s), t)  # out of range: dropped
    for row, n in enumerate(sizes):
      pos[row, :n] = lengths[row] + np.arange(n)
    new = jnp.take_along_axis(keys, jnp.asarray(np.minimum(pos, t - 1))[:, :, None, None], axis=1)
    buf = write(buf, jnp.asarray(pos, jnp.int32), new)
    lengths += np.asarray(sizes)
    got = np.asarray(quant4.load_grouped_keys(buf))
    for row in range(3):
      want = _expected_keys(keys[row], lengths[row])
      np.testing.assert_allclose(got[row, :, :lengths[row]], want, rtol=0, atol=1e-6,
                                 err_msg=f"write {step}, sequence {row}")
    np.testing.assert_array_equal(np.asarray(buf.residual_group), lengths // G)
  assert lengths.tolist() == [137, 127, 99]
  with pytest.raises(ValueError, match="not whole groups"):
    quant4.zeros_grouped_keys((1, 1, 40, d), jnp.bfloat16)


def test_keys_written_whole_take_their_ranges_from_the_valid_slots_alone():
  """A context written at once (Star's): no group left open, and its padding slots (set huge
  here) change no code, scale or zero point of the valid ones: every group with a valid slot
  quantizes as its valid slots alone would (a wholly padded group: any range)."""
  b, kvh, t, d = 2, 2, 96, 16
  rng = np.random.default_rng(3)
  keys = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
  valid = np.arange(t)[None, :] < np.array([[70], [33]])  # [B, T]
  padded = np.where(valid[:, None, :, None], keys, 1e4)
  got = quant4.grouped_keys_written_whole(jnp.asarray(padded), jnp.asarray(valid), jnp.bfloat16)
  assert got.residual_group.tolist() == [t // G] * b
  read = np.asarray(quant4.load_grouped_keys(got))
  for row, n in enumerate((70, 33)):
    for start in range(0, n, G):
      end = min(start + G, n)
      group = keys[row, :, start:end]
      step = (group.max(axis=1) - group.min(axis=1)) / 15  # [KV, d]
      ulp = 2.0 ** -11 * np.abs(group).max(axis=1)  # the stored zero point and scale (fp16's)
      err = np.abs(read[row, :, start:end] - group)
      assert np.all(err <= (step / 2 + ulp)[:, None, :] + 1e-5), (row, start, float(err.max()))
  with pytest.raises(ValueError, match="not whole groups"):
    quant4.grouped_keys_written_whole(jnp.zeros((1, 1, 40, d)), jnp.ones((1, 40), bool),
                                      jnp.bfloat16)


def test_products_over_codes_equal_the_dequantize_first_definitions():
  """quant4_products folds key scales into the query per group (and zero points into one dot
  product per group): equal, within fp32 rounding, to the same products over the dequantized
  keys, residual group included, for grouped query heads (6 query heads over 2 KV heads)."""
  from pallas_kernels import quant4_products
  b, kvh, h, t, d = 2, 2, 6, 96, 64
  rng = np.random.default_rng(11)
  k = rng.normal(size=(b, t, kvh, d))
  k[..., 9] += 30  # an outlier channel
  buf = quant4.write_grouped_keys(quant4.zeros_grouped_keys((b, kvh, t, d), jnp.bfloat16),
                                  jnp.asarray(np.stack([np.arange(t), np.r_[:80, [t] * 16]])),
                                  jnp.asarray(k, jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(buf.residual_group), [3, 2])  # 96 and 80 written
  q = jnp.asarray(rng.normal(size=(b, 3, h, d)), jnp.float32)
  got = quant4_products.key_scores(q, buf)
  kd = quant4.load_grouped_keys(buf)  # [B, KV, T, d]
  want = jnp.einsum("bqkhd,bktd->bqkht", q.reshape(b, 3, kvh, h // kvh, d), kd).reshape(
      b, 3, h, t)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)
