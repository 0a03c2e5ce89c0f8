"""RESA against the naive O(L) formulation of Eq. 3, its prior against its definition, lam = 0
against the wrapped methods, and bad settings."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run import generation as gen
from jax_longctx.ops.cache import KVCache
from jax_longctx.methods import AttnContext, MethodError, PrefillEnd, get
from jax_longctx.methods.resa import RESAState, fold_into_prior, residual_attention
from jax_longctx.core.rope import inv_freq, rotate
from jax_longctx.core.options import RunOptions
from tests.conftest import tiny_config

B, H, KV, D, T = 2, 6, 2, 8, 40


def _softmax_out(logits, v):
  """logits [..., T] (-inf = masked), v [..., T, d] -> (out, lse) in float64."""
  m = np.max(logits, axis=-1, keepdims=True)
  p = np.exp(logits - m)
  lse = np.log(p.sum(-1)) + m[..., 0]
  return np.einsum("...t,...td->...d", p / p.sum(-1, keepdims=True), v), lse


def _random_case(seed):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, KV, T, D))
  v = rng.normal(size=(B, KV, T, D))
  q = rng.normal(size=(B, 1, H, D))
  mu_q = rng.normal(size=(B, H, D)) * 0.5
  mu_k = rng.normal(size=(B, KV, D)) * 0.5
  q_pos = np.array([[33], [20]])
  slots = np.stack([rng.permutation(T)[:9] for _ in range(B * H)]).reshape(B, H, 9)
  return k, v, q, mu_q, mu_k, q_pos, slots


def _naive(k, v, q, mu_q, mu_k, q_pos, slots, lam):
  """Eq. 3: prior logits P_j + b everywhere, the selected slots' true logits, one softmax."""
  group = H // KV
  kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [B, H, T, d]
  prior = np.einsum("bhd,bhtd->bht", mu_q, kh) / np.sqrt(D)
  bias = np.einsum("bhd,bhd->bh", q[:, 0] - mu_q, np.repeat(mu_k, group, axis=1)) / np.sqrt(D)
  true = np.einsum("bhd,bhtd->bht", q[:, 0], kh) / np.sqrt(D)
  chosen = np.zeros((B, H, T), bool)
  np.put_along_axis(chosen, slots, True, axis=-1)
  logits = np.where(chosen, true, prior + bias[..., None] + np.log(lam))
  visible = np.arange(T)[None, None, :] <= q_pos[:, :, None]
  return _softmax_out(np.where(visible, logits, -np.inf), vh)[0]


def _state(k, v, mu_q, mu_k, q_pos):
  """The prior over every visible token, as end_of_prefill and the folds maintain it."""
  group = H // KV
  prior = np.einsum("bhd,bhtd->bht", mu_q, np.repeat(k, group, axis=1)) / np.sqrt(D)
  visible = np.arange(T)[None, None, :] <= q_pos[:, :, None]
  o_est, lse_p = _softmax_out(np.where(visible, prior, -np.inf), np.repeat(v, group, axis=1))
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return RESAState(None, f32(np.zeros_like(mu_q)), f32(mu_q), f32(mu_k), f32(o_est), f32(lse_p))


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_aggregator_equals_the_naive_eq3(lam):
  k, v, q, mu_q, mu_k, q_pos, slots = _random_case(0)
  state = _state(k, v, mu_q, mu_k, q_pos)
  cache = KVCache(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  got = residual_attention(jnp.asarray(q, jnp.float32), state, cache, jnp.asarray(slots),
                           jnp.asarray(q_pos, jnp.int32), lam)
  want = _naive(k, v, q, mu_q, mu_k, q_pos, slots, lam)
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, atol=1e-5, rtol=1e-5)


def test_folding_a_token_equals_recomputing_the_prior():
  k, v, _, mu_q, mu_k, q_pos, _ = _random_case(1)
  before = _state(k, v, mu_q, mu_k, q_pos - 1)
  new = np.take_along_axis(k, q_pos[:, None, :, None], axis=2)  # the token at q_pos [B, KV, 1, d]
  new_v = np.take_along_axis(v, q_pos[:, None, :, None], axis=2)
  got = fold_into_prior(before, jnp.asarray(np.swapaxes(new, 1, 2), jnp.float32),
                        jnp.asarray(np.swapaxes(new_v, 1, 2), jnp.float32),
                        jnp.ones((B, 1), bool))
  want = _state(k, v, mu_q, mu_k, q_pos)
  np.testing.assert_allclose(np.asarray(got.o_est), np.asarray(want.o_est), atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.lse_p), np.asarray(want.lse_p), atol=1e-5)


