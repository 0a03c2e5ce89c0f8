"""How a command of the command line ends when it cannot finish: one line on stderr, never a
traceback, for what a user or the machine causes (a bad setting, a path that cannot be read or
written, a full disk), and for Ctrl-C a line saying what was kept and how to resume."""

from __future__ import annotations

import os
import shlex
import sys

from jax_longctx.core.errors import LongctxError

# Errors a user can cause; they print one line instead of a traceback. Every error the library
# raises on purpose is a LongctxError; ValueError stays for the checks of the command line itself.
USER_ERRORS = (LongctxError, ValueError)
ERROR_STATUS = 2  # argparse's status for a bad command line; every one-line error exits with it
INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C ended

# Options naming a path, in the order they are matched against the path an OSError names: the
# line says which option the path came from ("--out R: File exists").
_PATH_OPTIONS = ("out", "prompt_file", "model", "config", "dst", "src")


def _option(dest: str) -> str:
  return dest if dest in ("src", "dst") else "--" + dest.replace("_", "-")


def _under(path: str, root: str) -> bool:
  path, root = os.path.abspath(path), os.path.abspath(root)
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def os_error_line(e: OSError, args) -> str:
  """`<what>: <path>: <reason>` for an OSError: what is the option the path came from (--out,
  --model, ...) or else the command; an error the library raised with a message of its own
  (no errno) is that message."""
  if e.strerror is None:
    return str(e)
  paths = [os.fsdecode(p) for p in (e.filename, e.filename2) if p is not None]
  what = getattr(args, "command", None) or "error"
  for dest in _PATH_OPTIONS:
    value = getattr(args, dest, None)
    if isinstance(value, str) and paths and _under(paths[0], value):
      what = f"{_option(dest)} {value}"
      if os.path.abspath(paths[0]) == os.path.abspath(value):
        paths = paths[1:]  # the line already names it
      break
  return ": ".join([what, *paths, e.strerror])


def command_line(argv: list[str] | None) -> str:
  """The command as the user can type it again: `jax-longctx ...` for arguments given to
  `main`, else this process's own (the installed script's path, or `python -m jax_longctx`)."""
  if argv is not None:
    return shlex.join(["jax-longctx", *argv])
  head = [sys.argv[0]]
  if os.path.basename(sys.argv[0]) == "__main__.py":
    head = [sys.executable, "-m", "jax_longctx"]
  return shlex.join([*head, *sys.argv[1:]])


def interrupted_line(args, prog: str, again: str | None) -> str:
  """What Ctrl-C leaves: the command's `kept(args)` (the finished work a rerun resumes from, when
  it keeps any) and the command that resumes."""
  kept = getattr(args, "kept", None)
  where = kept(args) if kept else None
  if not where:
    return f"{prog}: interrupted"
  resume = f"run the same command to resume: {again}" if again else "run the same command to resume"
  return f"{prog}: interrupted; {where}; {resume}"


def _quiet_stdout() -> None:
  """After the reader of stdout left (`jax-longctx methods | head`): later writes, Python's
  own flush at exit included, go nowhere instead of raising again."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
  except (OSError, ValueError, AttributeError):  # stdout is no file (captured by a test)
    pass


def run_parsed(args, prog: str = "jax-longctx", again: str | None = None) -> int:
  """Runs a parsed command. A user's error or an OSError is one line on stderr and exit status
  2; Ctrl-C is one line and status 130. again: the command line to print for resuming (default:
  this process's)."""
  try:
    return args.func(args)
  except KeyboardInterrupt:
    print(interrupted_line(args, prog, again or command_line(None)), file=sys.stderr)
    return INTERRUPTED_STATUS
  except BrokenPipeError:
    _quiet_stdout()
    return 1
  except OSError as e:
    print(f"{prog}: error: {os_error_line(e, args)}", file=sys.stderr)
    return ERROR_STATUS
  except USER_ERRORS as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return ERROR_STATUS
