"""`jax-longctx train-cpt`: added to the command line through the `jax_longctx.commands` entry
point (pyproject.toml), since the library's CLI sits below this package."""

from __future__ import annotations

import argparse
import sys

from jax_longctx.methods import parse_method_args
from train_cpt.config import load_config
from train_cpt.loop import train


def add_command(sub: argparse._SubParsersAction) -> None:
  t = sub.add_parser("train-cpt", help="RefreshKV continued pretraining (resumes by itself)")
  t.add_argument("--config", required=True, help="a .toml or .json file of train_cpt settings")
  t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a setting of the file; repeat for several")
  t.add_argument("--stop-after", type=int, default=None,
                 help="leave after this many steps (resume later with the same command)")
  t.set_defaults(func=run)


def run(args) -> int:
  cfg = load_config(args.config, parse_method_args(args.set))
  result = train(cfg, stop_after=args.stop_after)
  print(f"last evaluation: {result}")
  print(f"log in {cfg.out_dir}/log.jsonl; trained model in {cfg.out_dir}/final")
  return 0


def main(argv=None) -> int:
  """`python -m train_cpt.cli --config ...`: the same command from a source tree that is not
  pip-installed (no entry point: a checkout carried to a GPU machine)."""
  from jax_longctx.app.cli import run_parsed
  parser = argparse.ArgumentParser(prog="python -m train_cpt.cli")
  add_command(parser.add_subparsers(dest="command", required=True))
  return run_parsed(parser.parse_args(["train-cpt", *(sys.argv[1:] if argv is None else argv)]),
                    prog="train-cpt")


if __name__ == "__main__":
  sys.exit(main())
