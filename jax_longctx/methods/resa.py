"""RESA: a rank-1 prior that estimates what sparse attention leaves out, merged online.

"RESA: Bringing Back What Sparse Attention Ignores with Residual Estimation" (shared/papers/
001_e9c4a03395ea0ae1.txt; no public code). Wraps a selecting method (`quest`, `topk`).

Prior Estimator (§4.2, Eq. 2), once per layer at the end of prefill: the mean post-RoPE query
mu_Q of the prompt and mean key mu_K; prior logits P_j = mu_Q.k_j / sqrt(d) over every cached
key, their log-sum-exp and O_est = softmax(P) V (one extra query row over the cache).
Online Aggregator (§4.3, Eqs. 3-5), per decode step in O(|I|): the prior logits of this query are
P_j + b with the bias b = (q - mu_Q).mu_K / sqrt(d); the selected tokens I take their true
logits, the rest keep the prior, and the merge is done in log-sum-exp form:

  O = [lam (Z_b O_est - Z_I O_I) + Z_SA O_SA] / [lam (Z_b - Z_I) + Z_SA]

where Z_b = exp(lse_P + b), (O_I, Z_I) is mu_Q's attention restricted to I (times exp(b)) and
(O_SA, Z_SA) the wrapped method's own attention over I. lam = 1 is Eq. 3 exactly; lam = 0 is the
wrapped method exactly.

Over ReAttention (`base="reattention"`; the scope is its budget, set through `base_args`): I is
the step's scope, (O_SA, Z_SA) ReAttention's attention over it (keys at scope ranks 0..n-1, the
query at its rank), and the prior places every key at one relative distance D from the query
(`prior_distance`; default the middle of the scope's span part, n_local + clip * span / 2: where
a key outside the scope would sit had it been selected). RoPE makes a logit depend on the
distance only, (R_m q).(R_n k) = (R_D q).k for D = m - n, so with the cache's pre-RoPE keys the
prior query is mu_Q rotated by D, computed once at the end of prefill like the paper's, and the
bias takes the step's query rotated by D too. Why not the original positions: ReAttention never
uses them (ranks are reassigned each step). Why not distance 0 (the pre-RoPE logits, which
ReAttention's selection ranks by): measured on the default model it overweights the prior (a
key at distance 0 scores far above RoPE-scored keys at the scope's distances) and RESA then
lost passkeys that ReAttention alone found, 0 of 6 against 4 of 6 at D = n_local or the scope's
end (docs/METHODS.md). Z_b and Z_I are scored the same way, so their difference is the prior
mass of the keys outside the scope; that difference meets Z_SA in the merge, weighed by `lam`.

Both registry entries are here: `resa` (one device) and `resa_mesh` (RESA over mesh ReAttention,
the prior's vectors replicated and its sums over the cache merged across the shards).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

import pallas_kernels
from jax_longctx.ops.attention import attention, merge_attention
from jax_longctx.ops.cache import KVCache, float_dtype, per_row, weighted_sum
from jax_longctx.methods.base import (AttnContext, Budget, Method, MethodError, PrefillEnd,
                                      TokenShards, get, register)
from jax_longctx.methods.reattention import ReAttention
from jax_longctx.methods.selection import SelectingMethod, gather_slots, gathered_attention
from jax_longctx.methods.token_layout import device_part, layout_here
from jax_longctx.core.rope import apply_rope, rotate

Prior = Literal["head", "group"]


@struct.dataclass
class RESAState:
  inner: object  # the wrapped method's state
  q_sum: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, H, d] fp32: sum of the prompt's queries as the prior takes them
  mu_q: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, H, d] fp32
  mu_k: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, KV, d] fp32
  o_est: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, H, d] fp32: softmax(P) V over every cached token
  lse_p: jnp.ndarray = axes(ROWS, HEADS)  # [B, H] fp32: log sum_j exp(P_j)


@register
@dataclasses.dataclass(frozen=True)
class RESA(Method):
  """`base`: the method RESA wraps, a selecting method (quest, topk) or reattention, given as a
  method object (`RESA(base=Quest(page_size=8))`) or by registry name with `base_args` its
  hyper-parameters (`--method-arg base=quest --method-arg "base_args=(('page_size', 8),)"`);
  either way it is built once, at construction, into `inner`. `budget`: the selecting method's
  token budget, replacing the base's own (None keeps the base's: 1024 for quest and topk);
  ReAttention's budget is its scope (n_global, clip, span, n_local: its own fields), and
  `budget` does not apply to it. `lam` = 1 by default: Eq. 3 as written, which the paper finds
  best for retrieval tasks (§5.4; summarization prefers smaller values). `prior`: "head" gives
  each query head its own mu_Q; "group" shares one mu_Q (the mean of the group's heads) per kv
  head."""

  name = "resa"
  ends_prefill = True  # end_of_prefill below

  base: str | Method = "quest"
  budget: Budget | None = None
  lam: float = 1.0
  prior: Prior = "head"
  base_args: tuple = ()
  prior_distance: int | None = None  # over ReAttention (module doc); None: mid span part
  # The wrapped method, built from the fields above in __post_init__ (a wrong base or base_args
  # fails at construction) and never again: the steps read it every layer.
  inner: SelectingMethod | ReAttention = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "inner", self._wrapped())

  @property
  def int4_refusal(self) -> str:  # the wrapped method's cache is RESA's
    return self.inner.int4_refusal

  def _wrapped(self) -> SelectingMethod | ReAttention:
    inner = get(self.base, **dict(self.base_args))
    if isinstance(inner, SelectingMethod):
      return inner if self.budget is None else dataclasses.replace(inner, budget=self.budget)
    if not isinstance(inner, ReAttention):
      raise MethodError(f"resa wraps a selecting method (quest, topk) or reattention, not "
                        f"{inner.name!r}")
    return inner

  def hparams(self) -> dict[str, Any]:
    """RESA's settings, with the wrapped method by registry name (`base`) and its settings as
    they run (`base_args`: the base's own, base_args and the budget applied), whether the base
    came as a name or as an object."""
    own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    return {**own, "base": self.inner.name, "base_args": self.inner.hparams()}

  @property
  def prefill_chunk(self) -> int | None:  # type: ignore[override]
    """The wrapped method's (ReAttention's `chunk`; None for the selecting methods)."""
    return self.inner.prefill_chunk

  @property
  def pre_rope(self) -> bool:
    """The prior on the cache's pre-RoPE keys (under ReAttention: see the module's doc)."""
    return isinstance(self.inner, ReAttention)

  @property
  def distance(self) -> int:
    """Over ReAttention: the relative distance at which the prior places every key."""
    if self.prior_distance is not None:
      return self.prior_distance
    return self.inner.n_local + self.inner.clip * self.inner.span // 2

  def prior_query(self, q, ctx: AttnContext):
    """q [B, S, H, d] as the prior scores it against its keys, fp32: after RoPE at the query's
    position, or over ReAttention rotated by the fixed distance (keys pre-RoPE)."""
    if self.pre_rope:
      return rotate(q, jnp.int32(self.distance), ctx.freqs).astype(jnp.float32)
    return apply_rope(q, ctx.q_pos, ctx.freqs).astype(jnp.float32)

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> RESAState:
    if not 0 <= self.lam <= 1:
      raise MethodError(f"lam={self.lam} must lie in [0, 1]")
    if self.prior_distance is not None and (self.prior_distance < 0 or not self.pre_rope):
      raise MethodError(f"prior_distance={self.prior_distance}: a distance >= 0, over "
                        "reattention only")
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    zeros = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    return RESAState(self.inner.init_state(cfg, batch, max_len, dtype, chunk),
                     zeros(batch, h, d), zeros(batch, h, d), zeros(batch, kvh, d),
                     zeros(batch, h, d), jnp.full((batch, h), -jnp.inf, jnp.float32))

  def prefill(self, state: RESAState, q, k, v, ctx: AttnContext):
    out, inner = self.inner.prefill(state.inner, q, k, v, ctx)
    q_sum = state.q_sum + jnp.einsum("bshd,bs->bhd", self.prior_query(q, ctx),
                                     ctx.valid.astype(jnp.float32))
    return out, state.replace(inner=inner, q_sum=q_sum)

  def end_of_prefill(self, state: RESAState, info: PrefillEnd) -> RESAState:
    inner = self.inner.end_of_prefill(state.inner, info)
    cache = self.inner.cache(inner)
    n = jnp.maximum(info.prompt_lengths, 1).astype(jnp.float32)  # [B]
    mu_q = state.q_sum / n[:, None, None]
    if self.prior == "group":
      b, h, d = mu_q.shape
      kvh = cache.k.shape[1]
      grouped = info.heads.group(  # a group's heads may lie on several devices
          jnp.mean(mu_q.reshape(b, kvh, h // kvh, d), axis=2, keepdims=True), "mean")
      mu_q = jnp.broadcast_to(grouped, (b, kvh, h // kvh, d)).reshape(b, h, d)
    k_sum, o_est, lse_p = self.prior_over_cache(mu_q, cache, info.prompt_lengths, info)
    return state.replace(inner=inner, mu_q=mu_q, mu_k=k_sum / n[:, None, None], o_est=o_est,
                         lse_p=lse_p)

  def prior_over_cache(self, mu_q, cache: KVCache, lengths, info: PrefillEnd):
    """Over the prompt's keys (slots < lengths [B]): (their sum [B, KV, d] fp32, softmax(P) V
    [B, H, d] fp32, lse [B, H]) with P = mu_Q.k / sqrt(d). The mesh variant merges its shards'."""
    in_prompt = jnp.arange(cache.max_len)[None, :] < lengths[:, None]  # [B, T]
    # Accumulated in fp32 from the stored keys: an fp32 copy of every layer's keys is what the
    # dot would otherwise take, and the hook runs all layers in one program.
    kvh = cache.k.shape[1]
    k_sum = weighted_sum(cache.k, jnp.broadcast_to(in_prompt[:, None, :],
                                                   (in_prompt.shape[0], kvh, cache.max_len)))
    o_est, lse_p = pallas_kernels.flash_attention(
        mu_q[:, None].astype(float_dtype(cache.k, info.cfg.jnp_dtype)), cache.k, cache.v,
        causal=False, kv_len=lengths,
        kv_layout="BHTD", route=info.options.route)
    return k_sum, o_est[:, 0].astype(jnp.float32), lse_p[:, 0]

  def prior_over_scope(self, mu_q, cache: KVCache, sc, tokens: TokenShards):
    """mu_Q's attention over the scope's keys (pre-RoPE; no mask but the scope's length):
    (out [B, H, d] fp32, lse [B, H]). The mesh variant merges its devices' parts."""
    take = sc.idx[:, None, :, None]
    in_scope = jnp.arange(sc.idx.shape[1])[None, :] < sc.length[:, None]  # [B, N]
    scope = lambda x: per_row(lambda a: jnp.take_along_axis(a, take, axis=2), x)  # noqa: E731
    out, lse = attention(mu_q[:, None].astype(float_dtype(cache.k, mu_q.dtype)), scope(cache.k),
                         scope(cache.v),
                         jnp.zeros((mu_q.shape[0], 1), jnp.int32), jnp.where(in_scope, 0, -1))
    return out[:, 0].astype(jnp.float32), lse[:, 0]

  def decode(self, state: RESAState, q, k, v, ctx: AttnContext):
    inner = self.inner
    if self.pre_rope:
      return self._decode_scope(state, q, k, v, ctx)
    if inner.dense_at(ctx):
      out, inner_state = inner.decode(state.inner, q, k, v, ctx)
      return out, state.replace(inner=inner_state)
    if q.shape[1] != 1:
      raise MethodError("resa decodes one token per step")
    k_rot = apply_rope(k, ctx.q_pos, ctx.freqs)
    inner_state = inner.write(state.inner, k_rot, v, ctx)
    q_rot = apply_rope(q, ctx.q_pos, ctx.freqs)
    slots = inner.selected_slots(inner_state, q_rot, ctx)
    state = fold_into_prior(state.replace(inner=inner_state), k_rot, v, ctx.valid)
    out = residual_attention(q_rot, state, inner.cache(inner_state), slots, ctx.q_pos, self.lam)
    return out.astype(q.dtype), state

  def _decode_scope(self, state: RESAState, q, k, v, ctx: AttnContext):
    """Over ReAttention: its own step (the scope and its attention with LSE), then the prior's
    estimate of the keys outside the scope merged in; all of the prior pre-RoPE."""
    if q.shape[1] != 1:
      raise MethodError("resa decodes one token per step")
    out, lse, inner_state, sc = self.inner.step(state.inner, q, k, v, ctx)
    state = fold_into_prior(state.replace(inner=inner_state), k, v, ctx.valid)
    if self.lam == 0:  # ReAttention's own output, bit for bit
      return out, state
    o_sel, lse_sel = self.prior_over_scope(state.mu_q, self.inner.cache(inner_state), sc,
                                           ctx.tokens)
    h, d = q.shape[2:]
    mu_k = jnp.repeat(state.mu_k, h // state.mu_k.shape[1], axis=1)  # [B, H, d]
    bias = jnp.sum((self.prior_query(q, ctx)[:, 0] - state.mu_q) * mu_k, axis=-1) / math.sqrt(d)
    merged = merge_residual(out[:, 0].astype(jnp.float32), lse[:, 0], state.o_est,
                            state.lse_p + bias, o_sel, lse_sel + bias, self.lam)
    return merged[:, None].astype(q.dtype), state



@register
@dataclasses.dataclass(frozen=True)
class MeshRESA(RESA):
  """RESA over mesh ReAttention (its prior pre-RoPE: the module's doc says why), the cache split
  along the tokens over the mesh's `ctx` axis: the prior's vectors replicated, its attention over
  the prompt and over the scope merged from the devices' parts (the key sum by psum, the rest by
  LSE). `base_args`: ReAttention's hyper-parameters, e.g. (("n_local", 2048),); shard_block as
  reattention_mesh's."""

  name = "resa_mesh"
  splits_tokens = True

  base: str = "reattention_mesh"
  shard_block: int = 0

  def _wrapped(self) -> ReAttention:
    if self.base != "reattention_mesh":
      raise MethodError(f"resa_mesh wraps reattention_mesh, not {self.base!r}")
    return get(self.base, shard_block=self.shard_block, **dict(self.base_args))

  def cache_unit(self, shards: int, kv_dtype=None) -> int:
    return self.inner.cache_unit(shards, kv_dtype)

  def prior_over_cache(self, mu_q, cache: KVCache, lengths, info: PrefillEnd):
    cache = self.inner.here(cache, info.tokens)
    layout, p = layout_here(info.tokens, cache.max_len, self.shard_block)
    held = layout.held_below(lengths, p)  # this shard's prompt slots: its first ones
    k_sum, o_est, lse_p = super().prior_over_cache(mu_q, cache, held, info)
    o_est, lse_p = info.tokens.merge(o_est, lse_p)
    return info.tokens.sum(k_sum), o_est, lse_p

  def prior_over_scope(self, mu_q, cache: KVCache, sc, tokens: TokenShards):
    cache = self.inner.here(cache, tokens)
    part = device_part(sc, *layout_here(tokens, cache.max_len, self.shard_block))
    return tokens.merge(*super().prior_over_scope(mu_q, cache, part, tokens))


def fold_into_prior(state: RESAState, k_rot, v, valid) -> RESAState:
  """Adds generated tokens (k_rot, v [B, S, KV, d]: keys as the prior takes them, after RoPE or,
  over ReAttention, before) to the prior, so it keeps covering every cached token: O(S) per
  step. mu_Q and mu_K stay the prompt's."""
  b, s, kvh, d = k_rot.shape
  h = state.mu_q.shape[1]
  kh = jnp.repeat(k_rot.astype(jnp.float32), h // kvh, axis=2)  # [B, S, H, d]
  vh = jnp.repeat(v.astype(jnp.float32), h // kvh, axis=2)
  logit = jnp.einsum("bhd,bshd->bsh", state.mu_q, kh) / math.sqrt(d)
  logit = jnp.where(valid[:, :, None], logit, -jnp.inf)
  outs = jnp.concatenate([state.o_est[None], jnp.moveaxis(vh, 1, 0)], axis=0)  # [1+S, B, H, d]
  lses = jnp.concatenate([state.lse_p[None], jnp.moveaxis(logit, 1, 0)], axis=0)
  o_est, lse_p = merge_attention(outs, lses)
  return state.replace(o_est=o_est, lse_p=lse_p)


def residual_attention(q_rot, state: RESAState, cache, slots, q_pos, lam: float):
  """RESA's output for one decode query q_rot [B, 1, H, d] over the selected slots [B, H, n]."""
  if lam == 0:  # the wrapped method's own attention, bit for bit
    return gathered_attention(q_rot, cache, slots, q_pos)[0]
  b, _, h, d = q_rot.shape
  kvh = state.mu_k.shape[1]
  k_sel, v_sel, k_pos = gather_slots(cache, slots)
  # One pass over the gathered keys for both rows: the query, and mu_Q restricted to I.
  rows = jnp.concatenate([q_rot, state.mu_q[:, None].astype(q_rot.dtype)], axis=1)  # [B, 2, H, d]
  out, lse = attention(rows, k_sel, v_sel, jnp.repeat(q_pos, 2, axis=1), k_pos)
  o_sa, lse_sa = out[:, 0].astype(jnp.float32), lse[:, 0]
  o_sel, lse_sel = out[:, 1].astype(jnp.float32), lse[:, 1]
  mu_k = jnp.repeat(state.mu_k, h // kvh, axis=1)  # [B, H, d]
  bias = jnp.sum((q_rot[:, 0].astype(jnp.float32) - state.mu_q) * mu_k, axis=-1) / math.sqrt(d)
  return merge_residual(o_sa, lse_sa, state.o_est, state.lse_p + bias, o_sel, lse_sel + bias,
                        lam)[:, None]


def merge_residual(o_sa, lse_sa, o_all, lse_all, o_sel, lse_sel, lam: float):
  """[lam (Z_all O_all - Z_sel O_sel) + Z_sa O_sa] / [lam (Z_all - Z_sel) + Z_sa], in fp32 with
  every Z = exp(lse) taken relative to the largest, so long contexts cannot overflow."""
  m = jnp.maximum(lse_all, lse_sa)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_all = lam * jnp.exp(lse_all - m)
  w_sel = lam * jnp.exp(lse_sel - m)
  w_sa = jnp.exp(lse_sa - m)
  rest = jnp.maximum(w_all - w_sel, 0.0)  # the prior mass of the tokens I leaves out
  num = w_all[..., None] * o_all - w_sel[..., None] * o_sel + w_sa[..., None] * o_sa
  den = rest + w_sa
  return jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
