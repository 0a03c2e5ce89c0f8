"""Tensor- and data-parallel inference on 8 fake CPU devices (tests/test_tensor_parallel.py and
tests/test_tensor_parallel_layouts.py; the 8-bit and 4-bit caches: tests/test_kv_quant_mesh.py
and tests/test_kv_int4_mesh.py), the checks of a test file in one process of their own (the
device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.tensor_parallel_checks NAME...

Against one device, on the same weights: the same greedy tokens (the decode loop compiled
during the prefill, as on one device), prompt logits and teacher-forced NLL within fp32
rounding, and the same cache after decoding (every position a method kept, every score it ranked
by; KV heads copied on the mesh compared once). What runs
where, to keep CI short (each mesh compiles every step anew):
- every registered per-layer method on (data 2, model 4) of a model with 16 query and 2 KV heads
  (each KV head copied onto 2 shards, so a GQA group spans devices), the teacher-forced steps
  (the greedy loop runs the same per-token step; the checks below run it): `all_methods`;
- full, SnapKV, ReAttention and RefreshKV (one of each kind: exact, evicting at the end of
  prefill, selecting over a pre-RoPE cache, deciding from a layer's mean query) on (1, 8) of an
  8-head MHA model (one head a device) and on (4, 2) of the 16/2 model: `meshes_mha`,
  `meshes_gqa`;
- a Qwen2-style model (q/k/v biases, tied embeddings, a vocabulary of 101 padded to 104) on
  (2, 4) and a 9-head / 3-KV model (the default model's layout) on (2, 3), its evicting methods
  with budgets given as fractions of the cache: `qwen`, `nine`;
- the cache in 8 bits (int8 for every method, fp8 for two) on (2, 2) against one device with
  the same cache dtype, and mesh ReAttention's on (ctx 2, model 2): `quantized`; in 4 bits
  (every method that stores it) likewise: `quantized_int4`, and the mesh methods below over it:
  `mesh_methods_int4`; the HLO check below with an int8
  cache: `hlo_no_cache_gather_int8`;
- the mesh methods, Star and ring on (ctx 2, model 4), mesh ReAttention and RESA on it on
  (ctx 4, model 2), against ctx alone: `mesh_methods`;
- no all-gather of a cache's size in any method's compiled prefill chunk or decode loop:
  `hlo_no_cache_gather`; bad meshes: `errors`; fused projections per shard: `fused`;
- every method's steps on (2, 4) exported for TPU as 8-device programs: `tpu_export`.
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import quant4

from jax_longctx.core.mesh import MeshError, make_mesh
from jax_longctx.core.options import RunOptions
from jax_longctx.methods import get, names
from jax_longctx.model import fuse_placed, fuse_projections, place, random_params
from jax_longctx.ops.cache import is_int4_dtype
from jax_longctx.run import chunked_prefill, sharding
from jax_longctx.run import generation as gen
from jax_longctx.run.driver import generate
from jax_longctx.run.key_smoothing import smooth_keys
from tests.conftest import mesh_config
from tests.test_methods import CACHE_LEN, _apart, _method, _prompts
from tests.helpers import check_main
from tests.helpers.compiles import compiled_on

MODELS = {
    "mha": dict(num_heads=8, num_kv_heads=8, head_dim=8),
    "gqa": dict(num_heads=16, num_kv_heads=2, head_dim=8),
    "qwen": dict(num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True,
                 architecture="qwen2", tie_word_embeddings=True, vocab_size=101),
    "nine": dict(num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=36, intermediate_size=48),
}
BUDGET = 24  # tokens a bounded method keeps: below the prompts' lengths, so they evict/select
NEW = 4


def _model(name: str):
  cfg = mesh_config(**MODELS[name], max_position_embeddings=CACHE_LEN)
  return cfg, random_params(cfg, seed=1)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def same_state(one, many, what: str):
  """Caches equal leaf by leaf; a leaf whose KV-head dimension the mesh copied is compared on
  one copy of each head. Integer leaves (positions, slots) exactly, 8-bit cache values
  within one rounding step (on under 1% of them)."""
  for a, b in zip(jax.tree.leaves(_host(one)), jax.tree.leaves(_host(many))):
    for d, (x, y) in enumerate(zip(a.shape, b.shape)):
      if x != y:
        assert y % x == 0, (what, a.shape, b.shape)
        b = np.take(b, np.arange(0, y, y // x), axis=d)
    if a.dtype == np.uint8:  # a 4-bit cache's codes, two a byte: compared code by code
      a, b = (np.concatenate([x & 15, x >> 4], axis=-1).astype(np.int8) for x in (a, b))
    if a.dtype.itemsize == 1 and a.dtype != bool:  # an 8-bit cache's values: a float a hair
      int_values = np.issubdtype(a.dtype, np.integer)  # apart may round one step the other way
      a, b = a.astype(np.float32), b.astype(np.float32)
      np.testing.assert_allclose(a, b, atol=1 if int_values else 2 ** -9, rtol=0.125,
                                 err_msg=what)
      assert np.mean(a != b) < 1e-2, what
    elif np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
      np.testing.assert_array_equal(a, b, err_msg=what)
    else:
      np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4, err_msg=what)


def compare(model: str, mesh: str, methods, budget=BUDGET, kv_dtype=None, tokens=True) -> None:
  """Each method on `mesh` against one device (module doc); a fractional budget goes to the
  methods that evict (RATIO), the others keep BUDGET tokens; the cache is stored as kv_dtype on
  both. tokens=False leaves out the greedy generation (its decode loop compiles per method and
  mesh; the teacher-forced steps, logits and cache are still compared)."""
  cfg, params = _model(model)
  one_opts = RunOptions(prefill_chunk=8, kv_dtype=kv_dtype)
  opts = one_opts.replace(mesh=mesh)
  placed = place(params, cfg, opts.mesh)
  docs, ins = _apart(_prompts(cfg, (13, 21, 17, 26), seed=3))
  targets = np.random.default_rng(4).integers(0, cfg.vocab_size, (4, NEW)).astype(np.int32)
  for name in methods:
    m = _method(name, budget if name in RATIO or isinstance(budget, int) else BUDGET)
    what = f"{name} on {model} {mesh} {kv_dtype or ''}"
    run = lambda p, o: generate(p, cfg, docs, m, max_new_tokens=NEW, cache_len=CACHE_LEN,  # noqa
                                instructions=ins, options=o)
    if tokens:  # on the mesh the decode loop compiles during the prefill where it can
      want = run(params, one_opts).tokens
      with compiled_on("decode_loop") as threads:
        assert run(placed, opts).tokens == want, what
      ahead = not (m.ends_prefill or m.needs_instruction or m.encodes_context)
      assert threads == ["compile-ahead" if ahead else "MainThread"], (what, threads)
    caches = []
    for p, o in ((params, one_opts), (placed, opts)):
      cache, last = gen.prefill(p, cfg, docs, m, cache_len=CACHE_LEN, decode_room=NEW,
                                instructions=ins, options=o)
      nll, cache = gen.teacher_forced_nll(p, cache, last, jnp.asarray(targets), cfg=cfg,
                                          method=m, options=o)
      caches.append((np.asarray(last), np.asarray(nll), cache))
    (l1, n1, c1), (l2, n2, c2) = caches
    np.testing.assert_allclose(l1, l2, atol=1e-4, rtol=0, err_msg=what)
    np.testing.assert_allclose(n1, n2, atol=1e-4, rtol=0, err_msg=what)
    same_state(c1.state, c2.state, what)


FEW = ("full", "snapkv", "reattention", "refreshkv")


def all_methods():
  compare("gqa", "data=2,model=4", names("layer"), tokens=False)


def meshes(model: str, mesh: str):
  compare(model, mesh, FEW)


def qwen():
  compare("qwen", "data=2,model=4", ("full", "refreshkv", "citrus_shared", "quest"))


def nine():
  """The default model's layout over (data 2, model 3), every evicting method with its budget
  as a fraction of the cache (`budget=0.25`, how the papers and kvpress set budgets: a ratio
  once failed on a mesh, its state's shape changing with the cache length)."""
  compare("nine", "data=2,model=3", ("full",) + RATIO, budget=0.25)


# The evicting methods, whose budget as a fraction of the cache once broke on a mesh.
RATIO = ("snapkv", "h2o", "tova", "streaming_llm", "refreshkv", "citrus_shared")


# The quantized caches compare the teacher-forced steps only (logits, NLL and cache within 1e-4):
# the greedy loop runs the same per-token step under another loop, which `meshes`, `qwen` and
# `nine` check on a mesh.
def quantized():
  """The cache in 8 bits on (data 2, model 2): every per-layer method (budgets as fractions)
  with int8, two with fp8 (an exact method and one over pre-RoPE keys), as one device with the
  same cache (the scales split with their rows and heads); mesh ReAttention's on (ctx 2,
  model 2) as on ctx alone."""
  compare("gqa", "data=2,model=2", names("layer"), budget=0.5, kv_dtype="int8", tokens=False)
  compare("gqa", "data=2,model=2", ("full", "reattention"), budget=0.5,
          kv_dtype="float8_e4m3fn", tokens=False)
  cfg, params = _model("gqa")
  docs = _prompts(cfg, (37, 30), seed=5)
  m = get("reattention_mesh", n_global=2, n_local=8, span=2, clip=3, top_k=2, chunk=4)
  runs = [generate(params, cfg, docs, m, max_new_tokens=5, cache_len=64,
                   options=RunOptions(mesh=mesh, kv_dtype="int8"))
          for mesh in ("ctx=2", "ctx=2,model=2")]
  assert runs[0].tokens == runs[1].tokens
  same_state(runs[0].cache.state, runs[1].cache.state, "reattention_mesh int8")


def quantized_int4():
  """The cache in 4 bits on (data 2, model 2): every method that stores it (budgets as
  fractions), as one device with the same cache (the scales and zero points split with their
  rows and heads)."""
  compare("gqa", "data=2,model=2", [n for n in names("layer") if not get(n).int4_refusal],
          budget=0.5, kv_dtype="int4", tokens=False)


def smoothed():
  """Key smoothing and KV offsets calibrated on a mesh whose KV heads are copied (gqa, 2 KV
  heads, on model=4): what one device calibrates (each copy of a head the same), and with it
  the int8 cache's tokens, logits and cache as one device's; calibrated on a mesh with a ctx
  axis, the same, and mesh ReAttention's int8 run with it as on ctx alone."""
  cfg, params = _model("gqa")
  ids = _prompts(cfg, (40,), seed=6)[0]
  one, cfg_one = smooth_keys(params, cfg, ids)
  opts = RunOptions(prefill_chunk=8, kv_dtype="int8", mesh="data=2,model=4")
  many, cfg_many = smooth_keys(params, cfg, ids, opts)
  assert cfg_one == cfg_many and cfg_one.key_smoothing
  for i, layer in one["layers"].items():
    want = np.asarray(layer["attn"]["k_smooth"])
    got = np.asarray(many["layers"][i]["attn"]["k_smooth"])  # [KV x copies, hd]
    assert got.shape == (2 * want.shape[0], want.shape[1]), got.shape
    np.testing.assert_array_equal(got[::2], want, err_msg=f"layer {i}")
    np.testing.assert_array_equal(got[1::2], want, err_msg=f"layer {i}")
    for name in ("k_offset", "v_offset", "k_offset_before_rope"):  # means: summed in another order
      want = np.asarray(layer["attn"][name])
      got = np.asarray(many["layers"][i]["attn"][name])
      for copy in (got[::2], got[1::2]):
        np.testing.assert_allclose(copy, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {i}")
  docs = _prompts(cfg, (13, 21, 17, 26), seed=3)
  for name in ("full", "refreshkv", "reattention"):
    m = _method(name, BUDGET)
    runs = [generate(p, cfg_one, docs, m, max_new_tokens=NEW, cache_len=CACHE_LEN, options=o)
            for p, o in ((one, opts.replace(mesh=None)), (many, opts))]
    assert runs[0].tokens == runs[1].tokens, name
    same_state(runs[0].cache.state, runs[1].cache.state, f"{name} smoothed int8")
  # A mesh that splits the context (mesh ReAttention's, ctx 2 x model 2: no KV head copied):
  # the calibration (full attention) runs on one context shard's devices, as one device's.
  on_ctx, cfg_ctx = smooth_keys(params, cfg, ids, RunOptions(mesh="ctx=2,model=2"))
  assert cfg_ctx == cfg_one
  for i, layer in one["layers"].items():
    for name in ("k_smooth", "k_offset", "v_offset", "k_offset_before_rope"):
      np.testing.assert_allclose(np.asarray(on_ctx["layers"][i]["attn"][name]),
                                 np.asarray(layer["attn"][name]), rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} {i} on ctx")
  m = get("reattention_mesh", n_global=2, n_local=8, span=2, clip=3, top_k=2, chunk=4)
  runs = [generate(p, cfg_one, docs[:2], m, max_new_tokens=NEW, cache_len=CACHE_LEN,
                   options=RunOptions(mesh=mesh, kv_dtype="int8"))
          for p, mesh in ((one, "ctx=2"), (on_ctx, "ctx=2,model=2"))]
  assert runs[0].tokens == runs[1].tokens
  same_state(runs[0].cache.state, runs[1].cache.state, "reattention_mesh smoothed int8")


def mesh_methods(kv_dtype=None, only=None):
  """star, ring, reattention_mesh and resa_mesh (or the `only` of them) with the heads over
  `model` too: the tokens and logits of the context axis alone (which tests/test_distributed.py
  and test_reattention_mesh.py check against one device), the cache stored as kv_dtype on both.
  Each method on one of two layouts (each compiles anew). In 4 bits every shard and Star block
  holds whole key groups of G: a cache of 4 G (G a shard over ctx 4), Star's blocks of G."""
  cfg, params = _model("gqa")
  rng = np.random.default_rng(5)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 30)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 3)]
  settings = dict(n_global=2, n_local=8, span=2, clip=3, top_k=2, chunk=4)
  four_bit = is_int4_dtype(kv_dtype)
  group = quant4.format_of(kv_dtype).group if four_bit else 8
  cache_len = 4 * group if four_bit else 64
  entries = [((2, 4), get("star", block_size=group)), ((2, 4), get("ring")),
             ((4, 2), get("reattention_mesh", **settings)),
             ((4, 2), get("resa_mesh", base_args=tuple(settings.items()), lam=0.7))]
  for (ctx, model), m in entries:
    if only is not None and m.name not in only:
      continue
    runs = [generate(params, cfg, contexts, m, instructions=queries, max_new_tokens=5,
                     cache_len=cache_len, options=RunOptions(mesh=mesh, kv_dtype=kv_dtype))
            for mesh in (f"ctx={ctx}", f"ctx={ctx},model={model}")]
    what = f"{m.name} ctx={ctx} model={model} {kv_dtype or ''}"
    assert runs[1].tokens == runs[0].tokens, (what, runs[1].tokens, runs[0].tokens)
    if runs[1].cache is not None:
      same_state(runs[0].cache.state, runs[1].cache.state, what)
      codes = [x for x in jax.tree.leaves(runs[1].cache.state) if x.dtype == jnp.uint8]
      assert bool(codes) == four_bit, what  # the run stored what it was asked to


