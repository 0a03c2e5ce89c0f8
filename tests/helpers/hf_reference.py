"""transformers' model classes (Llama, Mistral, Qwen2, Qwen3 by config.json) as the reference
implementation (weights only, fp32, CPU)."""

import numpy as np


def hf_logits(hf_dir: str, token_ids) -> np.ndarray:
  import torch
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits
  return out.numpy()


def hf_star(model, context, query, block: int, anchor: int, new_tokens: int):
  """Star Attention written a second time over a transformers model (upstream's recipe, batch 1):
  phase 1 runs each [anchor; block] row (anchor at 0..a-1, block at its global positions; block 0
  alone) and keeps the block's post-RoPE KV; phase 2 greedily decodes the query over the
  concatenated cache at positions continuing from the context. Returns (the query's last-token
  logits [V], new tokens)."""
  import torch
  from transformers import DynamicCache

  n = len(context)
  keys = values = None
  with torch.no_grad():
    for start in range(0, n, block):
      part = list(context[start:start + block])
      a = anchor if start else 0
      ids = list(context[:a]) + part
      pos = list(range(a)) + list(range(start, start + len(part)))
      out = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=True)
      ks = [layer.keys[:, :, a:] for layer in out.past_key_values.layers]
      vs = [layer.values[:, :, a:] for layer in out.past_key_values.layers]
      keys = ks if keys is None else [torch.cat(x, 2) for x in zip(keys, ks)]
      values = vs if values is None else [torch.cat(x, 2) for x in zip(values, vs)]
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
      cache.update(k, v, layer)
    ids, first, toks = list(query), None, []
    for _ in range(new_tokens):
      pos = torch.arange(n, n + len(ids))[None]
      logits = model(torch.tensor([ids]), position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[0, -1]
      first = logits.numpy() if first is None else first
      toks.append(int(logits.argmax()))
      n, ids = n + len(ids), toks[-1:]
  return first, toks
