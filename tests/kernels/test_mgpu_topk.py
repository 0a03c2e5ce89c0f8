"""The Mosaic GPU top-k kernel (pallas_kernels/topk/mgpu_topk.py) on CPU.

jax's Mosaic GPU interpreter runs the kernel's warpgroups as threads (TMA ring, barriers, turns,
the selection rounds, masks, splits) with WGMMA and layout casts replaced by plain dot products
(`native=False`, see mgpu_common.Ops); the native code is lowered to Mosaic GPU MLIR on this
CPU-only jaxlib (layouts, SMEM), and runs on the GPU in benchmarks/mgpu_topk.py.
Integer inputs make every score exact: indices and scores must equal the reference's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, layout, mgpu_common, quant, topk_scores
from pallas_kernels.topk import mgpu_topk, topk_segments
from pallas_kernels.topk import topk as ts_module
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import TOPK_MANY_ROWS, KernelOptions
from tests.conftest import run_on_eight_devices
from tests.kernels.inputs import keys_shape, normal, small_ints

NO_INTERPRETER = mgpu_common.interpreter_available()
needs_interpreter = pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))


@pytest.fixture(autouse=True)
def _reset_interpreter():
  """jax's GPU interpreter must be reset after a kernel raised, or the next run fails too."""
  yield
  if NO_INTERPRETER is None:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def mosaic(block_kv=64, stages=2, key_splits=None, warpgroups=None):
  return Tiling(impl="mosaic", block_rows=64, block_keys=block_kv, num_stages=stages,
                key_splits=key_splits, num_warps=warpgroups and 4 * warpgroups)


def assert_exact(q, k, top_k, tiling, options=KernelOptions(), **kw):
  keys = k.shape[2 if kw.get("kv_layout") == "BHTD" else 1]
  rows = q.shape[1] * q.shape[2] // k.shape[1 if kw.get("kv_layout") == "BHTD" else 2]
  # Mosaic takes the call (a shape it refuses would silently run the Triton kernel instead)
  assert ts_module._mosaic_config(Variant("gpu", True), q, k, rows, top_k, tiling,
                                  keys=keys) is not None
  v, i = topk_scores(q, k, top_k, route=Route(backend="gpu", kernels=options), tiling=tiling, **kw)
  rv, ri = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  assert v.shape == i.shape == rv.shape and v.dtype == jnp.float32 and i.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
  return np.asarray(v), np.asarray(i)


# name: (batch, q_len, q_heads, kv_heads, keys, d, top_k, layout, valid, prefix, suffix, tiling)
CASES = {
    # 2 sequences of different lengths, prefix / suffix excluded, 304 keys (a multiple of 16, as
    # segments need; of 8, as Mosaic's TMA needs): a clamped last tile
    "g4_d64_top4_bthd": (2, 16, 4, 1, 304, 64, 4, "BTHD", (304, 171), 5, 17, mosaic()),
    # 296 keys: the segments do not fit, so "segments" runs the kernel's running set
    "g4_d64_top4_bthd_296": (2, 16, 4, 1, 296, 64, 4, "BTHD", (296, 171), 5, 17, mosaic()),
    # top 16 over 2 key splits, the other layout, a 3-slot ring; 64 rows padded to a CTA's 128
    "g4_d128_top16_bhtd_split": (1, 16, 4, 1, 336, 128, 16, "BHTD", None, 70, 0,
                                 mosaic(stages=3, key_splits=2)),
    # no GQA; top 1; 128-key tiles; the second sequence has a single candidate
    "g1_d64_top1": (2, 64, 2, 2, 200, 64, 1, "BTHD", (200, 6), 5, 0, mosaic(block_kv=128)),
    # 128-key tiles over 2 key splits: "columns" in two windows a tile
    "g4_d64_top4_bthd_384": (2, 16, 4, 1, 384, 64, 4, "BTHD", (384, 171), 5, 17,
                             mosaic(block_kv=128, key_splits=2)),
    # 64-key tiles: "columns" in one window a tile; top 8, the other layout
    "g4_d128_top8_bhtd_320": (1, 16, 4, 1, 320, 128, 8, "BHTD", None, 70, 3, mosaic()),
}


