#!/usr/bin/env bash
# The CItruS quality sweep of issue 8 (docs/results/citrus/), as run on one GPU.
#   experiments/citrus_quality.sh [MODEL] [OUT]
# k = 768, chunk 256 (the paper's §5.3). Passkey at 4K-32K and niah multi-key at 8K-16K, 20
# samples over 5 depths, chat template: the three CItruS caches, H2O + shared cache, and
# StreamingLLM with the same memory during encoding (budget k + chunk = 1024); full attention up
# to the default model's window (8K). Long-text perplexity at 8K (last 256 tokens): standard
# CSE and the shared cache against StreamingLLM and full attention (the paper's Figure 7).
#   TASKS="passkey ppl" runs a subset, SAMPLES=N another sample count; results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/citrus}
tasks=${TASKS:-passkey niah_multikey ppl}
evicting=citrus_shared,citrus_individual,citrus_standard,h2o_shared,streaming_llm
cli=(python -m jax_longctx.cli eval --model "$model" --samples "${SAMPLES:-20}")
same_memory=(--method-arg streaming_llm.budget=1024)
for task in $tasks; do
  case $task in
    passkey)
      "${cli[@]}" --chat --task passkey --methods "$evicting" "${same_memory[@]}" \
        --lengths 4k,8k,16k,32k \
        --cache-len 33792 --out "$out/passkey"
      "${cli[@]}" --chat --task passkey --methods full --lengths 4k,8k --cache-len 8704 \
        --out "$out/passkey" ;;
    niah_multikey)
      "${cli[@]}" --chat --task niah_multikey --methods "$evicting" "${same_memory[@]}" \
        --lengths 8k,16k \
        --cache-len 16896 --out "$out/niah_multikey"
      "${cli[@]}" --chat --task niah_multikey --methods full --lengths 8k --cache-len 8704 \
        --out "$out/niah_multikey" ;;
    ppl)
      "${cli[@]}" --task ppl --methods citrus_standard,citrus_shared,streaming_llm,full \
        "${same_memory[@]}" \
        --lengths 8k --cache-len 8704 --out "$out/ppl" ;;
  esac
done
