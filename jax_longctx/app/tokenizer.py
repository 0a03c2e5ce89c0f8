"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import json
import os


class Tokenizer:

  def __init__(self, directory: str):
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{directory}: no tokenizer.json")
    self._tk = HFTokenizer.from_file(path)
    conf_path = os.path.join(directory, "tokenizer_config.json")
    conf = {}
    if os.path.exists(conf_path):
      with open(conf_path) as f:
        conf = json.load(f)
    self.chat_template: str | None = conf.get("chat_template")
    self.add_bos = bool(conf.get("add_bos_token", False))
    self.bos_token = self._token_text(conf.get("bos_token"))
    self.eos_token = self._token_text(conf.get("eos_token"))

  def save(self, directory: str) -> None:
    """tokenizer.json and the settings this class reads, into `directory`."""
    self._tk.save(os.path.join(directory, "tokenizer.json"))
    conf = {"chat_template": self.chat_template, "add_bos_token": self.add_bos,
            "bos_token": self.bos_token, "eos_token": self.eos_token}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({k: v for k, v in conf.items() if v is not None}, f, indent=1)

  @staticmethod
  def _token_text(tok):
    return tok.get("content") if isinstance(tok, dict) else tok

  def token_id(self, text: str | None) -> int | None:
    return None if text is None else self._tk.token_to_id(text)

  @property
  def vocab_size(self) -> int:
    return self._tk.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    """Token ids; BOS first when the tokenizer adds one and the text does not already begin with
    it (a chat template that writes `{{- bos_token }}` itself, as Llama 3's does, gets one BOS)."""
    # encode_batch releases the GIL (encode holds it for ~2 s on a 1M-token prompt), so a sweep
    # can build its next sample on a thread while the device runs this one (eval.py).
    ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
    bos = self.token_id(self.bos_token)
    if self.add_bos and bos is not None and ids[:1] != [bos]:
      return [bos] + ids
    return ids

  def decode(self, ids) -> str:
    return self._tk.decode([int(i) for i in ids], skip_special_tokens=True)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
