"""RefreshKV against the paper's loop written out step by step, and against full / SnapKV."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run import generation as gen
from jax_longctx.methods import MethodError, get
from jax_longctx.methods.refreshkv import RefreshKV
from jax_longctx.run.driver import generate
from jax_longctx.core.options import RunOptions
from tests.test_method_references import B, CFG, D, G, KV, _ctx, _inputs, _rot, _run


def _pool(x, kernel):
  half = kernel // 2
  return np.array([x[max(0, i - half):i + half + 1].max() for i in range(len(x))])


def _pooled_attention(qr, kr, b, t, pool):
  """[KV, t + 1]: token t's attention over 0..t, max over a group's heads, max-pooled."""
  logits = np.einsum("kgd,tkd->kgt", qr[b, t].reshape(KV, G, D), kr[b, :t + 1]) / np.sqrt(D)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).max(axis=1)
  return np.stack([_pool(row, pool) for row in p])


def _attend(qr, kr, v, b, t, kept):
  """Token t's output [H, D] over the positions kept per kv head."""
  out = np.zeros((G * KV, D), np.float32)
  for h in range(G * KV):
    cand = sorted(kept[h // G])
    logits = kr[b, cand, h // G] @ qr[b, t, h] / np.sqrt(D)
    p = np.exp(logits - logits.max())
    out[h] = (p / p.sum()) @ v[b, cand, h // G]
  return out


def _top(score, t, n, n_local=1):
  """Top n of a pooled score row with the n_local tokens up to t forced in; ties to the lower
  position."""
  s = score.copy()
  s[t - n_local + 1:t + 1] = np.inf
  order = np.argsort(-s, kind="stable")[:n]
  return {int(i): float(s[i]) for i in order}


def _reference(m, q, k, v, prompt, n):
  """The paper's Figure 2 per sequence. Returns (outputs [B, steps, H, D], kept, full steps)."""
  qr, kr = _rot(q), _rot(k)
  qm = (qr if m.similarity_after_rope else q).mean(axis=2)  # [B, T, D]
  outs, kept_all, due_all = [], [], []
  for b in range(B):
    part = [_top(row, prompt - 1, n, m.n_local)
            for row in _pooled_attention(qr, kr, b, prompt - 1, 7)]
    q_ref, rows, dues = qm[b, prompt - 1], [], []
    for t in range(prompt, q.shape[1]):
      step = t - prompt + 1
      cos = qm[b, t] @ q_ref / (np.linalg.norm(qm[b, t]) * np.linalg.norm(q_ref))
      due = step % m.fixed_stride == 0 if m.fixed_stride else (
          step % m.qc_stride == 0 and cos < m.threshold)
      dues.append(due)
      if due:
        q_ref = qm[b, t]
        if m.refresh:
          part = [_top(row, t, n, m.n_local) for row in _pooled_attention(qr, kr, b, t, 7)]
        seen = part if not m.full_attention else [range(t + 1)] * KV
        rows.append(_attend(qr, kr, v, b, t, seen))
      if not due or not m.refresh:  # the partial step: C_p plus the token, then one leaves
        for p in part:
          p[t] = np.inf
        if not due:
          rows.append(_attend(qr, kr, v, b, t, part))
        for p in part:
          if len(p) > n:
            low = min(p.values())
            del p[min(i for i, s in p.items() if s == low)]
    outs.append(rows)
    kept_all.append([sorted(p) for p in part])
    due_all.append(dues)
  return np.asarray(outs), kept_all, np.asarray(due_all)


SETTINGS = {
    "dynamic": dict(qc_stride=2, threshold=0.0),
    "dynamic_sorted_top_k": dict(qc_stride=2, threshold=0.0, selection="sort"),
    "after_rope": dict(qc_stride=2, threshold=0.0, similarity_after_rope=True),
    "fixed": dict(fixed_stride=3),
    "local_window": dict(fixed_stride=3, n_local=3),
    "without_refresh": dict(fixed_stride=3, refresh=False),
    "without_full_attention": dict(fixed_stride=3, full_attention=False),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_refreshkv_matches_the_papers_loop(setting):
  prompt, total, n = 20, 44, 6
  method = get("refreshkv", budget=n, **SETTINGS[setting])
  q, k, v = _inputs(total, 11)
  got, state = _run(method, q, k, v, prompt=prompt, chunk=8)
  ref, kept, dues = _reference(method, q, k, v, prompt, n)
  np.testing.assert_allclose(got[:, prompt:], ref, atol=1e-5)
  for b in range(B):
    for h in range(KV):
      assert sorted(int(p) for p in np.asarray(state.part.pos[b, h]) if p >= 0) == kept[b][h]
  np.testing.assert_array_equal(np.asarray(state.n_full), dues.sum(axis=1))
  assert dues.any() and not dues.all()
  if setting.startswith("dynamic"):  # the two sequences follow different schedules in one batch
    assert (dues[0] != dues[1]).any()


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def _generate(tiny, method, prompts, new=12):
  cfg, params = tiny
  return generate(params, cfg, prompts, method, max_new_tokens=new,
                  options=RunOptions(prefill_chunk=8), cache_len=64)


def test_threshold_above_one_every_step_is_full_attention(tiny):
  prompts = _prompts((30, 41))
  full = _generate(tiny, get("full"), prompts).tokens
  res = _generate(tiny, get("refreshkv", budget=8, qc_stride=1, threshold=1.01), prompts)
  assert res.tokens == full
  assert res.cache.state[0].part.budget == 8
  assert get("refreshkv").effective_stride(res.cache) == [1.0] * 3


def test_never_refreshing_is_fixed_size_snapkv(tiny):
  prompts = _prompts((30, 41), seed=3)
  snap = _generate(tiny, get("snapkv", budget=8, window=1, keep_size=True), prompts).tokens
  res = _generate(tiny, get("refreshkv", budget=8, threshold=-1.01), prompts)
  assert res.tokens == snap
  assert get("refreshkv").effective_stride(res.cache) == [float("inf")] * 3
  assert snap != _generate(tiny, get("full"), prompts).tokens  # K = 8 does lose something


def test_effective_stride_counts_full_steps(tiny):
  res = _generate(tiny, get("refreshkv", budget=8, qc_stride=3, threshold=1.01),
                  _prompts((30, 41)), new=13)  # 12 decode steps: full at 3, 6, 9, 12
  assert get("refreshkv").effective_stride(res.cache) == [3.0] * 3
  assert get("refreshkv").report(res.cache) == {"full_steps": [4.0] * 3, "decode_steps": 12.0}


class _Ungated(RefreshKV):
  """RefreshKV with no decode gate: every step carries the per-layer conditional."""

  def decode_gate(self, cache, q_pos):
    return None


def test_the_decode_gate_changes_no_result(tiny):
  """Steps the gate closes (no layer can refresh) run without the per-layer conditional; tokens,
  NLLs and full-step counts equal a loop with no gate, for a dynamic and a fixed stride."""
  cfg, params = tiny
  prompts = _prompts((30, 41), seed=5)
  targets = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 13)), jnp.int32)

  def run(method):
    tokens = _generate(tiny, method, prompts, new=13)
    cache, last = gen.prefill(params, cfg, prompts, method, cache_len=64,
                              options=RunOptions(prefill_chunk=8))
    nll, cache = gen.teacher_forced_nll(params, cache, last, targets, cfg=cfg, method=method)
    return tokens.tokens, np.asarray(nll), method.report(tokens.cache), method.report(cache)

  for kw in (dict(qc_stride=3, threshold=0.9), dict(fixed_stride=4)):
    gated, ungated = run(RefreshKV(budget=8, **kw)), run(_Ungated(budget=8, **kw))
    assert min(gated[2]["full_steps"]) > 0  # the open steps did refresh
    assert gated[0] == ungated[0] and gated[2:] == ungated[2:]
    np.testing.assert_allclose(gated[1], ungated[1], atol=1e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(qc_stride=0), "qc_stride=0 must be >= 1"),
    (dict(n_local=0), "n_local=0 must be >= 1"),
    (dict(selection="heap"), "selection='heap' is not valid; selection takes one of 'radix', "
                             "'sort'"),  # checked at construction, like every field's type
    (dict(refresh=False, full_attention=False), "leaves nothing to do"),
])
def test_bad_settings_are_named(kw, match):
  with pytest.raises(MethodError, match=match):
    get("refreshkv", **kw).init_state(CFG, 1, 64, jnp.float32, 8)


def test_decode_takes_one_token_per_step():
  q, k, v = _inputs(12, 0)
  method = get("refreshkv", budget=4)
  _, state = _run(method, q[:, :10], k[:, :10], v[:, :10], prompt=10, chunk=8, max_len=16)
  with pytest.raises(MethodError, match="one token per step, got 2"):
    method.decode(state, *(jnp.asarray(x[:, 10:12]) for x in (q, k, v)), _ctx(10, 12))
