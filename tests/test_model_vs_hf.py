"""The Flax model against transformers' LlamaForCausalLM on the same weights (fp32)."""

import numpy as np
import pytest

from checkpoints_convert import export_hf
from jax_longctx.app.api import LM
from jax_longctx.core.config import RopeScaling
from jax_longctx.model import random_params
from tests.conftest import TINY_LLAMA3, tiny_config
from tests.helpers.hf_reference import hf_logits


def test_default_model_matches_transformers(default_lm, default_hf_dir):
  text = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ") * 12
  ids = default_lm.encode(text)[:160]
  assert len(ids) >= 128
  ours = np.asarray(default_lm.logits([ids]))
  ref = hf_logits(default_hf_dir, [ids])
  assert np.max(np.abs(ours - ref)) <= 1e-3


@pytest.mark.parametrize("rope, tied, kv_heads, length", [
    (TINY_LLAMA3, False, 2, 40),  # GQA, untied, llama3 scaling
    ({}, True, 6, 24),  # MHA, tied
    ({"rope_scaling": RopeScaling("linear", 4.0)}, False, 3, 24),
    ({"rope_scaling": RopeScaling("dynamic", 2.0)}, False, 1, 80),  # past max positions (64)
])
def test_tiny_random_matches_transformers(tmp_path, rope, tied, kv_heads, length):
  cfg = tiny_config(tie_word_embeddings=tied, num_kv_heads=kv_heads, **rope)
  params = random_params(cfg, seed=3)
  export_hf(params, cfg, str(tmp_path / "hf"))
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, length))
  ours = np.asarray(LM(cfg, params, None).logits(ids))
  ref = hf_logits(str(tmp_path / "hf"), ids)
  assert np.max(np.abs(ours - ref)) <= 1e-4 * max(1.0, np.max(np.abs(ref)))
