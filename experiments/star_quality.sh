#!/usr/bin/env bash
# Star Attention quality of issue 10 (docs/results/star/): passkey and niah multi-key at 8K, 4
# blocks (a quarter of the context each, anchor = block) on 4 devices, chat template, and full
# attention on the same samples. On a CPU machine the 4 devices are fake (XLA_FLAGS below); on a
# GPU host, the visible GPUs.
#   experiments/star_quality.sh [MODEL] [OUT]     SAMPLES=N (default 20); results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/star}
if ! python -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')"; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"
fi
for task in passkey niah_multikey; do
  python -m jax_longctx.cli eval --model "$model" --chat --task "$task" --methods star,full \
    --lengths 8k --samples "${SAMPLES:-20}" --out "$out/$task"
done
