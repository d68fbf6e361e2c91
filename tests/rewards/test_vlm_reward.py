"""VLM reward models (verl.models.vlm_reward) through the reward-model role and RewardModelScorer:
the image reaches the model (two images, same text: different scores), a dropped image is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from verl.config.schema import MegatronConfig, ModelConfig
from verl.data.processor import load_processor
from verl.models.vlm_reward import VLMJudge, VLMRewardModel, is_vlm_reward_dir, load_vlm_reward
from verl.protocol import Batch
from verl.roles.reward_model import RewardModel
from verl.roles.vlm_reward import VLMRewardEngine
from verl.testing.tiny_vlm import cached_tiny_vlm

RESPONSE = "It is red."


@pytest.fixture(scope="module")
def vlm_dir() -> str:
    return cached_tiny_vlm()


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_processor(vlm_dir)


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()


def _image(colour, size=(40, 30)) -> Image.Image:
    return Image.fromarray(np.full((*size, 3), colour, dtype=np.uint8))


RED, BLUE = _image([255, 0, 0]), _image([0, 0, 255], size=(28, 56))


def _batch(processor, images, *, with_images=True, prompt_len=32, response_len=8) -> Batch:
    """A rollout-shaped batch: left-padded prompts (one image each) and right-padded responses."""
    tok = processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    response = tok.encode(RESPONSE, add_special_tokens=False)[:response_len]
    ids, masks, mm = [], [], []
    for image in images:
        enc = processor(text=[text], images=[image], return_tensors="pt")
        prompt = enc["input_ids"][0].tolist()
        assert len(prompt) <= prompt_len
        pad = tok.pad_token_id
        row = [pad] * (prompt_len - len(prompt)) + prompt + response + [pad] * (response_len - len(response))
        mask = [0] * (prompt_len - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (response_len - len(response))
        ids.append(row)
        masks.append(mask)
        mm.append({"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]})
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(masks)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, prompt_len:],
        "response_mask": attention_mask[:, prompt_len:],
    }
    return Batch.from_dict(tensors, {"multi_modal_inputs": mm} if with_images else None)


def _role(path: str) -> RewardModel:
    engine = RewardModel.build_model_role(
        model=ModelConfig(path=path), megatron=MegatronConfig(), pg=None, max_sequence_length=64, balance=False
    )
    assert isinstance(engine, VLMRewardEngine)
    return RewardModel(None, custom_scorer=False, model_role=engine, micro_batch_size=2)


@pytest.fixture(scope="module")
def head_dir(vlm, processor, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("vlm-rm") / "rm")
    VLMRewardModel(vlm).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def test_scalar_head_scores_the_image_through_the_role(head_dir, processor):
    """Same text, two images: the role's scores differ, and each equals the model on that row alone."""
    role = _role(head_dir)
    batch = _batch(processor, [RED, BLUE, RED])
    result = role.score(batch)
    scores = result.scores  # [3]
    # A different image must move the score (random weights: the gap is ~1e-2, far above float noise).
    assert abs(float(scores[0] - scores[1])) > 1e-4
    # The same row twice in one micro-batch and in the next one: same score up to float32 noise.
    assert torch.allclose(scores[0], scores[2], atol=1e-5)
    model = load_vlm_reward(head_dir)
    for i, image in enumerate([RED, BLUE]):
        one = _batch(processor, [image])
        mm = one.non_tensors["multi_modal_inputs"][0]
        values = model(one["input_ids"], one["attention_mask"], mm["pixel_values"], mm["image_grid_thw"])
        last = int(one["attention_mask"][0].nonzero().max())
        expected, actual = float(values[0, last]), float(scores[i])
        # Batched (rows padded together) vs alone: float32 reductions in another order, so not bitwise.
        assert actual == pytest.approx(expected, abs=1e-5)
    # The score sits on each response's last real token.
    last_resp = int(batch["response_mask"][1].nonzero().max())
    assert float(result.token_level_scores[1, last_resp]) == float(scores[1])
    assert result.metrics["reward/model_score_mean"] == pytest.approx(float(scores.mean()))


def test_the_data_paths_tensor_layout_gives_the_same_scores(head_dir, processor):
    """Images as the RL batch carries them (mm_pixel_values [B, N, D], mm_image_grid_thw [B, K, 3],
    zero-padded) score exactly as the per-row dicts."""
    batch = _batch(processor, [RED, BLUE])
    rows = list(batch.non_tensors["multi_modal_inputs"])
    n = max(len(r["pixel_values"]) for r in rows) + 3  # padded wider than any row
    pv = torch.zeros(len(rows), n, rows[0]["pixel_values"].shape[1])
    thw = torch.zeros(len(rows), 2, 3, dtype=torch.long)
    for i, r in enumerate(rows):
        pv[i, : len(r["pixel_values"])] = r["pixel_values"]
        thw[i, : len(r["image_grid_thw"])] = r["image_grid_thw"]
    tensors = dict(batch.tensors, mm_pixel_values=pv, mm_image_grid_thw=thw)
    role = _role(head_dir)
    expected = role.score(batch).scores
    actual = role.score(Batch.from_dict(tensors)).scores
    assert torch.equal(expected, actual)  # the same model inputs after unpadding: bitwise


def _score_on_ranks(path: str, batch: Batch) -> list[float]:
    """(On each rank) the role's scores with the rows split over the world as its DP group."""
    from types import SimpleNamespace

    import torch.distributed as dist

    engine = VLMRewardEngine(path, pg=SimpleNamespace(dp=dist.group.WORLD))
    return RewardModel(None, custom_scorer=False, model_role=engine, micro_batch_size=1).score(batch).scores.tolist()


