"""``verl.RLTrainer(lora_rank=, lora_alpha=, target_modules=)``: the run trains LoRA adapters on the
targets asked for (the checkpoint holds them only, with their settings), and bad values are
refused before any model is read."""

from __future__ import annotations

import json
import os

import pytest

WORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "words_reward.py")


def test_rl_trainer_trains_lora_adapters(tiny_model_dir, arithmetic_files, tmp_path):
    import torch

    import verl
    from verl.models.lora_io import read_checkpoint_adapters

    out = str(tmp_path / "run")
    trainer = verl.RLTrainer(
        tiny_model_dir, algorithm="grpo", use_vllm=False, rollout_batch_size=2, n_samples=4, micro_batch_size=8,
        learning_rate=1e-2, max_prompt_length=24, max_response_length=8, device="cpu",
        lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        # A reward with a spread on every step, so the policy loss and its gradient are not 0.
        overrides=[f"custom_reward_function.path={WORDS}"],
    )
    metrics = trainer.fit(dataset=arithmetic_files["train"], max_steps=2, save_steps=2, output_dir=out, save_hf=False)
    model = trainer.last_config.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, list(model.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    assert metrics["global_step"] == 2 and metrics["actor/grad_norm"] > 0

    ckpt = os.path.join(out, "global_step_2", "actor", "model")
    meta, adapters = read_checkpoint_adapters(ckpt)
    assert (meta["r"], meta["lora_alpha"], meta["target_modules"]) == (4, 8, ["q_proj", "v_proj"])
    modules = {key.split(".")[-3] for key in adapters}
    assert modules == {"q_proj", "v_proj"}
    # B starts at 0 (PEFT's init): two updates moved it.
    assert all(torch.count_nonzero(t) > 0 for key, t in adapters.items() if key.endswith("lora_B.weight"))
    # from_checkpoint gets the same arguments back.
    saved = json.load(open(os.path.join(out, "verl_rl_trainer.json"), encoding="utf-8"))["init"]
    assert (saved["lora_rank"], saved["lora_alpha"], saved["target_modules"]) == (4, 8, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_rank": -1}, "lora_rank=-1; give an int >= 0"),
        ({"lora_rank": 4, "lora_alpha": 0}, "lora_alpha=0; give an int > 0"),
        ({"lora_rank": 4, "target_modules": ["qkv"]}, "RLTrainer: target_modules=['qkv']"),
    ],
)
def test_rl_trainer_refuses_bad_lora_arguments(tmp_path, kwargs, message):
    import verl

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        verl.RLTrainer(str(tmp_path / "not_read"), device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "given", "drop"),
    [
        ({"lora_alpha": 32, "target_modules": ["q_proj"]}, "lora_alpha=32 and target_modules=['q_proj']",
         "lora_alpha= and target_modules="),
        ({"lora_alpha": 16}, "lora_alpha=16", "lora_alpha="),  # the value rank > 0 defaults to: still given
        ({"target_modules": "all-linear"}, "target_modules='all-linear'", "target_modules="),
    ],
)
def test_rl_trainer_refuses_lora_arguments_without_a_rank(tmp_path, kwargs, given, drop):
    """#58: they were dropped before any config existed, so the config's own check never saw them."""
    import verl

    with pytest.raises(ValueError) as info:
        verl.RLTrainer(str(tmp_path / "not_read"), device="cpu", **kwargs)
    assert str(info.value) == (
        f"RLTrainer: {given} given, but lora_rank=0 builds no adapters and trains every weight: give lora_rank= "
        f"(e.g. lora_rank=16) to train LoRA adapters, or drop {drop}"
    )


def test_rl_trainer_lora_defaults_with_a_rank_only(tmp_path):
    import verl

    trainer = verl.RLTrainer(str(tmp_path / "not_read"), device="cpu", lora_rank=4)
    assert {"actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.model.target_modules=all-linear"} <= set(
        trainer._settings
    )
    assert verl.RLTrainer(str(tmp_path / "not_read"), device="cpu")._settings == [
        s for s in trainer._settings if "lora" not in s and "target_modules" not in s
    ]


def test_from_checkpoint_reads_a_run_file_written_with_the_old_lora_defaults(tmp_path):
    """Run files written before lora_alpha/target_modules defaulted to None hold 16 and "all-linear"."""
    import verl

    os.makedirs(tmp_path / "global_step_1")
    init = {"actor_model": str(tmp_path / "not_read"), "device": "cpu", "lora_rank": 0, "lora_alpha": 16,
            "target_modules": "all-linear"}
    with open(tmp_path / "verl_rl_trainer.json", "w", encoding="utf-8") as f:
        json.dump({"init": init, "fit": {}, "hybrid_condition": False}, f)
    trainer = verl.RLTrainer.from_checkpoint(str(tmp_path / "global_step_1"))
    assert not any("lora" in s for s in trainer._settings)
