"""docs/step.md's schedule example runs as written: its schedule brought by its rollout operator
reaches every named point of a real step (one GRPO step on the tiny model, one rank)."""

from __future__ import annotations

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "step.md")
WORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "words_reward.py")


def _first_python_block() -> str:
    with open(DOC, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_docs_schedule_reaches_its_points_in_a_real_step(tiny_model_dir, arithmetic_files, tmp_path):
    from verl import DataStream, PPOUpdateOperator, RewardOperator
    from verl.trainer.step.schedule import SyncSchedule

    namespace: dict = {}
    exec(compile(_first_python_block(), DOC, "exec"), namespace)  # noqa: S102 (the page's own code)
    cpu = [
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
        "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "trainer.save_hf=false", "trainer.logger=[jsonl]", "data.val_files=null", "trainer.save_freq=-1",
        f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs",
    ]
    import importlib.util

    spec = importlib.util.spec_from_file_location("words_reward", WORDS)
    words = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(words)
    rollout = namespace["TimedRollout"](n=4, temperature=1.0)
    stream = (
        DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], overrides=cpu)
        .add_operator(rollout)
        .add_operator(RewardOperator(words.compute_score))
        .add_operator(PPOUpdateOperator(estimator="grpo", lr=1e-4))
    )
    try:
        step = stream.step()
    finally:
        stream.close()
    assert isinstance(rollout.schedule, SyncSchedule) and type(rollout.schedule).__name__ == "TimedPasses"
    assert step["trace/passes_s"] > 0  # before_passes, then before_updates, of the same step
    assert step["trace/adv_abs_mean"] > 0  # the words reward spreads within each group: nonzero advantages
