"""pallas_kernels/vote_scope.py (Pallas interpret mode on CPU) against the jnp scope it replaces
(jax_longctx/methods/reattention_scope.py: most_voted, span_runs, assemble), integer for integer,
and through select_scope against the paper's reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.methods import reattention_scope as rs
from pallas_kernels import KernelOptions
from pallas_kernels.vote_scope import MAX_VOTES, voted_scope
from tests.test_reattention import HP, _inputs, _step, reference_scope


def jnp_scope(votes, hi, seq_end, first_q, *, n_global, n_local, span, clip):
  kept = rs.most_voted(jnp.asarray(votes), clip)
  first, count = rs.span_runs(kept, jnp.int32(n_global), jnp.asarray(hi), span)
  return rs.assemble(first, count, n_global, n_local, n_global + clip * span + n_local,
                     jnp.asarray(seq_end), jnp.asarray(first_q))


def random_votes(rng, hi, lo, v):
  """Per row: a few distinct tokens of [lo, hi) voted many times over, some holes (-1); a row
  with no candidates votes nothing."""
  votes = np.full((len(hi), v), -1, np.int32)
  for b, end in enumerate(hi):
    if end > lo:
      pool = rng.integers(lo, end, size=int(rng.integers(1, 3 * 12)))
      votes[b] = rng.choice(pool, size=v)
      votes[b][rng.random(v) < 0.2] = -1
  return votes


# (votes per row, n_global, n_local, span, clip): fewer distinct tokens than clip and more;
# odd and even spans; no global part; 256 votes (MAX_VOTES, 64 heads x top-4); 200 (padded)
CASES = [(128, 4, 16, 5, 6), (40, 0, 24, 4, 20), (200, 3, 8, 1, 13), (MAX_VOTES, 32, 64, 32, 7)]


@pytest.mark.parametrize("v,n_global,n_local,span,clip", CASES)
def test_equals_the_jnp_scope(v, n_global, n_local, span, clip):
  rng = np.random.default_rng(v + clip)
  # sequences: long; shorter than global + local (no candidates); just past it; spans that
  # reach the local part and the global part
  seq_end = np.array([400, n_global + n_local - 1, n_global + n_local + 2, 190], np.int32)
  hi = seq_end - n_local
  first_q = seq_end - np.array([1, 1, 2, 1], np.int32)
  votes = random_votes(rng, hi, n_global, v)
  votes[3, :4] = [n_global, n_global, hi[3] - 1, hi[3] - 1]  # spans clipped at both ends
  want = jnp_scope(votes, hi, seq_end, first_q, n_global=n_global, n_local=n_local, span=span,
                   clip=clip)
  size = want.idx.shape[1]
  idx, length, q_offset = voted_scope(jnp.asarray(votes),
                                      jnp.asarray(np.stack([hi, seq_end, first_q], axis=1)),
                                      n_global=n_global, n_local=n_local, span=span, clip=clip,
                                      size=size, interpret=True)
  assert idx.shape == (4, size) and idx.dtype == length.dtype == q_offset.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(length), np.asarray(want.length))
  np.testing.assert_array_equal(np.asarray(q_offset), np.asarray(want.q_offset))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want.idx))
  assert int(length[0]) > n_global + n_local  # something was selected


def test_select_scope_with_the_kernel_equals_the_paper_reference():
  """A decode step of 2 sequences (one without candidates yet) through select_scope with
  KernelOptions(scope_kernel=True) on the interpreted GPU kernels."""
  seq_ends = (160, 21)
  q, k = _inputs(0, len(seq_ends), 1)
  pos, valid = _step(seq_ends, 1)
  scope = rs.select_scope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(valid),
                          backend="gpu", options=KernelOptions(scope_kernel=True), **HP)
  for b, end in enumerate(seq_ends):
    want = reference_scope(q[b], k[b], end, **HP)
    n = int(scope.length[b])
    assert np.asarray(scope.idx[b, :n]).tolist() == want
    assert int(scope.q_offset[b]) == want.index(int(pos[b, 0]))


def test_bad_input():
  votes, bounds = jnp.zeros((2, MAX_VOTES + 1), jnp.int32), jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="at most 256"):
    voted_scope(votes, bounds, n_global=1, n_local=1, span=1, clip=1, size=3)
  with pytest.raises(ValueError, match="bounds"):
    voted_scope(votes[:, :8], bounds[:, :2], n_global=1, n_local=1, span=1, clip=1, size=3)
