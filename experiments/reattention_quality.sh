#!/usr/bin/env bash
# The ReAttention quality sweep of issue 6 (docs/results/reattention/), as run on one GPU.
#   experiments/reattention_quality.sh [MODEL] [OUT]
# Passkey at 8K-64K and niah single / multi-key at 16K-32K, 20 samples over 5 depths, chat
# template. Into OUT/TASK: ReAttention with the paper's defaults (scope 8192 = the default model's
# window), full attention, and StreamingLLM with the same scope (budget 8192). Into
# OUT/local2k/TASK: ReAttention with a quarter of the window local (n_local 2048, clip 191,
# `ReAttention.for_window(8192, local_fraction=0.25)`), the setting that reads the default model's
# passkeys past 16K. One cache size per task, so each method compiles once per task.
#   TASKS="passkey niah_single" runs a subset, SAMPLES=N another sample count; results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/reattention}
tasks=${TASKS:-passkey niah_single niah_multikey}
cli=(python -m jax_longctx.cli eval --model "$model" --chat --samples "${SAMPLES:-20}")
paper=(--methods reattention,full,streaming_llm --method-arg streaming_llm.budget=8192)
local2k=(--methods reattention --method-arg reattention.n_local=2048
         --method-arg reattention.clip=191)

run() {  # run TASK DIR METHOD-ARGS...
  local task=$1 dir=$2
  shift 2
  if [ "$task" = passkey ]; then
    "${cli[@]}" "$@" --task passkey --lengths 8k,16k,32k,64k --cache-len 67584 --out "$dir"
  else
    "${cli[@]}" "$@" --task "$task" --lengths 16k,32k --cache-len 33792 --out "$dir"
  fi
}

for task in $tasks; do
  run "$task" "$out/$task" "${paper[@]}"
  run "$task" "$out/local2k/$task" "${local2k[@]}"
done
