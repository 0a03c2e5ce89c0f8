"""Evaluation sweeps: task x method x length x sample, resumable, with JSON, markdown and plots.

    jax-longctx eval --model default --task passkey --methods full,snapkv --lengths 4k,8k \
        --samples 20 --depths 0.1,0.5,0.9 --out DIR --method-arg snapkv.budget=256

RULER (`--task ruler`, or `ruler:vt,cwe`) runs its tasks one after the other into one DIR. A
compression sweep runs every method with a budget at each point, full attention once:

    jax-longctx eval --task ruler --lengths 4k --methods full,snapkv,tova \
        --compression-ratios 0.25,0.5,0.75 --out DIR

`--batch-size N` runs N samples of one method and length as one batch (records as single runs
make them, each carrying the batch's timings and size). DIR/results.jsonl gets one line per
finished sample (appended and synced as it goes, so an interrupted sweep resumes where it
stopped; a record that the interruption cut short is run again); DIR/summary.md and DIR/*.png
are rewritten at the end.

Before any sample runs, a sweep refuses in one line: an --out that is a file or cannot be
written; a length whose cache and weights cannot fit the device (`memory_estimate`); and an
--out whose records were made under other settings: another model, method hyper-parameter,
chat, cache dtype, task option, prefill chunk or cache size (`run_settings`: each record
carries what it ran under, and resuming is only ever from records this command would have
written). Rerun such a sweep with another --out, or remove the old results.jsonl.
"""

from __future__ import annotations

import dataclasses
import json  # noqa: F401 (the fault-injection tests write records as this module does)
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import jax

from jax_longctx import methods as methods_lib
from jax_longctx.app import memory_estimate, run_settings
from jax_longctx.app import tasks as tasks_lib
from jax_longctx.run.driver import continuation_nll, generate
from jax_longctx.core.axes import take_rows
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.core.progress import progress
# Scripts read and write records through this module's names (load_results, read_records).
from jax_longctx.app.records import (RESULTS, EvalError, append_record, load_results,  # noqa: F401
                                     read_records, record_key, stored_expected, unpack_results,
                                     writable_results)
from jax_longctx.app.report import write_report


