"""ReAttention against a slow reference written from the paper's Algorithms 1-2 and the authors'
code (shared/UPSTREAM.md): selection, GQA pairing, the layer output, positions, errors."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.ops.cache import KVCache
from jax_longctx.methods import AttnContext, MethodError, get
from jax_longctx.methods.reattention import ReAttention
from jax_longctx.methods.reattention_scope import (HISTOGRAM_MAX_SLOTS_PER_VOTE, PAIRWISE_MAX_VOTES,
                                                   WHOLE_PICK_MIN_CLIP,
                                                   most_voted, most_voted_counted,
                                                   most_voted_pairwise, most_voted_sorted,
                                                   select_scope)
from jax_longctx.core.options import RunOptions
from jax_longctx.core.rope import inv_freq
from pallas_kernels import Route
from tests.conftest import tiny_config

HP = dict(n_global=4, n_local=16, span=5, top_k=3, clip=6)


def reference_scope(q, k, seq_end, *, n_global, n_local, span, top_k, clip, pair=None):
  """One sequence: q [S, H, d] (the valid queries), k [KV, T, d] before RoPE -> token list.

  `pair` maps a query head to its kv head; upstream's decode path used h % KV (wrong).
  """
  n_q, h, _ = q.shape
  kvh = k.shape[0]
  pair = pair or (lambda head: head // (h // kvh))
  if seq_end <= n_global + n_local:
    return list(range(seq_end))
  lo, hi = n_global, seq_end - n_local
  votes = collections.Counter()
  for s in range(n_q):
    for head in range(h):
      scores = k[pair(head), lo:hi] @ q[s, head]  # raw q.k: no scale, no softmax, no RoPE
      for r in np.argsort(-scores, kind="stable")[:top_k]:
        votes[lo + int(r)] += 1
  kept = sorted(votes, key=lambda t: (-votes[t], t))[:clip]
  chosen = set()
  for i in kept:
    chosen.update(range(max(i - span // 2, lo), min(i + (span + 1) // 2, hi)))
  return list(range(n_global)) + sorted(chosen) + list(range(hi, seq_end))


def _inputs(seed, batch, n_q, cache_len=160, heads=6, kv_heads=2, d=8):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, n_q, heads, d)).astype(np.float32)
  k = rng.normal(size=(batch, kv_heads, cache_len, d)).astype(np.float32)
  return q, k


def _step(seq_ends, n_q):
  """Positions of a step ending at each sequence's seq_end (rows padded to n_q queries)."""
  ends = np.asarray(seq_ends)
  counts = np.minimum(n_q, ends)
  start = ends - counts
  pos = start[:, None] + np.arange(n_q)[None, :]
  return pos.astype(np.int32), pos < ends[:, None]


@pytest.mark.parametrize("n_q,seq_ends",
                         [(8, (150, 97)), (1, (160, 70)), (8, (23, 140)), (8, (15, 140))])
@pytest.mark.parametrize("backend", ["reference", "gpu"])
def test_selection_equals_the_paper_reference(n_q, seq_ends, backend):
  q, k = _inputs(0, len(seq_ends), n_q)
  pos, valid = _step(seq_ends, n_q)
  valid[1, -1] &= n_q == 1  # a padded query must not vote
  scope = select_scope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(valid),
                       route=Route(backend=backend), **HP)
  for b, end in enumerate(seq_ends):
    end = int(pos[b][valid[b]].max()) + 1
    want = reference_scope(q[b][valid[b]], k[b], end, **HP)
    n = int(scope.length[b])
    assert np.asarray(scope.idx[b, :n]).tolist() == want
    assert int(scope.q_offset[b]) == want.index(int(pos[b, 0]))


@pytest.mark.parametrize("stride,n_q", [(2, 8), (3, 8), (3, 1)])
@pytest.mark.parametrize("backend", ["reference", "gpu"])
def test_vote_stride_takes_every_stride_th_query_from_the_last(stride, n_q, backend):
  """vote_stride (not the paper's rule): the scope is the reference's over the voting queries
  alone (every stride-th counted back from the step's last; padded ones never vote), and the
  bounds still come from every query; one query (decode) always votes."""
  seq_ends = (150, 97)
  q, k = _inputs(3, len(seq_ends), n_q)
  pos, valid = _step(seq_ends, n_q)
  valid[1, -1] &= n_q == 1  # sequence 1's last slot is padding: the one before it is its last
  scope = select_scope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(valid),
                       vote_stride=stride, route=Route(backend=backend), **HP)
  votes = np.zeros(n_q, bool)
  votes[(n_q - 1) % stride::stride] = True
  for b in range(len(seq_ends)):
    end = int(pos[b][valid[b]].max()) + 1
    want = reference_scope(q[b][valid[b] & votes], k[b], end, **HP)
    assert np.asarray(scope.idx[b, :int(scope.length[b])]).tolist() == want
    assert int(scope.q_offset[b]) == want.index(int(pos[b, 0]))
  with pytest.raises(MethodError, match="vote_stride=0 must be >= 1"):
    get("reattention", vote_stride=0, **HP).init_state(tiny_config(), 1, 96, jnp.float32, 8)


