#!/usr/bin/env bash
# The 8-bit KV cache's quality against the bf16 cache (issue 54) on MODEL, full attention, the
# cache in bfloat16, int8 and float8_e4m3fn in one sweep (labels "full bfloat16", "full int8",
# ...): perplexity of the last 256 tokens of SAMPLES (100) texts at 16K and 32K, and passkey at
# 16K and 32K (20 samples, chat template). One cache size for both lengths (one compile per
# dtype). Results resume; a cut-off part runs on where it stopped.
#   experiments/kv_quant_quality.sh MODEL OUT [PARTS]     PARTS: "ppl passkey" (default)
# KV_DTYPES (default bfloat16,int8,float8_e4m3fn): the cache dtypes; an 8-bit one loads the model
# with key smoothing (run/key_smoothing.py) unless SMOOTH=off.
set -euo pipefail
model=$1 out=$2 parts=${3:-ppl passkey}
cli=(python -m jax_longctx eval --model "$model" --dtype bfloat16 --methods full
     --kv-dtype "${KV_DTYPES:-bfloat16,int8,float8_e4m3fn}" --lengths 16k,32k --cache-len 33280)
[[ ${SMOOTH:-on} == off ]] && cli+=(--no-key-smoothing)
for part in $parts; do
  case $part in
    ppl) "${cli[@]}" --task ppl --samples "${SAMPLES:-100}" --task-arg n_scored=256 \
           --out "$out/ppl" ;;
    passkey) "${cli[@]}" --task passkey --chat --samples "${SAMPLES:-20}" --out "$out/passkey" ;;
    *) echo "unknown part $part (ppl | passkey)" >&2; exit 2 ;;
  esac
done
