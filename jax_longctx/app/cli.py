"""jax-longctx runs long prompts through Llama-family language models in JAX with a choice of
attention method: full attention, which keeps the whole KV cache, or a method that compresses or
sparsifies it (SnapKV, H2O, TOVA, StreamingLLM, Quest, ReAttention, RESA, RefreshKV, CItruS, Star
Attention). It continues a prompt (generate), measures methods on long-context tasks (eval: passkey,
needles in a haystack, RULER, perplexity) and reports their results (report), and converts models
(convert, export)."""

# The commands of installed packages above this one (train_cpt's train-cpt) join through entry
# points in the group COMMANDS: each names a function that adds its subparser, so this package
# never imports them.

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

from jax_longctx import methods as methods_lib
from jax_longctx.app import bench
from jax_longctx.app import cli_commands as commands
from jax_longctx.app.cli_errors import USER_ERRORS, command_line, run_parsed
from jax_longctx.methods.refreshkv import CALIBRATION_THRESHOLDS

__all__ = ["USER_ERRORS", "build_parser", "main", "run_parsed"]
COMMANDS = "jax_longctx.commands"
EPILOG = ("`jax-longctx COMMAND --help` shows a command's options; `jax-longctx methods` and "
          "`jax-longctx tasks` list the methods and tasks with their settings and defaults.")
_KEPT_SHARE = ("A float budget is the share of the cache KEPT (budget=0.25 keeps a quarter): the "
               "complement of kvpress's compression_ratio and of --compression-ratios; an int "
               "budget is kept tokens.")


def _add_method_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--method", default="full",
                 help=f"attention method, one of: {', '.join(methods_lib.names())}")
  p.add_argument("--method-arg", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                 help="a hyper-parameter of the method, e.g. budget=256; repeat for several "
                      "(default: the method's own, listed by `jax-longctx methods`). "
                      + _KEPT_SHARE)


def _version() -> str:
  try:
    return version("jax-longctx")
  except PackageNotFoundError:  # a source tree run without installing it
    from jax_longctx import __version__
    return f"{__version__} (not installed)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Each option's help ends with its default, unless the help says it already (an option
  without a value of its own: "default: the checkpoint's dtype") or there is none to show (a
  flag, a list the option collects)."""

  def _get_help_string(self, action):
    text = action.help or ""
    said = "default:" in text or "(default)" in text
    if said or not action.option_strings or action.nargs == 0 or action.default in (None, []):
      return text
    return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
  """Every parser of the command line, subcommands too (argparse makes them of this class):
  each shows the defaults of its options."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", _HelpFormatter)
    super().__init__(*args, **kwargs)


_MESH_HELP = ("devices to run on, e.g. data=2,model=4: rows over data, heads and hidden units over "
              "model (tensor parallel), the context over ctx (star, ring, reattention_mesh); "
              "axes left out are 1 (default: one device; the methods that split the context "
              "over ctx take every device)")
_SMOOTH_HELP = ("with an 8-bit cache, quantize the keys and values as the model makes them "
                "(default: per-channel key smoothing and KV offsets calibrated at load, exact "
                "for every score)")
_KV_HELP = ("how the KV cache is stored: the model's dtype (default), int8 / float8_e4m3fn "
            "(8 bits with a scale per token and KV head, about half the bytes), or int4 (KIVI's "
            "4 bits: keys per channel over 32 tokens, values per token over 32 channels, about "
            "0.375 of bf16's bytes; the methods that only append: `jax-longctx methods`); "
            "int4_fp16 stores its scales in fp16 (0.31), int4_g64_fp16 groups 64 (0.28)")
_MODEL_HELP = ("a bundled model: 'default' (SmolLM2-135M-Instruct), 'qwen2.5-coder-0.5b' or "
               "'qwen2.5-coder-1.5b' (32K window); or a converted checkpoint, an HF directory or "
               "a GGUF file")


def _command(sub, name: str, summary: str, func) -> argparse.ArgumentParser:
  p = sub.add_parser(name, help=summary, description=summary)
  p.set_defaults(func=func)
  return p


