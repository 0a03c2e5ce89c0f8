"""Every kernel call of a method takes the run's route (pallas_kernels.Route, RunOptions.route).

Two checks: a static scan of jax_longctx/methods, ops and model for calls of the public kernels
(and of the helpers that hand a route on to them), each of which must pass `route=` from the
run's options or a parameter, never a Route built on the spot; and a run of every layer method
(prefill, then decode steps) whose kernels record the route they are handed, which must be the
run's. A call that drops the route is a TypeError (`route` is a required keyword), one that
builds its own is found by both checks.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jax_longctx.core.options import RunOptions
from jax_longctx.methods import names
from jax_longctx.model import forward
from jax_longctx.run import generation as gen
from pallas_kernels import KernelOptions, Route
from pallas_kernels.decode import add_rmsnorm, cache_write
from tests.test_methods import CACHE_LEN, _apart, _method, _prompts

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("jax_longctx/methods", "jax_longctx/ops", "jax_longctx/model")
# The public kernels, and the library's functions that take a route to hand on to them.
KERNELS = {"flash_attention", "chunk_attention", "gathered_attention", "topk_scores",
           "add_rms_norm", "write_one_token"}
ROUTED = KERNELS | {"ring_attention", "candidates", "vote", "select_scope", "scope_from_votes",
                    "add_and_norm"}


def _kernel_names(tree) -> set[str]:
  """Names a file binds to pallas_kernels' modules or kernels (import ... as ...)."""
  bound = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pallas_kernels"):
      bound |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Import):
      bound |= {a.asname or a.name for a in node.names if a.name.startswith("pallas_kernels")}
  return bound


def _is_routed_call(call: ast.Call, bound: set[str]) -> bool:
  f = call.func
  if isinstance(f, ast.Name):
    return f.id in ROUTED - KERNELS or (f.id in KERNELS and f.id in bound)
  if isinstance(f, ast.Attribute) and f.attr in ROUTED:
    base = f.value
    while isinstance(base, ast.Attribute):
      base = base.value
    if f.attr in KERNELS:
      return isinstance(base, ast.Name) and base.id in bound
    return True  # e.g. self.attn_norm.add_and_norm(...)
  return False


def route_violations(source: str, path: str = "<src>") -> list[str]:
  """Kernel calls in `source` without a `route=` taken from the run (a name or an attribute
  such as ctx.options.route, not a call)."""
  tree = ast.parse(source)
  bound = _kernel_names(tree)
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call) or not _is_routed_call(node, bound):
      continue
    name = ast.unparse(node.func)
    route = next((k.value for k in node.keywords if k.arg == "route"), None)
    if route is None:
      if any(k.arg is None for k in node.keywords):
        continue  # **kw handed on: the caller's own keywords (checked where it is called)
      out.append(f"{path}:{node.lineno} {name}(...) passes no route=")
    elif not isinstance(route, (ast.Name, ast.Attribute)):
      out.append(f"{path}:{node.lineno} {name}(route={ast.unparse(route)}): not the run's route")
  return out


def test_every_kernel_call_passes_the_runs_route():
  found, calls = [], 0
  for folder in SCANNED:
    for path in sorted((ROOT / folder).glob("*.py")):
      src = path.read_text()
      found += route_violations(src, str(path.relative_to(ROOT)))
      tree = ast.parse(src)
      bound = _kernel_names(tree)
      calls += sum(isinstance(n, ast.Call) and _is_routed_call(n, bound) for n in ast.walk(tree))
  assert found == []
  assert calls >= 20  # the scan sees the calls (a renamed kernel would hide them)


def test_the_scan_finds_a_dropped_or_fresh_route():
  src = ("import pallas_kernels\n"
         "def f(q, k, v, ctx):\n"
         "  a = pallas_kernels.gathered_attention(q, k, v, i, kv_layout='BHTD')\n"
         "  b = pallas_kernels.flash_attention(q, k, v, route=pallas_kernels.Route())\n"
         "  return pallas_kernels.flash_attention(q, k, v, route=ctx.options.route)\n")
  assert route_violations(src) == [
      "<src>:3 pallas_kernels.gathered_attention(...) passes no route=",
      "<src>:4 pallas_kernels.flash_attention(route=pallas_kernels.Route()): not the run's route"]


# A route no default equals: the GPU kernels asked for (so methods take their kernel branches),
# every decode kernel on, and a KernelOptions value of its own.
RUN = Route(backend="gpu", cache_write_backend="gpu", add_norm_backend="gpu", prefill_kernel=True,
            decode_kernel=True, kernels=KernelOptions(topk_dequantize_bytes=12345))
# What the instrumented kernels run: the references (fast on CPU, the same results).
AS_REFERENCE = RUN.replace(backend="reference", cache_write_backend=None, add_norm_backend=None)


@pytest.fixture
def seen_routes(monkeypatch):
  seen = []
  for owner, name in ((pallas_kernels, "flash_attention"), (pallas_kernels, "chunk_attention"),
                      (pallas_kernels, "gathered_attention"), (pallas_kernels, "topk_scores"),
                      (cache_write, "write_one_token"), (add_rmsnorm, "add_rms_norm")):
    real = getattr(owner, name)

    def recorded(*args, route, _real=real, _name=name, **kw):
      seen.append((_name, route))
      return _real(*args, route=AS_REFERENCE, **kw)

    monkeypatch.setattr(owner, name, recorded)
  return seen


@pytest.mark.parametrize("name", names("layer"))
def test_each_method_hands_its_kernels_the_runs_route(tiny, seen_routes, name):
  cfg, params = tiny
  method = _method(name, CACHE_LEN)
  docs, instructions = _apart(_prompts(cfg, (13, 21)))
  options = RunOptions(prefill_chunk=8, route=RUN)
  cache, _ = gen.prefill(params, cfg, docs, method, cache_len=CACHE_LEN, options=options,
                         decode_room=3, instructions=instructions)
  step = jax.jit(forward, static_argnums=(4, 5), static_argnames=("decode", "options"))
  for _ in range(3):
    tok = jnp.asarray(np.ones((len(docs), 1)), jnp.int32)
    _, cache = step(params, tok, cache.lengths[:, None], cache, method, cfg, decode=True,
                    options=options)
  kernels = {k for k, _ in seen_routes}
  assert "add_rms_norm" in kernels, kernels  # every decode step's norms
  assert [(k, r) for k, r in seen_routes if r != RUN] == []
  if name == "refreshkv":  # its decode reads the partial cache through gathered_attention
    assert "gathered_attention" in kernels


def test_run_options_hold_one_hashable_route():
  """RunOptions stays a static jit argument: the route is part of its hash, variants are built
  with replace_route, and a bad backend is one ConfigError line."""
  from jax_longctx.core.config_types import ConfigError
  base = RunOptions()
  gpu = base.replace_route(backend="gpu", decode_kernel=True)
  assert gpu.route == Route(backend="gpu", decode_kernel=True) and base.route == Route()
  assert hash(gpu) != hash(base) and gpu != base
  assert {gpu: 1}[RunOptions(route=Route(backend="gpu", decode_kernel=True))] == 1
  with pytest.raises(ConfigError, match="unknown kernel backend 'cuda' for Route.backend"):
    base.replace_route(backend="cuda")
  with pytest.raises(TypeError):
    pallas_kernels.flash_attention(jnp.ones((1, 1, 2, 8)), jnp.ones((1, 4, 1, 8)),
                                   jnp.ones((1, 4, 1, 8)))  # no route: not a silent default
