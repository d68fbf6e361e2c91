"""A vision-language model on the FSDP2 engine and the transformers rollout engine (#53).

The tiny Qwen2.5-VL (``verl.data.tiny_vlm``) generates from prompts with images (the dataset's
``mm_*`` columns); the FSDP2 engine recomputes the samples' log-probabilities with the same images
and mrope positions the model computes, takes an update with them, and freezes its vision encoder
on request.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl.testing.distributed import run_distributed

RESPONSE = 6


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"), TinyVLMSpec(corpus_lines=500))


@pytest.fixture(scope="module")
def rollout(vlm_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Two samples each of four prompts with images of two sizes (one or two per prompt), from the
    transformers engine: the trainer's batch columns."""
    from verl.config.schema import RolloutConfig
    from verl.data.rl_dataset import RLPromptDataset, collate_fn
    from verl.data.vlm import ImagePromptEncoder
    from verl.protocol import Batch
    from verl.rollout.hf_engine import HFRollout

    def img(color, size=(28, 28)):
        return {"bytes": _png(color, size), "path": None}

    rows = [
        {"prompt": "<image>Which colour?", "images": [img("red")]},
        {"prompt": "<image>Which colour?", "images": [img("blue", (56, 56))]},
        {"prompt": "<image> or <image>?", "images": [img("green"), img("red", (42, 56))]},
        {"prompt": "Bigger: <image>", "images": [img("yellow", (56, 28))]},
    ]
    path = str(tmp_path_factory.mktemp("data") / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{**r, "data_source": "colour"} for r in rows]), path)
    enc = ImagePromptEncoder.from_pretrained(vlm_dir)
    ds = RLPromptDataset(path, enc.tokenizer, processor=enc, max_prompt_length=48)
    prompts = collate_fn([ds[i] for i in range(len(ds))])
    batch = Batch.from_dict({k: v for k, v in prompts.items() if torch.is_tensor(v)})
    engine = HFRollout(RolloutConfig(name="hf", n=2, temperature=1.0, prompt_length=48, response_length=RESPONSE,
                                     seed=3), vlm_dir, device="cpu", micro_batch_size=3)
    out = engine.generate(batch)
    keys = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs", "mm_pixel_values",
            "mm_image_grid_thw")
    return {k: out[k] for k in keys}


def _engine(vlm_dir: str, *, trainable: bool, freeze: bool = False):
    from transformers import AutoModelForImageTextToText

    from verl.config import OptimConfig
    from verl.config.schema import FSDPConfig
    from verl.engine.fsdp import FSDPEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    optim = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0, weight_decay=0.0) if trainable else None
    module = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    return pg, FSDPEngine(module, pg=pg, fsdp=FSDPConfig(), optim=optim, total_training_steps=4, hf_dir=vlm_dir,
                          name="actor", freeze_vision_tower=freeze)


