#!/usr/bin/env bash
# Star Attention quality of issue 10 (docs/results/star/): passkey and niah multi-key at 8K, 4
# blocks (a quarter of the context each, anchor = block) on 4 devices, chat template, and full
# attention on the same samples. On a CPU machine the 4 devices are fake (XLA_FLAGS below); on a
# GPU host, the visible GPUs.
#   experiments/star_quality.sh [MODEL] [OUT]     SAMPLES=N (default 20); results resume.
# LENGTHS (default 8k). PROCESSES=N launches N processes, one per GPU (CUDA_VISIBLE_DEVICES=i,
# jax.distributed on localhost, as a multi-host user runs it; process 0 writes), instead of one
# process over every visible GPU. TASKS (default "passkey niah_multikey"), run in that order.
# METHODS (default star,full): add ring for its per-sample times under the same launch (the
# records' prefill_s). For the 32K-window Qwen model on 4 GPUs (issue 24):
#   LENGTHS=16k,32k PROCESSES=4 experiments/star_quality.sh qwen2.5-coder-1.5b docs/results/star/qwen2.5-coder-1.5b
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=${1:-default}
out=${2:-docs/results/star}
processes=${PROCESSES:-1}
if ! python -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')"; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"
fi
for task in ${TASKS:-passkey niah_multikey}; do
  on_processes "$processes" python -m jax_longctx eval --model "$model" --chat --task "$task" \
    --methods "${METHODS:-star,full}" --lengths "${LENGTHS:-8k}" --samples "${SAMPLES:-20}" \
    ${DTYPE:+--dtype "$DTYPE"} --out "$out/$task"
done
