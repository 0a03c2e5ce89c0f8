"""Every registered method's steps on a tiny model, exported for TPU from this CPU machine
(pallas_kernels.lowering_for): the Mosaic lowering of the kernels each method calls, with the
shapes and layouts the method hands them, fails here and not first on a TPU. Shapes only:
nothing runs (tests/kernels/test_tpu_export.py does the kernels alone; docs/KERNELS.md says what
an export does and does not prove).

Per-layer methods: a prefill chunk, a decode step (each gate value when the method has a decode
gate), and the end-of-prefill hook where there is one (RESA's prior runs flash_attention there).
Mesh methods: Star's / ring's phase 1 (the context encoded over the mesh axis) and phase 2 (the
query and the decode loop), mesh ReAttention's (and RESA's over it) steps, on a real 1-device
mesh and on an abstract 4-device one. Tensor parallel: every method's steps on (data 2, model 4)
of this process's 8 CPU devices (tests/helpers/tensor_parallel_checks.py `tpu_export`).

KERNEL_STEPS is exact both ways: a step that should reach a kernel but exports without a Mosaic
call (silently on the jnp reference) fails, and so does a new or changed method whose step
starts calling kernels without being listed here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jax_longctx.core.mesh import ModelShards
from jax_longctx.core.options import RunOptions
from jax_longctx.methods import Method, get, names
from jax_longctx.model import abstract_model, forward, new_cache
from jax_longctx.core.mesh import specs
from jax_longctx.model import param_specs
from jax_longctx.run import sharding
from jax_longctx.run.chunked_prefill import end_prefill, prefill_step
from jax_longctx.run.context_encoding import _rows, encode_blocks
from jax_longctx.run.generation import Sampling, decode_loop, row_keys
from tests.conftest import tiny_config
from tests.test_methods import _method
from tests.helpers.tpu_export import export_for_tpu, mosaic_calls

S = jax.ShapeDtypeStruct
# bf16 and a head dim of 64 as on a TPU; a cache past one 256-key tile, not a multiple of it.
CFG = tiny_config(dtype="bfloat16", head_dim=64)
BATCH, CACHE_LEN, CHUNK, BUDGET = 2, 300, 16, 32

# The per-layer steps that run a Pallas kernel on a TPU (found by these exports, and why):
# prefill chunks of full and of the methods whose prefill is full's (Quest, top-k and RESA over
# them, SnapKV, RefreshKV) go to chunk_attention; ReAttention votes with topk_scores and attends
# with flash_attention in its chunks and gathers its scope in decode; RefreshKV's decode steps
# use gathered_attention; RESA's end-of-prefill hook computes its prior with flash_attention.
# Decode of full and its kin keeps the jnp path (measured at 78% of the HBM bound).
KERNEL_STEPS = {
    "full": {"prefill"},
    "quest": {"prefill"},
    "topk": {"prefill"},
    "snapkv": {"prefill"},
    "resa": {"prefill", "end_of_prefill"},
    "refreshkv": {"prefill", "decode"},
    "reattention": {"prefill", "decode"},
}
MESHES = {"1_device": lambda: Mesh(np.array(jax.devices()[:1]), ("ctx",)),
          "abstract_4": lambda: AbstractMesh((4,), ("ctx",))}


def _setup(name):
  method = _method(name, BUDGET)
  chunk = method.prefill_chunk or CHUNK
  cache = jax.eval_shape(lambda: new_cache(CFG, method, BATCH, CACHE_LEN, chunk=chunk))
  return method, chunk, abstract_model(CFG)[1], cache


def _expect(name, step, exported):
  calls = mosaic_calls(exported)
  if step in KERNEL_STEPS.get(name, ()):
    assert calls > 0, f"{name} {step}: no Mosaic kernel in the TPU export (reference path?)"
  else:
    assert calls == 0, f"{name} {step}: {calls} Mosaic kernel(s); add it to KERNEL_STEPS"


@pytest.mark.parametrize("name", names("layer"))
def test_prefill_chunk_exports_for_tpu(name):
  method, chunk, params, cache = _setup(name)

  def step(params, tokens, start, lengths, cache, last):
    return prefill_step(params, tokens, start, lengths, cache, last, cfg=CFG, method=method)

  exported = export_for_tpu(step, params, S((BATCH, chunk), jnp.int32), S((), jnp.int32),
                            S((BATCH,), jnp.int32), cache, S((BATCH, CFG.vocab_size), jnp.float32))
  _expect(name, "prefill", exported)


@pytest.mark.parametrize("name", [n for n in names("layer") if get(n).ends_prefill])
def test_end_of_prefill_exports_for_tpu(name):
  method, _, _, cache = _setup(name)
  exported = export_for_tpu(lambda c: end_prefill(c, CFG, method, decode_room=8), cache)
  _expect(name, "end_of_prefill", exported)


@pytest.mark.parametrize("name", names("layer"))
def test_decode_step_exports_for_tpu(name):
  method, _, params, cache = _setup(name)
  # The cache as decoding gets it: after the end-of-prefill hook (SnapKV compresses there).
  cache = jax.eval_shape(lambda c: end_prefill(c, CFG, method, decode_room=8), cache)
  # With a decode gate, each gate value compiles a step of its own (generation.decode_while).
  gated = type(method).decode_gate is not Method.decode_gate
  for gate_open in (True, False) if gated else (True,):

    def step(params, tokens, cache):
      return forward(params, tokens, cache.lengths[:, None], cache, method, CFG, decode=True,
                     logits_index=jnp.zeros((BATCH,), jnp.int32), gate_open=gate_open)

    _expect(name, "decode", export_for_tpu(step, params, S((BATCH, 1), jnp.int32), cache))


@pytest.mark.parametrize("name", ["full", "reattention"])
def test_steps_over_a_4_bit_cache_export_for_tpu(name):
  """A prefill chunk and a decode step over the 4-bit cache (each kernel reading a bf16 copy of
  the layer's buffers, pallas_kernels/read.py): the same Mosaic kernels as over bf16."""
  method = _method(name, BUDGET)
  chunk = method.prefill_chunk or CHUNK
  cache = jax.eval_shape(lambda: new_cache(CFG, method, BATCH, CACHE_LEN, "int4", chunk=chunk))
  params = abstract_model(CFG)[1]

  def prefill(params, tokens, start, lengths, cache, last):
    return prefill_step(params, tokens, start, lengths, cache, last, cfg=CFG, method=method)

  def decode(params, tokens, cache):
    return forward(params, tokens, cache.lengths[:, None], cache, method, CFG, decode=True,
                   logits_index=jnp.zeros((BATCH,), jnp.int32))

  _expect(name, "prefill", export_for_tpu(
      prefill, params, S((BATCH, chunk), jnp.int32), S((), jnp.int32), S((BATCH,), jnp.int32),
      cache, S((BATCH, CFG.vocab_size), jnp.float32)))
  _expect(name, "decode", export_for_tpu(decode, params, S((BATCH, 1), jnp.int32), cache))


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", [n for n in names("mesh") if get(n).encodes_context])
def test_mesh_method_phases_export_for_tpu(name, mesh):
  """Phase 1 (the context's blocks encoded over the mesh axis) and phase 2 (the decode loop over
  them). On the abstract mesh each device's kernels get their share of the context and ring's
  K/V go around 4 devices; that export says mhlo.num_partitions = 1 beside a 4-device sdy mesh,
  so it checks lowering, it is not an artifact to deploy."""
  for phase, exported in _phase_exports(name, CFG, MESHES[mesh]()).items():
    assert mosaic_calls(exported) > 0, f"{name} {phase}: no Mosaic kernel"


def _laid(mesh, tree, specs):
  """Abstract values as the steps take them on a mesh of devices (an abstract mesh: as given)."""
  if not isinstance(mesh, Mesh):
    return tree
  return jax.tree.map(lambda x, p: S(x.shape, x.dtype, sharding=NamedSharding(mesh, p)), tree,
                      specs, is_leaf=lambda x: isinstance(x, P))


def _phase_exports(name, cfg, mesh):
  """Star's / ring's phase 1 and phase 2 exported on `mesh` (on a (ctx, model) mesh each
  device's blocks of its heads, the weights placed)."""
  options = RunOptions(mesh=mesh)
  method, mesh = get(name), options.mesh
  params = abstract_model(ModelShards.of(cfg, mesh).placed(cfg))[1]
  params = _laid(mesh, params, param_specs(params))
  lengths = np.asarray([CACHE_LEN, 111], np.int32)
  lay = method.context_layout(CACHE_LEN, mesh.shape["ctx"])
  rows = [S(x.shape, x.dtype) for x in _rows(np.zeros((BATCH, lay.n_blocks * lay.block),
                                                     np.int32), lengths, lay)]
  rows = [_laid(mesh, x, P(None, "ctx") if mesh.shape["ctx"] > 1 else P()) for x in rows]

  def phase1(params, *rows):
    return encode_blocks(params, *rows, cfg=cfg, method=method, layout=lay, room=12,
                         options=options)

  rows.append(_laid(mesh, S((BATCH,), jnp.int32), P()))  # the context lengths
  out = {"phase 1": export_for_tpu(phase1, params, *rows)}
  cache = jax.eval_shape(phase1, params, *rows)
  cache = _laid(mesh, cache, specs(cache, mesh))
  out["phase 2"] = export_for_tpu(
      lambda p, c, last, stops, keys: decode_loop(p, c, last, stops, keys, cfg=cfg,
                                                  method=method, max_new_tokens=4,
                                                  sampling=Sampling(), options=options),
      params, cache, S((BATCH, cfg.vocab_size), jnp.float32), S((1,), jnp.int32),
      jax.eval_shape(lambda: row_keys(0, BATCH)))
  return out


def _mesh_steps(method, cfg, options, cache_len, chunk):
  """Exports of a prefill chunk, the end-of-prefill hook (where there is one) and the decode
  loop as they run on options.mesh: each device's step under shard_map (run/sharding.py). On a
  mesh of devices the inputs carry their shardings, so the export is the program for that many
  devices; an abstract mesh checks the lowering only."""
  mesh = options.mesh
  laid = lambda tree, specs: _laid(mesh, tree, specs)  # noqa: E731
  rows = lambda x: laid(x, P("data"))  # noqa: E731
  cache = jax.eval_shape(lambda: sharding.empty_cache(cfg, method, BATCH, cache_len, chunk,
                                                       options))
  cache = laid(cache, specs(cache, mesh))
  params = abstract_model(ModelShards.of(cfg, mesh).placed(cfg))[1]
  params = laid(params, param_specs(params))
  i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
  last = rows(S((BATCH, cfg.vocab_size), jnp.float32))
  out = {"prefill": export_for_tpu(
      lambda p, t, s, n, c, last: prefill_step(p, t, s, n, c, last, cfg=cfg, method=method,
                                               options=options),
      params, rows(i32(BATCH, chunk)), i32(), rows(i32(BATCH)), cache, last)}
  end = lambda c: end_prefill(c, cfg, method, decode_room=8, options=options)  # noqa: E731
  if method.ends_prefill:
    out["end_of_prefill"] = export_for_tpu(end, cache)
  ended = jax.eval_shape(end, cache)
  ended = laid(ended, specs(ended, mesh))
  out["decode"] = export_for_tpu(
      lambda p, c, last, stops, keys: decode_loop(p, c, last, stops, keys, cfg=cfg,
                                                  method=method, max_new_tokens=4,
                                                  sampling=Sampling(), options=options),
      params, ended, last, i32(1), rows(jax.eval_shape(lambda: row_keys(0, BATCH))))
  return out


def _sharded_settings(name):
  settings = tuple(_method("reattention", BUDGET).hparams().items())
  return (get(name, **dict(settings)) if name == "reattention_mesh"
          else get(name, base_args=settings))


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", [n for n in names("mesh") if not get(n).encodes_context])
def test_sharded_steps_export_for_tpu(name, mesh):
  """Mesh ReAttention's (and RESA over it) chunk and decode steps per device under shard_map, the
  cache split along the tokens over the mesh axis: their kernels (topk_scores on the shard,
  flash / gathered attention on the shard's part of the scope; RESA's prior over each shard at
  the end of prefill) lower for TPU with the shard's shapes."""
  method = _sharded_settings(name)
  options = RunOptions(mesh=MESHES[mesh]())
  # 80 slots per device on the abstract mesh
  for step, exported in _mesh_steps(method, CFG, options, 320, method.prefill_chunk).items():
    assert mosaic_calls(exported) > 0, f"{name} {step}: no Mosaic kernel"


# Tensor parallel: 8 query heads over model=4 (2 KV heads, each copied onto 2 shards), rows over
# data=2, on 8 devices (a TPU v5e-8's count).
TP_CFG = tiny_config(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2)


def tensor_parallel_exports():
  """Every per-layer method's prefill chunk, end-of-prefill hook and decode loop as they run on a
  (data 2, model 4) mesh of this process's 8 (CPU) devices, each device's heads, weights and
  rows under shard_map: exported for TPU as 8-device programs, with the same kernels as on one
  device (KERNEL_STEPS); every mesh method's steps or phases on (ctx 2, model 4) likewise. Run
  by tests/helpers/tensor_parallel_checks.py `tpu_export`."""
  options = RunOptions(mesh="data=2,model=4")
  for name in names("layer"):
    method = _method(name, BUDGET)
    exported = _mesh_steps(method, TP_CFG, options, CACHE_LEN, method.prefill_chunk or CHUNK)
    for step, e in exported.items():
      _expect(name, step, e)
      assert e.nr_devices == 8, (name, step, e.nr_devices)
  # The mesh methods on (ctx 2, model 4): mesh ReAttention's steps, Star's and ring's phases.
  options = RunOptions(mesh="ctx=2,model=4")
  for name in names("mesh"):
    if get(name).encodes_context:
      exported = _phase_exports(name, TP_CFG, options.mesh)
    else:
      method = _sharded_settings(name)
      exported = _mesh_steps(method, TP_CFG, options, 320, method.prefill_chunk)
    for step, e in exported.items():
      assert mosaic_calls(e) > 0 and e.nr_devices == 8, (name, step, e.nr_devices)
