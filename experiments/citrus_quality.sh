#!/usr/bin/env bash
# The CItruS quality sweep (issues 8 and 24; docs/results/citrus/), as run on one GPU.
#   experiments/citrus_quality.sh [MODEL] [OUT]
# k = K (default 768, the paper's §5.3), chunk 256. Passkey at PASSKEY_LENGTHS (default 4k-32k)
# and niah multi-key at NIAH_LENGTHS (default 8k,16k), 20 samples over 5 depths, chat template:
# the three CItruS caches, H2O + shared cache, and StreamingLLM with the same memory during
# encoding (budget k + chunk); full attention at FULL_PASSKEY_LENGTHS / FULL_NIAH_LENGTHS
# (default: up to the default model's 8K window). Long-text perplexity at 8K (last 256 tokens):
# standard CSE and the shared cache against StreamingLLM and full attention (the paper's Fig. 7).
#   For a 32K-window model: PASSKEY_LENGTHS=8k,16k,32k NIAH_LENGTHS=16k,32k
#   FULL_PASSKEY_LENGTHS=8k,16k,32k FULL_NIAH_LENGTHS=16k,32k K=2048 TASKS="passkey niah_multikey".
#   TASKS="passkey ppl" runs a subset, SAMPLES=N another sample count, DTYPE; results resume.
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=${1:-default}
out=${2:-docs/results/citrus}
tasks=${TASKS:-passkey niah_multikey ppl}
k=${K:-768}
passkey_lengths=${PASSKEY_LENGTHS:-4k,8k,16k,32k}
niah_lengths=${NIAH_LENGTHS:-8k,16k}
full_passkey_lengths=${FULL_PASSKEY_LENGTHS:-4k,8k}
full_niah_lengths=${FULL_NIAH_LENGTHS:-8k}
citrus=(citrus_shared citrus_individual citrus_standard h2o_shared)
evicting=$(IFS=,; echo "${citrus[*]},streaming_llm")
cli=(python -m jax_longctx eval --model "$model" --samples "${SAMPLES:-20}")
[ -n "${DTYPE:-}" ] && cli+=(--dtype "$DTYPE")
same_memory=(--method-arg "streaming_llm.budget=$(( k + 256 ))")
for m in "${citrus[@]}"; do same_memory+=(--method-arg "$m.budget=$k"); done
sweep() {  # sweep TASK LENGTHS FULL_LENGTHS
  "${cli[@]}" --chat --task "$1" --methods "$evicting" "${same_memory[@]}" --lengths "$2" \
    --cache-len "$(cache_len "$2")" --out "$out/$1"
  "${cli[@]}" --chat --task "$1" --methods full --lengths "$3" --cache-len "$(cache_len "$3")" \
    --out "$out/$1"
}
for task in $tasks; do
  case $task in
    passkey) sweep passkey "$passkey_lengths" "$full_passkey_lengths" ;;
    niah_multikey) sweep niah_multikey "$niah_lengths" "$full_niah_lengths" ;;
    ppl)
      "${cli[@]}" --task ppl --methods citrus_standard,citrus_shared,streaming_llm,full \
        "${same_memory[@]}" --lengths 8k --cache-len 8704 --out "$out/ppl" ;;
  esac
done
