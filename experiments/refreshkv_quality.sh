#!/usr/bin/env bash
# The RefreshKV quality sweep (issues 9 and 24; docs/results/refreshkv/), as run on one GPU.
#   experiments/refreshkv_quality.sh [MODEL] [OUT]
# K = L/8 (budget 0.125 of the cache, SnapKV the same), similarity threshold 0.85, QC stride 5
# and 10. Long-text perplexity at PPL_LENGTHS (default 8k; last 256 tokens, teacher-forced one
# token per decode step; ppl_ratio_by_position.png is the paper's Figure 3), chain-of-key and
# niah multi-key at TASK_LENGTHS (default 8k) with the chat template. Several lengths write
# OUT/TASK/LENGTH, each with its own cache (L + 512), so K = L/8 holds at every length.
#   TASKS="ppl" runs a subset, SAMPLES=N another sample count, DTYPE, PPL_NAME another directory
#   name for the ppl results (OUT/PPL_NAME); results resume.
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=${1:-default}
out=${2:-docs/results/refreshkv}
tasks=${TASKS:-ppl chain_of_key niah_multikey}
methods=full,snapkv,rkv5:refreshkv,rkv10:refreshkv
args=(--method-arg snapkv.budget=0.125 --method-arg rkv5.qc_stride=5
      --method-arg rkv10.qc_stride=10)
# The recorded setting, pinned: unset, the threshold and the query reading would come from the
# model's calibration (issue 39; experiments/refreshkv_calibrated.sh runs that).
for l in rkv5 rkv10; do
  args+=(--method-arg "$l.threshold=0.85" --method-arg "$l.similarity_after_rope=False")
done
cli=(python -m jax_longctx eval --model "$model" --samples "${SAMPLES:-20}")
[ -n "${DTYPE:-}" ] && cli+=(--dtype "$DTYPE")
for task in $tasks; do
  chat=(--chat)
  lengths=${TASK_LENGTHS:-8k}
  [ "$task" = ppl ] && chat=() && lengths=${PPL_LENGTHS:-8k}
  for length in ${lengths//,/ }; do
    name=$task
    [ "$task" = ppl ] && name=${PPL_NAME:-ppl}
    dir=$out/$name
    [ "$lengths" != "$length" ] && dir=$out/$name/$length
    "${cli[@]}" "${chat[@]}" --task "$task" --methods "$methods" "${args[@]}" \
      --lengths "$length" --cache-len $(( $(tokens "$length") + 512 )) --out "$dir"
  done
done
