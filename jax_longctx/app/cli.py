"""`jax-longctx` command line: generate, eval, calibrate, convert, export, and the commands of installed
packages above this one (train_cpt's train-cpt), found as entry points in the group COMMANDS:
each names a function that adds its subparser, so this package never imports them."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from jax_longctx import methods as methods_lib
from jax_longctx.methods.refreshkv import CALIBRATION_THRESHOLDS

# Errors a user can cause; they print one line instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
COMMANDS = "jax_longctx.commands"


def _add_method_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--method", default="full",
                 help=f"attention method (one of: {', '.join(methods_lib.names())})")
  p.add_argument("--method-arg", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                 help="a hyper-parameter of the method; repeat for several")


def _cmd_generate(args) -> int:
  from jax_longctx.app.api import load

  if (args.prompt is None) == (args.prompt_file is None):
    raise ValueError("give exactly one of --prompt and --prompt-file")
  prompt = args.prompt if args.prompt_file is None else _read_prompt(args.prompt_file)
  routed = methods_lib.args_per_method(args.method_arg, {args.method: args.method},
                                           option="--method")
  method = methods_lib.get(args.method, **methods_lib.parse_method_args(routed[args.method]))
  lm = load(args.model, dtype=args.dtype, serving=True, mesh=args.mesh, kv_dtype=args.kv_dtype,
            smooth_keys=_smoothing(args, [args.kv_dtype]))
  (text,) = lm.generate([prompt], method, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        chat=args.chat, chunk_size=args.chunk_size,
                        instruction=args.instruction)
  print(text)
  return 0


def _read_prompt(path: str) -> str:
  """The text of --prompt-file; a path that cannot be read (a directory, no permission) is a
  one-line error naming it, not a traceback."""
  try:
    with open(path) as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"--prompt-file {path}: {e.strerror or e}") from None


def _cmd_convert(args) -> int:
  from jax_longctx.checkpoints import convert

  cfg = convert(args.src, args.dst, overwrite=args.overwrite)
  print(f"wrote {args.dst}: {cfg.num_layers} layers, {cfg.num_params() / 1e6:.1f}M params, "
        f"{cfg.dtype}")
  return 0


def _cmd_export(args) -> int:
  from jax_longctx.checkpoints import export_hf, restore

  cfg, params = restore(args.src)
  export_hf(params, cfg, args.dst, tokenizer_dir=args.src, overwrite=args.overwrite)
  print(f"wrote {args.dst} (Hugging Face safetensors)")
  return 0


def _cmd_eval(args) -> int:
  from jax_longctx.app import eval as eval_lib
  from jax_longctx.app.api import load
  from jax_longctx.app import tasks as tasks_lib
  from jax_longctx.app.report import summary_table
  from jax_longctx.app.tasks import parse_length

  from jax_longctx.core.options import RunOptions

  kv_dtypes = [x.strip() for x in args.kv_dtype.split(",") if x.strip()] if args.kv_dtype else []
  for kv in kv_dtypes:
    RunOptions(kv_dtype=kv)  # a bad name is one line, before the model loads
  specs = eval_lib.MethodSpec.parse(args.methods, args.method_arg)
  specs = eval_lib.MethodSpec.per_kv_dtype(
      eval_lib.MethodSpec.at_points(specs, _budget_points(args)), kv_dtypes)
  lengths = [parse_length(x) for x in args.lengths.split(",")]
  depths = [float(x) for x in args.depths.split(",")]
  if any(not 0 <= d <= 1 for d in depths):
    raise ValueError(f"--depths must lie in [0, 1], got {depths}")
  options = methods_lib.parse_method_args(args.task_arg)
  for name in tasks_lib.expand(args.task):  # a bad task or option fails before the model loads
    tasks_lib.get(name, **options)
  if args.coordinator:
    _convert_apart(args.model)
    _join(args.coordinator, args.num_processes, args.process_id)
  lm = load(args.model, dtype=args.dtype, serving=True, mesh=args.mesh,
            smooth_keys=_smoothing(args, kv_dtypes))
  records = eval_lib.run_sweep(lm, args.task, specs, lengths, depths, args.samples, args.out,
                               chat=args.chat, options=lm.run_options(args.chunk_size),
                               task_options=options,
                               cache_len=args.cache_len, batch_size=args.batch_size,
                               first_sample=args.first_sample)
  print(summary_table(records))
  print(f"results in {args.out}")
  return 0


def _smoothing(args, kv_dtypes) -> bool:
  """Whether the model loads with key smoothing: for an 8-bit cache, unless turned off."""
  from pallas_kernels.quant import EIGHT_BIT

  return not args.no_key_smoothing and any(kv in EIGHT_BIT for kv in kv_dtypes)


def _budget_points(args) -> list:
  """--compression-ratios / --budgets as the sweep's points (none: no compression sweep)."""
  from jax_longctx.app.eval import BudgetPoint

  if args.compression_ratios is None and args.budgets is None:
    return []
  if any(a.partition("=")[0].rpartition(".")[2] == "budget" for a in args.method_arg):
    raise ValueError("--compression-ratios / --budgets set every method's budget; drop budget "
                     "from --method-arg")
  if args.budgets is not None:
    items = [x.strip() for x in args.budgets.split(",") if x.strip()]
    if not all(x.isdigit() for x in items):
      raise ValueError(f"--budgets takes kept tokens as integers, e.g. 512,1024, got "
                       f"{args.budgets!r} (ratios go to --compression-ratios)")
    return [BudgetPoint(tokens=int(x)) for x in items]
  return [BudgetPoint(ratio=r) for r in _floats(args.compression_ratios, "--compression-ratios")]


