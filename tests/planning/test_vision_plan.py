"""A vision-language actor on Megatron in the memory plan (#53): the vision tower's parameters, their
gradients and optimizer state (unless frozen), and its activations per image, against a hand count of
the tiny Qwen2.5-VL (``verl.data.tiny_vlm``) and against the same plan without the tower."""

from __future__ import annotations

import dataclasses

import pytest

from verl.config import CONFIG_DIR, PPOConfig, parse_cli
from verl.planning.cli import config_inputs
from verl.planning.memory import formula_stage_params, formula_sync, memory_plan
from verl.planning.vision import VisionTower

# The tiny tower by hand: hidden 32, MLP 64, 2 blocks, 3 channels, temporal patch 2, patch 14, merge 2,
# the language model's hidden 64.
PATCH_EMBED = 32 * 3 * 2 * 14 * 14  # 37,632: the bias-free Conv3d
BLOCK = 2 * 32 + (3 * 32 * 32 + 3 * 32) + (32 * 32 + 32) + 2 * (32 * 64 + 64) + 64 * 32 + 32  # 10,592
MERGER = 32 + (128 * 128 + 128) + (128 * 64 + 64)  # 24,800: norm, 128 -> 128, 128 -> 64 (h m^2 = 128)
TOWER = PATCH_EMBED + 2 * BLOCK + MERGER  # 83,616
# One image at the tiny processor's budget, 112 x 112 pixels: 64 patches, 16 merged tokens. Saved for backward
# per patch: its 1,176 pixels and 32-wide embedding, per block 4 x 32 (norms) + 3 x 32 (q/k/v) + 32
# (attention) + 3 x 64 (gate, up, product), the merger's norm in/out (2 x 32) and MLP (3 x 128 per merged token
# = 3 x 32 per patch); per merged token the 64-wide features.
PER_PATCH_TRAIN = 1176 + 32 + 2 * (4 * 32 + 3 * 32 + 32 + 3 * 64) + 2 * 32 + 3 * 32  # 2,264
PER_IMAGE_TRAIN = 64 * PER_PATCH_TRAIN + 16 * 64  # elements
PER_IMAGE_FORWARD = 64 * (1176 + 4 * 32 + 3 * 32 + 32 + 3 * 64) + 16 * 64  # pixels, one block's working set, features


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"), TinyVLMSpec(corpus_lines=200))


def test_the_tower_count_is_the_hand_count_and_the_model_s(vlm_dir):
    from transformers import AutoModelForImageTextToText

    tower = VisionTower.from_model_dir(vlm_dir)
    assert (tower.params, tower.patches_per_image) == (TOWER, 64)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert tower.params == sum(p.numel() for p in model.model.visual.parameters())  # the module itself
    assert tower.activation_bytes(3, 4, trains=True) == 3 * 4 * PER_IMAGE_TRAIN
    assert tower.activation_bytes(3, 2, trains=False) == 3 * 2 * PER_IMAGE_FORWARD


def _plans(vlm_dir: str, *overrides: str):
    # The VLM recipe's run on the Megatron actor (2 CPU ranks, fp32, Adam; micro-batches of 32 training and
    # 64 forward-only sequences, one image each).
    cfg = parse_cli(PPOConfig, ["--config", str(CONFIG_DIR / "grpo_vlm_tiny_cpu.yaml"), f"actor_rollout_ref.model.path={vlm_dir}",
                                "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                                *overrides], prog="test", default_config_file=None, world_size=None)
    inputs = config_inputs(cfg, model_config=None, gpu_memory_gib=80.0)
    plain = dataclasses.replace(inputs, vision=None)

    def plan(i):
        stages = {r.name: formula_stage_params(i.spec_of(r.name), r) for r in i.roles}
        return memory_plan(i, stages, formula_sync(i), source="formula")

    return inputs, plan(inputs), plan(plain)


@pytest.mark.parametrize("freeze", [False, True], ids=["trained", "frozen"])
def test_the_plan_counts_the_tower_and_its_images(vlm_dir, freeze):
    more = ["actor_rollout_ref.actor.freeze_vision_tower=true"] if freeze else []
    inputs, with_tower, without = _plans(vlm_dir, *more)
    assert inputs.vision is not None and inputs.role("actor").freeze_vision is freeze
    for rank, bare in zip(with_tower.ranks, without.ranks):
        actor, actor0 = rank.roles["actor"], bare.roles["actor"]
        ref, ref0 = rank.roles["ref"], bare.roles["ref"]
        assert actor.params - actor0.params == TOWER * 4  # fp32 on CPU, whole on each rank
        assert ref.params - ref0.params == TOWER * 4
        # Trained: the fp32 main_grad and Adam's two moments (fp32 weights: no master copy); frozen: none.
        assert actor.grads - actor0.grads == (0 if freeze else TOWER * 4)
        assert actor.optimizer - actor0.optimizer == (0 if freeze else TOWER * 8)
        assert ref.grads == ref0.grads == 0 and ref.optimizer == ref0.optimizer == 0
        # A training micro-batch of 32 sequences of one image each; frozen, the tower keeps its forward working set.
        per = PER_IMAGE_FORWARD if freeze else PER_IMAGE_TRAIN
        assert actor.activations - actor0.activations == 32 * 4 * per
        assert actor.forward_activations - actor0.forward_activations == 64 * 4 * PER_IMAGE_FORWARD  # old log-probs: 64
        assert ref.forward_activations - ref0.forward_activations == 64 * 4 * PER_IMAGE_FORWARD