def test_columns_windows_widen_on_long_key_axes():
  """64-key windows, 128 from COLUMN_LONG_KEYS keys (or as asked), None where the tiles or
  top_k do not fit; stage 2 spreads more candidates over more warps."""
  long = topk_segments.COLUMN_LONG_KEYS
  assert topk_segments.column_window(long - 256, 256, 4) == 64
  assert topk_segments.column_window(long, 256, 4) == 128
  assert topk_segments.column_window(long, 256, 4, window=64) == 64
  assert topk_segments.column_window(long, 64, 4) is None  # a 128-key window in 64-key tiles
  assert topk_segments.column_window(512, 128, 9) is None
  assert [topk_segments.rescore_warps(n, True) for n in (64, 128, 256)] == [1, 4, 8]
  assert [topk_segments.rescore_warps(n, False) for n in (64, 128, 256)] == [1, 8, 8]
  with pytest.raises(ValueError, match="topk_column_window"):
    KernelOptions(topk_column_window=256)


def windows(t, block_kv, top_k, many_rows):
  """The strided segments' window topk_scores runs these with (None: not "columns")."""
  if many_rows != "columns" or top_k == 1:
    return None
  return topk_segments.column_window(t, block_kv, top_k)


def segment_stages(monkeypatch):
  """Counts the calls of topk_segments' stage 2 (so a test knows which selection ran)."""
  calls = []
  stage2 = topk_segments.keys_of_segments

  def spy(*args, **kw):
    calls.append(kw.get("window"))
    return stage2(*args, **kw)

  monkeypatch.setattr(topk_segments, "keys_of_segments", spy)
  return calls


@needs_interpreter
@pytest.mark.parametrize("many_rows", TOPK_MANY_ROWS)
@pytest.mark.parametrize("case", list(CASES))
def test_mgpu_topk_matches_reference_in_interpreter(case, many_rows, monkeypatch):
  b, lq, h, kvh, t, d, top_k, kv_layout, valid, prefix, suffix, tiling = CASES[case]
  rng = np.random.default_rng(len(case))
  q = small_ints(rng, (b, lq, h, d))
  k = small_ints(rng, keys_shape(b, t, kvh, d, kv_layout))
  calls = segment_stages(monkeypatch)
  v, i = assert_exact(q, k, top_k, tiling, KernelOptions(topk_many_rows=many_rows),
                      valid_len=None if valid is None else jnp.asarray(valid),
                      exclude_prefix=prefix, exclude_suffix=suffix, kv_layout=kv_layout)
  # segments run where asked, for top_k > 1, when the keys are a multiple of 16; strided ones
  # where the keys and tiles are a multiple of their window, else contiguous ones
  window = windows(t, tiling.block_keys, top_k, many_rows)
  assert bool(calls) == (many_rows != "kernel" and top_k > 1 and t % 16 == 0)
  assert calls in ([], [window])
  assert window or many_rows != "columns" or case not in ("g4_d64_top4_bthd_384",
                                                          "g4_d128_top8_bhtd_320")
  hi = (t if valid is None else np.asarray(valid)[:, None, None, None]) - suffix
  assert np.all((i == -1) | ((i >= prefix) & (i < hi))), "an excluded key was selected"
  if case == "g1_d64_top1":  # sequence 1 has the single candidate key 5
    assert np.all(i[1] == 5)


@needs_interpreter
@pytest.mark.parametrize("many_rows", TOPK_MANY_ROWS)
def test_mgpu_topk_ties_go_to_lowest_index(many_rows):
  """37 distinct keys repeated: every score is tied many times over, across tiles, segments
  and splits."""
  rng = np.random.default_rng(7)
  k = jnp.tile(small_ints(rng, (1, 37, 1, 64)), (1, 12, 1, 1))[:, :416]
  q = small_ints(rng, (1, 16, 4, 64))
  v, i = assert_exact(q, k, 16, mosaic(key_splits=2), KernelOptions(topk_many_rows=many_rows))
  tied = v[..., 1:] == v[..., :-1]
  assert tied.any() and np.all(i[..., 1:][tied] > i[..., :-1][tied])