def _floats(text: str, option: str) -> list[float]:
  try:
    return [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"{option} takes comma-separated numbers, got {text!r}") from None


def _cmd_calibrate(args) -> int:
  from jax_longctx.app.api import load
  from jax_longctx.app.calibration import Rule, calibrate_refreshkv, check_args
  from jax_longctx.app.calibration_report import calibration_table
  from jax_longctx.app.tasks import parse_length

  lengths = [parse_length(x) for x in args.lengths.split(",")]
  strides = [int(x) for x in _floats(args.qc_strides, "--qc-strides")]
  thresholds = _floats(args.thresholds, "--thresholds")
  readings = [r.strip() for r in args.readings.split(",") if r.strip()]
  check_args(readings, thresholds, args.texts, strides)
  rule = Rule(tolerance=args.tolerance, min_stride=args.min_stride)
  lm = load(args.model, dtype=args.dtype, serving=True, mesh=args.mesh, kv_dtype=args.kv_dtype,
            smooth_keys=_smoothing(args, [args.kv_dtype]))
  calib = calibrate_refreshkv(
      lm, lengths=lengths, texts=args.texts, thresholds=thresholds, readings=readings,
      qc_strides=strides, budget=args.budget, n_scored=args.n_scored, rule=rule,
      out_dir=args.out, chunk=args.chunk_size)
  print(calibration_table(calib))
  print(f"wrote {calib['written_to']}" + (f"; tables and plots in {args.out}" if args.out else ""))
  return 0


