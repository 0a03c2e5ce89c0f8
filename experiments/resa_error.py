"""RESA's error study (issue 7): how far sparse attention's output is from full attention's, with
and without the prior, on real activations of a model.

    python experiments/resa_error.py --model default --tasks niah_multikey,niah_multivalue,passkey \
        --length 6k --samples 2 --steps 16 --out docs/results/resa

Each prompt runs through the model with full attention; then `steps` tokens are decoded
(teacher-forced on the full-attention greedy continuation). At every decode step and layer a probe
computes, from the same q and cache, the outputs of Quest and ideal top-k at budgets of 2.5%, 5%
and 10% of the context, alone and with RESA (prior per query head, per kv group, and lam 0.5 and
0.25), and their
relative error ||o - o_full|| / ||o_full|| per head. The model itself always continues with full
attention, so every variant sees identical inputs. Writes errors.json, summary.md and
per_layer.png to --out; `--replot DIR...` redraws DIR/per_layer.png from DIR/errors.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_longctx import load

from jax_longctx.app import plots, tasks
from jax_longctx.run.generation import prefill
from jax_longctx.methods import Method, get
from jax_longctx.methods.full import Full
from jax_longctx.methods.resa import RESA, RESAState, fold_into_prior, residual_attention
from jax_longctx.core.progress import progress
from jax_longctx.core.rope import apply_rope

FRACTIONS = (0.025, 0.05, 0.10)
# (label, base, lam, prior): lam 0 is the base method alone.
VARIANTS = tuple(
    (f"{base}{suffix}", base, lam, prior) for base in ("quest", "topk")
    for suffix, lam, prior in (("", 0.0, "head"), ("+resa", 1.0, "head"),
                               ("+resa(group)", 1.0, "group"), ("+resa(lam=.5)", 0.5, "head"),
                               ("+resa(lam=.25)", 0.25, "head")))


@struct.dataclass
class ProbeState:
  resa: RESAState  # inner = Quest's state: the full post-RoPE cache plus page bounds
  group_prior: RESAState  # the per-kv-group prior (inner unused)
  err: jnp.ndarray  # [fractions, variants] summed relative errors
  steps: jnp.ndarray  # [] decode steps seen


@dataclasses.dataclass(frozen=True)
class Probe(Method):
  """Full attention that also measures every variant's output error at each decode step."""

  name = "resa_probe"
  ends_prefill = True  # end_of_prefill below: the priors are built there
  budgets: tuple = ()  # tokens per fraction: fixed tokens + a multiple of Quest's page size
  fixed: tuple = (0, 0)  # (n_sink, n_recent) every selector reads besides its choice

  def _resa(self, prior="head") -> RESA:
    return get("resa", base="quest", budget=max(self.budgets), prior=prior,
               base_args=(("dense_layers", 0), ("n_sink", self.fixed[0]),
                          ("n_recent", self.fixed[1])))

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    state = self._resa().init_state(cfg, batch, max_len, dtype, chunk)
    fresh = jax.tree.map(jnp.copy, state.replace(inner=None))  # own buffers: the cache is donated
    return ProbeState(state, fresh,
                      jnp.zeros((len(self.budgets), len(VARIANTS)), jnp.float32), jnp.float32(0))

  def prefill(self, state: ProbeState, q, k, v, ctx):
    out, resa = self._resa().prefill(state.resa, q, k, v, ctx)
    return out, state.replace(resa=resa)

  def end_of_prefill(self, state: ProbeState, info):
    group = self._resa("group").end_of_prefill(state.resa, info)
    return state.replace(resa=self._resa().end_of_prefill(state.resa, info),
                         group_prior=group.replace(inner=None))

  def decode(self, state: ProbeState, q, k, v, ctx):
    quest = self._resa().inner
    k_rot = apply_rope(k, ctx.q_pos, ctx.freqs)
    inner = quest.write(state.resa.inner, k_rot, v, ctx)
    q_rot = apply_rope(q, ctx.q_pos, ctx.freqs)
    priors = {"head": fold_into_prior(state.resa.replace(inner=inner), k_rot, v, ctx.valid),
              "group": fold_into_prior(state.group_prior, k_rot, v, ctx.valid)}
    full, _ = Full().attend_cache(inner.kv, q_rot, ctx)
    full = full.astype(jnp.float32)
    rows = []
    for budget in self.budgets:
      row = []
      for _, base, lam, prior in VARIANTS:
        extra = {"dense_layers": 0} if base == "quest" else {}
        selector = get(base, budget=budget, n_sink=self.fixed[0], n_recent=self.fixed[1], **extra)
        slots = selector.selected_slots(inner if base == "quest" else inner.kv, q_rot, ctx)
        out = residual_attention(q_rot, priors[prior], inner.kv, slots, ctx.q_pos, lam)
        diff = jnp.linalg.norm(out.astype(jnp.float32) - full, axis=-1)
        row.append(jnp.mean(diff / jnp.maximum(jnp.linalg.norm(full, axis=-1), 1e-30)))
      rows.append(jnp.stack(row))
    return full.astype(q.dtype), ProbeState(priors["head"], priors["group"].replace(inner=None),
                                            state.err + jnp.stack(rows), state.steps + 1)


