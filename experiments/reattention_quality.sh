#!/usr/bin/env bash
# The ReAttention quality sweep of issue 6 (docs/results/reattention/), as run on one GPU.
#   experiments/reattention_quality.sh [MODEL] [OUT]
# Passkey at 8K-64K and niah single / multi-key at 16K-32K, 20 samples over 5 depths, chat
# template; ReAttention with the paper's defaults (scope 8192 = the default model's window), full
# attention, and StreamingLLM with the same scope (budget 8192). One cache size per task, so each
# method compiles once per task.
#   TASKS="passkey niah_single" runs a subset, SAMPLES=N another sample count; results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/reattention}
tasks=${TASKS:-passkey niah_single niah_multikey}
methods=reattention,full,streaming_llm
cli=(python -m jax_longctx.cli eval)
common=(--model "$model" --chat --samples "${SAMPLES:-20}" --methods "$methods"
        --method-arg streaming_llm.budget=8192)
for task in $tasks; do
  if [ "$task" = passkey ]; then
    "${cli[@]}" "${common[@]}" --task passkey --lengths 8k,16k,32k,64k --cache-len 67584 \
      --out "$out/passkey"
  else
    "${cli[@]}" "${common[@]}" --task "$task" --lengths 16k,32k --cache-len 33792 --out "$out/$task"
  fi
done