def _convert_apart(model: str) -> None:
  """Converts a bundled model (or the default) in a child process, before this one joins the
  others. Converted inside a joined process, it deadlocked (4 H200s; CPU too): the converting
  process's JAX backend and orbax wait for every process, and the others wait on the
  conversion's lock. The children take turns on that lock; one converts."""
  import os
  import subprocess
  code = ("import sys\nfrom jax_longctx.app.api import checkpoint_path\n"
          "try:\n  checkpoint_path(sys.argv[1])\n"
          "except Exception as e:\n  sys.exit(f'jax-longctx: error: {e}')")
  # The conversion needs no accelerator: the child leaves the GPUs alone.
  done = subprocess.run([sys.executable, "-c", code, model],
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if done.returncode:
    sys.exit(done.returncode)  # the child printed the one-line error


def _join(coordinator: str, num_processes: int, process_id: int) -> None:
  import jax
  if not 0 <= process_id < num_processes:
    raise ValueError(f"--process-id {process_id} must lie in [0, --num-processes {num_processes})")
  # CPU processes (tests, a CPU cluster) need a collectives backend; GPUs use NCCL regardless.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


_MESH_HELP = ("devices to run on, e.g. data=2,model=4: rows over data, heads and hidden units over "
              "model (tensor parallel), the context over ctx (star, ring, reattention_mesh); "
              "axes left out are 1")
_SMOOTH_HELP = ("with an 8-bit cache, quantize the keys and values as the model makes them "
                "(default: per-channel key smoothing and KV offsets calibrated at load, exact "
                "for every score)")
_KV_HELP = ("how the KV cache is stored: the model's dtype (default), or int8 / float8_e4m3fn "
            "(8 bits with a scale per token and KV head, about half the bytes)")
_MODEL_HELP = ("'default' (SmolLM2-135M), 'qwen2.5-coder-0.5b' or 'qwen2.5-coder-1.5b' (bundled, "
               "32K window), a converted checkpoint, an HF directory or a GGUF file")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jax-longctx", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="continue a prompt")
  g.add_argument("--model", default="default", help=_MODEL_HELP)
  g.add_argument("--prompt")
  g.add_argument("--prompt-file")
  g.add_argument("--instruction", default=None,
                 help="the instruction, read apart from the prompt (then the document) by "
                      "methods guided by it (citrus_*, h2o_shared); without it they take the "
                      "prompt's last paragraph (after its last blank line)")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  g.add_argument("--chunk-size", type=int, default=None,
                 help="prefill chunk length (default: 8192 on GPUs, 512 elsewhere)")
  g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  g.add_argument("--mesh", default=None, metavar="AXIS=N,...", help=_MESH_HELP)
  g.add_argument("--kv-dtype", default=None, metavar="DTYPE", help=_KV_HELP)
  g.add_argument("--no-key-smoothing", action="store_true", help=_SMOOTH_HELP)
  _add_method_args(g)
  g.set_defaults(func=_cmd_generate)

  ev = sub.add_parser("eval", help="evaluate methods on a long-context task")
  ev.add_argument("--model", default="default", help=_MODEL_HELP)
  ev.add_argument("--task", required=True,
                  help="passkey, niah_single, niah_single_text, niah_multikey, niah_multivalue, "
                       "niah_multiquery, chain_of_key, ppl; ruler (RULER's 11 synthetic tasks, "
                       "docs/EVAL.md) or ruler:TASK,TASK (some of them, e.g. ruler:vt,cwe)")
  ev.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                  help="a task option, e.g. value_type=uuid, chain=5, n_scored=128")
  ev.add_argument("--methods", default="full", help="comma-separated method names")
  ev.add_argument("--method-arg", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                  help="METHOD.KEY=VALUE for one method, KEY=VALUE for every method but full")
  ev.add_argument("--lengths", default="4k", help="prompt lengths in tokens, e.g. 4k,8k")
  points = ev.add_mutually_exclusive_group()
  points.add_argument("--compression-ratios", default=None, metavar="R,R,...",
                      help="a compression sweep (kvpress's plot): each method with a budget at "
                           "each ratio, kept tokens = (1 - R) x length; full runs once as the "
                           "baseline; e.g. 0.25,0.5,0.75")
  points.add_argument("--budgets", default=None, metavar="TOKENS,...",
                      help="a compression sweep at kept-token budgets, e.g. 512,1024,2048")
  ev.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths in [0, 1]")
  ev.add_argument("--samples", type=int, default=20, help="samples per method and length")
  ev.add_argument("--first-sample", type=int, default=0, metavar="K",
                  help="run samples K..samples-1 only (seeds and depths as in the whole sweep): "
                       "one sweep split over several processes or GPUs, each its own --out")
  ev.add_argument("--out", required=True, help="directory for results.jsonl, summary.md, plots")
  ev.add_argument("--chat", action="store_true", help="use the model's chat template")
  ev.add_argument("--chunk-size", type=int, default=None,
                  help="prefill chunk length (default: 8192 on GPUs, 512 elsewhere)")
  ev.add_argument("--cache-len", type=int, default=None,
                  help="one cache size (tokens) for all lengths: one compile per method")
  ev.add_argument("--batch-size", type=int, default=1, metavar="N",
                  help="samples of one method and length run together as one batch (default 1; "
                       "on a GPU, 8-16 at 4K-32K shares each decode step's weight reads)")
  ev.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  ev.add_argument("--mesh", default=None, metavar="AXIS=N,...", help=_MESH_HELP)
  ev.add_argument("--kv-dtype", default=None, metavar="DTYPE[,DTYPE...]",
                  help=_KV_HELP + "; a comma list runs every method with each (labelled)")
  ev.add_argument("--no-key-smoothing", action="store_true", help=_SMOOTH_HELP)
  ev.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                  help="run as one of --num-processes processes (jax.distributed, one per GPU "
                       "or host): mesh methods span every process's devices; process 0 writes")
  ev.add_argument("--num-processes", type=int, default=1)
  ev.add_argument("--process-id", type=int, default=0)
  ev.set_defaults(func=_cmd_eval)

  cal = sub.add_parser("calibrate", help="choose a method's setting for a model on held-out "
                      "text (refreshkv: its similarity threshold, the paper's Appendix A.4)")
  cal.add_argument("method", choices=["refreshkv"])
  cal.add_argument("--model", default="default", help=_MODEL_HELP)
  cal.add_argument("--lengths", default="16k", help="held-out text lengths, e.g. 16k")
  cal.add_argument("--texts", type=int, default=24, help="held-out texts per length")
  cal.add_argument("--thresholds", default=",".join(map(str, CALIBRATION_THRESHOLDS)),
                   help="similarity thresholds to sweep, comma-separated")
  cal.add_argument("--readings", default="before,after",
                   help="queries compared before and/or after RoPE")
  cal.add_argument("--qc-strides", default="5", help="query-comparison strides, e.g. 5,10")
  cal.add_argument("--budget", type=float, default=0.125, help="K as a fraction of the cache")
  cal.add_argument("--n-scored", type=int, default=256, help="scored (decoded) tokens per text")
  cal.add_argument("--tolerance", type=float, default=0.05,
                   help="share of the gap within which a threshold counts as the best's equal")
  cal.add_argument("--min-stride", type=float, default=0.0,
                   help="lowest effective stride a threshold may have (0: no floor, the paper's)")
  cal.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  cal.add_argument("--mesh", default=None, metavar="AXIS=N,...", help=_MESH_HELP)
  cal.add_argument("--kv-dtype", default=None, metavar="DTYPE", help=_KV_HELP)
  cal.add_argument("--no-key-smoothing", action="store_true", help=_SMOOTH_HELP)
  cal.add_argument("--chunk-size", type=int, default=None,
                   help="prefill chunk length (default: 8192 on GPUs, 512 elsewhere)")
  cal.add_argument("--out", default=None,
                   help="directory for per-text records (a rerun resumes), summary.md, "
                        "calibration.md and calibration.png")
  cal.set_defaults(func=_cmd_calibrate)

  c = sub.add_parser("convert", help="HF directory or GGUF file -> orbax checkpoint")
  c.add_argument("src")
  c.add_argument("dst")
  c.add_argument("--overwrite", action="store_true")
  c.set_defaults(func=_cmd_convert)

  e = sub.add_parser("export", help="orbax checkpoint -> HF safetensors directory")
  e.add_argument("src")
  e.add_argument("dst")
  e.add_argument("--overwrite", action="store_true")
  e.set_defaults(func=_cmd_export)

  for command in entry_points(group=COMMANDS):
    command.load()(sub)
  return parser


def run_parsed(args, prog: str = "jax-longctx") -> int:
  """Runs a parsed command; a user's error is one line on stderr and exit status 2."""
  try:
    return args.func(args)
  except USER_ERRORS as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
  return run_parsed(build_parser().parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