@needs_interpreter
@pytest.mark.parametrize("block_kv,splits,window,warpgroups", [
    (64, 2, 0, None), (128, 1, 0, None),  # windows of 64: 1 / 2 a tile
    (128, 2, 128, None)])  # windows of 128, segments of 16 keys: stage 2 rescores 176 keys a row
def test_columns_ties_go_to_lowest_index(block_kv, splits, window, warpgroups, monkeypatch):
  """Strided segments over 29 distinct keys repeated: equal maxima in one window's columns,
  whose keys interleave, and across windows and splits; top 8, the most "columns" keeps (on
  two compute warpgroups here; tests/helpers/mgpu_topk_three_checks.py runs it on three)."""
  rng = np.random.default_rng(19)
  k = jnp.tile(small_ints(rng, (1, 29, 1, 64)), (1, 18, 1, 1))[:, :512]
  q = small_ints(rng, (1, 16, 4, 64))
  calls = segment_stages(monkeypatch)
  v, i = assert_exact(q, k, 8, mosaic(block_kv=block_kv, key_splits=splits,
                                      warpgroups=warpgroups),
                      KernelOptions(topk_many_rows="columns", topk_column_window=window),
                      exclude_prefix=2)
  assert calls == [window or topk_segments.COLUMN_WINDOW]
  tied = v[..., 1:] == v[..., :-1]
  assert tied.any() and np.all(i[..., 1:][tied] > i[..., :-1][tied])


@needs_interpreter
@pytest.mark.parametrize("name", ["bf16", "int8_parts", "ties", "races"])
def test_three_warpgroups_in_the_interpreter(name, request):
  """Three compute warpgroups in the interpreter (tests/helpers/mgpu_topk_three_checks.py), in a
  process of 8 fake CPU devices: jax's interpreter runs each warpgroup as a thread whose barrier
  waits hold one of the CPU client's workers, and on one device of a 2-core machine a CTA of
  four starved (a top-8 case hung every time; on 8 devices it passed)."""
  run_on_eight_devices("tests.helpers.mgpu_topk_three_checks", name, request)


@needs_interpreter
@pytest.mark.parametrize("balanced,asked_by", [(True, "option"), (False, "tiling")])
def test_balanced_splits_share_the_candidates_tiles(balanced, asked_by, monkeypatch):
  """3 splits over two sequences whose candidates are a part of the key axis ([5, 458) and
  [5, 200): prefix, suffix and lengths excluded): balanced splits cut each one's candidate tiles
  in 3 (the last short, some splits of the shorter one empty), the others the key axis; both
  exact. The 3 asked by the call's Tiling or by KernelOptions.topk_key_splits."""
  rng = np.random.default_rng(23)
  k = small_ints(rng, (2, 512, 2, 64))
  q = small_ints(rng, (2, 16, 8, 64))
  seen = []
  kernel = mgpu_topk.mgpu_topk_scores
  monkeypatch.setattr(mgpu_topk, "mgpu_topk_scores",
                      lambda *a, **kw: seen.append((kw["splits"], kw["balanced"])) or kernel(
                          *a, **kw))
  by_tiling = asked_by == "tiling"
  assert_exact(q, k, 4, mosaic(key_splits=3 if by_tiling else None),
               KernelOptions(topk_balanced_splits=balanced, topk_key_splits=0 if by_tiling else 3),
               valid_len=jnp.asarray([512, 254]), exclude_prefix=5, exclude_suffix=54)
  assert seen == [(3, balanced)]


def test_key_splits_option_is_a_count():
  with pytest.raises(ValueError, match="topk_key_splits=-1 must be a count"):
    KernelOptions(topk_key_splits=-1)