@dataclasses.dataclass(frozen=True)
class BudgetPoint:
  """One point of a compression sweep: a compression ratio as kvpress defines it (the share of
  the tokens a method drops: 1 - kept / length, the length being the sweep's, which RULER's
  prompts fill less their tokens to generate) or a number of kept tokens. Either becomes the
  method's `budget` in tokens (an int: a float budget would be a fraction of the cache)."""
  ratio: float | None = None
  tokens: int | None = None

  def __post_init__(self):
    if (self.ratio is None) == (self.tokens is None):
      raise EvalError("a budget point is a compression ratio or a number of tokens")
    if self.ratio is not None and not 0 <= self.ratio < 1:
      raise EvalError(f"a compression ratio lies in [0, 1), got {self.ratio}")
    if self.tokens is not None and self.tokens < 1:
      raise EvalError(f"a budget of kept tokens is at least 1, got {self.tokens}")

  @property
  def tag(self) -> str:
    return f"cr{self.ratio:g}" if self.ratio is not None else f"{self.tokens}tok"

  def kept(self, length: int) -> int:
    return self.tokens if self.tokens is not None else max(1, round((1 - self.ratio) * length))

  def fields(self, length: int, n_tokens: int) -> dict:
    """What a record of this point carries: the nominal ratio, the kept tokens, and the share
    of this sample's prompt dropped."""
    kept = self.kept(length)
    return {"compression_ratio": self.ratio if self.ratio is not None else 1 - kept / length,
            "budget_tokens": kept,
            "prompt_compression": round(1 - min(kept, n_tokens) / n_tokens, 4)}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  label: str  # the name shown in tables
  method: Any
  point: BudgetPoint | None = None  # a compression sweep's: label = f"{base}@{point.tag}"
  base: str = ""  # the label without the point
  kv_dtype: str | None = None  # how its cache is stored (None: the run's; RunOptions.kv_dtype)

  @staticmethod
  def per_kv_dtype(specs: list["MethodSpec"], kv_dtypes: list[str | None]) -> list["MethodSpec"]:
    """Each spec once per cache dtype; with several, the dtype joins the label ("full int8")."""
    if len(kv_dtypes) <= 1:
      return [dataclasses.replace(s, kv_dtype=(kv_dtypes or [None])[0]) for s in specs]
    return [dataclasses.replace(s, label=f"{s.label} {kv}", kv_dtype=kv,
                                base=s.base and f"{s.base} {kv}")
            for s in specs for kv in kv_dtypes]

  def at(self, length: int) -> "MethodSpec":
    """The spec as it runs at `length`: a point's budget in tokens."""
    if self.point is None:
      return self
    return dataclasses.replace(
        self, method=dataclasses.replace(self.method, budget=self.point.kept(length)))

  @classmethod
  def at_points(cls, specs: list["MethodSpec"], points: list[BudgetPoint]) -> list["MethodSpec"]:
    """Every method with a budget at every point; full attention once, the baseline."""
    if not points:
      return specs
    out = []
    for s in specs:
      if s.method == methods_lib.get("full"):
        out.append(s)
      elif "budget" in s.method.hparams():
        out += [cls(f"{s.label}@{p.tag}", s.method, point=p, base=s.label) for p in points]
      else:
        raise EvalError(f"{s.label} ({s.method.name}) has no budget to sweep; a compression sweep "
                        f"runs methods with a budget, and full as the baseline")
    return out

  @classmethod
  def parse(cls, names: str, method_args: list[str] | None) -> list["MethodSpec"]:
    """'full,snapkv' + ['snapkv.budget=256'] -> specs (args without a dot go to every method).

    An entry `label:name` runs method `name` under its own label, so one method can run with
    several settings in a sweep (`rkv5:refreshkv` + `rkv5.qc_stride=5`).
    """
    run = {}  # label -> registry name
    for entry in [n.strip() for n in names.split(",") if n.strip()]:
      label, _, name = entry.rpartition(":")
      run[label or name] = name
    per = methods_lib.args_per_method(method_args, run)
    return [cls(label, methods_lib.get(name, **methods_lib.parse_method_args(per[label])))
            for label, name in run.items()]


