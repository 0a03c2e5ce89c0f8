"""The memory a run would need, estimated before any weight is used, against the device's.

A sweep that cannot fit (full attention over 10M tokens) would otherwise build its prompt,
compile and fail minutes later with an allocator's message; `check` refuses it in one line that
gives the estimate and the longest length that fits. The estimate is a lower bound: the weights'
bytes, the KV cache as the method allocates it (its own buffers read off `new_cache` without
allocating them: full attention caches every token, a budgeted method mostly its budget, SnapKV
the whole prompt while it prefills; a method encoding its context in blocks, Star, every token
as full attention) and one prefill chunk's activations. It refuses only what
cannot fit; passing it says nothing of compiler scratch or fragmentation. Nothing is refused for
running past the model's trained window: some methods (ReAttention) read past it.

The device's memory: `bytes_limit` of the first local device on an accelerator, the weights and
cache spread over a mesh's devices; on CPU the host's available RAM (/proc/meminfo's
MemAvailable, else sysconf), to which the weights already resident there are added back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Callable

import jax

from jax_longctx import methods as methods_lib
from jax_longctx.core.errors import LongctxError
from jax_longctx.core.options import RunOptions
from jax_longctx.model import new_cache
from jax_longctx.run.chunked_prefill import chunk_for


class DoesNotFit(LongctxError, ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Need:
  """Bytes one run needs on one device."""
  weights: int
  cache: int
  activations: int

  @property
  def total(self) -> int:
    return self.weights + self.cache + self.activations


def weight_bytes(params) -> int:
  """Bytes of every array of a parameter tree (read off shapes; nothing is moved)."""
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params))


@functools.lru_cache(maxsize=256)
def cache_bytes(cfg, method, batch: int, cache_len: int, kv_dtype, chunk: int) -> int:
  """Bytes of the cache `method` allocates for `batch` rows of `cache_len` slots: every layer's
  state as `new_cache` builds it, traced for its shapes only (milliseconds at 10M slots)."""
  if getattr(method, "encodes_context", False):
    # Star's blocks hold every context token's keys and values once, as full attention's cache
    # does (their anchor copies on top are left out of this lower bound).
    method = methods_lib.get("full")
  shapes = jax.eval_shape(lambda: new_cache(cfg, method, batch, cache_len, kv_dtype, chunk=chunk))
  return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def activation_bytes(cfg, batch: int, chunk: int) -> int:
  """One prefill chunk through one layer: the residual stream and its normed copy, the
  queries, keys and values, attention's output, the MLP's three intermediate tensors, in fp32
  (the widest a step computes in), and the last position's logits. Attention's scores are left
  out: every path reads keys in blocks, so they stay small beside these."""
  width = (3 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
           + 3 * cfg.intermediate_size)
  return 4 * batch * (chunk * width + cfg.vocab_size)


def need(cfg, weights: int, method, *, length: int, cache_len: int, batch: int,
         options: RunOptions, spread: bool = True) -> Need:
  """What one method needs at one length (its cache stored as options.kv_dtype), on one device
  of options.mesh: a lower bound spreading weights and cache evenly over the mesh's devices.
  spread=False: the whole, for devices that share one memory (a CPU host's)."""
  chunk = chunk_for(method, options, length)
  kv_dtype = options.cache_dtype(cfg.jnp_dtype)
  devices = 1 if options.mesh is None or not spread else options.mesh.size
  return Need(weights // devices,
              cache_bytes(cfg, method, batch, cache_len, kv_dtype, chunk) // devices,
              activation_bytes(cfg, -(-batch // devices), chunk))


def available(resident: int = 0) -> tuple[int, str]:
  """(bytes one device may hold, its platform). On CPU: the host's available RAM plus
  `resident`, bytes of the weights that already lie in it (the estimate counts them)."""
  device = jax.local_devices()[0]
  # A CPU device's own limit, where JAX reports one, is no bound on the host's RAM.
  stats = (device.memory_stats() or {}) if device.platform != "cpu" else {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]), device.platform
  return host_available() + resident, device.platform


def host_available() -> int:
  """The host's available RAM: MemAvailable (what the kernel can give without swapping), else
  the free pages sysconf counts."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def longest_fitting(fits: Callable[[int], bool], hi: int) -> int:
  """The largest length in [0, hi) for which fits(length) holds (0: none), fits being monotone:
  a binary search of about log2(hi) estimates."""
  lo = 0
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def gigabytes(n: int) -> str:
  return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def tokens(n: int) -> str:
  """4096 -> '4K', 491520 -> '480K', 10485760 -> '10M' (as --lengths names them); a tenth
  below 100 units ('2.5M'), whole units above."""
  for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
    if n >= size:
      return f"{round(n / size, 1 if n < 100 * size else None):g}{unit}"
  return str(n)


def check(runs: list[tuple[str, int, Callable[[int], Need]]], capacity: int, platform: str,
          cache_len: int | None = None) -> None:
  """Refuses the first of `runs`, (label, length, need_at), whose need_at(length) is past
  `capacity`: one line with the estimate and the longest length that fits. cache_len: a cache
  size the run fixes whatever the length (then it, not the length, is what to lower)."""
  for label, length, need_at in runs:
    got = need_at(length)
    if got.total <= capacity:
      continue
    if cache_len is not None:
      asked, room = f"--cache-len {cache_len}", "lower --cache-len"
    else:
      fits = longest_fitting(lambda n: need_at(n).total <= capacity, length)
      asked = f"--lengths {tokens(length)}"
      room = (f"the longest that fits is ~{tokens(fits)} tokens" if fits >= 256 else
              "no length fits")
    raise DoesNotFit(
        f"{asked}: {label} needs ~{gigabytes(got.total)} ({gigabytes(got.cache)} of cache, "
        f"{gigabytes(got.weights)} of weights, {gigabytes(got.activations)} of activations) on "
        f"this {platform} device ({gigabytes(capacity)} available); {room}")