def test_wave_splits_fill_the_cores_waves(monkeypatch):
  from pallas_kernels import backend, gpu
  monkeypatch.setattr(backend, "num_cores", lambda: 132)
  t = 1 << 20
  assert [gpu.wave_splits(p, t, 256) for p in (128, 96, 48, 8)] == [1, 4, 8, 16]
  assert gpu.wave_splits(96, 4096, 256) == 4  # at most one split per 4 tiles
  assert gpu.wave_splits(48, 2048, 256) == 2  # none fills 95%: the fuller of 1 and 2


@needs_interpreter
def test_mgpu_topk_float_inputs():
  rng = np.random.default_rng(3)
  q, k = normal(rng, (1, 16, 4, 128), jnp.bfloat16), normal(rng, (1, 272, 1, 128), jnp.bfloat16)
  assert ts_module._mosaic_config(Variant("gpu", True), q, k, 64, 8, mosaic(),
                                  keys=272) is not None
  v, i = topk_scores(q, k, 8, scale=0.125, route=Route(backend="gpu"), tiling=mosaic())
  rv, ri = topk_scores(q, k, 8, scale=0.125, route=Route(backend="reference"))
  np.testing.assert_allclose(np.asarray(v), np.asarray(rv), rtol=1e-5, atol=1e-5)
  gap = np.abs(np.diff(np.asarray(rv), axis=-1)).min(axis=-1) > 1e-4
  np.testing.assert_array_equal(np.asarray(i)[gap], np.asarray(ri)[gap])


@needs_interpreter
def test_segments_give_several_keys_of_one_segment():
  """Every row's 4 best keys in one 16-key segment (and its 5th in another): the segments'
  stage 2 must take all four from it, whichever segments come next."""
  rng = np.random.default_rng(5)
  q = jnp.abs(small_ints(rng, (1, 16, 4, 64))) + 1  # positive: larger keys score higher
  k = small_ints(rng, (1, 320, 1, 64))
  k = k.at[:, 200:204].add(40).at[:, 37].add(30)
  v, i = assert_exact(q, k, 4, mosaic())
  assert np.all(np.sort(i, axis=-1) == np.arange(200, 204))


