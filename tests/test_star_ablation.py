"""experiments/star_block_ablation.py, the tool behind Star's measured reason in docs/CLAIMS.md:
its splice must leave Star's answer alone when no block is made exact, and give full
attention's when every block is (Star's query step is exact over an exact context)."""

import numpy as np

from experiments.star_block_ablation import ablate
from jax_longctx.methods import get
from jax_longctx.run.driver import generate


def test_no_block_exact_is_star_and_every_block_exact_is_full_attention(default_lm):
  lm = default_lm
  rng = np.random.default_rng(3)
  doc = [int(t) for t in rng.integers(100, lm.config.vocab_size, 611)]  # 4 blocks of 153
  query = [int(t) for t in rng.integers(100, lm.config.vocab_size, 9)]
  none, every = ablate(lm, doc, query, ["none", "all"], max_new_tokens=6)
  star = generate(lm.params, lm.config, [doc], get("star"), instructions=[query],
                  max_new_tokens=6, options=lm.run_options())
  full = generate(lm.params, lm.config, [doc + query], get("full"), max_new_tokens=6,
                  options=lm.run_options())
  assert none == list(star.tokens[0])
  assert every == list(full.tokens[0])
  assert none != every  # Star's approximation shows on this sample, so the splice is seen