def _logprobs(vlm_dir: str, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The FSDP2 engine's log-probabilities of each batch's response columns (one rank)."""
    from verl.parallel import megatron_state as ms

    _, engine = _engine(vlm_dir, trainable=False)
    try:
        return [engine.forward(b, micro_batch_size=3).outputs["logprobs"][:, -RESPONSE:] for b in batches]
    finally:
        ms.destroy_model_parallel()


def _step(vlm_dir: str, batch: dict[str, torch.Tensor], freeze: bool) -> dict:
    """One SGD step on this rank's half of ``batch`` (micro-batches of 2 rows): loss, gradient norm, weights."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.engine import LossShare
    from verl.parallel import megatron_state as ms

    pg, engine = _engine(vlm_dir, trainable=True, freeze=freeze)
    try:
        dp, rank = pg.dp.size(), pg.dp.rank()
        per = batch["input_ids"].shape[0] // dp
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        info = GlobalBatchInfo.from_masks([local["response_mask"].float()], group=pg.dp if dp > 1 else None)

        def loss_fn(outputs, mb):
            return LossShare(agg_loss(-outputs["logprobs"][:, -RESPONSE:], mb["response_mask"], "token-mean",
                                      global_batch_info=info))

        result = engine.train_step(local, micro_batch_size=2, loss_fn=loss_fn)
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in engine.module.named_parameters()}
        return {"loss": result.loss, "norm": result.grad_norm, "weights": weights}
    finally:
        ms.destroy_model_parallel()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_trainer_logprobs_equal_the_rollouts_and_read_the_image(vlm_dir, rollout):
    other = dict(rollout, mm_pixel_values=rollout["mm_pixel_values"].flip(-1))  # every image changed
    dropped = {k: v for k, v in rollout.items() if not k.startswith("mm_")}
    dropped["mm_image_grid_thw"] = torch.zeros_like(rollout["mm_image_grid_thw"])  # no image in any row
    same, changed = run_distributed(_logprobs, 1, vlm_dir, [rollout, other])[0]
    mask = rollout["response_mask"].bool()
    # fp32, the same weights and mrope positions: the cached-KV decode and the one full pass sum in another
    # order; measured 4.8e-7.
    assert (same - rollout["rollout_log_probs"]).abs()[mask].max() <= 1e-5
    # Another image gives other log-probabilities (the pixels reach the model): measured 0.09 at most.
    assert (changed - same).abs()[mask].max() > 1e-2
    # Image tokens without their images are refused, not read as text.
    with pytest.raises(Exception, match="image tokens but no images"):
        run_distributed(_logprobs, 1, vlm_dir, [dropped])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_step_as_one_process_and_freeze_the_vision_tower(vlm_dir, rollout):
    batch = {k: v for k, v in rollout.items() if k != "rollout_log_probs"}
    one = run_distributed(_step, 1, vlm_dir, batch, False)[0]
    two = run_distributed(_step, 2, vlm_dir, batch, False)
    frozen = run_distributed(_step, 2, vlm_dir, batch, True)[0]
    before = _initial_weights(vlm_dir)
    for out in two:
        # The halves' shares are summed in another order (per rank, then the reduce-scatter): fp32 rounding
        # (the norm, ~2, relative: a few ulps).
        assert abs(out["loss"] - one["loss"]) <= 1e-6 and abs(out["norm"] - one["norm"]) <= 1e-6 * one["norm"]
        for name, value in one["weights"].items():
            torch.testing.assert_close(out["weights"][name], value, atol=1e-6, rtol=0, msg=name)
    vision = [n for n in before if n.startswith("model.visual.")]
    assert vision and all(not torch.equal(one["weights"][n], before[n]) for n in vision if "norm" not in n)
    # Frozen: the vision encoder's weights are the checkpoint's; the language model still moves.
    assert all(torch.equal(frozen["weights"][n], before[n]) for n in vision)
    assert not torch.equal(frozen["weights"]["lm_head.weight"], before["lm_head.weight"])


def _initial_weights(vlm_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    return {n: p.detach().clone() for n, p in AutoModelForImageTextToText.from_pretrained(vlm_dir).named_parameters()}


def _grpo_body(vlm_dir: str, train_file: str, root: str, *more: str) -> dict:
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        overrides=[
            f"actor_rollout_ref.model.path={vlm_dir}", f"data.train_files={train_file}", "data.val_files=null",
            "data.max_prompt_length=48", "data.max_response_length=8", "data.train_batch_size=4",
            "actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            # The random model scores 0 everywhere (GRPO's advantages are 0): the entropy bonus moves it.
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_hf=false",
            "trainer.n_gpus_per_node=2", "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
            f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs", *more,
        ],
        world_size=2,
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
        visual = [p for n, p in trainer.world.actor.engine.module.named_parameters() if n.startswith("model.visual.")]
        grads = sorted({p.requires_grad for p in visual})
    import json

    with open(f"{root}/logs/metrics.jsonl", encoding="utf-8") as f:
        steps = [json.loads(line) for line in f]
    return {"steps": steps, "visual_requires_grad": grads}


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("freeze", [False, True], ids=["trained", "frozen"])
def test_grpo_with_images_on_fsdp2(vlm_dir, tmp_path, freeze):
    """Two GRPO steps with images (2 ranks, actor and reference on FSDP2, the transformers rollout fed by the
    push): step 1's ratio is exactly 1 and its KL 0 (same weights); the rollout's log-probabilities are the
    actor's at both steps (step 2: after the push of the updated weights, the vision encoder's included)."""
    rows = [{"prompt": f"<image>Which colour? {i}", "images": [{"bytes": _png(c, (28, 28) if i % 2 else (56, 56)),
                                                                  "path": None}],
             "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": c}}
            for i, c in enumerate(["red", "blue", "green", "red", "blue", "green", "red", "blue"])]
    train = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), train)
    more = ["actor_rollout_ref.actor.freeze_vision_tower=true"] if freeze else []
    out = run_distributed(_grpo_body, 2, vlm_dir, train, str(tmp_path / "run"), *more, timeout=580)[0]
    first, second = out["steps"][0], out["steps"][1]
    assert first["actor/ppo_kl"] == 0.0 and abs(first["actor/kl_loss"]) <= 1e-6
    for step in (first, second):
        # The engine's cached decode and the trainer's one pass in fp32: rounding only (text models' bound).
        assert step["training/rollout_logprob_diff_max"] < 1e-4, step["training/rollout_logprob_diff_max"]
    assert second["actor/kl_loss"] != 0.0  # the actor moved
    assert out["visual_requires_grad"] == ([False] if freeze else [True])