@pytest.mark.parametrize("seed", range(4))
def test_vote_counting_by_pairs_or_histogram_equals_by_sorting(seed):
  """Decode steps count votes pairwise (V <= PAIRWISE_MAX_VOTES), prefill chunks over a short
  cache in a histogram of its slots (its best blocks and slots picked by comparing pairs, or by
  top_k through block maxima, also recursing over them), longer ones by sorting: the same kept
  tokens, including count ties (to the lower token), holes (-1) and rows with fewer distinct
  tokens than clip."""
  rng = np.random.default_rng(seed)
  v, clip, tokens = [(128, 127, 40), (300, 20, 25), (96, 50, 500),
                     (PAIRWISE_MAX_VOTES, 127, 900)][seed]
  votes = jnp.asarray(rng.integers(-1, tokens, (3, v)), jnp.int32)
  pairs, sorted_ = most_voted_pairwise(votes, clip), most_voted_sorted(votes, clip)
  assert pairs.shape == (3, clip)
  np.testing.assert_array_equal(np.asarray(pairs), np.asarray(sorted_))
  for slots, block, direct, pairs_max in [(tokens, 16, 2048, 4096), (tokens + 37, 4, 8, 4096),
                                          (2 * tokens, 8, 0, 64), (tokens + 5, 4, 8, 0)]:
    counted = most_voted_counted(votes, clip, slots, block=block, direct_max=direct,
                                 pairwise_max=pairs_max)
    np.testing.assert_array_equal(np.asarray(counted), np.asarray(sorted_))


def test_vote_counting_with_one_top_k_over_the_histogram_equals_by_sorting():
  """A large clip on the GPU picks the histogram's most counted by one lax.top_k over its slots
  (whole_pick_clip): the same kept tokens as sorting the votes, count ties to the lower token,
  holes and rows with fewer distinct tokens than clip included."""
  rng = np.random.default_rng(7)
  slots = 20000  # past what the pairs compare on the GPU (clip x 16-slot blocks > 4,096)
  votes = np.asarray(rng.integers(-1, slots, (3, 2 * PAIRWISE_MAX_VOTES)), np.int32)
  votes[2, 100:] = rng.integers(0, 200, 2 * PAIRWISE_MAX_VOTES - 100)  # < clip distinct tokens
  votes = jnp.asarray(votes)
  clip = WHOLE_PICK_MIN_CLIP + 44
  whole = most_voted(votes, clip, slots, pairwise_max=4096, whole_pick_clip=WHOLE_PICK_MIN_CLIP)
  np.testing.assert_array_equal(np.asarray(whole), np.asarray(most_voted_sorted(votes, clip)))
  np.testing.assert_array_equal(np.asarray(whole), np.asarray(most_voted(votes, clip, slots)))

  def top_ks(**kw):  # lax.top_k calls in the program: one over all slots, or through blocks
    return str(jax.make_jaxpr(lambda v: most_voted(v, clip, slots, pairwise_max=4096, **kw))(
        votes)).count(" top_k[")
  assert top_ks(whole_pick_clip=WHOLE_PICK_MIN_CLIP) == 1 < top_ks()
  # past the histogram's slots a vote for the block maxima, but within the whole pick's
  slots = (HISTOGRAM_MAX_SLOTS_PER_VOTE + 16) * votes.shape[1]
  whole = jax.jit(lambda v: most_voted(v, clip, slots, pairwise_max=4096,
                                       whole_pick_clip=WHOLE_PICK_MIN_CLIP))
  assert "scatter-add" in str(whole.trace(votes).jaxpr)  # counted, not sorted
  np.testing.assert_array_equal(np.asarray(whole(votes)),
                                np.asarray(most_voted_sorted(votes, clip)))


def test_upstream_gqa_pairing_would_select_other_tokens():
  q, k = _inputs(3, 1, 1)
  pos, valid = _step((150,), 1)
  scope = select_scope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(valid),
                       route=Route(), **HP)
  got = np.asarray(scope.idx[0, :int(scope.length[0])]).tolist()
  upstream = reference_scope(q[0], k[0], 150, pair=lambda head: head % 2, **HP)
  assert got == reference_scope(q[0], k[0], 150, **HP)
  assert got != upstream


