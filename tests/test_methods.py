"""Every registered method: jit, one decode compile, batching, GQA, budgets, full-attention parity."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run import generation as gen
from jax_longctx.run.driver import generate
from jax_longctx.methods import MethodError, get, names
from jax_longctx.methods import full as full_lib
from jax_longctx.methods import hparams
from jax_longctx.model import forward
from jax_longctx.core.options import RunOptions
from pallas_kernels import Route
from pallas_kernels.attention import chunk

EVICTING = ("h2o", "streaming_llm", "tova", "snapkv")
# The methods that split the context over a mesh: tests/test_distributed.py and others.
PER_LAYER = names("layer")
CACHE_LEN = 48


def _method(name, budget):
  """The method at a given budget, with settings small enough for tiny prompts."""
  if name == "full":
    return get("full")
  if name == "reattention":  # the scope plays the budget: global + clip * span + local
    return get(name, n_global=2, n_local=max(8, budget - 8), span=2, clip=3, top_k=2, chunk=8)
  kw = {"budget": budget}
  if name == "snapkv":
    kw["window"] = 4
  if name.startswith(("citrus", "h2o_shared")):
    kw["chunk"] = 8
  if name == "quest":
    kw.update(page_size=4, dense_layers=0)
  if name == "resa":
    kw["base_args"] = (("page_size", 4), ("dense_layers", 0))
  return get(name, **kw)


def _fields(name):
  return {f.name for f in dataclasses.fields(get(name))}


def _prompts(cfg, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def _apart(prompts):
  """(documents, instructions): each prompt's last 3 tokens play its instruction. Methods not
  guided by the instruction read both as one prompt, so every method runs the same tokens."""
  return [p[:-3] for p in prompts], [p[-3:] for p in prompts]


def _generate(params, cfg, prompts, method, max_new_tokens):
  docs, instructions = _apart(prompts)
  return generate(params, cfg, docs, method, max_new_tokens=max_new_tokens,
                  options=RunOptions(prefill_chunk=8), cache_len=CACHE_LEN,
                  instructions=instructions).tokens


# The one-token step as the decode loop runs it, jitted: called eagerly it dispatched (and
# compiled, per method and shape) each of its hundreds of ops apart, ~1 min of this file on 2 cores.
_decode_step = jax.jit(forward, static_argnums=(4, 5), static_argnames=("decode", "options"))


def _step_logits(params, cfg, prompts, method, n_decode, chunk=8, options=RunOptions()):
  """Prefill (last-token logits), then decode teacher-forced tokens; logits of every step."""
  docs, instructions = _apart(prompts)
  options = options.replace(prefill_chunk=chunk)
  cache, last = gen.prefill(params, cfg, docs, method, cache_len=CACHE_LEN, options=options,
                            decode_room=n_decode, instructions=instructions)
  out = [np.asarray(last)]
  rng = np.random.default_rng(1)
  for _ in range(n_decode):
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(prompts), 1)), jnp.int32)
    logits, cache = _decode_step(params, tok, cache.lengths[:, None], cache, method, cfg,
                                 decode=True, options=options)
    out.append(np.asarray(logits[:, 0]))
  return np.stack(out, axis=1), cache


@pytest.mark.parametrize("name", PER_LAYER)
def test_budget_covering_the_context_reproduces_full_attention(tiny, name):
  cfg, params = tiny  # GQA (6 query / 2 kv heads): a wrong grouping changes the output
  prompts = _prompts(cfg, (13, 29))
  ref, _ = _step_logits(params, cfg, prompts, get("full"), 6)
  got, _ = _step_logits(params, cfg, prompts, _method(name, CACHE_LEN), 6)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", PER_LAYER)
def test_batch_of_different_lengths_equals_each_alone(tiny, name):
  cfg, params = tiny
  prompts = _prompts(cfg, (9, 26), seed=4)
  method = _method(name, 16)  # small enough that evicting and selecting methods drop tokens
  batched = _generate(params, cfg, prompts, method, 8)
  for p, row in zip(prompts, batched):
    assert row == _generate(params, cfg, [p], method, 8)[0]


@pytest.mark.parametrize("name", PER_LAYER)
def test_decode_compiles_once_per_generation_shape(tiny, name):
  cfg, params = tiny
  method = _method(name, 16)
  before = gen.DECODE_TRACES[0]
  for seed in range(2):
    _generate(params, cfg, _prompts(cfg, (11, 20), seed), method, 5)
  assert gen.DECODE_TRACES[0] - before == 1


@pytest.mark.parametrize("name", EVICTING)
def test_evicting_state_respects_the_budget(tiny, name):
  cfg, params = tiny
  budget, n_decode = 12, 5
  _, cache = _step_logits(params, cfg, _prompts(cfg, (21, 33)), _method(name, budget), n_decode)
  for layer in cache.state:
    slots = getattr(layer, "slots", layer)
    held = np.asarray(np.sum(np.asarray(slots.pos) >= 0, axis=-1))
    limit = budget + n_decode if name == "snapkv" else budget  # SnapKV appends generated tokens
    assert held.max() <= limit
    assert held.min() > 0
    if name != "snapkv":
      assert slots.pos.shape[-1] == budget + 8  # budget plus one chunk, never the context


def test_selection_methods_differ_from_full_when_budget_is_small(tiny):
  cfg, params = tiny
  prompts = _prompts(cfg, (29, 29))
  ref, _ = _step_logits(params, cfg, prompts, get("full"), 3)
  for name in PER_LAYER:
    if name == "full":
      continue
    got, _ = _step_logits(params, cfg, prompts, _method(name, 8), 3)
    assert np.max(np.abs(got[:, 1:] - ref[:, 1:])) > 1e-4, name


def _default_budget(name):
  """The method's default budget in tokens when one is set (RESA: its base's), else None."""
  method = get(name)
  budget = getattr(getattr(method, "inner", method), "budget", None)
  return budget if isinstance(budget, int) else None


# Every method whose default budget is a token count: 1024 and the like, above any tiny prompt.
DEFAULT_TOKEN_BUDGETS = [n for n in PER_LAYER if _default_budget(n)]


@pytest.mark.parametrize("name", DEFAULT_TOKEN_BUDGETS)
def test_default_budget_above_the_cache_is_full_attention(tiny, name):
  """A default budget on a shorter prompt keeps every token: full attention's logits, prefill
  and decode, and its greedy tokens. Settings that only shrink what the budget keeps are left as
  the defaults (SnapKV's window 32, Quest's 16-token pages); Quest selects from the first layer."""
  cfg, params = tiny
  assert _default_budget(name) > CACHE_LEN
  kw = {"quest": dict(dense_layers=0), "resa": dict(base_args=(("dense_layers", 0),))}
  method = get(name, **kw.get(name, {}))
  prompts = _prompts(cfg, (13, 29), seed=5)
  ref, _ = _step_logits(params, cfg, prompts, get("full"), 3)
  got, _ = _step_logits(params, cfg, prompts, method, 3)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  assert _generate(params, cfg, prompts, method, 4) == _generate(params, cfg, prompts,
                                                                 get("full"), 4)


@pytest.mark.parametrize("name", [n for n in PER_LAYER if "budget" in _fields(n)])
def test_budget_above_the_cache_keeps_it_whole_and_says_so_once(name, capsys, monkeypatch):
  monkeypatch.setattr(hparams, "_WHOLE_CACHE_NOTED", set())  # as in a fresh process
  monkeypatch.delenv("JAX_LONGCTX_QUIET", raising=False)
  method = get(name, budget=100)
  for _ in range(2):
    method.init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8)
  note = [line for line in capsys.readouterr().err.splitlines() if "budget=100" in line]
  owner = getattr(method, "inner", method).name  # RESA's budget is its base's
  assert note == [f"jax-longctx: note: {owner} budget=100 is larger than the cache (48 slots): "
                  "it keeps every token (full attention, no compression)"]
  monkeypatch.setenv("JAX_LONGCTX_QUIET", "1")
  monkeypatch.setattr(hparams, "_WHOLE_CACHE_NOTED", set())
  method.init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8)
  assert "budget=100" not in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n in PER_LAYER if "budget" in _fields(n)])
def test_budget_errors_name_the_parameter(name):
  with pytest.raises(MethodError, match=f"method '{name}': budget=0 is not valid"):
    get(name, budget=0)
  with pytest.raises(MethodError, match=f"method '{name}' has no hyper-parameter 'budgte'"):
    get(name, budgte=3)


def test_page_size_must_divide_the_budget():
  with pytest.raises(MethodError, match="page_size=16 does not divide the budget"):
    get("quest", budget=40).init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8)


def test_fractional_budget():
  state = get("h2o", budget=0.25).init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8)
  assert state.budget == 12
  # A float is a fraction: 1.0 is the whole cache (not one token), an int counts tokens.
  assert get("h2o", budget=1.0).init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8).budget == 48
  assert get("h2o", budget=1).init_state(_cfg(), 1, CACHE_LEN, jnp.float32, 8).budget == 1


@pytest.mark.parametrize("name", PER_LAYER)
def test_prefill_donates_only_what_it_can(tiny, name):
  """No 'Some donated buffers were not usable' warning from the prefill steps and the
  end-of-prefill hook (SnapKV shrinks its cache there); the decode loop returns a cache of the
  shapes it took, so all of it is reused."""
  cfg, params = tiny
  docs, instructions = _apart(_prompts(cfg, (13, 21), seed=7))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gen.prefill(params, cfg, docs, _method(name, 16), cache_len=CACHE_LEN + 8,
                options=RunOptions(prefill_chunk=8), decode_room=3, instructions=instructions)  # a cache size no other test compiles
  donation = [str(w.message) for w in caught if "donated buffers" in str(w.message)]
  assert not donation, donation


def _cfg():
  from tests.conftest import tiny_config
  return tiny_config()


@pytest.mark.parametrize("route", ["flash_attention", "cudnn_composition"])
def test_full_prefill_through_the_kernel_equals_the_jnp_path(tiny, monkeypatch, route):
  """On accelerators prefill chunks use chunk_attention (on NVIDIA GPUs two cuDNN calls merged
  by LSE, here with cuDNN's definition in jnp; else flash_attention); both match the CPU path."""
  cfg, params = tiny
  prompts = _prompts(cfg, (13, 29))
  ref, _ = _step_logits(params, cfg, prompts, get("full"), 2)
  if route == "cudnn_composition":
    monkeypatch.setattr(chunk, "cudnn_route", lambda *a: True)
    monkeypatch.setattr(chunk, "cudnn_dense", chunk.reference_dense)
  jax.clear_caches()  # the other route's steps were traced with the same options
  got, _ = _step_logits(params, cfg, prompts, get("full"), 2,
                        options=RunOptions(route=Route(prefill_kernel=True)))
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_full_decode_through_the_kernel_equals_the_jnp_path(tiny, monkeypatch):
  """On NVIDIA GPUs one-token steps go to flash_attention (its split-K decode kernel there, its
  reference here) with the fused projections of `serving_params`: logits as the CPU path's, for
  sequences of different lengths."""
  from jax_longctx.model import fuse_projections
  cfg, params = tiny
  prompts = _prompts(cfg, (13, 29))
  ref, _ = _step_logits(params, cfg, prompts, get("full"), 4)
  got, _ = _step_logits(fuse_projections(params), cfg, prompts, get("full"), 4,
                        options=RunOptions(route=Route(decode_kernel=True)))
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_mesh_methods_run_on_one_device(tiny):
  """A method that splits the context over a mesh takes the one road on one device too (the
  mesh's ctx axis of size 1): mesh ReAttention gives ReAttention's tokens, ring attention
  (exact) full attention's."""
  cfg, params = tiny
  docs, ins = _apart(_prompts(cfg, (30, 21)))
  hp = dict(n_global=2, n_local=8, span=2, clip=3, top_k=2, chunk=8)

  def run(method):
    return generate(params, cfg, docs, method, max_new_tokens=4, cache_len=CACHE_LEN,
                    instructions=ins).tokens

  assert run(get("reattention_mesh", **hp)) == run(get("reattention", **hp))
  assert run(get("ring")) == run(get("full"))


def test_an_end_of_prefill_hook_must_be_declared():
  # The drivers run end_of_prefill only for methods with ends_prefill; an undeclared hook would
  # be skipped silently (the RESA error study's probe lost its priors that way).
  from jax_longctx.methods.base import Method

  with pytest.raises(TypeError, match="ends_prefill"):
    class Undeclared(Method):  # noqa: F841
      def end_of_prefill(self, state, info):
        return state

  class Declared(Method):
    ends_prefill = True

    def end_of_prefill(self, state, info):
      return state
  assert Declared.ends_prefill
