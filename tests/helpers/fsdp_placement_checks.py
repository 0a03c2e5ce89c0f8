"""Training placement from core/mesh.py RULES against the shape probing train_cpt/sharding.py did
before (tests/test_fsdp_placement.py), on 8 fake CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.fsdp_placement_checks NAME...
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_longctx.core.config import preset
from jax_longctx.model import abstract_model
from tests.conftest import tiny_config
from tests.helpers import check_main
from train_cpt import sharding
from train_cpt import state as state_lib
from train_cpt.config import load_config
from train_cpt.optimizer import optimizer


# --- REFERENCE: the placement train_cpt/sharding.py made before RULES placed training (copied
# --- from it as it was, kept here only to compare against; the library no longer has it).
def reference_param_sharding(mesh, shape) -> NamedSharding:
  n = mesh.shape["fsdp"]
  dims = [i for i in np.argsort(shape)[::-1] if shape[i] % n == 0 and shape[i] >= n] \
      if n > 1 else []
  spec = [None] * len(shape)
  if dims:
    spec[int(dims[0])] = "fsdp"
  return NamedSharding(mesh, P(*spec))
# --- end of REFERENCE


# Where RULES place otherwise, and why (the report of issue 73 part 4): left whole, where the
# reference split another dimension. A vocabulary fsdp does not divide (97 here; every preset's
# divides 8): the embeddings whole, not split along the model dimension beside their vocabulary
# split (one array splits one dimension over fsdp). A q/k/v bias [heads, head_dim]: its heads are
# over `model` only, so whole in training (12 x 128 values a layer at the 1.5B shape).
WHOLE = {"tiny": {"embed", "lm_head"}, "qwen2.5-coder-1.5b": {"q_bias", "k_bias", "v_bias"}}


def _weight_name(path) -> str:
  key = path[-1]
  return str(getattr(key, "key", key))


def _state_shapes(model_cfg, moments_dtype):
  cfg = load_config(None, {"moments_dtype": moments_dtype})
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                        abstract_model(model_cfg)[1])
  return {"params": shapes, "opt_state": jax.eval_shape(optimizer(cfg).init, shapes)}


def placement():
  models = {"tiny (the cpt job's)": tiny_config(vocab_size=49152, max_position_embeddings=256),
            "tiny": tiny_config(), "llama-3.1-8b": preset("llama-3.1-8b"),  # the 2-GPU benchmark's
            "qwen2.5-coder-1.5b": preset("qwen2.5-coder-1.5b")}
  meshes = {"fsdp=8": (0, 8), "data=2,fsdp=4": (4, 8), "fsdp=2": (0, 2)}
  same, whole = 0, set()
  for model_name, model_cfg in models.items():
    for mesh_name, (fsdp, n) in meshes.items():
      cfg = load_config(None, {"fsdp": fsdp, "micro_batch": n, "global_batch": n})
      mesh = state_lib.training_mesh(cfg, jax.devices()[:n])
      assert dict(mesh.shape) == {"data": n // (fsdp or n), "fsdp": fsdp or n, "model": 1,
                                  "ctx": 1}, mesh.shape
      tree = _state_shapes(model_cfg, "bfloat16")
      got = sharding.shard_like_params(mesh, tree)

      def check(path, x, new):
        nonlocal same
        old = reference_param_sharding(mesh, tuple(x.shape))
        if new.is_equivalent_to(old, len(x.shape)):
          same += 1
          return
        where = f"{model_name} on {mesh_name}: {jax.tree_util.keystr(path)} {tuple(x.shape)}"
        assert _weight_name(path) in WHOLE.get(model_name, ()), (where, new.spec, old.spec)
        assert new.spec == P(), (where, new.spec)
        whole.add((model_name, _weight_name(path)))

      jax.tree_util.tree_map_with_path(check, tree, got)
  print(f"{same} leaves placed as before; left whole: {sorted(whole)}")
  assert whole == {(m, w) for m, ws in WHOLE.items() for w in ws}  # the table is not stale


CHECKS = {"placement": placement}

if __name__ == "__main__":
  assert len(jax.devices()) >= 8, f"needs 8 devices, got {len(jax.devices())}"
  check_main.main(CHECKS, sys.argv[1:])