def test_the_vllm_engine_refuses_a_vlm_rather_than_drop_its_images(vlm_dir):
    from verl.config.schema import RolloutConfig
    from verl.rollout.factory import build_rollout_engine

    with pytest.raises(ValueError, match=r"^actor_rollout_ref.rollout.name=vllm: .* is a vision-language model.*name=hf"):
        build_rollout_engine(RolloutConfig(name="vllm", prompt_length=8, response_length=4), vlm_dir)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_whose_rows_have_no_images_steps_beside_one_whose_rows_have(vlm_dir, rollout):
    """Rank 0's rows have images, rank 1's are text only: rank 1 runs the vision encoder on a blank image
    (0 x its features), so FSDP2's gathers pair up and the step is one process's."""
    from transformers import AutoConfig

    image_token = AutoConfig.from_pretrained(vlm_dir).image_token_id
    batch = {k: v[:8].clone() for k, v in rollout.items() if k != "rollout_log_probs"}
    ids = batch["input_ids"][4:]
    ids[ids == image_token] = 100  # rows 4-7: the same text, no image tokens
    batch["mm_image_grid_thw"][4:] = 0
    batch["mm_pixel_values"][4:] = 0
    one = run_distributed(_step, 1, vlm_dir, batch, False)[0]
    for out in run_distributed(_step, 2, vlm_dir, batch, False, timeout=200):
        # The halves' shares summed in another order: fp32 rounding (the norm, ~2, relative: measured 1.2e-6
        # absolute, 5 ulps).
        assert abs(out["loss"] - one["loss"]) <= 1e-6 and abs(out["norm"] - one["norm"]) <= 1e-6 * one["norm"]
        for name, value in one["weights"].items():
            torch.testing.assert_close(out["weights"][name], value, atol=1e-6, rtol=0, msg=name)


def test_image_tokens_without_images_are_refused_by_the_rollout(vlm_dir, rollout):
    """The agent loop and ``sample`` hand the engine token ids only: a prompt with image tokens is refused
    there, not generated from without its images."""
    from transformers import AutoConfig

    from verl.config.schema import RolloutConfig
    from verl.rollout.base import SamplingSpec
    from verl.rollout.hf_engine import HFRollout

    engine = HFRollout(RolloutConfig(name="hf", prompt_length=48, response_length=2), vlm_dir, device="cpu")
    image_token = AutoConfig.from_pretrained(vlm_dir).image_token_id
    width = rollout["input_ids"].shape[1] - RESPONSE  # the prompt columns, left-padded
    prompt = rollout["input_ids"][0, :width][rollout["attention_mask"][0, :width].bool()].tolist()
    assert image_token in prompt
    with pytest.raises(ValueError, match="prompts hold image tokens but no images reached the engine"):
        engine.sample([prompt], SamplingSpec(n=1, max_tokens=2, temperature=1.0, top_p=1.0, top_k=-1))
    assert len(engine.sample([[t for t in prompt if t != image_token]], SamplingSpec(
        n=1, max_tokens=2, temperature=1.0, top_p=1.0, top_k=-1))) == 1  # text only: generated
