"""Training and inference place by one table (core/mesh.py RULES through `spec_of`)."""

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jax_longctx.core.axes import EMBED, HEADS, KV_HEADS, ROWS, TOKENS
from jax_longctx.core.mesh import MeshError, ModelShards, make_mesh, spec_of
from jax_longctx.model import weight_spec
from tests.conftest import run_on_eight_devices, tiny_config


def _mesh(spec: str):
  sizes = dict(part.split("=") for part in spec.split(","))
  return make_mesh(AbstractMesh(tuple(int(s) for s in sizes.values()), tuple(sizes)))


def test_two_logical_axes_on_one_mesh_axis_are_refused_naming_both():
  with pytest.raises(MeshError, match="logical axes 'heads' and 'kv_heads' of one array both "
                                      "land on mesh axis 'model'"):
    spec_of((ROWS, HEADS, KV_HEADS), _mesh("data=2,model=4"))
  with pytest.raises(MeshError, match="'rows' and 'embed' .* mesh axis 'fsdp'"):
    spec_of((ROWS, EMBED), None)  # a declaration error on any mesh, split or not


def test_each_mesh_kind_sees_its_column():
  serve, train = _mesh("data=2,model=4"), _mesh("data=2,fsdp=4")
  assert spec_of((ROWS, HEADS, TOKENS, None), serve) == P("data", "model")
  assert spec_of((None, ROWS, None), train) == P(None, ("data", "fsdp"))
  assert weight_spec("q_proj", serve) == P(None, "model")  # [D, H, hd]: heads, D whole
  assert weight_spec("q_proj", train) == P("fsdp")  # its model dimension over fsdp
  assert weight_spec("o_proj", train) == P(None, None, "fsdp")  # [H, hd, D]
  assert weight_spec("gate_proj", serve) == P(None, "model")  # [D, F]: the hidden units
  assert weight_spec("gate_proj", train) == P(None, "fsdp")  # the same dimension in training
  assert weight_spec("embed", train, (128, 48)) == P("fsdp")
  assert weight_spec("embed", train, (97, 48)) == P()  # 4 does not divide 97: whole


def test_a_run_refuses_the_training_axis():
  with pytest.raises(MeshError, match="fsdp=2 is the training axis"):
    ModelShards.of(tiny_config(), _mesh("fsdp=2"))


def test_fsdp_placement_from_rules_matches_the_shape_probing_it_replaced():
  run_on_eight_devices("tests.helpers.fsdp_placement_checks", "placement")
