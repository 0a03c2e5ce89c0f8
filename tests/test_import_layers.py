"""Imports run one way (docs/ARCHITECTURE.md, "Layers"): a module may import its own layer and the
layers below it, never one above, and neither at module level nor inside a function. A static
scan of the sources: fast, and it sees imports that a run would not reach."""

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "jax_longctx", "checkpoints_convert", "train_cpt")

# Lowest first. A module takes the layer of the longest prefix listed for it.
LAYERS = [
    ("kernels", ["pallas_kernels"]),
    ("config", ["jax_longctx.config", "jax_longctx.config_types", "jax_longctx.families",
                "jax_longctx.rope", "jax_longctx.progress", "jax_longctx.tokenizer", "jax_longctx.tasks",
                "jax_longctx.report", "checkpoints_convert.errors",
                "checkpoints_convert.safetensors_io", "checkpoints_convert.sources",
                "checkpoints_convert.layout", "checkpoints_convert.gguf_tokenizer",
                "train_cpt.config", "train_cpt.data", "train_cpt.sharding"]),
    ("attention", ["jax_longctx.attention", "jax_longctx.cache", "jax_longctx.top_n"]),
    ("methods", ["jax_longctx.methods", "train_cpt.pattern"]),
    # checkpoints_convert.pipeline needs the model's parameter shapes (abstract_model); the
    # package's __init__ loads it lazily, so its readers and layout stay on the config layer.
    ("model", ["jax_longctx.model", "checkpoints_convert.pipeline", "checkpoints_convert"]),
    ("prefill", ["jax_longctx.chunked_prefill"]),
    ("instructed", ["jax_longctx.instructed"]),
    ("generate", ["jax_longctx.generation"]),
    ("distributed", ["jax_longctx.distributed"]),
    ("driver", ["jax_longctx.driver"]),
    ("eval/api", ["jax_longctx.api", "jax_longctx.eval", "jax_longctx.default_model",
                  "jax_longctx.bundled", "train_cpt"]),
    ("cli", ["jax_longctx.cli", "jax_longctx"]),  # the package re-exports the API lazily
]


def _layer(module: str) -> int:
  best = None
  for i, (_, prefixes) in enumerate(LAYERS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
        best = (i, len(p))
  assert best is not None, f"{module} is in no layer: add it to LAYERS"
  return best[0]


def _modules():
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _is_module(name: str) -> bool:
  base = ROOT.joinpath(*name.split("."))
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(tree: ast.AST):
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
          yield (full if _is_module(full) else child.module), inner
      yield from walk(child, inner)
  for name, inner in walk(tree, False):
    if name.split(".")[0] in PACKAGES:
      yield name, inner


def _violations():
  out = []
  for module, path in _modules():
    own = _layer(module)
    for target, in_function in _imports(ast.parse(path.read_text())):
      if target == module or (target in PACKAGES and module.startswith(target + ".")):
        continue  # a package's own __init__ from inside it
      if _layer(target) > own:
        where = "inside a function" if in_function else "at module level"
        out.append(f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[_layer(target)][0]}) "
                   f"{where}")
  return out


def test_imports_run_one_way():
  assert _violations() == []


def test_the_scan_catches_an_upward_import():
  """A function-level import of a higher layer is found (the way circles used to be dodged)."""
  src = "def f():\n  from jax_longctx.generation import prefill\n"
  found = list(_imports(ast.parse(src)))
  assert found == [("jax_longctx.generation", True)]
  assert _layer("jax_longctx.generation") > _layer("jax_longctx.instructed")
