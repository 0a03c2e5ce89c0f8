"""`jax-longctx` command line: generate, convert, export."""

from __future__ import annotations

import argparse
import sys

from jax_longctx import methods as methods_lib

# Errors a user can cause; they print one line instead of a traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


def _add_method_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--method", default="full",
                 help=f"attention method (one of: {', '.join(methods_lib.names())})")
  p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                 help="a hyper-parameter of the method; repeat for several")


def _cmd_generate(args) -> int:
  from jax_longctx.api import load

  if (args.prompt is None) == (args.prompt_file is None):
    raise ValueError("give exactly one of --prompt and --prompt-file")
  prompt = args.prompt
  if args.prompt_file is not None:
    with open(args.prompt_file) as f:
      prompt = f.read()
  method = methods_lib.get(args.method, **methods_lib.parse_method_args(args.method_arg))
  lm = load(args.model, dtype=args.dtype)
  (text,) = lm.generate([prompt], method, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        chat=args.chat, chunk_size=args.chunk_size)
  print(text)
  return 0


def _cmd_convert(args) -> int:
  from checkpoints_convert import convert

  cfg = convert(args.src, args.dst, overwrite=args.overwrite)
  print(f"wrote {args.dst}: {cfg.num_layers} layers, {cfg.num_params() / 1e6:.1f}M params, "
        f"{cfg.dtype}")
  return 0


def _cmd_export(args) -> int:
  from checkpoints_convert import export_hf, restore

  cfg, params = restore(args.src)
  export_hf(params, cfg, args.dst, tokenizer_dir=args.src, overwrite=args.overwrite)
  print(f"wrote {args.dst} (Hugging Face safetensors)")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jax-longctx", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="continue a prompt")
  g.add_argument("--model", default="default",
                 help="'default', a converted checkpoint, an HF directory or a GGUF file")
  g.add_argument("--prompt")
  g.add_argument("--prompt-file")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  g.add_argument("--chunk-size", type=int, default=512, help="prefill chunk length")
  g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  _add_method_args(g)
  g.set_defaults(func=_cmd_generate)

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
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except _USER_ERRORS as e:
    print(f"jax-longctx: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
