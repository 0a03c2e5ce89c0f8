"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) and its chat template.

A chat template is Jinja code that comes with the model file, so it is untrusted: it renders in
Jinja's immutable sandbox (no attribute that starts with `_`, no method that changes a list or
dict) with the helpers transformers gives templates (`raise_exception`, `strftime_now`, a JSON
`tojson`, `{% break %}`/`{% continue %}`, `{% generation %}` blocks). A template that reaches for
Python internals, or fails in any other way, is one TokenizerError line naming the model file it
came from; nothing of it runs outside the sandbox.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jax_longctx.checkpoints.gguf_tokenizer import SOURCE_KEY
from jax_longctx.core.errors import LongctxError

_MAX_REPEAT = 1 << 22  # characters or items one `*` may build (a chat prompt is far shorter)
_MAX_BITS = 1 << 16  # of an integer `*` or `**` (10 ** 10 ** 10 would fill memory)
_MAX_REASON = 300  # characters of a template's own error message quoted in ours


class TokenizerError(LongctxError, ValueError):
  """A tokenizer file or chat template this library refuses or cannot use."""


# ---- the sandbox --------------------------------------------------------------------------------
def _raise_exception(message):
  # What templates call on a conversation they do not support ("System message must be first").
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; the models were trained on
  # prompts rendered with transformers' filter, which does neither.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def _dict(*args, **kwargs):
  # In place of the `dict` type itself, whose class attributes a template has no use for.
  return dict(*args, **kwargs)


_dict.fromkeys = dict.fromkeys


class _Namespace(jinja2.utils.Namespace):
  """`namespace(...)` that refuses names starting with `_`: Python looks up some of those
  (`__html__`) on the object, where a template could plant its own."""

  def __init__(*args, **kwargs):  # noqa: B902 (Namespace's signature: `self` may be a key)
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise SecurityError(f"namespace attribute {name!r} starts with '_'")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`, which templates wrap around assistant turns for
  training masks: here it renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
  intercepted_binops = frozenset(("*", "**"))

  def unsafe_undefined(self, obj, attribute):
    # Jinja's default is an Undefined that fails only when used further, so `{{ x.__class__ }}`
    # would print nothing; a template that reaches for internals at all is refused.
    raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object "
                        "is unsafe")

  def call_binop(self, context, operator, left, right):
    # A sandboxed template may still ask for an absurd string or number in one expression.
    if operator == "*":
      for seq, n in ((left, right), (right, left)):
        if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
            and len(seq) * n > _MAX_REPEAT):
          raise SecurityError(f"a repetition of {len(seq) * n} items is too large")
      if _ints(left, right) and abs(left).bit_length() + abs(right).bit_length() > _MAX_BITS:
        raise SecurityError(f"an integer product of more than {_MAX_BITS} bits is too large")
    if (operator == "**" and _ints(left, right) and right > 0
        and abs(left).bit_length() * right > _MAX_BITS):
      raise SecurityError(f"an integer power of about {abs(left).bit_length() * right} bits is too "
                          "large")
    return super().call_binop(context, operator, left, right)


def _ints(*values) -> bool:
  return all(isinstance(v, int) for v in values)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
  env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                 extensions=[jinja2.ext.loopcontrols, _Generation])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict,
                     namespace=_Namespace)
  return env


def _one_line(e: Exception) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  if len(text) > _MAX_REASON:
    text = text[:_MAX_REASON] + "..."
  return text


def _template_error(origin: str, e: Exception) -> TokenizerError:
  if isinstance(e, SecurityError):
    what = "refused by the template sandbox"
  elif isinstance(e, jinja2.TemplateSyntaxError):
    what = f"has a syntax error at line {e.lineno}"
  elif type(e) is jinja2.exceptions.TemplateError:  # the template's own raise_exception
    what = "refuses this conversation"
  else:
    what = f"fails ({type(e).__name__})"
  return TokenizerError(f"{origin}: chat template {what}: {_one_line(e)}")


def _template_text(value, origin: str) -> str | None:
  """tokenizer_config.json's chat_template: one string, or transformers' list of named templates
  (the one named "default" is the chat template)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, dict) for t in value):
    named = {t.get("name"): t.get("template") for t in value}
    if isinstance(named.get("default"), str):
      return named["default"]
  raise TokenizerError(f"{origin}: chat_template is neither a string nor a list of named "
                       "templates with a 'default' one")


# ---- the tokenizer ------------------------------------------------------------------------------
class Tokenizer:

  def __init__(self, directory: str):
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{directory}: no tokenizer.json")
    try:
      self._tk = HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
      raise TokenizerError(f"{path}: not a readable tokenizer ({_one_line(e)})") from e
    conf_path = os.path.join(directory, "tokenizer_config.json")
    conf = {}
    if os.path.exists(conf_path):
      try:
        with open(conf_path) as f:
          conf = json.load(f)
      except (OSError, ValueError, RecursionError) as e:
        raise TokenizerError(f"{conf_path}: not readable JSON ({_one_line(e)})") from e
      if not isinstance(conf, dict):
        raise TokenizerError(f"{conf_path}: not a JSON object")
    # Errors of the template name the file the user gave: a GGUF's tokenizer is written out to a
    # directory of its own (recording the GGUF) before it is read here.
    source = conf.get(SOURCE_KEY)
    self.origin = source if isinstance(source, str) else conf_path
    self.chat_template: str | None = _template_text(conf.get("chat_template"), self.origin)
    self._compiled: tuple[str, jinja2.Template] | None = None
    self.add_bos = bool(conf.get("add_bos_token", False))
    self.bos_token = self._token_text(conf.get("bos_token"), "bos_token")
    self.eos_token = self._token_text(conf.get("eos_token"), "eos_token")

  def save(self, directory: str) -> None:
    """tokenizer.json and the settings this class reads, into `directory`."""
    self._tk.save(os.path.join(directory, "tokenizer.json"))
    conf = {"chat_template": self.chat_template, "add_bos_token": self.add_bos,
            "bos_token": self.bos_token, "eos_token": self.eos_token}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({k: v for k, v in conf.items() if v is not None}, f, indent=1)

  def _token_text(self, tok, key: str) -> str | None:
    text = tok.get("content") if isinstance(tok, dict) else tok
    if text is not None and not isinstance(text, str):
      raise TokenizerError(f"{self.origin}: {key} is {text!r}, not a token's text")
    return text

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

  def _template(self) -> jinja2.Template:
    """The chat template compiled once (again only if `chat_template` was replaced)."""
    if self._compiled is None or self._compiled[0] != self.chat_template:
      try:
        self._compiled = (self.chat_template, _environment().from_string(self.chat_template))
      except Exception as e:  # a syntax error, or an expression the compiler rejects
        raise _template_error(self.origin, e) from e
    return self._compiled[1]

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if not self.chat_template:
      raise TokenizerError(f"{self.origin}: this tokenizer has no chat template")
    template = self._template()
    try:
      return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                             bos_token=self.bos_token or "", eos_token=self.eos_token or "")
    except Exception as e:  # whatever the template does wrong is its error, named as such
      raise _template_error(self.origin, e) from e
