"""Every README example, run as written.

Each ```bash block's commands that start with `jax-longctx` (after any `VAR=value` assignments,
e.g. the multi-device example's XLA_FLAGS) run through bash, one after the other, in one
temporary working directory: the README writes its results under a relative `results/`, and
`jax-longctx report results/...` reads what the `eval` before it wrote. The two Quick start
blocks are left out (CI runs them itself, `.ci/run`); so are lines such as `pip install`. Each
```python block runs as a script in a process of its own. Blocks marked ```text are prose, not
run. The examples run on CPU with the default model; together 2 min 36 s on 2 cores (2026-11-27).

Also: the user-facing docs say nothing of how the project is worked on, and cite papers by
title or arXiv id rather than by a path of the project's own.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*jax-longctx(\s|$)")


def _blocks(kind: str, text: str = README) -> list[str]:
  return re.findall(rf"^```{kind}\n(.*?)^```", text, re.S | re.M)


def quick_start_blocks() -> list[str]:
  section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return _blocks("bash", section)[:2]


def readme_commands() -> list[str]:
  """The `jax-longctx` commands of every ```bash block but the two Quick start ones, in order,
  each a line (continuation backslashes joined)."""
  skip = quick_start_blocks()
  commands = []
  for block in _blocks("bash"):
    if block in skip:
      continue
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      line = line.strip()
      if COMMAND.match(line):
        commands.append(line)
  return commands


COMMANDS = readme_commands()
PYTHON_BLOCKS = _blocks("python")


def _env() -> dict:
  """This process's environment (the suite's compile flags and compilation cache, the model
  cache) with this interpreter's scripts first on PATH, where `jax-longctx` lives."""
  bin_dir = os.path.dirname(sys.executable)
  return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _check(out: subprocess.CompletedProcess, what: str) -> None:
  assert out.returncode == 0, (
      f"README example failed (exit {out.returncode}):\n{what}\n--- stdout\n"
      f"{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """One working directory for every command, in README order (report reads eval's output)."""
  return tmp_path_factory.mktemp("readme")


def test_readme_has_examples():
  assert len(quick_start_blocks()) == 2
  assert len(COMMANDS) >= 5 and PYTHON_BLOCKS, (COMMANDS, len(PYTHON_BLOCKS))


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{i}:{c[:60]}" for i, c in enumerate(COMMANDS)])
def test_readme_command(command, workdir):
  out = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=workdir, env=_env(),
                       capture_output=True, text=True, timeout=420)
  _check(out, command)
  if re.search(r"jax-longctx eval\b", command):  # a sweep ends with its summary table
    for out_dir in re.findall(r"--out (\S+)", command):
      assert os.path.exists(os.path.join(workdir, out_dir, "summary.md")), command


@pytest.mark.parametrize("source", PYTHON_BLOCKS,
                         ids=[f"python{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python(source, workdir, tmp_path):
  script = tmp_path / "example.py"
  script.write_text(source)
  out = subprocess.run([sys.executable, str(script)], cwd=workdir, env=_env(),
                       capture_output=True, text=True, timeout=420)
  _check(out, source)


USER_DOCS = ["README.md", "BENCHMARKS.md"] + [
    os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
    if f.endswith(".md")]
# How the project is worked on (machines lent for a while, tracked issues) is no reader's
# business: measurements name their device and date instead.
TEAM_WORDS = re.compile(r"\blease|device time|this session|the session|issue [0-9]|issue's|"
                        r"shared/papers", re.I)


@pytest.mark.parametrize("path", USER_DOCS)
def test_user_docs_speak_to_users(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    hits = [f"{path}:{n}: {line.strip()[:120]}" for n, line in enumerate(f, 1)
            if TEAM_WORDS.search(line)]
  assert not hits, "\n".join(hits)