def _add_model_args(p: argparse.ArgumentParser, kv_help: str = _KV_HELP,
                    kv_metavar: str = "DTYPE") -> None:
  """The options every command that loads a model takes."""
  p.add_argument("--model", default="default", help=_MODEL_HELP)
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="the weights' and activations' dtype (default: the checkpoint's)")
  p.add_argument("--mesh", default=None, metavar="AXIS=N,...", help=_MESH_HELP)
  p.add_argument("--kv-dtype", default=None, metavar=kv_metavar, help=kv_help)
  p.add_argument("--no-key-smoothing", action="store_true", help=_SMOOTH_HELP)
  p.add_argument("--chunk-size", type=int, default=None,
                 help="prefill chunk length (default: 8192 on GPUs, 512 elsewhere)")


def _add_generate(sub) -> None:
  g = _command(sub, "generate", "continue a prompt", commands.cmd_generate)
  _add_model_args(g)
  g.add_argument("--prompt", help="the prompt text (default: none; give it or --prompt-file)")
  g.add_argument("--prompt-file", metavar="PATH",
                 help="a UTF-8 text file holding the prompt; - reads standard input "
                      "(default: none; give it or --prompt)")
  g.add_argument("--instruction", default=None,
                 help="the instruction, read apart from the prompt (then the document) by "
                      "methods guided by it (citrus_*, h2o_shared) (default: the prompt's last "
                      "paragraph, after its last blank line)")
  g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
  g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
  g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
  g.add_argument("--seed", type=int, default=0, help="the sampling seed")
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  _add_method_args(g)


def _add_eval(sub) -> None:
  ev = _command(sub, "eval", "evaluate methods on a long-context task", commands.cmd_eval)
  _add_model_args(ev, kv_help=_KV_HELP + "; a comma list runs every method with each (labelled)",
                  kv_metavar="DTYPE[,DTYPE...]")
  ev.add_argument("--task", required=True,
                  help="a task (`jax-longctx tasks` lists them with their options), ruler "
                       "(RULER's 11 synthetic tasks) or ruler:TASK,TASK (some of them, e.g. "
                       "ruler:vt,cwe)")
  ev.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                  help="a task option, e.g. value_type=uuid, chain=5, n_scored=128 (default: "
                       "the task's own, listed by `jax-longctx tasks`)")
  ev.add_argument("--methods", default="full",
                  help="comma-separated method names (`jax-longctx methods` lists them); "
                       "LABEL:NAME runs a method under a label of its own, so one method can "
                       "run with several settings")
  ev.add_argument("--method-arg", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                  help="METHOD.KEY=VALUE for one method (or label), KEY=VALUE for every method "
                       "but full (default: each method's own). " + _KEPT_SHARE)
  ev.add_argument("--lengths", default="4k", help="prompt lengths in tokens, e.g. 4k,8k")
  points = ev.add_mutually_exclusive_group()
  points.add_argument("--compression-ratios", default=None, metavar="R,R,...",
                      help="a compression sweep (kvpress's plot): each method with a budget at "
                           "each ratio, kept tokens = (1 - R) x length; full runs once as the "
                           "baseline; e.g. 0.25,0.5,0.75 (default: no sweep, each method at its "
                           "own budget)")
  points.add_argument("--budgets", default=None, metavar="TOKENS,...",
                      help="a compression sweep at kept-token budgets, e.g. 512,1024,2048 "
                           "(default: no sweep)")
  ev.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths in [0, 1]")
  ev.add_argument("--samples", type=int, default=20, help="samples per method and length")
  ev.add_argument("--first-sample", type=int, default=0, metavar="K",
                  help="run samples K..samples-1 only (seeds and depths as in the whole sweep): "
                       "one sweep split over several processes or GPUs, each its own --out")
  ev.add_argument("--out", required=True,
                  help="directory for results.jsonl, summary.md and plots; a rerun with the "
                       "same --out skips the samples it holds")
  ev.add_argument("--chat", action="store_true", help="use the model's chat template")
  ev.add_argument("--kernel-option", action="append", default=[], metavar="KEY=VALUE",
                  help="a pallas_kernels.KernelOptions field for every run, e.g. "
                       "topk_eight_bit=products (default: the library's choice); each record "
                       "names the fields given")
  ev.add_argument("--cache-len", type=int, default=None,
                  help="one cache size (tokens) for all lengths: one compile per method "
                       "(default: a cache sized to each length)")
  ev.add_argument("--batch-size", type=int, default=1, metavar="N",
                  help="samples of one method and length run together as one batch (on a GPU, "
                       "8-16 at 4K-32K shares each decode step's weight reads)")
  ev.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                  help="run as one of --num-processes processes (jax.distributed, one per GPU "
                       "or host): mesh methods span every process's devices; process 0 writes "
                       "(default: one process)")
  ev.add_argument("--num-processes", type=int, default=1, help="processes with --coordinator")
  ev.add_argument("--process-id", type=int, default=0,
                  help="this process's rank with --coordinator")
  ev.set_defaults(kept=lambda a: f"finished samples are kept in {a.out}/results.jsonl")


