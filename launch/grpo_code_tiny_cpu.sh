#!/usr/bin/env bash
""":"
# Code RL on one CPU machine: a tiny Qwen2 learns to answer arithmetic questions with a Python program
# whose printed output the code scorer checks in the sandbox (verl.rewards.code over verl.sandbox:
# bubblewrap, no network, rlimits; docs/sandbox.md). Make the model and its tokenizer locally,
# generate 2-digit addition problems as a code task ("What is 37+97? Answer with a Python
# program that prints it." -> a ```python fence around print(37+97); data_source
# verl/arithmetic_code, one stdin/stdout test), SFT-warm the model briefly (it learns the fence and
# the print, and copies the operands imperfectly), then train it with GRPO: the Megatron actor and
# reference and the CPU vLLM engine in one torchrun world of 2 ranks, every sampled program run in
# its own sandbox for its reward. Validation (4 samples at temperature 1 on 100 held-out problems)
# before GRPO and every 20 of its 60 steps. This file is valid bash and valid Python: both run it.
#
#   bash launch/grpo_code_tiny_cpu.sh                      # the whole demo (starts torchrun itself)
#   torchrun --nproc_per_node=2 launch/grpo_code_tiny_cpu.sh
#   OUT=/path bash launch/grpo_code_tiny_cpu.sh key=value  # outputs elsewhere; extra main_ppo overrides
#   SFT_STEPS=100 bash launch/grpo_code_tiny_cpu.sh        # another warm-up length (0: no warm-up)
#   TRAIN=2000 VAL=20 bash launch/grpo_code_tiny_cpu.sh    # fewer training / held-out problems
#   bash launch/grpo_code_tiny_cpu.sh --dry-run            # the memory plan of this layout
#
# Needs bubblewrap (`apt-get install bubblewrap`); where it cannot start, the reward refuses to run
# programs unconfined unless you add sandbox.allow_unconfined=true (docs/sandbox.md).
# Measured: docs/sandbox.md ("The code recipe").
#
# Outputs land in $OUT (default: outputs/grpo_code_tiny_cpu): the model, data, SFT checkpoint, GRPO
# checkpoints, metrics.jsonl and the exported model. A rerun reuses the model, data and SFT model and
# trains GRPO afresh. The inputs are made once, by global rank 0 (VERL_LAUNCH_STAGE=prepare: that alone).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
if [ "${VERL_LAUNCH_STAGE:-}" != prepare ]; then
  VERL_DEFAULT_NPROC="${NPROC:-2}"
  source "$root/launch/common.sh"
  verl_launch "${BASH_SOURCE[0]}" "$@"
fi

out="${OUT:-$root/outputs/grpo_code_tiny_cpu}"
sft_steps="${SFT_STEPS:-200}"
train="${TRAIN:-20000}"
val="${VAL:-100}"
mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  echo "== making the tiny model"
  "$python" "$root/tools/make_tiny_model.py" --family qwen2 --out "$out/model"
fi
if [ ! -f "$out/data/train.parquet" ]; then
  "$python" "$root/tools/data/arithmetic.py" --code --out-dir "$out/data" --train "$train" --val "$val" --digits 2 --ops +
fi
if [ "$sft_steps" != 0 ] && [ ! -f "$out/sft_model/config.json" ]; then
  echo "== SFT warm-up: $sft_steps steps on the reference programs"
  "$python" -m verl.trainer.main_sft --config sft_tiny_cpu \
    model.path="$out/model" \
    data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet" data.max_length=80 \
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
    out = os.path.abspath(os.environ.get("OUT", os.path.join(root, "outputs", "grpo_code_tiny_cpu")))
    cpu_recipe_environment(out)  # one thread per rank, no hub, vLLM's caches inside $OUT

    from verl.trainer.launcher import launched_world_overrides, recipe_summary, run_recipe

    model = os.path.join(out, "sft_model" if os.environ.get("SFT_STEPS", "200") != "0" else "model")
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
    return run_recipe("grpo_code_tiny_cpu", sys.argv[1:], overrides=overrides, prepare=prepare, device="cpu",
                      summary=lambda cfg, started: recipe_summary(cfg, started, label="validation reward"))


launcher_entry(__name__, main)
