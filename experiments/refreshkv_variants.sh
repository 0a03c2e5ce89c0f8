#!/usr/bin/env bash
# RefreshKV design variants on long-text perplexity at 8K (docs/results/refreshkv/variants):
# where the gap to full attention comes from. SnapKV with RefreshKV's initial cache (window 1,
# fixed size: RefreshKV never refreshing), a stricter threshold, a comparison every step, a
# local window kept at refreshes, a fixed stride.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/refreshkv/variants}
python -m jax_longctx eval --model "$model" --samples "${SAMPLES:-10}" --task ppl \
  --lengths 8k --cache-len 8704 --out "$out" \
  --methods snap1:snapkv,rkv5t95:refreshkv,rkv1:refreshkv,rkv5loc32:refreshkv,rkv10loc32:refreshkv,fixed10:refreshkv \
  --method-arg snap1.budget=0.125 --method-arg snap1.window=1 --method-arg snap1.keep_size=True \
  --method-arg rkv5t95.qc_stride=5 --method-arg rkv5t95.threshold=0.95 \
  --method-arg rkv1.qc_stride=1 \
  --method-arg rkv5loc32.qc_stride=5 --method-arg rkv5loc32.n_local=32 \
  --method-arg rkv10loc32.n_local=32 --method-arg fixed10.fixed_stride=10 \
  --method-arg rkv5t95.similarity_after_rope=False \
  $(for l in rkv1 rkv5loc32 rkv10loc32; do  # the recorded 0.85 before RoPE, not a calibration
      echo "--method-arg $l.threshold=0.85 --method-arg $l.similarity_after_rope=False"; done)
