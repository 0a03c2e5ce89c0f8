#!/usr/bin/env bash
# RESA task quality of issue 7 (docs/results/resa/), as run on one GPU:
#   experiments/resa_quality.sh [MODEL] [OUT]
# niah multi-key, niah multi-value and passkey at 8K, 20 samples over 5 depths, chat template:
# Quest and Quest+RESA (lam 1, prior per query head) at the same budget, 416 tokens (5% of 8K,
# a whole number of Quest's 16-token pages), every layer sparse as in the RESA paper.
#   TASKS=... and SAMPLES=N override; results resume where they stopped.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/resa}
tasks=${TASKS:-niah_multikey niah_multivalue passkey}
budget=${BUDGET:-416}
cli=(python -m jax_longctx.cli eval)
for task in $tasks; do
  "${cli[@]}" --model "$model" --chat --samples "${SAMPLES:-20}" --task "$task" --lengths 8k \
    --methods quest,resa --method-arg quest.budget="$budget" --method-arg quest.dense_layers=0 \
    --method-arg resa.budget="$budget" --method-arg 'resa.base_args=(("dense_layers",0),)' \
    --cache-len 8704 --out "$out/$task"
done