@pytest.mark.distributed
def test_rows_split_over_two_data_parallel_ranks(head_dir, processor, run_dist):
    """Three rows over DP=2 (one padded row): every rank holds the whole batch's scores, equal to one rank's."""
    batch = _batch(processor, [RED, BLUE, BLUE])
    expected = _role(head_dir).score(batch).scores
    for actual in run_dist(_score_on_ranks, 2, head_dir, batch):
        # Micro-batches of 1 vs 2 rows (other padding): float32 noise only.
        assert torch.allclose(torch.tensor(actual), expected, atol=1e-5)


def test_a_dropped_image_is_refused(head_dir, processor):
    role = _role(head_dir)
    with pytest.raises(ValueError, match=r"row 0: \d+ image placeholder tokens but no multi_modal_inputs"):
        role.score(_batch(processor, [RED], with_images=False))
    bad = _batch(processor, [RED, BLUE])
    bad.non_tensors["multi_modal_inputs"][1] = bad.non_tensors["multi_modal_inputs"][0] | {
        "image_grid_thw": torch.tensor([[1, 4, 4]])
    }
    grid_error = r"row 1: \d+ image placeholder tokens in the sequence but its image_grid_thw \[\[1, 4, 4\]\] gives 4"
    with pytest.raises(ValueError, match=grid_error):
        role.score(bad)


def test_judge_reads_the_image(vlm, processor, tmp_path):
    """The generative judge's log p(Yes) - log p(No) through the role: differs by image and equals the
    VLM's own next-token log-probabilities after the question."""
    judge = VLMJudge(vlm, processor.tokenizer)
    out = str(tmp_path / "judge")
    judge.save_pretrained(out)
    processor.save_pretrained(out)
    assert is_vlm_reward_dir(out)
    scores = _role(out).score(_batch(processor, [RED, BLUE])).scores
    assert abs(float(scores[0] - scores[1])) > 1e-4
    one = _batch(processor, [BLUE])
    mask = one["attention_mask"][0].bool()
    question = torch.tensor(processor.tokenizer.encode(judge.question, add_special_tokens=False))
    ids = torch.cat([one["input_ids"][0][mask], question])[None]
    mm = one.non_tensors["multi_modal_inputs"][0]
    with torch.no_grad():
        logits = vlm(input_ids=ids, attention_mask=torch.ones_like(ids), **mm).logits[0, -1]
    logp = torch.log_softmax(logits, -1)
    expected = float(logp[judge.yes_id] - logp[judge.no_id])
    # Left padding in the batch vs none here: float32 noise only.
    assert float(scores[1]) == pytest.approx(expected, abs=1e-4)


def test_reward_model_scorer_takes_a_vlm_object(vlm, processor, head_dir):
    """RewardModelScorer(rm_model=<VLMRewardModel>) writes it as a reward-model directory the trainer's
    role loads (reward_model.enable / model.path), with the same scores as the object."""
    from verl import RewardModelScorer

    model = load_vlm_reward(head_dir)
    op = RewardModelScorer(rm_model=model, tokenizer=processor)
    overrides = op.config_overrides()
    path = overrides["reward_model.model.path"]
    assert overrides["reward_model.enable"] is True and is_vlm_reward_dir(path)
    assert overrides["reward_model.strategy"] == "fsdp2"  # the pre-flight's Megatron weight check is skipped
    assert os.path.isfile(os.path.join(path, "processor_config.json"))
    batch = _batch(processor, [RED, BLUE])
    expected = _role(head_dir).score(batch).scores
    actual = _role(path).score(batch).scores
    assert torch.equal(expected, actual)  # the same weights written and read back: bitwise
    with pytest.raises(ValueError, match="tokenizer=.*processor"):
        RewardModelScorer(rm_model=VLMRewardModel(vlm))


def _grpo_with_vlm_reward(vlm_dir: str, rm_dir: str, train_file: str, root: str) -> list[dict]:
    """(On each rank) one GRPO step with images on the FSDP2 actor, scored by the VLM reward model as
    the trainer's reward-model role; the logged metrics."""
    import json

    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        overrides=[
            f"actor_rollout_ref.model.path={vlm_dir}", f"data.train_files={train_file}", "data.val_files=null",
            "data.max_prompt_length=48", "data.max_response_length=4", "data.train_batch_size=2",
            "actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.strategy=fsdp2",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_hf=false",
            "trainer.n_gpus_per_node=1", "trainer.logger=[jsonl]", "trainer.total_training_steps=1",
            f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs",
        ],
        world_size=1,
    )
    with PPOTrainer(cfg) as trainer:
        assert isinstance(trainer.world.reward.model_role, VLMRewardEngine)
        trainer.fit()
    with open(f"{root}/logs/metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_grpo_step_scores_with_the_vlm_reward_model(vlm_dir, head_dir, tmp_path, run_dist):
    """reward_model.model.path = a VLM reward model's directory: the trainer's role is a VLMRewardEngine and
    a GRPO step with images is scored by it (a row's images missing would stop the step: the role refuses it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def png(image: Image.Image) -> bytes:
        import io

        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    rows = [{"prompt": "<image>Which colour?", "images": [{"bytes": png(im), "path": None}],
             "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": c}}
            for im, c in ((RED, "red"), (BLUE, "blue"))]
    train = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), train)
    [steps] = run_dist(_grpo_with_vlm_reward, 1, vlm_dir, head_dir, train, str(tmp_path / "run"), timeout=580)
    assert "reward/model_score_mean" in steps[0], sorted(steps[0])
    assert steps[0]["reward/model_score_mean"] != 0.0
