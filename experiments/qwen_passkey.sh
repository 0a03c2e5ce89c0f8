#!/usr/bin/env bash
# Passkey with full attention on a bundled 32K-window Qwen model (issue 23, docs/results/qwen/):
# chat template, 20 samples over 5 depths per length. On the GPU machine, after
# `benchmarks/carry_model.py join` put the model in $JAX_LONGCTX_CACHE (docs/MODELS.md):
#   experiments/qwen_passkey.sh qwen2.5-coder-0.5b 8k,16k,32k $OUT/passkey_0.5b
#   experiments/qwen_passkey.sh qwen2.5-coder-1.5b 8k,16k,32k $OUT/passkey_1.5b
# SAMPLES=N (default 20), DTYPE (default bfloat16, as the recorded runs); results resume. On CPU, 4k with SAMPLES=5 took 6 min (0.5B).
set -euo pipefail
model=${1:-qwen2.5-coder-0.5b}
lengths=${2:-8k,16k,32k}
out=${3:-docs/results/qwen/passkey_${model}}
python -m jax_longctx eval --model "$model" --task passkey --chat --methods full \
  --lengths "$lengths" --samples "${SAMPLES:-20}" --dtype "${DTYPE:-bfloat16}" --out "$out"