def _cache_len(length: int, new_tokens: int) -> int:
  # One size per requested length, so every sample of a length shares the compiled steps. A
  # prompt is at most `length` tokens (the tasks size it so); the 2% above it is room for a
  # method reading its instruction apart (`LM.apart`), whose two parts may tokenize longer
  # than the whole, and keeps the cache of a float (fractional) budget what it was.
  return -(-(int(length * 1.02) + new_tokens + 1) // 256) * 256


def cache_len_for(task, length: int, cache_len: int | None) -> int:
  """The cache a task's samples of `length` run in: `cache_len` when the sweep fixes one."""
  return cache_len or _cache_len(length, task.max_new_tokens)


def _peak_bytes():
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run_batch(lm, task, spec: MethodSpec, samples: list, options: RunOptions = DEFAULT,
              cache_len: int | None = None, rows: int | None = None) -> list[dict]:
  """Samples of one task and length through one method (`driver`) as one batch: each sample's
  prediction, score and the method's report on its own row; the batch's timings.

  cache_len: one cache size for every sample (one compile per method for a whole sweep of
  lengths); None sizes the cache per requested length. rows: the batch's size (at least the
  samples'): the last sample is repeated to fill it and its copies' results dropped, so a
  sweep's last, short batch runs the compiled steps of the full ones.
  """
  method, n = spec.method, len(samples)
  samples = list(samples) + [samples[-1]] * (max(rows or n, n) - n)
  if spec.kv_dtype is not None:
    options = options.replace(kv_dtype=spec.kv_dtype)
  timing = {"batch": len(samples)}
  if task.name == "ppl":
    prefixes, targets = zip(*(task.split(s) for s in samples))
    nll, run = continuation_nll(lm.params, lm.config, method, prefixes, targets,
                                [lm.instruction_ids(s.instruction) for s in samples],
                                cache_len=cache_len_for(task, samples[0].length, cache_len),
                                options=options)
    timing.update(prefill_s=run.prefill_s, decode_s=run.decode_s)
    return [{"prediction": None, "expected": None, "score": float(math.exp(nll[i].mean())),
             "nll": nll[i].round(5).tolist(), **timing, **_row_report(method, run, i)}
            for i in range(n)]
  if method.needs_instruction:  # CItruS, or a mesh method's query
    ids, instructions = zip(*(lm.apart(s.document, s.instruction) for s in samples))
  else:
    ids, instructions = [lm.tokenizer.encode(s.prompt) for s in samples], None
  run = generate(lm.params, lm.config, ids, method, instructions=instructions,
                 max_new_tokens=task.max_new_tokens, stop_tokens=lm.stop_tokens(),
                 options=options,
                 cache_len=cache_len_for(task, samples[0].length, cache_len))
  timing.update(prefill_s=run.prefill_s, decode_s=run.decode_s)
  out = []
  for i, sample in enumerate(samples[:n]):
    prediction = lm.tokenizer.decode(run.tokens[i])
    out.append({"prediction": prediction, **stored_expected(sample.expected),
                "score": task.score(prediction, sample), **timing,
                **_row_report(method, run, i)})
  return out


def _row_report(method, run, i: int) -> dict:
  """The method's report on row i of a run's cache (a batch-1 run: on its whole cache), over
  the run's own entries (the devices a mesh run spanned)."""
  if len(run.prompt_lengths) == 1:
    return run.report
  return {**run.report, **method.report(take_rows(run.cache, i, i + 1, "cache"))}


def plan(task, specs, lengths, depths, samples, first: int = 0) -> list[tuple]:
  """(spec, length, depth, seed) for samples first..samples-1 (seed i) of each spec and length;
  samples spread round-robin over depths, so a part of a sweep plans what the whole does."""
  depths = depths if task.needle_task else [None]
  return [(spec, length, depths[i % len(depths)], i)
          for spec in specs for length in lengths for i in range(first, samples)]


def made_ahead(task, tokenizer, batches: list[list[tuple]], chat: bool) -> Iterator[list]:
  """[(plan entry, its sample), ...] for each batch of plan entries in order, each batch's
  samples built on a thread while the batch before runs: a 1M-token prompt takes 15-20 s on the
  host that the devices would otherwise wait for (the tokenizer releases the GIL). A failed
  build raises at its turn."""
  with ThreadPoolExecutor(max_workers=1) as pool:
    def build(entries):
      return pool.submit(lambda: [(e, task.make(tokenizer, e[1], e[2], e[3], chat=chat))
                                  for e in entries])
    pending = build(batches[0]) if batches else None
    for i in range(len(batches)):
      made = pending.result()
      pending = build(batches[i + 1]) if i + 1 < len(batches) else None
      yield made


def batched(todo: list[tuple], size: int) -> list[list[tuple]]:
  """Plan entries in batches of up to `size`, each of one method and one length, in order."""
  out = []
  for entry in todo:
    if out and len(out[-1]) < size and out[-1][0][:2] == entry[:2]:
      out[-1].append(entry)
    else:
      out.append([entry])
  return out


def run_sweep(lm, task_name: str, specs: list[MethodSpec], lengths: list[int],
              depths: list[float], samples: int, out_dir: str, *, chat: bool = False,
              options: RunOptions = DEFAULT, task_options: dict | None = None,
              cache_len: int | None = None, batch_size: int = 1,
              first_sample: int = 0) -> list[dict]:
  """task_name: one task, or several (`tasks.expand`: "ruler", "ruler:vt,cwe"), run one after
  the other into the same results. specs: `MethodSpec.at_points` for a compression sweep.
  batch_size: samples of one method and length run as one batch (`run_batch`; the last one
  filled with copies): fewer, fuller device steps; the records are those of single runs.
  first_sample: samples before it are left to another process (plan)."""
  if samples < 1:
    raise EvalError(f"--samples must be at least 1, got {samples}")
  if batch_size < 1:
    raise EvalError(f"a batch holds at least one sample, got {batch_size}")
  if not 0 <= first_sample < samples:
    raise EvalError(f"--first-sample {first_sample} must lie in [0, samples={samples})")
  task_list = [tasks_lib.get(n, **(task_options or {})) for n in tasks_lib.expand(task_name)]
  # Settings a method leaves to the model (RefreshKV's calibrated threshold) filled in, so each
  # record's hparams show what ran.
  specs = [dataclasses.replace(s, method=lm.resolve_method(s.method)) for s in specs]
  check_memory(lm, task_list, specs, lengths, options, cache_len, batch_size)
  for task in task_list:  # a length too short for a task fails here, before anything runs
    for length in lengths:
      if hasattr(task, "check_length"):
        task.check_length(lm.tokenizer, length, chat)
  # Several processes (a multi-host mesh) run the same sweep; the first one writes the records.
  writer = jax.process_index() == 0
  results_path = writable_results(out_dir) if writer else os.path.join(out_dir, RESULTS)
  sweep = run_settings.sweep_settings(lm, chat, options)
  planned = {(task.name, s.label, length): run_settings.entry_settings(
                 task, s.at(length).method, _kv_dtype(lm, s, options), length,
                 cache_len_for(task, length, cache_len), options)
             for task in task_list for s in specs for length in lengths}
  done = load_results(out_dir, repair=writer)
  try:
    run_settings.check_resumable(done, sweep, planned)
  except run_settings.Mismatch as e:
    raise EvalError(f"{out_dir} holds {e}; rerun with another --out, or remove "
                    f"{results_path}") from None

  def run_of(task, label, length) -> dict:
    return {"sweep": sweep, "entry": planned[(task.name, label, length)]}

  # Records of other settings were refused above; the settings' digest in the key keeps it so.
  seen = {(*record_key(r), run_settings.digest(r["run"])) for r in done}
  runs = [(task, [p for length in lengths
                  for p in plan(task, [s.at(length) for s in specs], [length], depths, samples,
                                first_sample)
                  if (task.name, p[0].label, p[1], p[2], p[3],
                      run_settings.digest(run_of(task, p[0].label, p[1]))) not in seen])
          for task in task_list]

  runs = [(task, batched(todo, batch_size)) for task, todo in runs]

  def batches_in_turn():
    for task, batches in runs:
      for made in made_ahead(task, lm.tokenizer, batches, chat):
        yield task, made

  for task, made in progress(batches_in_turn(), total=sum(len(b) for _, b in runs),
                             desc=f"{task_name} sweep", unit="batch" if batch_size > 1 else "it"):
    (spec, length, _, _), _ = made[0]
    results = run_batch(lm, task, spec, [sample for _, sample in made], options, cache_len,
                        rows=batch_size)
    for ((_, _, depth, seed), sample), result in zip(made, results):
      rec = {"task": task.name, "method": spec.label, "hparams": spec.method.hparams(),
             "length": length, "depth": depth, "seed": seed, "n_tokens": sample.n_tokens,
             "chat": chat, "kv_dtype": _kv_dtype(lm, spec, options),
             "run": run_of(task, spec.label, length)}
      if spec.point is not None:
        rec.update(base_method=spec.base, **spec.point.fields(length, sample.n_tokens))
      rec.update(result, peak_bytes=_peak_bytes())
      if writer:
        append_record(results_path, rec)
      done.append(rec)
  if writer:
    write_report(done, out_dir)
  return done


def _kv_dtype(lm, spec: MethodSpec, options: RunOptions) -> str:
  """How a spec's cache is stored: its own dtype, the run's, else the model's."""
  return spec.kv_dtype or options.kv_dtype or lm.config.dtype


def check_memory(lm, task_list, specs: list[MethodSpec], lengths: list[int],
                 options: RunOptions, cache_len: int | None, batch: int) -> None:
  """Refuses, in one line, a method and length whose weights, cache and activations cannot fit
  the device (`memory_estimate`), from shapes alone: in well under a second."""
  weights = memory_estimate.weight_bytes(lm.params)
  capacity, platform = memory_estimate.available(resident=weights)
  for task in task_list:
    for spec in specs:
      opts = options.replace(kv_dtype=spec.kv_dtype) if spec.kv_dtype else options

      def need_at(length, task=task, spec=spec, opts=opts):
        return memory_estimate.need(lm.config, weights, spec.at(length).method, length=length,
                                    cache_len=cache_len_for(task, length, cache_len),
                                    batch=batch, options=opts, spread=platform != "cpu")
      memory_estimate.check([(spec.label, length, need_at) for length in lengths], capacity,
                            platform, cache_len)
