"""Chain-of-key (RefreshKV, arXiv:2411.05787, Appendix A.6).

A shuffled list of two-word keys "a-b" in which every word starts exactly one key, so each key
has exactly one successor (the key that starts with its last word). The model writes a chain of
T keys; the score is the length of the valid prefix over T (a key is valid if it is in the list
and, after the first, starts with the previous key's last word).
"""

from __future__ import annotations

import dataclasses
import random
import re

from jax_longctx.app.tasks import text_sources
from jax_longctx.app.tasks.base import Sample, TaskError, fit_length, from_question, render


@dataclasses.dataclass(frozen=True)
class ChainOfKey:
  chain: int = 10  # T
  name = "chain_of_key"
  needle_task = False

  @property
  def max_new_tokens(self) -> int:
    return 8 * self.chain

  def make(self, tok, length: int, depth: float | None, seed: int, chat: bool = False) -> Sample:
    rng = random.Random(seed)
    vocab = list(text_sources.words("noun") + text_sources.words("adjective"))
    rng.shuffle(vocab)
    tail = (f"\n\nYou are given many keys composed of a few words. Your task is to generate a "
            f"chain of {self.chain} keys such that the first word of the current key is the last "
            f"word of the previous key. Separate the keys with comma. You must generate keys that "
            f"are in the context.")
    answer = f" Chain of {self.chain} keys:"

    def keys_for(n):
      if n + 1 > len(vocab):
        raise TaskError(f"not enough words for {n} keys")
      cycle = vocab[:max(n, self.chain + 1)]  # one cycle: every chain can go on
      keys = [f"{cycle[i]}-{cycle[(i + 1) % len(cycle)]}" for i in range(len(cycle))]
      random.Random(seed + 1).shuffle(keys)
      return keys

    def build(n):
      body = "Here is a list of keys: " + ", ".join(keys_for(n)) + "." + tail
      return render(tok, body, answer, chat)

    prompt, n_tok = fit_length(tok, length, build, length // 6, name=self.name)
    keys = tuple(re.findall(r"\w+-\w+", prompt.split("Here is a list of keys:")[1].split(".")[0]))
    return Sample(self.name, prompt, keys, length, None, seed, n_tok,
                  from_question(prompt, tail.lstrip()))

  def score(self, prediction: str, sample: Sample) -> float:
    valid = set(sample.expected)
    got = re.findall(r"[A-Za-z]+-[A-Za-z]+", prediction)
    ok, prev = 0, None
    for key in got[:self.chain]:
      if key not in valid or (prev is not None and key.split("-")[0] != prev.split("-")[1]):
        break
      ok, prev = ok + 1, key
    return ok / self.chain
