"""The tutorials' lines (issue #58, seed 001 "用极简API暴露复杂能力") run as written: each in a
script of its own, in a subprocess, with no ``if __name__ == "__main__":`` guard. The ``...`` of a
line are the session's tiny models and data; step counts are cut to what the line checks.

- ``from verl.trainer import RLTrainer`` then ``help(RLTrainer.__init__)``;
- ``trainer.fit(dataset=dataset, max_steps=..., logging_steps=..., save_steps=..., output_dir=...)``;
- ``RLTrainer(actor_model=..., reward_model=..., algorithm="hybrid_ppo")`` then
  ``fit(dataset_path="my_rlhf_data.jsonl")``: HybridFlow's PPO (actor, critic with GAE, the reward
  model, the reference), one pass over the file.

Beside them, the cheap checks: ``logging_steps`` refused in one line, and the loop's logger
callback sending every ``trainer.log_freq``-th step (every step by default).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = ('use_vllm=False, device="cpu", rollout_batch_size=4, n_samples=2, micro_batch_size=8, '
          "max_prompt_length=24, max_response_length=8")


def _run(script: str, cwd, **env_vars: str) -> str:
    """Run ``script`` as a user runs a tutorial's file: ``python tutorial.py``; its output (stdout and stderr)."""
    path = cwd / "tutorial.py"
    path.write_text(script, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env_vars}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    log = cwd / "tutorial.log"
    with open(log, "w", encoding="utf-8") as f:  # a file, not a pipe: no child can hold it open
        proc = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=400)
    text = log.read_text(encoding="utf-8")
    assert proc.returncode == 0, text[-4000:]
    return text


def _metric_steps(text: str) -> list[int]:
    """The steps of the console logger's lines (``... verl.metrics: step N | ...``)."""
    return [int(m) for m in re.findall(r"verl\.metrics: step (\d+) \|", text)]


def test_from_verl_trainer_import_rltrainer_then_help(tmp_path):
    text = _run("from verl.trainer import RLTrainer\nhelp(RLTrainer.__init__)\n", tmp_path)
    assert "Help on function __init__ in module verl.api.facade" in text
    for argument in ("actor_model", "reward_model", "algorithm", "hybrid_condition"):
        assert f"{argument}:" in text, argument


@pytest.mark.slow
def test_fit_with_logging_steps_save_steps_and_output_dir(tiny_model_dir, arithmetic_files, tmp_path):
    # The tutorial's max_steps=200, logging_steps=10, save_steps=50, cut to 3, 2 and 2.
    script = f"""
import os
from verl.trainer import RLTrainer
from verl.utils import load_hf_dataset

dataset = load_hf_dataset(os.environ["TRAIN"])
trainer = RLTrainer(actor_model=os.environ["MODEL"], {SHAPES})
trainer.fit(dataset=dataset, max_steps=3, logging_steps=2, save_steps=2, output_dir=os.environ["OUT"])
"""
    out = tmp_path / "out"
    text = _run(script, tmp_path, MODEL=tiny_model_dir, TRAIN=arithmetic_files["val"], OUT=str(out))
    # Metrics reach the console and metrics.jsonl every 2 steps and at the last; checkpoints every 2 and at the end.
    assert _metric_steps(text) == [2, 3], text[-4000:]
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f if line.strip()] == [2, 3]
    assert sorted(p for p in os.listdir(out) if p.startswith("global_step_")) == ["global_step_2", "global_step_3"]
    assert (out / "huggingface" / "config.json").is_file()


