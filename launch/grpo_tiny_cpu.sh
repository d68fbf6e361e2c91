#!/usr/bin/env bash
# The README's main job, end to end on one CPU machine: make a tiny Qwen2 and its tokenizer
# locally, generate the synthetic 2-digit addition task, SFT-warm the model briefly (it learns
# the answer format and a little arithmetic, leaving room to improve), then train it with GRPO:
# the Megatron actor and reference and the CPU vLLM engine in one torchrun world of 2 ranks.
# The validation reward (accuracy on 200 held-out problems) is printed before and after GRPO.
# About ten minutes on 2 cores.
#
#   bash launch/grpo_tiny_cpu.sh                      # the whole demo
#   OUT=/path bash launch/grpo_tiny_cpu.sh key=value  # outputs elsewhere; extra main_ppo overrides
#   SFT_STEPS=500 bash launch/grpo_tiny_cpu.sh        # another warm-up length
#   OPS=- TRAIN=5000 OUT=outputs/grpo_sub bash launch/grpo_tiny_cpu.sh   # another task: 2-digit subtraction
#
# Outputs land in $OUT (default: outputs/grpo_tiny_cpu in the repository root): the model, data,
# SFT checkpoint, GRPO checkpoints, metrics.jsonl and the exported Hugging Face model; the last
# lines printed say where. A rerun reuses the model, data and SFT model and trains GRPO afresh.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
out="${OUT:-$root/outputs/grpo_tiny_cpu}"
nproc="${NPROC:-2}"
sft_steps="${SFT_STEPS:-600}"
ops="${OPS:-+}"
train="${TRAIN:-20000}"  # training problems (subtraction has fewer distinct 2-digit ones)
# One thread per rank: at this model size more threads on a busy 2-core machine are much slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# vLLM's caches and sockets stay inside $OUT; its per-request INFO lines are left out.
export VLLM_CACHE_ROOT="$out/cache/vllm" VLLM_RPC_BASE_PATH="$out/cache/vllm-rpc"
export TORCHINDUCTOR_CACHE_DIR="$out/cache/inductor" VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"

mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  echo "== making the tiny model"
  "$python" "$root/tools/make_tiny_model.py" --family qwen2 --out "$out/model"
fi
if [ ! -f "$out/data/train.parquet" ]; then
  "$python" "$root/tools/data/arithmetic.py" --out-dir "$out/data" --train "$train" --val 200 --digits 2 --ops "$ops"
fi
if [ ! -f "$out/sft_model/config.json" ]; then
  echo "== SFT warm-up: $sft_steps steps (the full SFT demo takes 1200 to ~97%)"
  "$python" -m verl.trainer.main_sft --config sft_tiny_cpu \
    model.path="$out/model" \
    data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet" \
    trainer.total_training_steps="$sft_steps" trainer.test_freq=-1 trainer.save_freq=-1 \
    trainer.resume_mode=disable trainer.default_local_dir="$out/sft_checkpoints" \
    trainer.log_dir="$out/sft_logs" trainer.hf_export_dir="$out/sft_model"
fi

echo "== GRPO on $nproc ranks (Megatron actor + reference, CPU vLLM rollout)"
"$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m verl.trainer.main_ppo \
  --config grpo_tiny_cpu \
  actor_rollout_ref.model.path="$out/sft_model" \
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet" \
  trainer.n_gpus_per_node="$nproc" trainer.resume_mode=disable \
  trainer.default_local_dir="$out/checkpoints" trainer.log_dir="$out/logs" \
  trainer.hf_export_dir="$out/grpo_model" "$@"

"$python" - "$out" <<'EOF'
import json
import os
import sys

out = sys.argv[1]
records = [json.loads(line) for line in open(os.path.join(out, "logs", "metrics.jsonl"), encoding="utf-8")]
val = [(r["step"], k, v) for r in records for k, v in r.items() if k.startswith("val-core/")]
if val:
    (s0, key, before), (s1, _, after) = val[0], val[-1]
    print(f"== validation reward ({key}): {before:.3f} before GRPO (step {s0}) -> {after:.3f} after (step {s1})")
print(f"== metrics:      {os.path.join(out, 'logs', 'metrics.jsonl')}")
print(f"== checkpoints:  {os.path.join(out, 'checkpoints')}")
print(f"== HF export:    {os.path.join(out, 'grpo_model')}")
EOF
