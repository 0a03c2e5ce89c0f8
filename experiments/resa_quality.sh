#!/usr/bin/env bash
# RESA task quality (issues 7 and 24; docs/results/resa/), as run on one GPU:
#   experiments/resa_quality.sh [MODEL] [OUT]
# niah multi-key, niah multi-value and passkey, 20 samples over 5 depths, chat template, at each
# of LENGTHS (default 8k): Quest and Quest+RESA (lam 1, prior per query head) at the same budget,
# 5% of the length rounded up to whole 16-token Quest pages (416 tokens at 8K), every layer
# sparse as in the RESA paper. Results of a length go to OUT/TASK (one length, as recorded for
# the default model) or OUT/TASK/LENGTH (several).
#   LENGTHS=16k,32k, TASKS=..., SAMPLES=N, BUDGET=tokens (every length), DTYPE override;
#   results resume where they stopped.
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=${1:-default}
out=${2:-docs/results/resa}
tasks=${TASKS:-niah_multikey niah_multivalue passkey}
lengths=${LENGTHS:-8k}
cli=(python -m jax_longctx eval --model "$model" --chat --samples "${SAMPLES:-20}")
[ -n "${DTYPE:-}" ] && cli+=(--dtype "$DTYPE")
for length in ${lengths//,/ }; do
  n=$(tokens "$length")
  budget=${BUDGET:-$(( (n * 5 / 100 + 15) / 16 * 16 ))}
  for task in $tasks; do
    dir=$out/$task
    [ "$lengths" != "$length" ] && dir=$out/$task/$length
    "${cli[@]}" --task "$task" --lengths "$length" \
      --methods quest,resa --method-arg quest.budget="$budget" --method-arg quest.dense_layers=0 \
      --method-arg resa.budget="$budget" --method-arg 'resa.base_args=(("dense_layers",0),)' \
      --cache-len $(( n + 512 )) --out "$dir"
  done
done