@pytest.mark.slow
def test_hybrid_ppo_without_a_condition_runs_hybridflow_ppo(tiny_model_dir, reward_model_dir, arithmetic_files,
                                                            tmp_path):
    import pyarrow.parquet as pq

    rows = pq.read_table(arithmetic_files["val"]).to_pylist()[:4]  # one step of rollout_batch_size=4: one pass
    (tmp_path / "my_rlhf_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    script = f"""
import json, os
from verl.trainer import RLTrainer

trainer = RLTrainer(actor_model=os.environ["MODEL"], reward_model=os.environ["REWARD_MODEL"], algorithm="hybrid_ppo",
                    {SHAPES})
result = trainer.fit(dataset_path="my_rlhf_data.jsonl")
cfg = trainer.last_config
print("RESULT " + json.dumps({{
    "global_step": result["global_step"], "estimator": cfg.algorithm.adv_estimator, "critic": cfg.use_critic,
    "reward_model": cfg.reward_model.enable, "kl_loss": cfg.actor_rollout_ref.actor.use_kl_loss,
    "keys": sorted(k for k in result if k.startswith(("critic/vf_loss", "reward/model_score", "timing_s/ref",
                                                      "conditional/", "dpo/"))),
}}))
"""
    text = _run(script, tmp_path, MODEL=tiny_model_dir, REWARD_MODEL=reward_model_dir)
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, text[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    # PPO on every sample (no PPO/DPO routing): GAE with the critic, scored by the reward model, the reference's KL.
    assert result == {
        "global_step": 1, "estimator": "gae", "critic": True, "reward_model": True, "kl_loss": True,
        "keys": ["critic/vf_loss", "reward/model_score_mean", "timing_s/ref"],
    }
    assert "RL trainer: gae; step RolloutOperator -> RewardOperator -> PPOUpdateOperator" in text
    assert _metric_steps(text) == [1]
    assert (tmp_path / "outputs" / "verl" / "huggingface" / "config.json").is_file()  # fit's default output_dir


@pytest.mark.parametrize("bad", [0, -10, 2.5, True, "10"])
def test_logging_steps_that_is_not_a_positive_int_is_refused_in_one_line(bad, tmp_path):
    import verl

    trainer = verl.RLTrainer("model", algorithm="grpo")
    with pytest.raises(ValueError) as info:
        trainer.fit(dataset=str(tmp_path / "train.parquet"), max_steps=1, logging_steps=bad, output_dir=str(tmp_path))
    assert str(info.value) == (
        f"RLTrainer.fit: logging_steps={bad!r}; give an int >= 1 (metrics are logged and printed every logging_steps steps)"
    )
    assert not (tmp_path / "verl_rl_trainer.json").exists()  # refused before anything is written


def test_hybrid_ppo_maps_to_gae_without_a_condition_and_grpo_with_one(tiny_model_dir, arithmetic_files, tmp_path):
    import verl

    def config(**kwargs):
        trainer = verl.RLTrainer(tiny_model_dir, algorithm="hybrid_ppo", use_vllm=False, device="cpu", **kwargs)
        return trainer.build_config(dataset_path=arithmetic_files["train"], max_steps=1, logging_steps=10,
                                    output_dir=str(tmp_path))

    ppo = config()
    assert (ppo.algorithm.adv_estimator, ppo.use_critic, ppo.trainer.log_freq) == ("gae", True, 10)
    routed = config(hybrid_condition=lambda s: s["reward"] > 0)
    assert (routed.algorithm.adv_estimator, routed.trainer.log_freq) == ("grpo", 10)


def _logged_steps(log_freq: int, test_freq: int = -1, total: int = 7, stop_at: int | None = None) -> list[int]:
    """The steps :class:`LoggerCallback` sends to the loggers in a run of ``total`` steps."""
    from verl.trainer.loop import LoggerCallback

    logged: list[int] = []
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(log_freq=log_freq, test_freq=test_freq)), total_steps=total,
        global_step=0, tracking=SimpleNamespace(log=lambda metrics, step: logged.append(step)),
    )
    loop = SimpleNamespace(trainer=trainer, last={})
    callback = LoggerCallback()
    for step in range(1, (stop_at or total) + 1):
        trainer.global_step = step
        callback.on_step_end(loop, {"x": 1.0})
        loop.last = {"x": 1.0}
    if stop_at is not None:
        callback.on_stop(loop)
    else:
        callback.on_train_end(loop)
    return logged


def test_the_loggers_get_every_log_freq_th_step_and_the_last():
    assert _logged_steps(1) == [1, 2, 3, 4, 5, 6, 7]  # the default: every step, as before
    assert _logged_steps(3) == [3, 6, 7]
    assert _logged_steps(3, test_freq=5) == [3, 5, 6, 7]  # a validated step's metrics are not lost
    assert _logged_steps(3, stop_at=4) == [3, 4]  # a stop logs the step it ends at


def test_a_routed_hybrid_run_does_not_resume_as_plain_ppo(tmp_path):
    """A run whose samples a ``hybrid_condition`` routed resumes only with it: without it the run would
    turn into HybridFlow's PPO (another estimator, a critic its checkpoint lacks)."""
    import verl
    from verl.api.facade import RUN_FILE

    (tmp_path / "global_step_1").mkdir()
    saved = {"init": {"actor_model": "model", "algorithm": "hybrid_ppo"}, "fit": {}, "hybrid_condition": True}
    (tmp_path / RUN_FILE).write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ValueError, match=r"routed its samples by a hybrid_condition, which is not saved; pass it again"):
        verl.RLTrainer.from_checkpoint(str(tmp_path / "global_step_1"))
    resumed = verl.RLTrainer.from_checkpoint(str(tmp_path / "global_step_1"), hybrid_condition=lambda s: True)
    assert resumed.algorithm == "hybrid_ppo" and resumed.hybrid_condition is not None
