"""A vision-language critic on the FSDP2 engine (critic.strategy=fsdp2 with a VLM directory, #53): a Qwen3-VL
critic, and a Qwen2.5-VL one in a PPO/GAE run.

transformers has no ``*ForSequenceClassification`` for the Qwen-VL families: the critic is the VLM's
decoder (vision encoder and language model) with verl's scalar head (``verl.models.vlm.VLMValueModel``).
Its values are the head on a plain transformers forward of the same rows and images, they change when
the images do (the pixels reach the critic), a value-loss step moves them, the exported critic loads
back as the same critic, and a PPO/GAE run through main_ppo trains it beside an FSDP2 actor.
"""

from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed]

RESPONSE = 4


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _rows(n: int) -> list[dict]:
    colours = ["red", "blue", "green", "yellow"]
    return [{"prompt": f"<image>Which colour? {i}",
             "images": [{"bytes": _png(colours[i % 4], (32, 32) if i % 2 else (64, 32)), "path": None}],
             "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": colours[i % 4]}}
            for i in range(n)]


def _batch(vlm_dir: str, data: str):
    """Prompts with images (two sizes), random responses and returns to regress on: the critic's columns."""
    from verl.data.rl_dataset import RLPromptDataset, collate_fn
    from verl.data.vlm import ImagePromptEncoder
    from verl.protocol import Batch

    enc = ImagePromptEncoder.from_pretrained(vlm_dir)
    ds = RLPromptDataset(data, enc.tokenizer, processor=enc, max_prompt_length=32)
    prompts = collate_fn([ds[i] for i in range(len(ds))])
    gen = torch.Generator().manual_seed(0)
    rows = prompts["input_ids"].shape[0]
    responses = torch.randint(10, 200, (rows, RESPONSE), generator=gen)
    response_mask = torch.ones(rows, RESPONSE, dtype=torch.long)
    response_mask[1, -1] = 0
    return Batch.from_dict({
        "input_ids": torch.cat([prompts["input_ids"], responses * response_mask], 1),
        "attention_mask": torch.cat([prompts["attention_mask"], response_mask], 1),
        "responses": responses * response_mask, "response_mask": response_mask,
        "returns": torch.randn(rows, RESPONSE, generator=gen),
        **{k: v for k, v in prompts.items() if k.startswith("mm_")},
    })


def _critic_body(vlm_dir: str, data: str, export: str) -> dict:
    from verl.config import from_dict
    from verl.config.schema import CriticConfig
    from verl.parallel import megatron_state as ms
    from verl.roles.critic import Critic

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=3)
    try:
        cfg = from_dict(CriticConfig, {
            "strategy": "fsdp2", "model": {"path": vlm_dir, "use_remove_padding": False},
            "optim": {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 1.0},
            "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "forward_micro_batch_size_per_gpu": 3,
        })
        critic = Critic(cfg, pg=pg, total_training_steps=2, max_sequence_length=64)
        batch = _batch(vlm_dir, data)
        before = critic.compute_values(batch)
        flipped = critic.compute_values(_with(batch, mm_pixel_values=batch["mm_pixel_values"].flip(-1)))
        batch["values"] = before
        metrics = critic.update(batch, shuffle_seed=0, rollout_n=1)
        after = critic.compute_values(batch)
        # The trained critic exported and loaded back as a critic: the same weights, the head's included.
        critic.engine.export_hf(os.path.join(export, "critic"))
        trained = critic.engine.full_state_dict()
        from verl.engine.fsdp import load_hf_value_model

        back = load_hf_value_model(cfg.model.__class__(path=os.path.join(export, "critic")), dtype=torch.float32)
        reloaded = back.state_dict()
        same = sorted(reloaded) == sorted(trained) and all(torch.equal(reloaded[k], trained[k]) for k in trained)
        return {"before": before, "flipped": flipped, "after": after, "metrics": metrics, "round_trip": same,
                "module": type(critic.engine.module).__name__}
    finally:
        ms.destroy_model_parallel()


def _with(batch, **columns):
    from verl.protocol import Batch

    return Batch.from_dict({**{k: batch[k] for k in batch.keys()}, **columns})