@pytest.mark.parametrize("prior", ["head", "group"])
def test_prior_estimator_follows_its_definition(prior):
  cfg = tiny_config()
  rng = np.random.default_rng(2)
  method = get("resa", base="topk", budget=8, prior=prior)
  state = method.init_state(cfg, B, T, jnp.float32, 8)
  k, v = rng.normal(size=(2, B, KV, T, D))
  q_sum = rng.normal(size=(B, H, D))
  lengths = np.array([31, 17])
  state = state.replace(inner=KVCache(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)),
                        q_sum=jnp.asarray(q_sum, jnp.float32))
  got = method.end_of_prefill(state, PrefillEnd(cfg, 0, jnp.asarray(lengths), 0))
  mu_q = q_sum / lengths[:, None, None]
  if prior == "group":
    mu_q = np.repeat(mu_q.reshape(B, KV, H // KV, D).mean(axis=2), H // KV, axis=1)
  mu_k = np.stack([k[b, :, :n].mean(axis=1) for b, n in enumerate(lengths)])
  want = _state(k, v, mu_q, mu_k, lengths[:, None] - 1)
  np.testing.assert_allclose(np.asarray(got.mu_q), mu_q, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.mu_k), mu_k, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.o_est), np.asarray(want.o_est), atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.lse_p), np.asarray(want.lse_p), atol=1e-5)


def _decode_logits(params, cfg, method, n_decode=4):
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (30, 21)]
  cache, last = gen.prefill(params, cfg, prompts, method, cache_len=48,
                            options=RunOptions(prefill_chunk=8))
  out = [np.asarray(last)]
  for _ in range(n_decode):
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 1)), jnp.int32)
    logits, cache = gen.forward(params, tok, cache.lengths[:, None], cache, method, cfg,
                                decode=True)
    out.append(np.asarray(logits[:, 0]))
  return np.stack(out, 1)


# ReAttention's scope 2 + 3 * 2 + 8 = 16 tokens of prompts of 30 and 21: it selects spans.
_REATTENTION = (("n_global", 2), ("n_local", 8), ("span", 2), ("clip", 3), ("top_k", 2),
                ("chunk", 8))


@pytest.mark.parametrize("base,args", [("quest", (("page_size", 4), ("dense_layers", 0))),
                                       ("topk", ()), ("reattention", _REATTENTION)])
def test_lam_zero_is_the_wrapped_method_and_lam_one_differs(tiny, base, args):
  cfg, params = tiny
  wrapped = get(base, **dict(args)) if base == "reattention" else get(base, budget=8,
                                                                      **dict(args))
  plain = _decode_logits(params, cfg, wrapped)
  np.testing.assert_array_equal(
      _decode_logits(params, cfg, get("resa", base=base, budget=8, lam=0.0, base_args=args)),
      plain)
  with_prior = _decode_logits(params, cfg, get("resa", base=base, budget=8, base_args=args))
  assert np.isfinite(with_prior).all()
  assert np.max(np.abs(with_prior[:, 1:] - plain[:, 1:])) > 1e-4


def test_bad_settings_fail_clearly():
  cfg = tiny_config()
  with pytest.raises(MethodError, match=r"lam=1.5 must lie in \[0, 1\]"):
    get("resa", budget=8, lam=1.5).init_state(cfg, 1, 48, jnp.float32, 8)
  with pytest.raises(MethodError, match="prior='token'"):
    get("resa", budget=8, prior="token").init_state(cfg, 1, 48, jnp.float32, 8)
  with pytest.raises(MethodError, match="selecting method"):
    get("resa", base="h2o", budget=8).init_state(cfg, 1, 48, jnp.float32, 8)
  with pytest.raises(MethodError, match="unknown method 'nope'"):
    get("resa", base="nope", budget=8).init_state(cfg, 1, 48, jnp.float32, 8)


