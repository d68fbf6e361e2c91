"""``verl.RLTrainer``: a run stopped at step 3 of 6 and resumed with ``from_checkpoint`` ends where
the uninterrupted run ends: steps 4-6 log the same metrics, and the final weights are the same.

Measured on CPU: bit-equal (reward, policy loss, KL and gradient norm of steps 4-6, e.g. step 6:
reward 0.328125, grad_norm 1.18840469..., kl 0.01861444...; every exported tensor), so the test
asks for equality, not a tolerance."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

WORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "words_reward.py")
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")


def _facade(model: str):
    import verl

    return verl.RLTrainer(
        model, algorithm="grpo", use_vllm=False, rollout_batch_size=2, n_samples=4, micro_batch_size=8,
        learning_rate=1e-3, max_prompt_length=24, max_response_length=8, device="cpu",
        # A reward with a spread on every step, so the policy loss and its gradient are not 0.
        overrides=[f"custom_reward_function.path={WORDS}"],
    )


def _logged(out) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    with open(os.path.join(out, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                steps.setdefault(record.pop("step"), {}).update(record)
    return steps


def _weights(out) -> dict:
    from safetensors.torch import load_file

    folder = os.path.join(out, "huggingface")
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    assert tensors, f"no safetensors in {folder}"
    return tensors


def test_resume_at_3_of_6_equals_the_uninterrupted_run(tiny_model_dir, arithmetic_files, tmp_path):
    import torch

    from verl import RLTrainer
    from verl.monitor import VerlMonitor

    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    data = arithmetic_files["train"]
    _facade(tiny_model_dir).fit(dataset=data, max_steps=6, save_steps=3, output_dir=whole)
    first = _facade(tiny_model_dir).fit(dataset=data, max_steps=3, save_steps=3, output_dir=parts, save_hf=False)
    assert first["checkpoint"] == os.path.join(parts, "global_step_3")
    resumed = RLTrainer.from_checkpoint(os.path.join(parts, "checkpoint-3"))
    watch = VerlMonitor(log_dir=os.path.join(parts, "logs"), report_interval=1)  # the steps this fit runs
    last = resumed.fit(max_steps=6, resume_from_checkpoint=True, save_hf=True, monitor=watch)
    assert last["global_step"] == 6
    # It continued from the checkpoint: steps 4-6 only (a run from scratch would also end equal).
    assert [s["step"] for s in watch.summaries] == [4.0, 5.0, 6.0]

    expected, actual = _logged(whole), _logged(parts)
    assert sorted(expected) == sorted(actual) == [1, 2, 3, 4, 5, 6]  # the resumed run appends 4-6 once
    for step in (4, 5, 6):
        for key in KEYS:
            # Bit-equal on CPU: the same samples (seeded by the step), the same weights and
            # optimizer state (restored from the checkpoint), the same float32 arithmetic.
            assert actual[step][key] == expected[step][key], (step, key, actual[step][key], expected[step][key])
    # The steps train (a reward spread, a policy loss, a gradient): the comparison is not of constants.
    assert all(expected[s]["actor/grad_norm"] > 1e-3 and expected[s]["actor/pg_loss"] != 0 for s in (4, 5, 6))

    w_expected, w_actual = _weights(whole), _weights(parts)
    assert sorted(w_expected) == sorted(w_actual)
    for name, tensor in w_expected.items():
        assert torch.equal(w_actual[name], tensor), name
    start = _weights_of_model(tiny_model_dir)
    assert any(not torch.equal(start[n], w_expected[n]) for n in start if n in w_expected)  # 6 steps moved the weights


def _weights_of_model(model_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors
