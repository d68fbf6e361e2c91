"""A user's script written as the tutorials write them — no ``if __name__ == "__main__":`` — that
trains with ``verl.RLTrainer`` and saves checkpoints runs its body once and exits 0.

Before ``verl.models.dist_save``, Megatron's checkpoint writer started a spawned process that
imported the script again: its body ran twice (a second training run) and the run died with
``EOFError`` at its first checkpoint. The script below takes the tutorial's path: vLLM for the
rollout (in-process), a checkpoint every step, validation, and the final Hugging Face export.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import os
import verl

with open(os.environ["BODY_LOG"], "a", encoding="utf-8") as f:
    f.write(__name__ + "\\n")
trainer = verl.RLTrainer(os.environ["MODEL"], algorithm="grpo", use_vllm=True, rollout_batch_size=2, n_samples=4,
                         micro_batch_size=8, max_prompt_length=24, max_response_length=8, device="cpu")
result = trainer.fit(dataset=os.environ["TRAIN"], max_steps=2, save_steps=1, output_dir=os.environ["OUT"],
                     val_dataset_path=os.environ["TRAIN"], eval_steps=2)
print("CHECKPOINT", result["checkpoint"])
"""


def test_a_guardless_script_that_saves_checkpoints_runs_once(tiny_model_dir, arithmetic_files, tmp_path):
    script = tmp_path / "tutorial_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    log, out = tmp_path / "body.log", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT, "BODY_LOG": str(log), "MODEL": tiny_model_dir,
           "TRAIN": arithmetic_files["val"], "OUT": str(out), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert log.read_text(encoding="utf-8").split() == ["__main__"]
    assert f"CHECKPOINT {out / 'global_step_2'}" in proc.stdout
    assert sorted(p for p in os.listdir(out) if p.startswith("global_step_")) == ["global_step_1", "global_step_2"]
    assert os.path.isfile(out / "huggingface" / "config.json")