def test_fixed_sink_and_recent_tokens_are_read_once_beside_the_selection():
  """RESA's evaluation keeps the first and last tokens in every budget (n_sink, n_recent)."""
  rng = np.random.default_rng(5)
  cfg = tiny_config()
  kv = KVCache(jnp.asarray(rng.normal(size=(B, KV, T, D)), jnp.float32),
               jnp.asarray(rng.normal(size=(B, KV, T, D)), jnp.float32))
  q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
  q_pos = np.array([[33], [20]])
  ctx = AttnContext(layer=0, q_pos=jnp.asarray(q_pos, jnp.int32), valid=jnp.ones((B, 1), bool),
                    freqs=None, cfg=cfg)
  method = get("topk", budget=12, n_sink=2, n_recent=3)
  slots = np.asarray(method.selected_slots(kv, q, ctx))
  scores = np.einsum("bhd,bhtd->bht", np.asarray(q[:, 0]), np.repeat(np.asarray(kv.k), 3, axis=1))
  for b in range(B):
    p = int(q_pos[b, 0])
    fixed = {0, 1, p - 2, p - 1, p}
    for h in range(H):
      got = [int(s) for s in slots[b, h] if s >= 0]
      assert len(got) == len(set(got))  # no slot twice
      order = [t for t in np.argsort(-scores[b, h], kind="stable") if t <= p and t not in fixed]
      chosen = set(order[:7])  # budget 12 - 5 fixed, chosen among the other visible tokens
      assert set(got) == fixed | chosen
  with pytest.raises(MethodError, match="leaves no tokens to select"):
    get("topk", budget=5, n_sink=2, n_recent=3).init_state(cfg, 1, T, jnp.float32, 8)


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_over_reattention_the_prior_covers_the_keys_outside_the_scope(lam):
  """One decode step of RESA over ReAttention (random pre-RoPE cache; token 33 / 20 written by
  the step) equals Eq. 3 written out: ReAttention's own attention over its scope (Z_SA, O_SA,
  RoPE at scope ranks) plus lam * exp(P_j + b) for every cached key outside the scope, the prior
  logits P_j = mu_Q.k_j / sqrt(d) on the pre-RoPE keys and the bias with the step's query
  rotated by the prior's distance (mu_Q, the state's, already is), all in one softmax."""
  k, v, q, mu_q, mu_k, q_pos, _ = _random_case(11)
  cfg = tiny_config()
  method = get("resa", base="reattention", lam=lam, base_args=_REATTENTION)
  assert method.pre_rope
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  at_step = lambda x: np.take_along_axis(x, q_pos[:, None, :, None], axis=2)  # noqa: E731
  k_new, v_new = at_step(k).transpose(0, 2, 1, 3), at_step(v).transpose(0, 2, 1, 3)
  before = q_pos - 1  # the prior folded so far covers the tokens before the step's
  state = _state(k, v, mu_q, mu_k, before).replace(inner=KVCache(f32(k), f32(v)))
  ctx = AttnContext(layer=0, q_pos=jnp.asarray(q_pos, jnp.int32), valid=jnp.ones((B, 1), bool),
                    freqs=inv_freq(cfg), cfg=cfg)
  got, _ = method.decode(state, f32(q), f32(k_new), f32(v_new), ctx)
  out_sa, lse_sa, _, sc = method.inner.step(state.inner, f32(q), f32(k_new), f32(v_new), ctx)
  group = H // KV
  kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [B, H, T, d]
  prior = np.einsum("bhd,bhtd->bht", mu_q, kh) / np.sqrt(D)
  q_far = np.asarray(rotate(f32(q[:, 0]), jnp.int32(method.distance), ctx.freqs))
  assert method.distance == dict(_REATTENTION)["n_local"] + (
      dict(_REATTENTION)["clip"] * dict(_REATTENTION)["span"] // 2)
  bias = np.einsum("bhd,bhd->bh", q_far - mu_q, np.repeat(mu_k, group, axis=1)) / np.sqrt(D)
  outside = np.arange(T)[None, :] <= q_pos  # [B, T]: cached after the step's write ...
  for b in range(B):
    outside[b, np.asarray(sc.idx[b, :int(sc.length[b])])] = False  # ... and not in the scope
  assert outside.sum() > 5  # ReAttention left keys out
  w = np.where(outside[:, None, :], np.exp(prior + bias[..., None]), 0.0) * lam  # [B, H, T]
  z_sa = np.exp(np.asarray(lse_sa[:, 0], np.float64))
  want = ((z_sa[..., None] * np.asarray(out_sa[:, 0], np.float64)
           + np.einsum("bht,bhtd->bhd", w, vh)) / (z_sa + w.sum(-1))[..., None])
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, atol=1e-5, rtol=1e-4)


def test_prior_distance_applies_over_reattention_only():
  cfg = tiny_config()
  with pytest.raises(MethodError, match="prior_distance=-1"):
    get("resa", base="reattention", base_args=_REATTENTION,
        prior_distance=-1).init_state(cfg, 1, T, jnp.float32, 8)
  with pytest.raises(MethodError, match="over reattention only"):
    get("resa", budget=8, prior_distance=4).init_state(cfg, 1, T, jnp.float32, 8)
  assert get("resa", base="reattention", base_args=_REATTENTION, prior_distance=5).distance == 5



def test_the_base_as_an_object_or_by_name_is_built_once():
  """RESA(base=Quest(...)) wraps that object; a name with base_args builds the same method, once
  at construction (`inner` is a field, not rebuilt per access); records name the base and the
  settings it runs with."""
  import json

  from jax_longctx.methods import MeshRESA, Quest, RESA
  obj = RESA(base=Quest(budget=256, page_size=8))
  named = get("resa", base="quest", base_args=(("page_size", 8),), budget=256)
  assert obj.inner == named.inner == Quest(budget=256, page_size=8)
  assert named.inner is named.inner
  assert RESA(base=Quest(budget=64), budget=32).inner.budget == 32  # a budget given replaces it
  rec = json.loads(json.dumps(named.hparams()))
  assert rec["base"] == obj.hparams()["base"] == "quest"
  assert (rec["base_args"]["page_size"], rec["base_args"]["budget"]) == (8, 256)
  mesh = get("resa_mesh", base_args=(("n_local", 16),))
  assert mesh.inner is mesh.inner and mesh.inner.n_local == 16 and mesh.inner.splits_tokens
  with pytest.raises(MethodError, match="quest' has no hyper-parameter 'nope'"):
    RESA(base=Quest(), base_args=(("nope", 1),))
