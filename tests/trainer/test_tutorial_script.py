"""A script written as the tutorials write them (no ``if __name__ == "__main__":``), run as a
user runs it: the facade with a reward model (PPO, checkpoints every step), ``from_checkpoint`` +
``fit(resume_from_checkpoint=True)``, the five-step stream with a monitor and its report, the
conditional PPO/DPO stream (first with the default one sample per prompt, which cannot form a
DPO pair, then with four), and ``export_as_api``. The script's body runs once, and each call
works or fails with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import json, os, sys

    from verl import (ConditionalUpdateOperator, DataStream, DPOUpdateOperator, PPOUpdateOperator, RewardOperator,
                      RLTrainer, RolloutOperator, VerlMonitor)

    MODEL, REWARD_MODEL, TRAIN, OUT, WORDS = sys.argv[1:6]
    with open(os.path.join(OUT, "body_runs.txt"), "a") as f:
        f.write("ran\\n")
    SHAPES = dict(max_prompt_length=24, max_response_length=8, device="cpu", use_vllm=False, micro_batch_size=8)
    CPU = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
           "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.save_hf=false",
           f"custom_reward_function.path={WORDS}"]
    results = {}


    def call(name, fn):
        try:
            results[name] = {"ok": fn()}
        except Exception as exc:  # the tutorials' user reads this one line
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}


    # The facade with a reward model: PPO (GAE with a critic), a checkpoint every step.
    trainer = RLTrainer(actor_model=MODEL, reward_model=REWARD_MODEL, algorithm="ppo",
                        rollout_batch_size=4, train_batch_size=4, n_samples=2, **SHAPES)
    call("ppo_with_reward_model", lambda: trainer.fit(dataset=TRAIN, max_steps=2, save_steps=1,
                                                       output_dir=f"{OUT}/ppo", save_hf=False)["global_step"])
    resumed = RLTrainer.from_checkpoint(f"{OUT}/ppo/checkpoint-2")
    call("from_checkpoint", lambda: resumed.fit(max_steps=3, resume_from_checkpoint=True)["global_step"])

    # The five-step stream with a monitor; its report.
    stream = (
        DataStream(model=MODEL, train_files=TRAIN, overrides=[*CPU, "actor_rollout_ref.rollout.n=4",
                                                              "trainer.total_training_steps=5"])
        .add_operator(RolloutOperator(n=4))
        .add_operator(RewardOperator())
        .add_operator(PPOUpdateOperator(estimator="grpo", kl_coef=0.001, lr=1e-4))
        .with_monitor(VerlMonitor(log_dir=f"{OUT}/stream/logs", report_interval=5))
    )
    call("stream_five_steps", lambda: [stream.step()["training/global_step"] for _ in range(5)])
    call("report", lambda: os.path.isfile(f"{OUT}/stream/logs/report.html"))
    call("export_as_api", lambda: sorted(r.path for r in stream.export_as_api(f"{OUT}/export").routes
                                         if r.path.startswith("/v1/")))
    stream.close()


    def conditional(n):
        rollout = RolloutOperator() if n is None else RolloutOperator(n=n)
        extra = [] if n is None else [f"actor_rollout_ref.rollout.n={n}"]
        hybrid = (
            DataStream(model=MODEL, train_files=TRAIN, overrides=[*CPU, *extra, "trainer.total_training_steps=1"])
            .add_operator(rollout)
            .add_operator(RewardOperator())
            .add_operator(ConditionalUpdateOperator(condition=lambda s: s["reward"] > 0.5,
                                                    true_branch=PPOUpdateOperator(estimator="grpo", kl_coef=0.001),
                                                    false_branch=DPOUpdateOperator(beta=0.1)))
        )
        try:
            return hybrid.step()["conditional/true_samples"]
        finally:
            hybrid.close()


    call("conditional_default_n", lambda: conditional(None))
    call("conditional_n4", lambda: conditional(4))
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tutorial_script_without_a_main_guard_runs_once(tiny_model_dir, reward_model_dir, arithmetic_files, tmp_path):
    script = tmp_path / "tutorial.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RANK", None)
    log = tmp_path / "run.log"
    with open(log, "w", encoding="utf-8") as f:  # a file, not a pipe: no child can hold it open
        proc = subprocess.run(
            [sys.executable, str(script), tiny_model_dir, reward_model_dir, arithmetic_files["train"], str(out),
             os.path.join(HERE, "words_reward.py")],
            cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=850,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert (out / "body_runs.txt").read_text() == "ran\n", "the script's body ran more than once"
    lines = [line for line in text.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, text[-4000:]
    results = json.loads(lines[0].removeprefix("RESULTS "))
    assert results["ppo_with_reward_model"] == {"ok": 2}, results
    assert results["from_checkpoint"] == {"ok": 3}, results
    assert results["stream_five_steps"] == {"ok": [1.0, 2.0, 3.0, 4.0, 5.0]}, results
    assert results["report"] == {"ok": True}, results
    assert results["export_as_api"] == {"ok": ["/v1/chat/completions", "/v1/completions", "/v1/models"]}, results
    # One sample per prompt (the config's default) can make no DPO pair: said in one line, before training.
    error = results["conditional_default_n"]["error"]
    assert "\n" not in error and "ConditionalUpdateOperator" in error and "RolloutOperator(n=4)" in error, error
    assert "ok" in results["conditional_n4"], results
    # The quiet start: verl's own lines, not the dependencies' chatter.
    assert "RL trainer: gae; step RolloutOperator -> RewardOperator -> PPOUpdateOperator" in text
    assert "vLLM" not in text or "INFO vllm" not in text
