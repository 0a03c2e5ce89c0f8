"""Each baseline against a slow reference written from its paper, on random q/k/v of one layer."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.methods import AttnContext, PrefillEnd, get
from jax_longctx.core.rope import apply_rope, inv_freq
from tests.conftest import tiny_config

CFG = tiny_config(num_heads=6, num_kv_heads=2, head_dim=8)
B, H, KV, D = 2, 6, 2, 8
G = H // KV
LAYER = 5  # past Quest's dense layers


def _inputs(n, seed):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, n, H, D)).astype(np.float32) * 2
  k = rng.normal(size=(B, n, KV, D)).astype(np.float32) * 2
  v = rng.normal(size=(B, n, KV, D)).astype(np.float32)
  return q, k, v


def _ctx(start, stop, lengths=None):
  pos = np.broadcast_to(np.arange(start, stop), (B, stop - start))
  valid = np.ones_like(pos, bool) if lengths is None else pos < np.asarray(lengths)[:, None]
  return AttnContext(LAYER, jnp.asarray(pos, jnp.int32), jnp.asarray(valid), inv_freq(CFG), CFG)


def _rot(x):
  """Post-RoPE copies (the references select on what the model sees)."""
  pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  return np.asarray(apply_rope(jnp.asarray(x), pos, inv_freq(CFG)))


def _run(method, q, k, v, prompt, chunk, max_len=64):
  """Prefill `prompt` tokens in chunks, decode the rest one by one. Returns (outs, state).

  Decode steps get `ctx.gate_open` from the method's `decode_gate`, as the model's loop does."""
  state = method.init_state(CFG, B, max_len, jnp.float32, chunk)
  outs = []
  for s in range(0, prompt, chunk):
    e = min(s + chunk, prompt)
    o, state = method.prefill(state, *(jnp.asarray(x[:, s:e]) for x in (q, k, v)), _ctx(s, e))
    outs.append(np.asarray(o))
  state = method.end_of_prefill(state, PrefillEnd(CFG, LAYER, jnp.full((B,), prompt),
                                                  max_len - prompt))
  for t in range(prompt, q.shape[1]):
    gate = method.decode_gate(types.SimpleNamespace(state=(state,)), jnp.full((B, 1), t))
    ctx = _ctx(t, t + 1).replace(gate_open=True if gate is None else bool(gate))
    o, state = method.decode(state, *(jnp.asarray(x[:, t:t + 1]) for x in (q, k, v)), ctx)
    outs.append(np.asarray(o))
  return np.concatenate(outs, axis=1), state


def _kept(pos_array, b, kvh):
  p = np.asarray(pos_array)[b, kvh]
  return sorted(int(x) for x in p if x >= 0)


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _probs(qr, kr, b, t, h, cand):
  """Attention of token t's head h over candidate positions (post-RoPE, scaled)."""
  return _softmax(kr[b, cand, h // G] @ qr[b, t, h] / np.sqrt(D))


def test_streaming_llm_keeps_sinks_and_recent_window():
  q, k, v = _inputs(30, 0)
  _, state = _run(get("streaming_llm", budget=10, n_sink=4), q, k, v, prompt=12, chunk=4)
  for b in range(B):
    for kvh in range(KV):
      assert _kept(state.pos, b, kvh) == [0, 1, 2, 3] + list(range(24, 30))


def test_h2o_matches_token_by_token_reference():
  n, steps = 8, 24
  q, k, v = _inputs(steps, 1)
  _, state = _run(get("h2o", budget=n), q, k, v, prompt=1, chunk=1)
  qr, kr = _rot(q), _rot(k)
  for b in range(B):
    for kvh in range(KV):
      kept, acc = [], {}
      for t in range(steps):
        cand = kept + [t]
        for h in range(kvh * G, (kvh + 1) * G):
          for pos, p in zip(cand, _probs(qr, kr, b, t, h, cand)):
            acc[pos] = acc.get(pos, 0.0) + p
        recent = sorted(cand)[-n // 2:]
        heavy = sorted((c for c in cand if c not in recent), key=lambda c: -acc[c])
        kept = sorted(recent + heavy[:n - len(recent)])
      assert _kept(state.pos, b, kvh) == kept


def test_tova_matches_token_by_token_reference():
  n, steps = 7, 22
  q, k, v = _inputs(steps, 2)
  _, state = _run(get("tova", budget=n), q, k, v, prompt=1, chunk=1)
  qr, kr = _rot(q), _rot(k)
  for b in range(B):
    kept = []
    for t in range(steps):
      cand = kept + [t]
      score = np.mean([_probs(qr, kr, b, t, h, cand) for h in range(H)], axis=0)
      kept = sorted(np.asarray(cand)[np.argsort(-score)[:n]].tolist())
    for kvh in range(KV):  # one decision shared by all heads of the layer
      assert _kept(state.pos, b, kvh) == kept


def test_snapkv_matches_reference_selection():
  n, w, prompt = 12, 4, 37
  q, k, v = _inputs(prompt, 3)
  _, state = _run(get("snapkv", budget=n, window=w, pool_kernel=7), q, k, v, prompt=prompt,
                  chunk=8)
  qr, kr = _rot(q), _rot(k)
  for b in range(B):
    for kvh in range(KV):
      score = np.zeros((G, prompt))
      for g, h in enumerate(range(kvh * G, (kvh + 1) * G)):
        for t in range(prompt - w, prompt):
          score[g, :t + 1] += _probs(qr, kr, b, t, h, list(range(t + 1)))
      score = score.max(axis=0)
      pooled = np.array([score[max(0, i - 3):i + 4].max() for i in range(prompt)])
      pooled[prompt - w:] = np.inf
      kept = sorted(np.argsort(-pooled, kind="stable")[:n].tolist())
      assert _kept(state.slots.pos, b, kvh) == kept


def _selected_attention(qr, kr, v, b, t, h, cand):
  return _probs(qr, kr, b, t, h, cand) @ v[b, cand, h // G]


def test_topk_matches_reference():
  n, prompt = 9, 30
  q, k, v = _inputs(prompt + 1, 4)
  outs, _ = _run(get("topk", budget=n), q, k, v, prompt=prompt, chunk=8)
  qr, kr = _rot(q), _rot(k)
  for b in range(B):
    for h in range(H):
      s = kr[b, :prompt + 1, h // G] @ qr[b, prompt, h]
      cand = sorted(np.argsort(-s)[:n].tolist())
      ref = _selected_attention(qr, kr, v, b, prompt, h, cand)
      np.testing.assert_allclose(outs[b, prompt, h], ref, atol=1e-5)


def test_quest_matches_reference():
  n, page, prompt = 12, 4, 33
  q, k, v = _inputs(prompt + 1, 5)
  outs, _ = _run(get("quest", budget=n, page_size=page, dense_layers=2), q, k, v,
                 prompt=prompt, chunk=8)
  qr, kr = _rot(q), _rot(k)
  t = prompt
  n_pages = -(-(t + 1) // page)
  for b in range(B):
    for h in range(H):
      kvh = h // G
      score = []
      for p in range(n_pages):
        keys = kr[b, p * page:min((p + 1) * page, t + 1), kvh]
        score.append(np.sum(np.maximum(qr[b, t, h] * keys.max(0), qr[b, t, h] * keys.min(0))))
      score = np.asarray(score)
      score[t // page] = np.inf  # the current page is always read
      pages = np.argsort(-score)[:n // page]
      cand = sorted(i for p in pages for i in range(p * page, (p + 1) * page) if i <= t)
      ref = _selected_attention(qr, kr, v, b, t, h, cand)
      np.testing.assert_allclose(outs[b, t, h], ref, atol=1e-5)


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming_llm"])
def test_chunked_prefill_never_keeps_padding(name):
  q, k, v = _inputs(16, 6)
  method = get(name, budget=6)
  state = method.init_state(CFG, B, 32, jnp.float32, 8)
  lengths = [5, 16]
  for s in (0, 8):
    _, state = method.prefill(state, *(jnp.asarray(x[:, s:s + 8]) for x in (q, k, v)),
                              _ctx(s, s + 8, lengths))
  pos = np.asarray(state.pos)
  assert pos[0].max() < 5 and (pos[0] >= 0).sum(axis=-1).tolist() == [5, 5]
  assert ((pos[1] >= 0).sum(axis=-1) == 6).all()
