"""H2O here against NVIDIA kvpress on the default model (CPU, fp32): answers and kept tokens.

    python -m experiments.h2o_kvpress_check --length 2048 --samples 6 --out h2o_kvpress.json

RULER niah prompts (chat template, as the RULER sweeps run them) at one compression ratio (the
sweep's: the budget is (1 - ratio) x length tokens), each read four ways over the same weights:

  full      our full attention;
  h2o       our `h2o`: one prefill chunk (as on GPU, where a 4K prompt is one chunk), heavy
            hitters + recent tokens, and one eviction per generated token (the paper's Alg. 1);
  paper     H2O's prompt-time selection written as a kvpress press over transformers: attention
            summed over every prompt query (no normalization), the query heads of a kv head
            summed, the latest recent_ratio x budget tokens always kept; evicts once after the
            prefill and never while generating;
  observed  kvpress's ObservedAttentionPress (its H2O-like press): attention averaged over the
            queries that can see each key (a causal normalization), no recent window, once after
            the prefill.

Both presses compress the whole prompt (question included), as our methods do. The report per
sample: each way's answer and score, how far our kept set after the prefill agrees with the
paper press's (per layer and kv head), and the share of (layer, kv head, needle value token) each
kept set holds, ours after the prefill and after each generated token: whether a lost needle was
lost while reading the prompt or while answering. Needs torch, transformers and kvpress (pip install kvpress; it installs
beside this project's transformers with --no-deps plus cachetools, datasets and fire).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time

import numpy as np

STEPS = 12  # a RULER niah answer of one 7-digit value ends well within this


@dataclasses.dataclass
class Prompt:
  ids: list[int]
  expected: tuple[str, ...]
  needle: list[int]  # positions of the tokens that spell the expected value(s) in the prompt


def needle_positions(tokenizer, ids, values) -> list[int]:
  """Prompt positions whose token text overlaps a value's characters (the first occurrence of
  each value in the decoded prompt; digits are single tokens in SmolLM2's vocabulary)."""
  ends, text = [], ""
  for t in ids:
    text += tokenizer.decode([t])
    ends.append(len(text))
  out = []
  for value in values:
    at = text.find(value)
    if at < 0:
      continue
    start = 0
    for i, end in enumerate(ends):
      if end > at and start < at + len(value):
        out.append(i)
      start = end
  return sorted(set(out))


def prompts(lm, task_name: str, length: int, n: int) -> list[Prompt]:
  from jax_longctx.app import tasks

  task = tasks.get(task_name, max_new_tokens=STEPS)
  out = []
  for seed in range(n):
    s = task.make(lm.tokenizer, length, None, seed, chat=True)
    ids = lm.tokenizer.encode(s.prompt)
    out.append(Prompt(ids, s.expected, needle_positions(lm.tokenizer, ids, s.expected)))
  return out


