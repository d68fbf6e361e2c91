#!/usr/bin/env bash
# The tiny CPU demo, end to end: make a tiny Qwen2 and its tokenizer locally, generate the
# synthetic 2-digit addition task, measure its accuracy, teach it the task with the Megatron
# SFT trainer, and measure again (0% before, ~97% after; ~4 minutes on 2 cores).
#
#   bash launch/sft_tiny_cpu.sh                  # single process
#   NPROC=2 bash launch/sft_tiny_cpu.sh          # the same run under torchrun on 2 ranks (DP=2)
#   OUT=/path bash launch/sft_tiny_cpu.sh key=value ...   # outputs elsewhere; extra config overrides
#
# Outputs (model, data, checkpoints, metrics.jsonl, the exported HF model) land in $OUT
# (default: outputs/sft_tiny_cpu in the repository root); metrics.jsonl under $OUT/logs.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
out="${OUT:-$root/outputs/sft_tiny_cpu}"
nproc="${NPROC:-1}"
# One thread per rank: at this model size two threads on a busy 2-core machine are ~20x slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  "$python" "$root/tools/make_tiny_model.py" --family qwen2 --out "$out/model"
fi
if [ ! -f "$out/data/train.parquet" ]; then
  "$python" "$root/tools/data/arithmetic.py" --out-dir "$out/data" --train 20000 --val 200 --digits 2
fi

echo "== accuracy before SFT"
"$python" -m verl.trainer.eval_generation --model "$out/model" --data "$out/data/test.parquet"

if [ "$nproc" -gt 1 ]; then
  # verl's torchrun (verl/trainer/torchrun.py)
  launcher=("$python" -m verl.trainer.torchrun --standalone --nproc_per_node "$nproc" -m verl.trainer.main_sft)
else
  launcher=("$python" -m verl.trainer.main_sft)
fi
settings=(
  model.path="$out/model"
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet"
  trainer.default_local_dir="$out/checkpoints" trainer.log_dir="$out/logs"
  trainer.hf_export_dir="$out/sft_model" "$@"
)
# In the background, so that a SIGTERM or Ctrl-C to this script reaches the trainer, which saves a
# checkpoint and exits 143 / 130; this script then exits with that status.
# VERL_DIES_WITH_PARENT=1: a kill -9 of this script takes the trainer (or torchrun and its workers) along.
VERL_DIES_WITH_PARENT=1 "${launcher[@]}" --config sft_tiny_cpu "${settings[@]}" &
trainer=$!
trap 'kill -TERM "$trainer" 2>/dev/null; wait "$trainer"; exit 143' TERM
trap 'kill -INT "$trainer" 2>/dev/null; wait "$trainer"; exit 130' INT
wait "$trainer"
trap - TERM INT

# The model this run exported, from its own settings (an override of trainer.hf_export_dir or
# trainer.save_hf wins over the defaults above): never an older run's folder.
exported="$("$python" -c '
import sys
from verl.config import SFTConfig, load_config
from verl.trainer.run_checks import hf_export_dir
cfg = load_config(SFTConfig, config_file="sft_tiny_cpu", overrides=sys.argv[1:])
print(hf_export_dir(cfg.trainer) if cfg.trainer.save_hf else "")
' "${settings[@]}")"
if [ -n "$exported" ]; then
  echo "== accuracy after SFT ($exported)"
  "$python" -m verl.trainer.eval_generation --model "$exported" --data "$out/data/test.parquet"
else
  echo "== no accuracy after SFT: trainer.save_hf=false exported no model"
fi
