"""Every registered method declares what the drivers ask of it (methods/base.py)."""

import pytest

from jax_longctx.methods import Method, get, names


def test_the_registry_lists_two_kinds():
  assert sorted(names("layer") + names("mesh")) == names()
  assert names("mesh") == ["reattention_mesh", "resa_mesh", "ring", "star"]
  for n in names("mesh"):
    method = get(n)
    assert method.splits_tokens
    # Either the context and the query are encoded apart in blocks (Star, ring), or the whole
    # prompt streams through the chunked road over a sharded cache (mesh ReAttention, RESA).
    assert method.needs_instruction == method.encodes_context


@pytest.mark.parametrize("name", names())
def test_declared_capabilities_match_the_code(name):
  cls = type(get(name))
  assert issubclass(cls, Method)
  # The drivers run end_of_prefill only for methods that declare it.
  assert cls.ends_prefill == (cls.end_of_prefill is not Method.end_of_prefill)
  if cls.needs_instruction and not cls.encodes_context:  # instructed.py calls both
    assert cls.score_instruction is not Method.score_instruction
    assert cls.evict_by_instruction is not Method.evict_by_instruction
  if cls.encodes_context:  # context_encoding.py calls both
    assert cls.context_layout is not Method.context_layout
    assert cls.context_encoder is not Method.context_encoder


def test_every_method_class_is_exported_under_its_own_name():
  """`from jax_longctx.methods import RESA` reaches every registered class (issue 37)."""
  from jax_longctx import methods
  for n in names():
    cls = type(get(n))
    assert cls.__name__ in methods.__all__ and getattr(methods, cls.__name__) is cls, n
