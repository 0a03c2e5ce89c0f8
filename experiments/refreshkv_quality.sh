#!/usr/bin/env bash
# The RefreshKV quality sweep of issue 9 (docs/results/refreshkv/), as run on one GPU.
#   experiments/refreshkv_quality.sh [MODEL] [OUT]
# K = L/8 (budget 0.125 of the cache, SnapKV the same), similarity threshold 0.85, QC stride 5
# and 10. Long-text perplexity at 8K (last 256 tokens, teacher-forced one token per decode
# step; ppl_ratio_by_position.png is the paper's Figure 3), chain-of-key and niah multi-key
# at 8K with the chat template.
#   TASKS="ppl" runs a subset, SAMPLES=N another sample count; results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/refreshkv}
tasks=${TASKS:-ppl chain_of_key niah_multikey}
methods=full,snapkv,rkv5:refreshkv,rkv10:refreshkv
args=(--method-arg snapkv.budget=0.125 --method-arg rkv5.qc_stride=5
      --method-arg rkv10.qc_stride=10 --lengths 8k --cache-len 8704)
cli=(python -m jax_longctx.cli eval --model "$model" --samples "${SAMPLES:-20}")
for task in $tasks; do
  chat=(--chat)
  [ "$task" = ppl ] && chat=()
  "${cli[@]}" "${chat[@]}" --task "$task" --methods "$methods" "${args[@]}" --out "$out/$task"
done
