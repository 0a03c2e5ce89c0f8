"""The marker table of tests/conftest.py (MARKED) cannot fall behind the tests: every test that
starts a multi-device process (names the device-count flag or `run_on_eight_devices`, itself or
through a function or fixture of its file that does) is `mesh`, and every entry names a test
file or a test function that exists. Read from the files' text: nothing is collected or run."""

import ast
import glob
import os

from tests.conftest import MARKED

TESTS = os.path.dirname(os.path.abspath(__file__))
MULTI_DEVICE = ("xla_force_host_platform_device_count", "run_on_eight_devices")


def _test_files() -> dict[str, str]:
  """tests/**/test_*.py by path under tests/ -> text (this file, which names the flags, left out)."""
  paths = glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)
  return {os.path.relpath(p, TESTS).replace(os.sep, "/"): open(p, encoding="utf-8").read()
          for p in sorted(paths) if os.path.abspath(p) != os.path.abspath(__file__)}


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
  return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def multi_device_tests(text: str) -> set[str]:
  """The test functions of a file's text that start a multi-device process: a function whose
  source names one of MULTI_DEVICE, or which calls one that does or takes it as a fixture."""
  functions = _functions(ast.parse(text))
  spawning = {name for name, f in functions.items()
              if any(flag in ast.get_source_segment(text, f) for flag in MULTI_DEVICE)}
  while True:
    more = {name for name, f in functions.items() if name not in spawning and (
        {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} | {a.arg for a in f.args.args})
        & spawning}
    if not more:
      return {name for name in spawning if name.startswith("test")}
    spawning |= more


def _covered(marker: str, file: str, test: str) -> bool:
  return file in MARKED[marker] or f"{file}::{test}" in MARKED[marker]


def test_every_multi_device_test_is_marked_mesh():
  files = _test_files()
  missing = [f"{file}::{test}" for file, text in files.items()
             for test in sorted(multi_device_tests(text)) if not _covered("mesh", file, test)]
  assert not missing, f"add to MARKED['mesh'] in tests/conftest.py: {missing}"
  flagged = [file for file, text in files.items() if "xla_force_host_platform_device_count" in text]
  assert flagged and all(any(e.split("::")[0] == f for e in MARKED["mesh"]) for f in flagged)


def test_every_entry_names_a_test_that_exists():
  files = _test_files()
  for marker, entries in MARKED.items():
    for entry in entries:
      file, _, test = entry.partition("::")
      assert file in files, f"MARKED[{marker!r}]: no tests/{file}"
      assert not test or test in _functions(ast.parse(files[file])), (
          f"MARKED[{marker!r}]: no {test} in tests/{file}")


def test_the_guard_sees_a_flag_through_a_helper():
  text = ('def _run():\n  env = "--xla_force_host_platform_device_count=8"\n\n'
          'def test_a():\n  _run()\n\ndef test_b():\n  pass\n')
  assert multi_device_tests(text) == {"test_a"}
