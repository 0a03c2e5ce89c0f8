"""Imports run one way (docs/ARCHITECTURE.md, "Layers"): a module may import its own layer and the
layers below it, never one above, and neither at module level nor inside a function. A module's
layer is the folder it lives in, so a new file is placed by where it is put. A static scan of the
sources: fast, and it sees imports that a run would not reach."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "jax_longctx", "checkpoints_convert", "train_cpt")

# Folders, lowest first. Top-level packages import one way: kernels <- jax_longctx <- the
# conversion tool and the training job; inside jax_longctx each folder is a layer.
LAYERS = (
    "pallas_kernels",  # kernels and their jnp references
    "jax_longctx/core",  # config, families, RoPE, run options, errors, progress
    "jax_longctx/ops",  # attention with LSE, caches, top-n
    "jax_longctx/methods",  # one attention method per file, the registry
    "jax_longctx/model",  # the decoder
    "jax_longctx/checkpoints",  # HF / GGUF readers, orbax checkpoints, HF export
    "jax_longctx/run",  # prefill, decode, the driver, the mesh drivers
    "jax_longctx/app",  # load(), eval, report, tasks, bundled models, the CLI
    "jax_longctx",  # the package itself: lazy exports and `python -m jax_longctx`
    "checkpoints_convert",  # the conversion tool's names
    "train_cpt",  # RefreshKV continued pretraining
)
# What may sit in a package folder itself rather than in one of its layer folders.
PACKAGE_FILES = ("__init__.py", "__main__.py")


def layer_of(path: pathlib.PurePath) -> int:
  """The layer of a source file (relative to the root): its deepest listed folder."""
  folder = path.parent.as_posix()
  best = None
  for i, prefix in enumerate(LAYERS):
    if (folder == prefix or folder.startswith(prefix + "/")) and (
        best is None or len(prefix) > len(LAYERS[best])):
      best = i
  assert best is not None, f"{path} is in no layer folder: put it in one of {LAYERS}"
  return best


def module_path(module: str, root: pathlib.Path) -> pathlib.PurePath:
  """The file that defines `module` (a package: its __init__.py), relative to root."""
  base = pathlib.PurePath(*module.split("."))
  if (root / base / "__init__.py").exists():
    return base / "__init__.py"
  return base.with_suffix(".py")


def _is_module(name: str, root: pathlib.Path) -> bool:
  base = root.joinpath(*name.split("."))
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(tree: ast.AST, root: pathlib.Path = ROOT):
  """(imported project module, inside a function?) for every import statement."""
  def walk(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
        continue
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
      if isinstance(child, ast.Import):
        for a in child.names:
          yield a.name, inner
      elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
        for a in child.names:
          full = f"{child.module}.{a.name}"
          yield (full if _is_module(full, root) else child.module), inner
      yield from walk(child, inner)
  for name, inner in walk(tree, False):
    if name.split(".")[0] in PACKAGES:
      yield name, inner


def violations(root: pathlib.Path = ROOT) -> list[str]:
  out = []
  for pkg in PACKAGES:
    for path in sorted((root / pkg).rglob("*.py")):
      rel = path.relative_to(root)
      if rel.parent.as_posix() in ("jax_longctx",) and rel.name not in PACKAGE_FILES:
        out.append(f"{rel} sits in the package folder itself: put it in a layer folder")
        continue
      own = layer_of(rel)
      module = ".".join(rel.with_suffix("").parts)
      for target, in_function in _imports(ast.parse(path.read_text()), root):
        if target in PACKAGES and module.startswith(target + "."):
          continue  # a package's own (lazy) __init__, imported on the way to a submodule
        theirs = layer_of(module_path(target, root))
        if theirs > own:
          where = "inside a function" if in_function else "at module level"
          out.append(f"{rel} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]}) {where}")
  return out


def test_imports_run_one_way():
  assert violations() == []


def test_the_scan_catches_an_upward_import():
  """A function-level import of a higher layer is found (the way circles used to be dodged)."""
  src = "def f():\n  from jax_longctx.run.generation import prefill\n"
  assert list(_imports(ast.parse(src))) == [("jax_longctx.run.generation", True)]


def test_a_file_in_the_wrong_folder_fails(tmp_path):
  """The test of the test: the same file is fine in the run layer and a violation in ops (it
  imports the model above ops), and a loose file in the package folder is refused."""
  for pkg in PACKAGES:
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
  for folder in ("core", "ops", "model", "run"):
    (tmp_path / "jax_longctx" / folder).mkdir()
    (tmp_path / "jax_longctx" / folder / "__init__.py").write_text("")
  (tmp_path / "jax_longctx" / "model" / "decoder.py").write_text("X = 1\n")
  src = "from jax_longctx.model.decoder import X\n"
  (tmp_path / "jax_longctx" / "run" / "steps.py").write_text(src)
  assert violations(tmp_path) == []
  (tmp_path / "jax_longctx" / "ops" / "steps.py").write_text(src)
  assert violations(tmp_path) == [
      "jax_longctx/ops/steps.py (jax_longctx/ops) imports jax_longctx.model.decoder "
      "(jax_longctx/model) at module level"]
  (tmp_path / "jax_longctx" / "ops" / "steps.py").unlink()
  (tmp_path / "jax_longctx" / "loose.py").write_text("")
  assert violations(tmp_path) == [
      "jax_longctx/loose.py sits in the package folder itself: put it in a layer folder"]


def test_top_level_packages_import_one_way():
  """No import runs back up between the top-level packages (their order in LAYERS)."""
  order = {p: i for i, p in enumerate(LAYERS) if "/" not in p}
  for pkg in PACKAGES:
    for path in (ROOT / pkg).rglob("*.py"):
      for target, _ in _imports(ast.parse(path.read_text())):
        top = target.split(".")[0]
        assert order[top] <= order[pkg], f"{path.relative_to(ROOT)} imports {target}"


# pallas_kernels: one folder per op, over shared modules at the top (backend, route, options,
# quant, layout, the GPU / Mosaic GPU / TPU helpers, the per-tile softmax, the jnp references).
# A shared module imports no op folder; an op folder imports the shared modules, its own files
# and only the op folders named here: attention's decode calls merge their key splits with
# decode/split_merge. The package's __init__ re-exports the entry points, so it is exempt.
KERNEL_OPS = {"attention": ("decode",), "topk": (), "decode": ()}


def kernel_violations(root: pathlib.Path = ROOT) -> list[str]:
  out = []
  base = root / "pallas_kernels"
  for path in sorted(base.rglob("*.py")):
    rel = path.relative_to(base)
    if rel.as_posix() == "__init__.py":
      continue
    own = rel.parts[0] if len(rel.parts) > 1 else None
    if own is not None and own not in KERNEL_OPS:
      out.append(f"pallas_kernels/{rel}: {own}/ is no op folder of {sorted(KERNEL_OPS)}")
      continue
    allowed = () if own is None else (own, *KERNEL_OPS[own])
    for target, _ in _imports(ast.parse(path.read_text()), root):
      parts = target.split(".")
      if parts[0] != "pallas_kernels" or len(parts) < 2 or parts[1] not in KERNEL_OPS:
        continue
      if parts[1] not in allowed:
        out.append(f"pallas_kernels/{rel} ({own or 'shared'}) imports {target}")
  return out


def test_kernel_ops_import_one_way():
  assert kernel_violations() == []


def test_the_kernel_scan_catches_a_cross_op_import(tmp_path):
  base = tmp_path / "pallas_kernels"
  for folder in ("", "attention", "topk", "decode"):
    (base / folder).mkdir(exist_ok=True)
    (base / folder / "__init__.py").write_text("")
  (base / "decode" / "merge.py").write_text("X = 1\n")
  (base / "attention" / "flash.py").write_text("from pallas_kernels.decode import merge\n")
  assert kernel_violations(tmp_path) == []
  (base / "topk" / "scores.py").write_text("from pallas_kernels.attention import flash\n")
  (base / "layout.py").write_text("from pallas_kernels.decode.merge import X\n")
  assert kernel_violations(tmp_path) == [
      "pallas_kernels/layout.py (shared) imports pallas_kernels.decode.merge",
      "pallas_kernels/topk/scores.py (topk) imports pallas_kernels.attention.flash"]
