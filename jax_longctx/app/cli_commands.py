"""What each command of the command line does, its options parsed (cli.py parses them):
load the model and run it, or read and write the files a command names."""

from __future__ import annotations

import sys

from jax_longctx import methods as methods_lib


def cmd_generate(args) -> int:
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
  """The text of --prompt-file (`-`: standard input); a path that cannot be read (a directory,
  no permission) or bytes that are not UTF-8 text are a one-line error naming it."""
  try:
    if path == "-":
      stdin = getattr(sys.stdin, "buffer", None)  # bytes, decoded as UTF-8 whatever the locale
      return stdin.read().decode("utf-8") if stdin is not None else sys.stdin.read()
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"--prompt-file {path}: {e.strerror or e}") from None
  except UnicodeDecodeError:
    name = "- (standard input)" if path == "-" else path
    raise ValueError(f"--prompt-file {name} is not UTF-8 text") from None


def cmd_convert(args) -> int:
  from jax_longctx.checkpoints import convert

  cfg = convert(args.src, args.dst, overwrite=args.overwrite)
  print(f"wrote {args.dst}: {cfg.num_layers} layers, {cfg.num_params() / 1e6:.1f}M params, "
        f"{cfg.dtype}")
  return 0


def cmd_export(args) -> int:
  from jax_longctx.checkpoints import export_hf, restore

  cfg, params = restore(args.src)
  export_hf(params, cfg, args.dst, tokenizer_dir=args.src, overwrite=args.overwrite)
  print(f"wrote {args.dst} (Hugging Face safetensors)")
  return 0


def cmd_eval(args) -> int:
  from jax_longctx.app import eval as eval_lib
  from jax_longctx.app.api import load
  from jax_longctx.app.bench_measure import kernel_options
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
  try:  # a bad field or value is one line, before the model loads
    kernels = kernel_options(args.kernel_option)
  except SystemExit as e:  # the benchmarks' way of saying it; here the CLI's one-line error
    raise ValueError(str(e)) from None
  options = methods_lib.parse_method_args(args.task_arg)
  for name in tasks_lib.expand(args.task):  # a bad task or option fails before the model loads
    tasks_lib.get(name, **options)
  if args.coordinator:
    _convert_apart(args.model)
    _join(args.coordinator, args.num_processes, args.process_id)
  lm = load(args.model, dtype=args.dtype, serving=True, mesh=args.mesh,
            smooth_keys=_smoothing(args, kv_dtypes))
  records = eval_lib.run_sweep(lm, args.task, specs, lengths, depths, args.samples, args.out,
                               chat=args.chat,
                               options=lm.run_options(args.chunk_size).replace_route(
                                   kernels=kernels),
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


def cmd_calibrate(args) -> int:
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


def cmd_report(args) -> int:
  from jax_longctx.app import report

  baselines = [x for label in args.baseline or [] for x in ("--baseline", label)]
  return report.main([*args.dirs, *baselines, *(["--pack"] if args.pack else [])])


def cmd_methods(args) -> int:
  from jax_longctx.app.cli_listing import methods_text

  print(methods_text(args.names), end="")
  return 0


def cmd_tasks(args) -> int:
  from jax_longctx.app.cli_listing import tasks_text

  print(tasks_text(), end="")
  return 0
