"""Passkey retrieval (Mohtashami & Jaggi 2023) with the prompt of CItruS (arXiv:2406.12018, App. E).

The needle stands on its own line. With the chat template the question closes the user turn
and the model answers in its own words ("The pass key is ..."): measured on the default model at
4K tokens, the plain prompt's answer prefix and its four blank lines made it answer "a magical
key" at middle depths where this form retrieves the key.
"""

from __future__ import annotations

import dataclasses
import random
import re

from jax_longctx.app.tasks.base import (Sample, fit_length, from_question, insert_at_depths, render,
                                    take_words, token_counter)
from jax_longctx.app.tasks.text_sources import FILLER_SENTENCES

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
          "them. I will quiz you about the important information there. ")
QUESTION = "\n\n\n\nWhat is the pass key? The pass key is"
CHAT_QUESTION = "What is the pass key?"


@dataclasses.dataclass(frozen=True)
class Passkey:
  name = "passkey"
  needle_task = True
  max_new_tokens: int = 12

  def make(self, tok, length: int, depth: float, seed: int, chat: bool = False) -> Sample:
    key = f"{random.Random(seed).randint(10000, 99999)}"
    needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"

    measure = token_counter(tok)

    def context(n_words):
      return insert_at_depths(take_words(FILLER_SENTENCES, n_words), [(depth, needle)], measure)

    def build(n):
      if chat:
        return render(tok, HEADER + context(n) + CHAT_QUESTION, "", chat=True)
      return render(tok, HEADER + context(n) + QUESTION, "", chat=False)

    prompt, n_tok = fit_length(tok, length, build, length // 2, name=self.name)
    question = CHAT_QUESTION if chat else QUESTION
    return Sample(self.name, prompt, (key,), length, depth, seed, n_tok,
                  from_question(prompt, question))

  def score(self, prediction: str, sample: Sample) -> float:
    numbers = re.findall(r"\d+", prediction)
    return float(bool(numbers) and numbers[0] == sample.expected[0])