@needs_interpreter
def test_pipeline_has_no_races():
  """The interpreter's race detector over the K ring (4 tiles through 2 slots, both warpgroups,
  the selection rounds in their turns): every refill is ordered after both releases."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  rng = np.random.default_rng(11)
  q, k = small_ints(rng, (1, 32, 4, 64)), small_ints(rng, (1, 256, 1, 64))
  bounds = jnp.array([[3, 250]], jnp.int32)
  vals, idx = mgpu_topk.mgpu_topk_scores(layout.q_rows(q, 1, 128), k, bounds, kp=4, span=256,
                                         splits=1, scale=None, config=mgpu_topk.Config(64, 64, 2),
                                         interpret=InterpretGPUParams(detect_races=True))
  jax.block_until_ready(idx)
  assert not interpret_pallas_call.get_races().races_found
  v, i = ts_module._finish(vals, idx, 4, 32, 4)
  rv, ri = topk_scores(q, k, 4, exclude_prefix=3, valid_len=250, route=Route(backend="reference"))
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


def test_routing():
  """Off GPU only tiling.impl="mosaic" picks the kernel; decode-sized rows, fp32, top_k above
  MAX_TOP_K stay on Triton; KernelOptions.topk_impl decides on a (pretended) Hopper GPU."""
  q, k = jnp.zeros((1, 16, 4, 64), jnp.bfloat16), jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  interp = Variant("gpu", True)
  cfg = ts_module._mosaic_config
  assert cfg(interp, q, k, 64, 4, None) is None
  assert cfg(interp, q, k, 64, 4, Tiling(impl="mosaic")) == mgpu_topk.DEFAULT_CONFIG
  assert cfg(interp, q, k, 4, 4, Tiling(impl="mosaic")) is None  # decode: 1 query x group 4
  assert cfg(interp, q.astype(jnp.float32), k.astype(jnp.float32), 64, 4,
             Tiling(impl="mosaic")) is None
  assert cfg(interp, q, k, 64, mgpu_topk.MAX_TOP_K + 1, Tiling(impl="mosaic")) is None
  assert cfg(Variant("reference", False), q, k, 64, 4, Tiling(impl="mosaic")) is None
  with pytest.raises(ValueError, match="impl"):
    cfg(interp, q, k, 64, 4, Tiling(impl="cuda"))


def test_routing_on_a_hopper_gpu(monkeypatch):
  native = Variant("gpu", False)
  q, k = jnp.zeros((1, 16, 4, 64), jnp.bfloat16), jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  monkeypatch.setattr(ts_module.backend_lib, "is_hopper", lambda: True)
  triton = KernelOptions(topk_impl="triton")
  assert ts_module._mosaic_config(native, q, k, 64, 4, None, options=triton) is None
  mosaic = KernelOptions(topk_impl="mosaic")
  assert ts_module._mosaic_config(native, q, k, 64, 4, None, options=mosaic) == \
      mgpu_topk.THREE_WARPGROUPS[False]  # bf16 keys, "columns": three compute warpgroups
  assert ts_module._mosaic_config(native, q, k, 64, 4, Tiling(impl="triton")) is None


def test_compute_warpgroups_by_keys_selection_and_ask(monkeypatch):
  """Three compute warpgroups over 16-bit keys under "columns" on the GPU; two over 8-bit keys,
  for other selections (top-1's argmax, "segments", "kernel"), in the interpreter, and where
  asked (KernelOptions.topk_warpgroups, a call's Tiling.num_warps first); a call asking three
  for a selection that reduces across warps is refused in one line."""
  monkeypatch.setattr(ts_module.backend_lib, "is_hopper", lambda: True)
  native, interp = Variant("gpu", False), Variant("gpu", True)
  q, k = jnp.zeros((1, 64, 4, 64), jnp.bfloat16), jnp.zeros((1, 4096, 1, 64), jnp.bfloat16)
  k8 = quant.quantize(k, "int8")
  three, two, eight = (mgpu_topk.THREE_WARPGROUPS[False], mgpu_topk.DEFAULT_CONFIG,
                       mgpu_topk.EIGHT_BIT_CONFIG)

  def cfg(variant, k, top_k, tiling=None, **options):
    return ts_module._mosaic_config(variant, q, k, 256, top_k, tiling, keys=4096,
                                    options=KernelOptions(**options))

  assert cfg(native, k, 4) == three and cfg(native, k8, 4) == eight
  assert cfg(native, k8, 4, topk_warpgroups=3) == mgpu_topk.THREE_WARPGROUPS[True]
  assert cfg(native, k, 4, topk_warpgroups=2) == two
  assert cfg(native, k, 1) == two  # the running argmax reduces across warps
  assert cfg(native, k, 4, topk_many_rows="segments") == two
  assert cfg(native, k, 4, topk_many_rows="kernel") == two
  assert cfg(interp, k, 4, Tiling(impl="mosaic")) == two
  assert cfg(interp, k, 4, Tiling(impl="mosaic", num_warps=12)).warpgroups == 3
  assert cfg(native, k, 4, Tiling(impl="mosaic", num_warps=8), topk_warpgroups=3) == two
  with pytest.raises(ValueError, match="topk_warpgroups=4 must be"):
    KernelOptions(topk_warpgroups=4)
  with pytest.raises(ValueError, match="warpgroups 1 must be 2 or 3"):
    cfg(native, k, 4, Tiling(impl="mosaic", num_warps=4))
  with pytest.raises(ValueError, match="3 compute warpgroups run only the selections"):
    topk_scores(q, k, 1, route=Route(backend="gpu"), tiling=Tiling(impl="mosaic", num_warps=12))


LOWERINGS = [(128, "BTHD", 4, None, "exact"), (64, "BHTD", 16, "warpgroup", "exact"),
             (128, "BHTD", 1, "lane", "exact"), (128, "BTHD", 4, "warpgroup", "segments"),
             (128, "BHTD", 4, "lane", "segments"), (128, "BTHD", 4, None, "columns"),
             (64, "BHTD", 8, "warpgroup", "columns"),
             # three compute warpgroups: 256-key tiles in 128-key parts (the default), and whole
             (128, "BTHD", 4, None, "columns3"), (64, "BHTD", 8, "lane", "columns3_128")]


@pytest.mark.parametrize("d,kv_layout,kp,semantics,selection", LOWERINGS)
def test_native_kernel_lowers_to_mosaic_gpu(d, kv_layout, kp, semantics, selection):
  """The GPU code (WGMMA, layout casts, the cross-warp "any" reduction in the while loop) lowers
  to a Mosaic GPU custom call on this CPU-only jaxlib, at the benchmark's shapes; Mosaic's own
  SMEM check runs too."""
  three = selection.startswith("columns3")
  b, kvh, rows, t = 1, 8, 2112 if three else 2048, 131072  # a multiple of 192 / 128 rows
  qr = jax.ShapeDtypeStruct((b, kvh, rows, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct(keys_shape(b, t, kvh, d, kv_layout), jnp.bfloat16)
  bounds = jax.ShapeDtypeStruct((b, 2), jnp.int32)
  config = mgpu_topk.Config(64, 128, 4, semantics=semantics)
  if three:
    config = mgpu_topk.Config(64, 128 if selection.endswith("128") else 256, 2,
                              semantics=semantics, warpgroups=3)
    selection = "columns"

  def f(qr, k, bounds):
    return mgpu_topk.mgpu_topk_scores(qr, k, bounds, kp=kp, span=t // 2, splits=2, scale=d ** -0.5,
                               kv_layout=kv_layout, config=config, selection=selection,
                               segment=128 if selection == "columns" else 16)

  text = jax.jit(f).trace(qr, k, bounds).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_unsupported():
  q, k = jnp.zeros((1, 64, 4, 64), jnp.bfloat16), jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  config = mgpu_topk.DEFAULT_CONFIG
  assert mgpu_topk.unsupported(q, k, 4, config=config) is None
  assert "top_k" in mgpu_topk.unsupported(q, k, 64, config=config)
  assert "multiple of 8" in mgpu_topk.unsupported(q, k, 4, config=config, keys=999)  # TMA
  assert mgpu_topk.unsupported(q, k, 4, config=config, keys=1000) is None
  assert "head dim" in mgpu_topk.unsupported(q[..., :32], k[..., :32], 4, config=config)
  assert "SMEM" in mgpu_topk.unsupported(q, k, 4, config=mgpu_topk.Config(64, 256, 8))


def test_segments_stage2_selects_like_numpy():
  """topk_segments.best_keys (Pallas interpret mode): each row's own candidate keys, some
  missing (-1), top 3 (a block of 4 in the kernel), a row with fewer candidates than 3."""
  rng = np.random.default_rng(13)
  b, kvh, rows, d, t, n = 1, 2, 16, 64, 96, 32
  qr, k = small_ints(rng, (b, kvh, rows, d)), small_ints(rng, (b, t, kvh, d))
  keys = np.stack([rng.permutation(t)[:n] for _ in range(b * kvh * rows)]).reshape(b, kvh, rows, n)
  keys[..., 5:9] = -1
  keys[0, 1, 3, 2:] = -1  # two candidates only
  v, i = topk_segments.best_keys(qr, k, jnp.asarray(keys, jnp.int32), 3, scale=0.5,
                                 kv_layout="BTHD", interpret=True)
  s = np.einsum("bhrd,bthd->bhrt", np.asarray(qr, np.float64), np.asarray(k, np.float64)) * 0.5
  for idx in np.ndindex(b, kvh, rows):
    cand = keys[idx][keys[idx] >= 0]
    order = cand[np.lexsort((cand, -s[idx][cand]))][:3]  # score desc, key asc
    want_i = np.full(3, -1)
    want_i[:len(order)] = order
    np.testing.assert_array_equal(np.asarray(i)[idx], want_i)
    np.testing.assert_array_equal(np.asarray(v)[idx][:len(order)], s[idx][order])
    assert np.all(np.asarray(v)[idx][len(order):] == -np.inf)


@needs_interpreter
@pytest.mark.parametrize("test_first", [True, False])
def test_segments_with_and_without_the_warpgroup_test(test_first):
  """Stage 1 inserts each tile's best segment after a test across the warpgroup (long splits)
  or without it (short ones): the same segments either way, so the reference's top-k."""
  rng = np.random.default_rng(17)
  q, k = small_ints(rng, (1, 32, 4, 64)), small_ints(rng, (1, 512, 1, 64))
  bounds = jnp.array([[3, 500]], jnp.int32)
  qr = layout.q_rows(q, 1, 128)
  vals, firsts = mgpu_topk.mgpu_topk_scores(qr, k, bounds, kp=4, span=256, splits=2, scale=None,
                                            config=mgpu_topk.Config(64, 64, 2),
                                            selection="segments", test_first=test_first,
                                            interpret=True)
  vals, idx = topk_segments.keys_of_segments(qr, k, bounds, vals, firsts, 4, scale=None,
                                             kv_layout="BTHD", interpret=True)
  v, i = ts_module._finish(vals, idx, 4, 32, 4)
  rv, ri = topk_scores(q, k, 4, exclude_prefix=3, valid_len=500, route=Route(backend="reference"))
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


def test_segments_with_the_warpgroup_test_lower_to_mosaic_gpu():
  qr = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 131072, 8, 128), jnp.bfloat16)
  bounds = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  f = lambda qr, k, bounds: mgpu_topk.mgpu_topk_scores(  # noqa: E731
      qr, k, bounds, kp=4, span=131072, splits=1, scale=None, selection="segments",
      test_first=True)
  assert "mosaic_gpu" in jax.jit(f).trace(qr, k, bounds).lower(
      lowering_platforms=("cuda",)).as_text()


