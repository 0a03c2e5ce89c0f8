"""transformers' LlamaForCausalLM as the reference implementation (weights only, fp32, CPU)."""

import numpy as np


def hf_logits(hf_dir: str, token_ids) -> np.ndarray:
  import torch
  from transformers import LlamaForCausalLM

  model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits
  return out.numpy()
