"""Our H2O's prompt selection against the paper's rule run through NVIDIA kvpress on transformers.

The rule (arXiv:2306.14048; the authors' real-drop cache): after the prompt each key's attention
summed over every prompt query (and here over the query heads of its kv head), the latest half of
the budget always kept, the other half the largest sums. experiments/h2o_kvpress_check.py runs
the same comparison on the default model and RULER prompts.
"""

import numpy as np
import pytest

pytest.importorskip("kvpress")
torch = pytest.importorskip("torch")

from checkpoints_convert import export_hf  # noqa: E402
from experiments.h2o_kvpress_check import Prompt, agreement, hf_generate, ours, presses  # noqa: E402
from jax_longctx.app.api import LM  # noqa: E402
from jax_longctx.methods import get  # noqa: E402


def test_h2o_keeps_the_tokens_the_paper_rule_keeps_under_kvpress(tiny, tmp_path):
  from transformers import AutoModelForCausalLM

  cfg, params = tiny  # 3 layers, GQA (6 query / 2 kv heads): the group's sum is checked too
  export_hf(params, cfg, str(tmp_path / "hf"))
  model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                               attn_implementation="eager").eval()
  n, budget = 48, 24
  ids = np.random.default_rng(3).integers(0, cfg.vocab_size, n).tolist()
  _, ours_kept, _ = ours(LM(cfg, params, None), Prompt(ids, (), []), get("h2o", budget=budget),
                         budget, chunk=n)  # the whole prompt in one prefill chunk
  paper_press, observed_press = presses(recent_ratio=0.5)
  _, paper_kept = hf_generate(model, ids, paper_press(1 - budget / n), stop=set())
  assert all(len(heads) == budget for layer in ours_kept for heads in layer)
  assert agreement(ours_kept, paper_kept) == 1.0
  # kvpress's own H2O-like press averages over the queries that see a key and keeps no recent
  # window: another set, so the agreement above is not one any selection would reach.
  _, observed_kept = hf_generate(model, ids, observed_press(1 - budget / n), stop=set())
  assert agreement(ours_kept, observed_kept) < 0.95
