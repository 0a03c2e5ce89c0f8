"""Method hyper-parameters given on the command line: typed checks before anything runs."""

import types
import typing

import pytest

from jax_longctx.app import cli
from jax_longctx.methods import MethodError, args_per_method, get, names, resolve_budget
from jax_longctx.methods.hparams import field_types

# A value of the wrong type for each kind of field, as a user would type it.
_WRONG = {"budget": "abc", int: "2.5", float: "abc", bool: "maybe", str: "3", tuple: "3",
          "literal": "'no-such-choice'"}


def _wrong_value(tp) -> str:
  args = typing.get_args(tp)
  if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None, X | Y: a wrong X
    return _wrong_value(next(a for a in args if a is not type(None)))
  if typing.get_origin(tp) is typing.Annotated:
    return _WRONG["budget"]
  if typing.get_origin(tp) is typing.Literal:
    return _WRONG["literal"]
  return _WRONG[tp]


_FIELDS = [(n, f) for n in names() for f in field_types(type(get(n)))]  # the constructors' fields


@pytest.mark.parametrize("name,field", _FIELDS, ids=[f"{n}.{f}" for n, f in _FIELDS])
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_every_field_with_a_wrong_type_is_a_one_line_error(name, field, command, capsys):
  value = _wrong_value(field_types(type(get(name)))[field])
  if command == "generate":
    argv = ["generate", "--prompt", "hi", "--method", name, "--method-arg", f"{field}={value}"]
  else:  # the method.key=value spelling; the error comes before the model or the task loads
    argv = ["eval", "--task", "passkey", "--methods", name, "--out", "/nonexistent",
            "--method-arg", f"{name}.{field}={value}"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0, err
  assert err.startswith(f"jax-longctx: error: method '{name}': {field}=") and "takes" in err, err


def test_the_reported_bad_inputs():
  for kw, msg in [({"budget": "abc"}, "budget='abc' is not valid"),
                  ({"budget": -5}, "-5 tokens is not >= 1"),
                  ({"budget": 2.5}, "a float above 1 is neither"),
                  ({"budget": True}, "budget=True is not valid"),
                  ({"window": 3.0}, "window takes an int"),
                  ({"windw": 3}, "has no hyper-parameter 'windw'; it takes: budget, keep_size")]:
    with pytest.raises(MethodError, match=msg):
      get("snapkv", **kw)
  with pytest.raises(MethodError, match=r"prior_distance=2.5 .*takes an int or None"):
    get("resa", base="reattention", prior_distance=2.5)
  assert get("resa", base="reattention", prior_distance=None).prior_distance is None
  with pytest.raises(MethodError, match="resa wraps a selecting method"):
    get("resa", base="snapkv")  # a wrong value, not only a wrong type, fails at construction
  with pytest.raises(MethodError, match="selection takes one of 'radix', 'sort'"):
    get("refreshkv", selection="heap")


def test_budget_rule_is_the_same_for_every_budget_field():
  assert resolve_budget(1.0, 100) == 100  # a float is a fraction: 1.0 is the whole cache
  assert resolve_budget(0.125, 100) == 13
  assert resolve_budget(1, 100) == 1  # an int counts tokens
  assert resolve_budget(101, 100) == 100  # a token budget above the cache keeps all of it
  budgeted = [n for n in names() if "budget" in field_types(type(get(n)))]
  assert len(budgeted) >= 10
  for n in budgeted:
    assert get(n, budget=1.0).budget == 1.0 and get(n, budget=3).budget == 3
    with pytest.raises(MethodError, match="budget takes a number of tokens"):
      get(n, budget=1.5)


def test_int_for_a_float_field_becomes_a_float():
  m = get("refreshkv", threshold=1)
  assert m.threshold == 1.0 and isinstance(m.threshold, float)


def test_both_spellings_reach_the_method():
  run = {"full": "full", "snapkv": "snapkv", "s2": "streaming_llm"}
  got = args_per_method(["budget=64", "snapkv.window=4", "s2.n_sink=2"], run)
  assert got == {"full": [], "snapkv": ["budget=64", "window=4"],
                 "s2": ["budget=64", "n_sink=2"]}
  with pytest.raises(MethodError, match="names method 'h2o', which is not in --method"):
    args_per_method(["h2o.budget=3"], {"snapkv": "snapkv"}, option="--method")


def test_generate_takes_the_method_dot_key_spelling(capsys):
  # A wrong value through the dotted spelling errors like the plain one: the routing reached it.
  assert cli.main(["generate", "--prompt", "hi", "--method", "snapkv",
                   "--method-arg", "snapkv.budget=abc"]) == 2
  assert "method 'snapkv': budget='abc'" in capsys.readouterr().err
  assert cli.main(["generate", "--prompt", "hi", "--method", "snapkv",
                   "--method-arg", "h2o.budget=3"]) == 2
  assert "not in --method (snapkv)" in capsys.readouterr().err