@pytest.mark.timeout(300)
def test_vlm_critic_values_read_the_image_and_a_step_moves_them(tmp_path):
    """A Qwen3-VL critic on one rank: values, images, a value-loss step, the export round trip."""
    from transformers import AutoModelForImageTextToText

    from verl.models.heads import scalar_head_init
    from verl.protocol.images import model_image_inputs
    from verl.testing.tiny_vlm import cached_tiny_vlm

    vlm_dir = cached_tiny_vlm(family="qwen3_vl")  # the GAE run below takes the Qwen2.5-VL
    data = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(4)), data)
    out = run_distributed(_critic_body, 1, vlm_dir, data, str(tmp_path))[0]
    assert out["module"].endswith("VLMValueModel")

    # Expected: the head (verl's scalar-head initialisation) on one plain transformers forward of the rows.
    batch = _batch(vlm_dir, data)
    vlm = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    ids = batch["input_ids"]
    with torch.no_grad():
        hidden = vlm.model(input_ids=ids, attention_mask=batch["attention_mask"],
                           mm_token_type_ids=(ids == vlm.config.image_token_id).int(),
                           **model_image_inputs({k: batch[k] for k in ("mm_pixel_values", "mm_image_grid_thw")}))
        head = scalar_head_init(vlm.config.text_config.hidden_size, vlm.config.text_config.initializer_range)
        values = (hidden.last_hidden_state @ head.T).squeeze(-1)  # [B, T]
    # The critic's values[:, t] are the state after token t: the response's values sit one column earlier.
    expected = values[:, -RESPONSE - 1 : -1] * batch["response_mask"]
    mask = batch["response_mask"].bool()
    assert expected[mask].abs().mean() > 1e-3  # a real head, not zeros
    # fp32; micro-batches of 3 rows cut at other widths than the one pass: rounding only (measured 3.0e-8; the
    # values are ~0.12 on average).
    torch.testing.assert_close(out["before"], expected, atol=1e-5, rtol=0)
    # Other pixels, other values: the images reach the critic's forward (measured 0.064 at most).
    assert (out["flipped"] - out["before"])[mask].abs().max() > 1e-2
    assert (out["after"] - out["before"])[mask].abs().max() > 1e-3  # the value-loss step moved them (measured 1.6)
    assert out["metrics"]["critic/vf_loss"] > 0
    assert out["round_trip"]


def _gae_body(vlm_dir: str, train: str, root: str) -> dict:
    from verl.trainer.main_ppo import main

    code = main(["--config", "ppo_tiny_cpu", f"actor_rollout_ref.model.path={vlm_dir}", f"data.train_files={train}",
                 "data.val_files=null", "data.max_prompt_length=32", "data.max_response_length=4",
                 "data.train_batch_size=2", "algorithm.adv_estimator=gae",
                 "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
                 "actor_rollout_ref.model.use_remove_padding=false", "critic.model.use_remove_padding=false",
                 "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=1",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                 "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2",
                 "critic.forward_micro_batch_size_per_gpu=2",
                 "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.save_hf=false", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1",
                 "trainer.logger=[jsonl]", f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs"])
    metrics: dict[str, float] = {}
    with open(os.path.join(root, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            metrics.update(json.loads(line))
    return {"code": code, "metrics": metrics}


@pytest.mark.timeout(400)
def test_gae_run_with_a_vlm_critic_on_fsdp2(tmp_path):
    """One PPO/GAE step through main_ppo: the tiny Qwen2.5-VL as FSDP2 actor and critic, the transformers rollout."""
    from verl.testing.tiny_vlm import cached_tiny_vlm

    train = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(2)), train)
    out = run_distributed(_gae_body, 1, cached_tiny_vlm(), train, str(tmp_path / "run"), timeout=380)[0]
    assert out["code"] == 0
    m = out["metrics"]
    assert m["critic/vf_loss"] > 0 and torch.isfinite(torch.tensor(m["critic/grad_norm"]))
    assert m["actor/ppo_kl"] == 0.0  # step 1: the same weights made the old log-probs