def run(lm, prompts, steps: int, length: int, fixed=(0, 0), on_prompt=None) -> np.ndarray:
  """Summed errors [layers, fractions, variants] and the number of decode steps.

  One probe and one cache length for every prompt (budgets from the nominal `length`, the cache
  sized for the longest prompt), so the decode step, which unrolls every variant at every budget
  in every layer, compiles once rather than once per prompt. `on_prompt(errors, done)` gets the
  running mean after each prompt (the caller writes it, so a run cut off keeps what it measured)."""
  cfg = lm.config
  n_fixed = sum(fixed)
  budgets = tuple(n_fixed + max(16, int(round((f * length - n_fixed) / 16)) * 16)
                  for f in FRACTIONS)
  probe = Probe(budgets=budgets, fixed=tuple(fixed))
  cache_len = -(-(max(len(ids) for ids in prompts) + steps + 1) // 16) * 16
  step = jax.jit(lambda p, t, c: lm_forward(p, t, c, probe, cfg), donate_argnums=2)
  total, count = 0.0, 0
  for ids in progress(prompts, desc="resa error"):
    cache, last = prefill(lm.params, cfg, [ids], probe, cache_len=cache_len)
    tok = jnp.argmax(last, axis=-1)[:, None].astype(jnp.int32)
    for _ in range(steps):
      logits, cache = step(lm.params, tok, cache)
      tok = jnp.argmax(logits[:, 0], axis=-1)[:, None].astype(jnp.int32)
    errs = np.stack([np.asarray(s.err) for s in cache.state])  # [layers, fractions, variants]
    total = total + errs
    count += steps
    if on_prompt is not None:
      on_prompt(total / count, count // steps)
  return total / count


def lm_forward(params, tok, cache, method, cfg):
  from jax_longctx.model import forward
  return forward(params, tok, cache.lengths[:, None], cache, method, cfg, decode=True)


def write(errors: np.ndarray, out_dir: str, meta: dict) -> None:
  os.makedirs(out_dir, exist_ok=True)
  labels = [v[0] for v in VARIANTS]
  mean = errors.mean(axis=0)  # over layers: [fractions, variants]
  with open(os.path.join(out_dir, "errors.json"), "w") as f:
    json.dump({**meta, "fractions": FRACTIONS, "variants": labels,
               "per_layer": errors.tolist(), "mean": mean.tolist()}, f, indent=1)
  lines = ["| budget | " + " | ".join(labels) + " | Quest reduction | top-k reduction |",
           "|---" * (len(labels) + 3) + "|"]
  for i, frac in enumerate(FRACTIONS):
    e = dict(zip(labels, mean[i]))
    red_q = 1 - e["quest+resa"] / e["quest"]
    red_t = 1 - e["topk+resa"] / e["topk"]
    lines.append(f"| {frac:.1%} | " + " | ".join(f"{x:.4f}" for x in mean[i])
                 + f" | {red_q:.0%} | {red_t:.0%} |")
  table = "\n".join(lines) + "\n"
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(f"Relative error of the attention output vs full attention, mean over layers, heads "
            f"and {meta['steps']} decode steps x {meta['prompts']} prompts "
            f"({meta['tasks']}, {meta['length']} tokens, model {meta['model']}; first/last "
            f"tokens fixed in every budget: {meta['fixed']}).\n\n" + table)
  plot(errors, meta, os.path.join(out_dir, "per_layer.png"))
  print(table)


# A variant's suffix -> its legend entry: the same look for Quest's and top-k's.
SUFFIXES = {"": "without RESA", "+resa": "+ RESA (prior per query head)",
            "+resa(group)": "+ RESA (prior per kv group)", "+resa(lam=.5)": "+ RESA, λ = 0.5",
            "+resa(lam=.25)": "+ RESA, λ = 0.25"}
BASES = {"quest": "Quest", "topk": "ideal top-k"}


def plot(errors: np.ndarray, meta: dict, path: str) -> str:
  """per_layer.png: the relative error by layer, a row of panels per budget, Quest left and
  ideal top-k right, each base's five variants (alone, RESA's priors and lam) in one legend."""
  errors = np.asarray(errors)  # [layers, fractions, variants]
  labels = [v[0] for v in VARIANTS]
  fractions = meta.get("fractions", FRACTIONS)
  bases = list(dict.fromkeys(v[1] for v in VARIANTS))
  order = {name: i for i, name in enumerate(SUFFIXES.values())}
  layers = list(range(errors.shape[0]))
  plt = plots.pyplot()
  fig, axes = plt.subplots(len(fractions), len(bases), figsize=(6 * len(bases),
                           2.9 * len(fractions)), sharex=True, sharey=True, squeeze=False)
  for i, frac in enumerate(fractions):
    for ax, base in zip(axes[i], bases):
      series = {SUFFIXES[label[len(base):]]: (layers, errors[:, i, j])
                for j, label in enumerate(labels) if labels[j].startswith(base)}
      plots.draw_lines(ax, series, order=order, markersize=3.5, linewidth=1.2)
      ax.set_title(f"{BASES[base]}, budget {frac:.1%} of the context", fontsize="medium")
      ax.set_ylim(bottom=0)
  for ax in axes[:, 0]:
    ax.set_ylabel("relative error\n||o - o_full|| / ||o_full||")
  for ax in axes[-1]:
    ax.set_xlabel("layer")
  plots.legend_outside(axes[0, -1], title="variant")
  fixed = meta.get("fixed")
  fig.suptitle(f"Attention output's error vs full attention by layer: model {meta['model']}, "
               f"{meta['length']} tokens, {meta['prompts']} prompts x {meta['steps']} decode "
               "steps" + (f", first/last tokens fixed {tuple(fixed)}" if fixed else ""),
               fontsize="medium")
  fig.tight_layout()
  return plots.save(fig, path)


def replot(out_dir: str) -> str:
  """per_layer.png again from OUT/errors.json (no model)."""
  with open(os.path.join(out_dir, "errors.json")) as f:
    saved = json.load(f)
  if saved["variants"] != [v[0] for v in VARIANTS]:
    raise SystemExit(f"{out_dir}/errors.json: variants {saved['variants']} are not this "
                     "script's")
  return plot(np.asarray(saved["per_layer"]), saved, os.path.join(out_dir, "per_layer.png"))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--replot", nargs="+", metavar="DIR",
                 help="only redraw DIR/per_layer.png from DIR/errors.json, for each DIR")
  p.add_argument("--model", default="default")
  p.add_argument("--tasks", default="niah_multikey,niah_multivalue,passkey")
  p.add_argument("--length", default="6k")
  p.add_argument("--samples", type=int, default=2)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--fixed", default="0,0",
                 help="n_sink,n_recent tokens in every budget (the RESA paper: 4,64)")
  p.add_argument("--out", default="docs/results/resa")
  args = p.parse_args()
  if args.replot:
    for out_dir in args.replot:
      print(replot(out_dir))
    return
  fixed = tuple(int(x) for x in args.fixed.split(","))
  lm = load(args.model)
  length = tasks.parse_length(args.length)
  prompts = []
  for name in args.tasks.split(","):
    task = tasks.get(name)
    for seed in range(args.samples):
      depth = 0.5 if task.needle_task else None
      prompts.append(lm.tokenizer.encode(task.make(lm.tokenizer, length, depth, seed,
                                                   chat=True).prompt))
  meta = {"model": args.model, "tasks": args.tasks, "length": length, "steps": args.steps,
          "fixed": fixed}
  run(lm, prompts, args.steps, length, fixed,
      on_prompt=lambda errors, done: write(errors, args.out, {**meta, "prompts": done}))


if __name__ == "__main__":
  main()
