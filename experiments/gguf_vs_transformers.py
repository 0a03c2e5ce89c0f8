"""A GGUF loaded by this library against transformers' own GGUF loader (fp32, CPU).

    python experiments/gguf_vs_transformers.py --model qwen2.5-coder-0.5b --out docs/results/qwen/gguf_vs_transformers.json

Compares the tokenizers on a set of strings, the logits over a few hundred tokens of prose (max
|diff|), and 32 greedy tokens after a ~200-token chat prompt. Needs torch and accelerate (which
transformers requires for GGUF); not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

STRINGS = [
    "def add(a, b):\n    return a + b\n\n# test\nprint(add(2, 3))",
    "Hello world! It's 2024-11-22, we'll see 12345678 numbers and 3.14159.",
    "   leading spaces\n\n\ttabs\r\nand CRLF   ",
    "naïve café – “quotes” 日本語のテキスト 中文 한국어 emoji 😀👍",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "The pass key is 60494. Remember it. 60494 is the pass key.",
    "I'M DON'T YOU'LL they've", "x" * 50 + " " + "ab12cd345ef" * 5,
    "if (x != y && z >= 10) { return arr[i++]; } // comment",
    "ÀÉÎõü ßẞ ǅ Σσς", "   ", "", "a\n\n\nb  \n  c",
]
PROSE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again. ") * 30
QUESTION = ("Summarize in one sentence, then write a Python function that reverses a string.\n\n"
            + PROSE[:700])


def reference(gguf_path: str, n_logits: int, n_new: int) -> dict:
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  d, f = os.path.split(gguf_path)
  tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
  chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                 add_generation_prompt=True)
  prompt = tok.encode(chat, add_special_tokens=False)
  ids = tok.encode(PROSE, add_special_tokens=False)[:n_logits]
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].numpy()
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
  return {"encodings": [tok.encode(s, add_special_tokens=False) for s in STRINGS], "chat": chat,
          "prompt": prompt, "ids": ids, "logits": logits, "greedy": greedy[0, len(prompt):].tolist()}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a bundled name or a .gguf path")
  p.add_argument("--logit-tokens", type=int, default=300)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--out", default=None, help="JSON file for the measured numbers")
  args = p.parse_args()

  import jax_longctx
  from jax_longctx.app import bundled

  path = bundled.gguf_file(args.model) if args.model in bundled.BUNDLED else args.model
  t0 = time.time()
  ref = reference(path, args.logit_tokens, args.new_tokens)
  t_ref = time.time() - t0
  lm = jax_longctx.load(path, dtype="float32")
  ours_enc = [lm.tokenizer.encode(s) for s in STRINGS]
  same_tok = [a == b for a, b in zip(ours_enc, ref["encodings"])]
  chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
  logits = np.asarray(lm.logits([ref["ids"]]))[0]
  greedy = lm.generate([ref["prompt"]], max_new_tokens=args.new_tokens, stop_tokens=())[0]
  agree = sum(a == b for a, b in zip(greedy, ref["greedy"]))
  first_diff = next((i for i, (a, b) in enumerate(zip(greedy, ref["greedy"])) if a != b), None)
  result = {
      "model": args.model, "tokenizer_strings_equal": f"{sum(same_tok)}/{len(same_tok)}",
      "chat_template_equal": chat == ref["chat"],
      "chat_prompt_tokens_equal": lm.tokenizer.encode(chat) == ref["prompt"],
      "prompt_tokens": len(ref["prompt"]), "logit_tokens": len(ref["ids"]),
      "max_abs_logit_diff": float(np.max(np.abs(logits - ref["logits"]))),
      "max_abs_logit": float(np.max(np.abs(ref["logits"]))),
      "argmax_agree": float(np.mean(logits.argmax(-1) == ref["logits"].argmax(-1))),
      "greedy_agree": f"{agree}/{len(ref['greedy'])}", "greedy_first_diff": first_diff,
      "greedy_text": lm.tokenizer.decode(greedy), "seconds_transformers": round(t_ref, 1),
      "seconds_total": round(time.time() - t0, 1),
  }
  print(json.dumps(result, indent=1, ensure_ascii=False))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
  main()