def _add_calibrate(sub) -> None:
  cal = _command(sub, "calibrate", "choose a method's setting for a model on held-out text "
                 "(refreshkv: its similarity threshold, the paper's Appendix A.4)", commands.cmd_calibrate)
  cal.add_argument("method", choices=["refreshkv"], help="the method to calibrate")
  _add_model_args(cal)
  cal.add_argument("--lengths", default="16k", help="held-out text lengths, e.g. 16k")
  cal.add_argument("--texts", type=int, default=24, help="held-out texts per length")
  cal.add_argument("--thresholds", default=",".join(map(str, CALIBRATION_THRESHOLDS)),
                   help="similarity thresholds to sweep, comma-separated")
  cal.add_argument("--readings", default="before,after",
                   help="queries compared before and/or after RoPE")
  cal.add_argument("--qc-strides", default="5", help="query-comparison strides, e.g. 5,10")
  cal.add_argument("--budget", type=float, default=0.125,
                   help="the share of the cache kept (K as a fraction of the cache)")
  cal.add_argument("--n-scored", type=int, default=256, help="scored (decoded) tokens per text")
  cal.add_argument("--tolerance", type=float, default=0.05,
                   help="share of the gap within which a threshold counts as the best's equal")
  cal.add_argument("--min-stride", type=float, default=0.0,
                   help="lowest effective stride a threshold may have (0: no floor, the paper's)")
  cal.add_argument("--out", default=None,
                   help="directory for per-text records (a rerun resumes), summary.md, "
                        "calibration.md and calibration.png (default: only the calibration, "
                        "written next to the model)")
  cal.set_defaults(kept=lambda a: a.out and f"finished texts are kept in {a.out}")


def _add_files(sub) -> None:
  c = _command(sub, "convert", "HF directory or GGUF file -> orbax checkpoint", commands.cmd_convert)
  c.add_argument("src", help="a Hugging Face model directory or a GGUF file")
  c.add_argument("dst", help="the checkpoint directory to write")
  c.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
  e = _command(sub, "export", "orbax checkpoint -> HF safetensors directory", commands.cmd_export)
  e.add_argument("src", help="a converted checkpoint directory")
  e.add_argument("dst", help="the Hugging Face directory to write")
  e.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
  r = _command(sub, "report", "rewrite a sweep's summary.md and plots from its results.jsonl "
               "(after a sweep was stopped, or several were merged)", commands.cmd_report)
  r.add_argument("dirs", nargs="+", metavar="DIR", help="an eval --out directory")
  r.add_argument("--baseline", action="append", default=None, metavar="LABEL",
                 help="a method label to measure perplexity gaps against; repeat for several "
                      "(default: every label containing 'snap')")
  r.add_argument("--pack", action="store_true",
                 help="then keep each sweep's records compressed (results.jsonl.gz; every "
                      "reader takes it, a rerun into the directory unpacks it)")


def _add_listings(sub) -> None:
  m = _command(sub, "methods", "list the attention methods with their hyper-parameters, "
               "defaults and papers", commands.cmd_methods)
  m.add_argument("names", nargs="*", metavar="METHOD",
                 help="only these methods (default: all)")
  _command(sub, "tasks", "list the eval tasks with their options and defaults", commands.cmd_tasks)


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="jax-longctx", description=__doc__, epilog=EPILOG)
  parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  _add_generate(sub)
  _add_eval(sub)
  _add_calibrate(sub)
  _add_files(sub)
  _add_listings(sub)
  bench.add_arguments(_command(sub, "bench", bench.SUMMARY, bench.cmd_bench))
  for command in entry_points(group=COMMANDS):
    command.load()(sub)
  return parser


def main(argv=None) -> int:
  """The `jax-longctx` command: argv as the words after it (default: this process's)."""
  args = build_parser().parse_args(argv)
  return run_parsed(args, again=command_line(argv))


if __name__ == "__main__":
  sys.exit(main())