def test_rope_positions_never_exceed_the_scope():
  method = get("reattention", chunk=8, **HP)
  q, k = _inputs(5, 3, 8, cache_len=400)
  for ends in [(9, 30, 57), (120, 250, 400), (399, 21, 333)]:
    pos, valid = _step(ends, 8)
    sc = select_scope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(valid),
                      route=Route(), **HP)
    length, first = np.asarray(sc.length), np.asarray(sc.q_offset)
    assert (length <= method.scope_size).all() and sc.idx.shape[1] == method.scope_size
    last_q = first + valid.sum(axis=1) - 1
    assert (last_q == length - 1).all()  # the step's last query takes the scope's last position


def _naive_attention(q, k, v, q_pos, k_pos):
  s = np.einsum("shd,htd->sht", q, k) / np.sqrt(q.shape[-1])
  s = np.where(k_pos[None, None, :] <= q_pos[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("sht,htd->shd", p / p.sum(-1, keepdims=True), v)


def _rope(x, pos, freqs):
  ang = pos[..., None].astype(np.float64) * np.asarray(freqs, np.float64)
  x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
  cos, sin = np.cos(ang), np.sin(ang)
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("backend", ["auto", "gpu", "tpu"])  # auto on CPU: the jnp path
@pytest.mark.parametrize("n_q", [8, 1])  # 1: decode, the kernel rotating the keys it gathers
def test_layer_output_is_rope_attention_over_the_reference_scope(backend, n_q):
  cfg = tiny_config()
  method = get("reattention", chunk=8, **HP)
  b, t, group = 2, 160, cfg.num_heads // cfg.num_kv_heads
  rng = np.random.default_rng(7)
  q = rng.normal(size=(b, n_q, cfg.num_heads, cfg.head_dim)).astype(np.float32)
  k_all = rng.normal(size=(b, t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
  v_all = rng.normal(size=(b, t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
  ends = (150, 61)
  pos, valid = _step(ends, n_q)
  state = KVCache(jnp.asarray(k_all.transpose(0, 2, 1, 3)),
                  jnp.asarray(v_all.transpose(0, 2, 1, 3)))
  k_new = np.take_along_axis(k_all, pos[:, :, None, None], axis=1)
  v_new = np.take_along_axis(v_all, pos[:, :, None, None], axis=1)
  freqs = inv_freq(cfg)
  ctx = AttnContext(layer=0, q_pos=jnp.asarray(pos), valid=jnp.asarray(valid), freqs=freqs,
                    cfg=cfg, options=RunOptions(route=Route(backend=backend)))
  out, _ = method.prefill(state, jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), ctx)
  for i, end in enumerate(ends):
    scope = np.asarray(reference_scope(q[i], k_all[i].transpose(1, 0, 2), end, **HP))
    rank = np.arange(len(scope))
    k_s = _rope(k_all[i, scope].transpose(1, 0, 2), rank[None, :], freqs)  # [KV, n, d]
    q_rank = np.searchsorted(scope, pos[i])
    q_r = _rope(q[i], q_rank[:, None], freqs)
    want = _naive_attention(q_r, np.repeat(k_s, group, axis=0),
                            np.repeat(v_all[i, scope].transpose(1, 0, 2), group, axis=0),
                            q_rank, rank)
    np.testing.assert_allclose(np.asarray(out[i]), want, atol=1e-5, rtol=1e-5)


def test_paper_defaults_fill_an_8k_window():
  m = get("reattention")
  assert (m.n_global, m.n_local, m.span, m.top_k, m.clip, m.chunk) == (32, 4096, 32, 4, 127, 512)
  assert m.scope_size == 8192 and m.prefill_chunk == 512
  assert ReAttention.for_window(8192) == m
  wide = ReAttention.for_window(131072)
  assert wide.scope_size <= 131072 and wide.n_local == 65536
  small_local = ReAttention.for_window(8192, local_fraction=0.25)  # the default model's setting
  assert (small_local.n_local, small_local.clip, small_local.scope_size) == (2048, 191, 8192)
  with pytest.raises(MethodError, match="too small"):
    ReAttention.for_window(8192, local_fraction=0.05)  # 409 local tokens < a 512-token chunk


def test_bad_settings_fail_clearly():
  cfg = tiny_config()  # window 64
  with pytest.raises(MethodError, match="exceeds the model's window"):
    get("reattention", n_global=4, n_local=40, span=4, clip=6).init_state(cfg, 1, 96, jnp.float32,
                                                                          8)
  with pytest.raises(MethodError, match="longer than n_local=16"):
    get("reattention", **HP).init_state(cfg, 1, 96, jnp.float32, 32)
  with pytest.raises(MethodError, match="clip=0 must be >= 1"):
    get("reattention", **{**HP, "clip": 0}).init_state(cfg, 1, 96, jnp.float32, 8)
  with pytest.raises(MethodError, match="has no hyper-parameter 'backend'"):
    get("reattention", backend="gpu", **HP)  # the run's route picks it (RunOptions.route)