def mesh_methods_int4():
  """mesh_methods over the 4-bit cache: its codes, scales, zero points and residual split with
  the heads over `model` as with the tokens over `ctx`; mesh ReAttention in the compact format
  too (groups of 64, fp16 scales)."""
  mesh_methods("int4")
  mesh_methods("int4_g64_fp16", only=("reattention_mesh",))


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "u32": 4, "s8": 1, "u8": 1}


def _gathers(hlo: str) -> list[int]:
  """Bytes each all-gather (or async all-gather start) of a compiled program's HLO writes:
  '%x = f32[2,8,1024,8]{3,2,1,0} all-gather(...)', a tuple of shapes for a combined one."""
  sizes = []
  for line in hlo.splitlines():
    head, found, _ = line.partition(" all-gather")
    if not found or "=" not in head:
      continue
    result = head.split("=", 1)[1]
    sizes.append(sum(_BYTES.get(t, 4) * int(np.prod([int(n) for n in d.split(",") if n] or [1]))
                     for t, d in _SHAPE.findall(result)))
  return sizes


def hlo_no_cache_gather(kv_dtype=None):
  """Every per-layer method's compiled prefill chunk and decode loop on (data 2, model 4): no
  all-gather as large as one layer's K (or V) cache on one device (an 8-bit one: its 8-bit
  values); the gathers left are the logits' vocabulary slices and the methods' head reductions
  (ReAttention's votes)."""
  cfg, params = _model("gqa")
  cache_len, batch = 1024, 4
  opts = RunOptions(prefill_chunk=8, mesh="data=2,model=4", kv_dtype=kv_dtype)
  placed = place(params, cfg, opts.mesh)
  # one layer's K on one device: its rows, its KV head, every slot
  limit = (batch // 2) * 1 * cache_len * cfg.head_dim * (4 if kv_dtype is None else 1)
  for name in names("layer"):
    m = _method(name, 40)
    cache = sharding.empty_cache(cfg, m, batch, cache_len, 8, opts)
    tokens = jnp.zeros((batch, 8), jnp.int32)
    plen = jnp.full((batch,), 8, jnp.int32)
    last = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    prefill = chunked_prefill.prefill_step.lower(
        placed, tokens, jnp.int32(0), plen, cache, last, cfg=cfg, method=m, options=opts)
    sizes = _gathers(prefill.compile().as_text())
    ended = jax.eval_shape(lambda c: chunked_prefill.end_prefill(c, cfg, m, 8, opts), cache)
    decode = gen.decode_loop.lower(placed, ended, last, jnp.zeros((1,), jnp.int32),
                                   gen.row_keys(0, batch), cfg=cfg, method=m, max_new_tokens=4,
                                   sampling=gen.Sampling(), options=opts)
    sizes += _gathers(decode.compile().as_text())
    assert max(sizes, default=0) < limit, (name, sorted(sizes)[-3:], limit)
  # The check sees what it must refuse: a step that gathers one layer's K over the heads.
  bad = jax.jit(jax.shard_map(
      lambda c: jax.lax.all_gather(c, "model", axis=1, tiled=True), mesh=opts.mesh,
      in_specs=(jax.sharding.PartitionSpec("data", "model"),),
      out_specs=jax.sharding.PartitionSpec("data"), check_vma=False))
  kv = jnp.zeros((batch, 2 * 4, cache_len, cfg.head_dim), jnp.float32)
  assert max(_gathers(bad.lower(kv).compile().as_text())) >= limit


def errors():
  cfg, params = _model("gqa")
  for spec, words in (("data=4,model=4", "needs 16 devices, but 8"),
                      ("data=2,tensor=2", "unknown mesh axis 'tensor'"),
                      ("model=0", "model=0"), ("model", "not axis=size")):
    try:
      make_mesh(spec)
    except MeshError as e:
      assert words in str(e) and "\n" not in str(e), (spec, e)
    else:
      raise AssertionError(spec)
  nine_cfg, nine_params = _model("nine")
  for spec, words in (("model=2", "num_heads=9 does not divide over model=2"),):
    try:
      generate(nine_params, nine_cfg, [[1, 2, 3]], get("full"), max_new_tokens=1,
               options=RunOptions(mesh=spec))
    except MeshError as e:
      assert words in str(e), e
    else:
      raise AssertionError(spec)
  try:  # per-layer methods do not take the context axis
    generate(params, cfg, [[1, 2, 3]], get("full"), max_new_tokens=1,
             options=RunOptions(mesh="ctx=2,model=2"))
  except MeshError as e:
    assert "ctx=2 is for the methods that split the context" in str(e), e
  else:
    raise AssertionError("ctx")


def fused():
  """The serving layout on a mesh (fused per shard) decodes as the unfused weights do."""
  cfg, params = _model("gqa")
  for mesh in ("model=8", "data=2,model=4"):
    opts = RunOptions(prefill_chunk=8, mesh=mesh)
    placed = place(params, cfg, opts.mesh)
    docs = _prompts(cfg, (13, 21), seed=6)
    plain = generate(placed, cfg, docs, get("full"), max_new_tokens=5, options=opts)
    fused_placed = fuse_placed(placed, opts.mesh)
    layer, was = next(iter(fused_placed["layers"].values())), next(iter(placed["layers"].values()))
    # only the fused weights are new buffers (a copy of the rest once held two models at once)
    assert layer["mlp"]["down_proj"] is was["mlp"]["down_proj"], mesh
    assert layer["attn_norm"]["scale"] is was["attn_norm"]["scale"], mesh
    # the transposed output projection splits along its heads, as o_proj did
    heads = jax.sharding.NamedSharding(make_mesh(opts.mesh),
                                       jax.sharding.PartitionSpec(None, "model", None))
    assert layer["attn"]["o_proj_t"].sharding.is_equivalent_to(heads, 3), mesh
    both = generate(fused_placed, cfg, docs, get("full"), max_new_tokens=5, options=opts)
    again = place(params, cfg, opts.mesh)  # consumed as serving_params does on a GPU: the
    consumed = fuse_placed(again, opts.mesh, consume=True)  # parts freed, the same weights
    assert next(iter(again["layers"].values()))["attn"]["q_proj"].is_deleted(), mesh
    assert next(iter(again["layers"].values()))["attn"]["o_proj"].is_deleted(), mesh
    jax.tree.map(np.testing.assert_array_equal, consumed, fused_placed)
    one = generate(fuse_projections(params), cfg, docs, get("full"), max_new_tokens=5)
    assert plain.tokens == both.tokens == one.tokens, mesh
  # every decode switch (benchmarks/decode.py --run-option / --kernel-option) per shard, the GPU
  # kernels interpreted (a width of 64: the add + norm kernel takes powers of two): the same tokens
  cfg = mesh_config(**MODELS["gqa"], hidden_size=64, max_position_embeddings=CACHE_LEN)
  params = random_params(cfg, seed=1)
  one = generate(fuse_projections(params), cfg, docs, get("full"), max_new_tokens=5)
  switches = RunOptions(prefill_chunk=8, mesh="data=2,model=4", route=pallas_kernels.Route(
      cache_write_backend="gpu", add_norm_backend="gpu", backend="gpu", prefill_kernel=False,
      decode_kernel=True, kernels=pallas_kernels.KernelOptions(
          decode_merge_kernel=True, decode_q_in_kernel=True)))
  switched = generate(fuse_placed(place(params, cfg, switches.mesh), switches.mesh), cfg, docs,
                      get("full"), max_new_tokens=5, options=switches)
  assert switched.tokens == one.tokens, (switched.tokens, one.tokens)
  # Weights fused on one device (what a process of a one-process-per-GPU run serves) go to a mesh
  # that does not split the model as they are; one that splits it needs them placed first.
  one_device = fuse_projections(params)
  queries = _prompts(cfg, (4, 5), seed=7)
  for mesh, method in (("data=8", get("full")), ("data=2,ctx=4", get("star"))):
    opts = RunOptions(prefill_chunk=8, mesh=mesh)
    spread, want = (generate(p, cfg, docs, method, instructions=queries, max_new_tokens=5,
                             options=opts) for p in (one_device, params))
    assert spread.tokens == want.tokens, mesh
  try:
    place(one_device, cfg, "model=2")
  except MeshError as e:
    assert "place the weights before fusing them on a mesh that splits the model" in str(e), e
  else:
    raise AssertionError("fused weights placed over model=2")


def tpu_export():
  from tests.test_tpu_export_methods import tensor_parallel_exports
  tensor_parallel_exports()


CHECKS = {"tpu_export": tpu_export, "all_methods": all_methods,
          "meshes_mha": lambda: meshes("mha", "model=8"),
          "meshes_gqa": lambda: meshes("gqa", "data=4,model=2"), "qwen": qwen, "nine": nine,
          "mesh_methods": mesh_methods, "hlo_no_cache_gather": hlo_no_cache_gather,
          "errors": errors, "fused": fused,
          "quantized": quantized, "quantized_int4": quantized_int4,
          "mesh_methods_int4": mesh_methods_int4,
          "hlo_no_cache_gather_int8": lambda: hlo_no_cache_gather("int8"),
          "smoothed": smoothed}

if __name__ == "__main__":
  check_main.main(CHECKS, sys.argv[1:])
