"""A conversion or an eval sweep that stops at a named moment of its run, for tests/test_faults.py.

    python -m tests.helpers.fault_child convert MOMENT SRC DST
    python -m tests.helpers.fault_child eval MOMENT EVAL-ARGS...
        (EVAL-ARGS: the arguments of `jax-longctx eval`)

At MOMENT the process prints `at MOMENT` and sleeps, so that the test's SIGKILL lands exactly
there; the other moments pass. Moments are wrapped around the library's own steps, nothing else
of the run changes.
"""

import os
import sys
import time

# Over one conversion, in order: the lock taken; the scratch made; tensors read at five points;
# orbax writing the params; the memory-mapped scratch gone; config and tokenizer written.
CONVERT_MOMENTS = ("locked", "scratch", "tensor 0/4", "tensor 1/4", "tensor 2/4", "tensor 3/4",
                   "tensor 4/4", "orbax writing", "params written", "renaming")


def eval_moment(phase: str, records: int) -> str:
  """`compute K`: running a sample with K records in the file; `write K`: halfway through
  writing record K + 1 (half its line on disk); `report`: writing summary.md and the plots."""
  return f"{phase} {records}" if phase != "report" else "report"


def _stop_if(moment: str, now: str) -> None:
  if now == moment:
    print(f"at {moment}", flush=True)
    time.sleep(600)


def _hook(obj, name: str, moment: str, label: str, after: bool = False) -> None:
  """Stops at `label` just before (or after) obj.name runs."""
  real = getattr(obj, name)

  def hooked(*a, **kw):
    if not after:
      _stop_if(moment, label)
    out = real(*a, **kw)
    if after:
      _stop_if(moment, label)
    return out
  setattr(obj, name, hooked)


def _convert(moment: str, src: str, dst: str) -> None:
  from jax_longctx.checkpoints import destination, pipeline
  import orbax.checkpoint as ocp

  _hook(destination, "remove_stale_scratch", moment, "locked")
  _hook(destination, "new_scratch", moment, "scratch", after=True)
  _hook(ocp.StandardCheckpointer, "wait_until_finished", moment, "orbax writing")
  _hook(pipeline, "save_config_file", moment, "params written")
  _hook(pipeline, "_rename_new", moment, "renaming")
  real_progress = pipeline.progress

  def progress(iterable, total=None, **kw):
    marks = {round(k * (total - 1) / 4): f"tensor {k}/4" for k in range(5)}
    for i, item in enumerate(real_progress(iterable, total=total, **kw)):
      if i in marks:
        _stop_if(moment, marks[i])
      yield item
  pipeline.progress = progress
  pipeline.convert(src, dst)


def _records(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    return f.read().count(b"\n")


def _eval(moment: str, args: list[str]) -> None:
  from jax_longctx.app import cli
  from jax_longctx.app import eval as eval_lib

  path = os.path.join(args[args.index("--out") + 1], eval_lib.RESULTS)
  real_run, real_append = eval_lib.run_batch, eval_lib.append_record
  real_report = eval_lib.write_report

  def run_batch(*a, **kw):
    _stop_if(moment, eval_moment("compute", _records(path)))
    return real_run(*a, **kw)

  def append(p, rec):
    if moment == eval_moment("write", _records(p)):
      line = eval_lib.json.dumps(rec).encode() + b"\n"
      with open(p, "ab") as f:
        f.write(line[:len(line) // 2])
      _stop_if(moment, moment)
    real_append(p, rec)

  def report(*a, **kw):
    _stop_if(moment, "report")
    return real_report(*a, **kw)

  eval_lib.run_batch, eval_lib.append_record, eval_lib.write_report = run_batch, append, report
  sys.exit(cli.main(["eval", *args]))


if __name__ == "__main__":
  kind, moment, *rest = sys.argv[1:]
  if kind == "convert":
    _convert(moment, *rest)
  else:
    _eval(moment, rest)
