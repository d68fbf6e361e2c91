#!/usr/bin/env bash
""":"
# Vision-language GRPO end to end on one CPU machine: make a tiny Qwen2.5-VL locally (random
# weights, a 2-block vision encoder), generate the colour-square task (name the colour of the
# square in a 28 x 28 image, 4 choices), SFT-warm the model briefly with main_sft in one process (it learns the
# answer format and starts to read the image), then train it with GRPO on 2 ranks: the actor and
# reference on the Megatron engine (the Qwen2.5-VL decoder as Megatron's GPTModel, its vision tower
# beside it), the transformers rollout engine fed by the actor's push (the vLLM engine does not take
# images here: docs/vlm.md). Validation (4 samples per prompt at temperature 1) runs before GRPO and
# every 20 of its 40 steps, on held-out images and on the same prompts with the square left out (the
# control: the prompt alone does not tell the colour, so at most chance, 0.25).
# 1 min 20 s from an empty $OUT on 2 quiet AMD EPYC cores, from a fresh clone: validation 0.318 -> 0.520 -> 0.740,
# the control 0.090 -> 0.131 -> 0.197; 7 min 23 s on the same cores shared with other jobs (load 15-33): 0.332 ->
# 0.566 -> 0.738, the control 0.094 -> 0.137 -> 0.209 (docs/vlm.md). The FSDP2 actor instead:
# `bash launch/grpo_vlm_tiny_cpu.sh actor_rollout_ref.actor.strategy=fsdp2` (the reference follows it).
# This file is valid bash and valid Python: both of these run it.
#
#   bash launch/grpo_vlm_tiny_cpu.sh                     # the whole demo (starts torchrun itself)
#   torchrun --nproc_per_node=2 launch/grpo_vlm_tiny_cpu.sh
#   OUT=/path bash launch/grpo_vlm_tiny_cpu.sh key=value # outputs elsewhere; extra main_ppo overrides
#   SFT_STEPS=60 bash launch/grpo_vlm_tiny_cpu.sh        # another warm-up length (0: no warm-up)
#   TRAIN=500 VAL=32 bash launch/grpo_vlm_tiny_cpu.sh    # fewer prompts (default 2000 and 128)
#
# Outputs land in $OUT (default: outputs/grpo_vlm_tiny_cpu in the repository root): the model,
# data, SFT model, metrics.jsonl and the exported Hugging Face model; the last lines printed say
# where. A rerun reuses the model, data and SFT model and trains GRPO afresh.
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

out="${OUT:-$root/outputs/grpo_vlm_tiny_cpu}"
sft_steps="${SFT_STEPS:-45}"
mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  echo "== making the tiny vision-language model"
  "$python" -c "import sys; from verl.data.tiny_vlm import make_tiny_vlm; make_tiny_vlm(sys.argv[1])" "$out/model"
fi
if [ ! -f "$out/data/blank.parquet" ]; then
  "$python" "$root/tools/data/colour_square.py" --out-dir "$out/data" --train "${TRAIN:-2000}" --val "${VAL:-128}"
fi
if [ "$sft_steps" != 0 ] && [ ! -f "$out/sft_model/config.json" ]; then
  echo "== SFT warm-up (main_sft, one process): $sft_steps steps (its greedy answers are right from ~30)"
  train_rows="${TRAIN:-2000}"
  sft_batch=$(( train_rows < 32 ? train_rows : 32 ))
  "$python" -m verl.trainer.main_sft --config sft_tiny_cpu model.path="$out/model" \
    data.train_files="$out/data/train.parquet" data.val_files=null data.response_key=extra_info.answer \
    data.max_length=64 data.train_batch_size="$sft_batch" data.micro_batch_size_per_gpu="$sft_batch" \
    trainer.total_training_steps="$sft_steps" optim.lr=2e-3 optim.lr_warmup_steps=0 optim.lr_decay_style=constant \
    optim.weight_decay=0.0 megatron.dtype=float32 trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger=[console] \
    trainer.progress_bar=false trainer.experiment_name=sft_vlm_warmup trainer.default_local_dir="$out/sft_run" \
    trainer.log_dir="$out/sft_run/logs" trainer.hf_export_dir="$out/sft_model"
  "$python" "$root/tools/sft_vlm_warmup.py" --eval-only --model "$out/sft_model" \
    --val "$out/data/test.parquet" --val "$out/data/blank.parquet"
fi
exit 0
":"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl.trainer.launcher import cpu_recipe_environment, launcher_entry  # noqa: E402 - after the path (a light module)


def summary(cfg, started: float) -> list[str]:
    """The recipe's closing lines, the control set's validation beside the task's."""
    import json

    from verl.trainer.launcher import recipe_summary

    lines = [line for line in recipe_summary(cfg, started, label="validation reward") if not line.startswith("== ")
             or line.startswith(("== metrics", "== checkpoints", "== HF export"))]
    metrics = os.path.join(os.path.expanduser(cfg.trainer.log_dir), "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getmtime(metrics) >= started - 1.0:
        with open(metrics, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        for source, label in (("verl/colour_square_blank/", "square left out (chance 0.25)"),
                              ("verl/colour_square/", "held-out images")):
            seen = [(r["step"], v) for r in records for k, v in r.items() if k.startswith("val-core/" + source)]
            if seen:
                lines.insert(0, f"== validation reward, {label}: " + ", ".join(f"{v:.3f} (step {s})" for s, v in seen))
    return lines


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.abspath(os.environ.get("OUT", os.path.join(root, "outputs", "grpo_vlm_tiny_cpu")))
    cpu_recipe_environment(out)  # one thread per rank, no hub, caches inside $OUT

    from verl.trainer.launcher import launched_world_overrides, run_recipe

    model = os.path.join(out, "sft_model" if os.environ.get("SFT_STEPS", "45") != "0" else "model")
    overrides = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={out}/data/train.parquet",
        f"data.val_files=[{out}/data/test.parquet,{out}/data/blank.parquet]",
        *launched_world_overrides(), "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}/checkpoints", f"trainer.log_dir={out}/logs", f"trainer.hf_export_dir={out}/grpo_model",
    ]
    prepare = ["bash", os.path.abspath(__file__)]
    # Read by the bash half when rank 0 runs `prepare`: that part alone, with this interpreter and this
    # checkout's verl (the one every rank imports).
    os.environ["VERL_LAUNCH_STAGE"] = "prepare"
    os.environ.setdefault("PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return run_recipe("grpo_vlm_tiny_cpu", sys.argv[1:], overrides=overrides, prepare=prepare, device="cpu", summary=summary)


launcher_entry(__name__, main)