# ---- our side ------------------------------------------------------------------------------
def ours(lm, prompt: Prompt, method, budget: int | None, chunk: int | None = None):
  """Greedy tokens, and for an evicting method the kept positions [L][KV] after the prefill
  and the share of the needle held after each step. The prompt is one prefill chunk (`chunk`
  tokens; default the prompt rounded up to 512, as the GPU default reads a 4K prompt)."""
  import jax
  import jax.numpy as jnp
  from jax_longctx.model import forward
  from jax_longctx.run import generation as gen

  n = len(prompt.ids)
  options = lm.run_options(chunk_size=chunk or -(-n // 512) * 512)
  cache, last = gen.prefill(lm.params, lm.config, [prompt.ids], method, cache_len=n + STEPS,
                            options=options, decode_room=STEPS)
  step = jax.jit(forward, static_argnums=(4, 5), static_argnames=("decode", "options"))
  needle = np.asarray(prompt.needle)

  def kept():
    return [[set(np.asarray(layer.pos)[0, h][np.asarray(layer.pos)[0, h] >= 0].tolist())
             for h in range(layer.pos.shape[1])] for layer in cache.state]

  def needle_held():
    return None if budget is None else held_share(kept(), needle)

  after_prefill = kept() if budget is not None else None
  held = [needle_held()]
  toks = [int(jnp.argmax(last[0]))]
  for _ in range(STEPS - 1):
    if toks[-1] in lm.stop_tokens():
      break
    logits, cache = step(lm.params, jnp.asarray([[toks[-1]]], jnp.int32),
                         cache.lengths[:, None], cache, method, lm.config, decode=True,
                         options=options)
    toks.append(int(jnp.argmax(logits[0, 0])))
    held.append(needle_held())
  return toks, after_prefill, held


# ---- kvpress side --------------------------------------------------------------------------
def presses(recent_ratio: float):
  """(the paper's H2O prompt selection, kvpress's ObservedAttentionPress), each recording the
  positions it keeps per layer."""
  import torch
  from kvpress import ObservedAttentionPress, ScorerPress
  from kvpress.utils import compute_n_kept

  class Recording:
    """Keeps each layer's kept positions [KV] (the press's own top-k of its scores)."""

    def forward_hook(self, module, inputs, kwargs, output):
      # transformers >= 5.3 hands the attention layer its cache as `cache` and no
      # cache_position; kvpress 0.5 reads `past_key_values` and `cache_position`: both given
      # here (the tokens of this forward are the latest q_len of the layer's cache).
      if "past_key_values" not in kwargs:
        cache = kwargs["cache"]
        n, q_len = cache.get_seq_length(module.layer_idx), kwargs["hidden_states"].shape[1]
        kwargs = {**kwargs, "past_key_values": cache,
                  "cache_position": torch.arange(n - q_len, n)}
      return super().forward_hook(module, inputs, kwargs, output)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
      s = super().score(module, hidden_states, keys, values, attentions, kwargs)
      n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
      top = s.topk(n_kept, dim=-1).indices[0]
      self.kept[module.layer_idx] = [set(row.tolist()) for row in top]
      return s

  @dataclasses.dataclass
  class H2OPromptPress(ScorerPress):
    """H2O (arXiv:2306.14048) at the end of a prefill: each key's attention summed over all
    prompt queries and the query heads of its kv head; the latest recent_ratio of the kept
    tokens always stay (the paper's equal heavy / recent split at 0.5)."""
    recent_ratio: float = 0.5

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
      b, kvh, n, _ = keys.shape
      s = attentions.sum(2).view(b, kvh, -1, n).sum(2)
      recent = round(self.recent_ratio * compute_n_kept(n, self.compression_ratio))
      s[..., n - recent:] = math.inf
      return s

  @dataclasses.dataclass
  class RecordedH2O(Recording, H2OPromptPress):
    kept: dict = dataclasses.field(default_factory=dict)

  @dataclasses.dataclass
  class RecordedObserved(Recording, ObservedAttentionPress):
    kept: dict = dataclasses.field(default_factory=dict)

  return (lambda ratio: RecordedH2O(compression_ratio=ratio, recent_ratio=recent_ratio),
          lambda ratio: RecordedObserved(compression_ratio=ratio))


def hf_generate(model, ids: list[int], press, stop) -> tuple[list[int], dict]:
  """kvpress's recipe: the press hooked in for the prefill only, then greedy decoding over the
  compressed cache at positions continuing the prompt's."""
  import torch
  from transformers import DynamicCache

  cache = DynamicCache()
  with torch.no_grad(), press(model):
    out = model(torch.tensor([ids]), cache=cache, logits_to_keep=1)
  toks = [int(out.logits[0, -1].argmax())]
  with torch.no_grad():
    for i in range(STEPS - 1):
      if toks[-1] in stop:
        break
      out = model(torch.tensor([[toks[-1]]]), cache=cache,
                  position_ids=torch.tensor([[len(ids) + i]]))
      toks.append(int(out.logits[0, -1].argmax()))
  return toks, press.kept


def held_share(kept, needle) -> float | None:
  """The share of (layer, kv head, needle token) that a kept set [L][KV] holds."""
  if not len(needle):
    return None
  return round(float(np.mean([p in heads for layer in kept for heads in layer
                              for p in needle])), 4)


def agreement(ours_kept, theirs: dict) -> float:
  """Mean over layers and kv heads of |ours & theirs| / |theirs|."""
  shares = [len(o & theirs[layer][h]) / len(theirs[layer][h])
            for layer, heads in enumerate(ours_kept) for h, o in enumerate(heads)]
  return float(np.mean(shares))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="ruler:niah_single_1")
  p.add_argument("--length", type=int, default=2048)
  p.add_argument("--samples", type=int, default=6)
  p.add_argument("--ratio", type=float, default=0.25, help="compression ratio (the sweep's)")
  p.add_argument("--recent-ratio", type=float, default=0.5)
  p.add_argument("--out", default=None, help="JSON file for the per-sample records")
  args = p.parse_args()

  import torch
  from transformers import AutoModelForCausalLM
  import jax_longctx
  from jax_longctx import methods
  from jax_longctx.checkpoints import export_hf

  torch.set_num_threads(max(1, os.cpu_count() or 1))
  lm = jax_longctx.load("default", dtype="float32")
  stop = set(lm.stop_tokens())
  budget = max(1, round((1 - args.ratio) * args.length))
  h2o = methods.get("h2o", budget=budget, recent_ratio=args.recent_ratio)
  paper_press, observed_press = presses(args.recent_ratio)
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "hf")  # export_hf writes a directory that does not exist yet
    export_hf(lm.params, lm.config, hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
  records = []
  for i, pr in enumerate(prompts(lm, args.task, args.length, args.samples)):
    t0 = time.time()
    n = len(pr.ids)
    kv_ratio = 1 - min(budget, n) / n  # kvpress's ratio of this prompt: the same tokens kept
    full_toks, _, _ = ours(lm, pr, methods.get("full"), None)
    h2o_toks, h2o_kept, held = ours(lm, pr, h2o, budget)
    paper_toks, paper_kept = hf_generate(model, pr.ids, paper_press(kv_ratio), stop)
    obs_toks, obs_kept = hf_generate(model, pr.ids, observed_press(kv_ratio), stop)
    answer = lambda t: lm.tokenizer.decode([x for x in t if x not in stop])  # noqa: E731
    score = lambda t: float(all(e in answer(t) for e in pr.expected))  # noqa: E731
    rec = {
        "seed": i, "n_tokens": n, "budget": budget, "needle": pr.needle,
        "expected": pr.expected,
        **{f"{k}_answer": answer(t) for k, t in (("full", full_toks), ("h2o", h2o_toks),
                                                ("paper", paper_toks), ("observed", obs_toks))},
        **{f"{k}_score": score(t) for k, t in (("full", full_toks), ("h2o", h2o_toks),
                                              ("paper", paper_toks), ("observed", obs_toks))},
        "h2o_vs_paper_kept": round(agreement(h2o_kept, paper_kept), 4),
        "h2o_vs_observed_kept": round(agreement(h2o_kept, obs_kept), 4),
        "needle_held_by_h2o_per_step": held,
        "needle_held_by_paper": held_share(list(paper_kept.values()), pr.needle),
        "needle_held_by_observed": held_share(list(obs_kept.values()), pr.needle),
        "seconds": round(time.time() - t0, 1),
    }
    records.append(rec)
    print(json.dumps(rec), flush=True)
  summary = {k: round(100 * np.mean([r[f"{k}_score"] for r in records]), 1)
             for k in ("full", "h2o", "paper", "observed")}
  summary["h2o_vs_paper_kept"] = round(float(np.mean([r["h2o_vs_paper_kept"] for r in records])), 4)
  print(json.dumps({"task": args.task, "length": args.length, "ratio": args.ratio,
                    "budget": budget, "samples": len(records), "score_%": summary}))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "records": records, "summary": summary}, f, indent=1)


if __name__ == "__main__":
  main()
