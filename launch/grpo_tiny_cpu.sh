#!/usr/bin/env bash
""":"
# The README's main job, end to end on one CPU machine: make a tiny Qwen2 and its tokenizer
# locally, generate the synthetic 2-digit addition task, SFT-warm the model briefly (it learns
# the answer format and a little arithmetic, leaving room to improve), then train it with GRPO:
# the Megatron actor and reference and the CPU vLLM engine in one torchrun world of 2 ranks.
# The validation reward (accuracy on 200 held-out problems) is printed before GRPO and every 100
# of its 200 steps. About five minutes on 2 quiet cores (GRPO ~0.8 s a step), much longer on a
# shared machine. This file is valid bash and valid Python: both of these run it.
#
#   bash launch/grpo_tiny_cpu.sh                      # the whole demo (starts torchrun itself)
#   torchrun --nproc_per_node=2 launch/grpo_tiny_cpu.sh
#   OUT=/path bash launch/grpo_tiny_cpu.sh key=value  # outputs elsewhere; extra main_ppo overrides
#   SFT_STEPS=500 bash launch/grpo_tiny_cpu.sh        # another warm-up length (0: no warm-up)
#   OPS=- TRAIN=5000 OUT=outputs/grpo_sub bash launch/grpo_tiny_cpu.sh   # another task: 2-digit subtraction
#   VAL=50 bash launch/grpo_tiny_cpu.sh               # fewer held-out problems (default 200)
#   NNODES=2 NODE_RANK=i NPROC_PER_NODE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT bash launch/grpo_tiny_cpu.sh
#                                                     # as two nodes (run it twice, i = 0 and 1)
#   bash launch/grpo_tiny_cpu.sh --dry-run            # the memory plan of this layout
#
# Outputs land in $OUT (default: outputs/grpo_tiny_cpu in the repository root): the model, data,
# SFT checkpoint, GRPO checkpoints, metrics.jsonl and the exported Hugging Face model; the last
# lines printed say where. A rerun reuses the model, data and SFT model and trains GRPO afresh (the
# earlier run's checkpoints, logs and export move to $OUT/earlier_runs/).
# The inputs are made once, by global rank 0 (VERL_LAUNCH_STAGE=prepare runs that part alone).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
if [ "${VERL_LAUNCH_STAGE:-}" != prepare ]; then
  VERL_DEFAULT_NPROC="${NPROC:-2}"
  source "$root/launch/common.sh"
  verl_launch "${BASH_SOURCE[0]}" "$@"
fi

out="${OUT:-$root/outputs/grpo_tiny_cpu}"
sft_steps="${SFT_STEPS:-600}"
ops="${OPS:-+}"
train="${TRAIN:-20000}"  # training problems (subtraction has fewer distinct 2-digit ones)
mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  echo "== making the tiny model"
  "$python" "$root/tools/make_tiny_model.py" --family qwen2 --out "$out/model"
fi
if [ ! -f "$out/data/train.parquet" ]; then
  "$python" "$root/tools/data/arithmetic.py" --out-dir "$out/data" --train "$train" --val "${VAL:-200}" --digits 2 --ops "$ops"
fi
if [ "$sft_steps" != 0 ] && [ ! -f "$out/sft_model/config.json" ]; then
  echo "== SFT warm-up: $sft_steps steps (the full SFT demo takes 1200 to ~97%)"
  "$python" -m verl.trainer.main_sft --config sft_tiny_cpu \
    model.path="$out/model" \
    data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet" \
    trainer.total_training_steps="$sft_steps" trainer.test_freq=-1 trainer.save_freq=-1 \
    trainer.resume_mode=disable trainer.default_local_dir="$out/sft_checkpoints" \
    trainer.log_dir="$out/sft_logs" trainer.hf_export_dir="$out/sft_model"
fi
exit 0
":"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl.trainer.launcher import cpu_recipe_environment, launcher_entry  # noqa: E402 - after the path (a light module)


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.abspath(os.environ.get("OUT", os.path.join(root, "outputs", "grpo_tiny_cpu")))
    cpu_recipe_environment(out)  # one thread per rank, no hub, vLLM's caches inside $OUT

    from verl.trainer.launcher import launched_world_overrides, recipe_summary, run_recipe

    model = os.path.join(out, "sft_model" if os.environ.get("SFT_STEPS", "600") != "0" else "model")
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={out}/data/train.parquet", f"data.val_files={out}/data/test.parquet",
        *launched_world_overrides(), "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}/checkpoints", f"trainer.log_dir={out}/logs", f"trainer.hf_export_dir={out}/grpo_model",
    ]
    prepare = ["bash", os.path.abspath(__file__)]
    # Read by the bash half when rank 0 runs `prepare`: that part alone, with this interpreter and this
    # checkout's verl (the one every rank imports).
    os.environ["VERL_LAUNCH_STAGE"] = "prepare"
    os.environ.setdefault("PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # The closing lines come from the folders this run used (the user's overrides win over the ones above).
    return run_recipe("grpo_tiny_cpu", sys.argv[1:], overrides=overrides, prepare=prepare, device="cpu",
                      summary=lambda cfg, started: recipe_summary(cfg, started, label="validation reward"))


launcher_entry(__name__, main)