def test_segments_stage2_by_xla_selects_as_the_kernel(monkeypatch):
  """Keys of 2^31 elements or more go to stage 2 by XLA (the Triton kernel's int32 offsets
  would overflow): here the limit lowered so that these keys pass it; the same picks, ties by
  lower key, as the Triton kernel (interpreted), both layouts and 8-bit keys."""
  from pallas_kernels import gpu, quant
  rng = np.random.default_rng(23)
  b, kvh, rows, d, t, n = 2, 2, 16, 64, 96, 32
  qr = small_ints(rng, (b, kvh, rows, d))
  keys = np.stack([rng.permutation(t)[:n] for _ in range(b * kvh * rows)]).reshape(b, kvh, rows, n)
  keys[..., 3:6] = -1
  keys = jnp.asarray(keys, jnp.int32)
  for kv_layout in ("BTHD", "BHTD"):
    k = small_ints(rng, keys_shape(b, t, kvh, d, kv_layout))
    for kk in (k, quant.quantize(k, "int8")):
      want = topk_segments.best_keys(qr, kk, keys, 4, scale=0.5, kv_layout=kv_layout,
                                     interpret=True)
      got = topk_segments.best_keys_xla(qr, kk, keys, 4, scale=0.5, kv_layout=kv_layout)
      # integer keys: exact; 8-bit ones times their scales: the sums' order differs, which may
      # swap two picks whose scores differ in the last bit
      order = (lambda x: x) if kk is k else (lambda x: np.sort(x, axis=-1))  # noqa: E731
      np.testing.assert_array_equal(order(np.asarray(got[1])), order(np.asarray(want[1])))
      np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]),
                                 rtol=0 if kk is k else 1e-6)
  monkeypatch.setattr(gpu, "MAX_TRITON_ELEMENTS", k.size - 1)
  assert not gpu.triton_indexable(k) and gpu.triton_indexable(k[:, :, :1])
