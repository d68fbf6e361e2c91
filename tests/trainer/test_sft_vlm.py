"""SFT of a vision-language model through the SFT trainer (the Megatron engine's Qwen2.5-VL): the items
carry the images, the image reaches the model's forward, and the loss falls on the colour-square task."""

from __future__ import annotations

import json
import os

import pytest
import torch

from verl.testing.distributed import run_distributed


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory) -> dict[str, str]:
    from verl.data.io import write_parquet
    from verl.data.tasks.colour_square import colour_square_records

    root = tmp_path_factory.mktemp("sft-vlm-data")
    files = {"train": str(root / "train.parquet"), "val": str(root / "val.parquet")}
    write_parquet(colour_square_records(16, seed=0, split="train", colours=("red", "blue")), files["train"])
    write_parquet(colour_square_records(8, seed=1, split="test", colours=("red", "blue")), files["val"])
    return files


def test_items_carry_images_and_mask_the_response(vlm_files):
    from verl.data.sft_dataset import SFTDataset
    from verl.data.tokenizer import load_tokenizer
    from verl.data.vlm import ImagePromptEncoder
    from verl.testing.tiny_vlm import cached_tiny_vlm

    model = cached_tiny_vlm()
    tokenizer = load_tokenizer(model)
    encoder = ImagePromptEncoder.from_pretrained(model, tokenizer=tokenizer)
    data = SFTDataset(vlm_files["train"], tokenizer, max_length=48, response_key="extra_info.answer",
                      processor=encoder)
    item = data[0]
    grid = item["mm_image_grid_thw"]
    assert grid.shape == (1, 3) and int(grid.prod()) == item["mm_pixel_values"].shape[0] > 0
    # One image token per merged patch group (merge 2: 4 patches -> 1 token), none in the target.
    assert int((item["input_ids"] == encoder.image_token_id).sum()) == int(grid.prod()) // 4
    assert not bool(((item["input_ids"] == encoder.image_token_id) & item["loss_mask"].bool()).any())
    target = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
    assert target.split("<|im_end|>")[0] in ("red", "blue")

    # Too few tokens for a row with images: refused, not truncated (it would cut image tokens).
    short = SFTDataset(vlm_files["train"], tokenizer, max_length=8, response_key="extra_info.answer",
                       processor=encoder, truncation="left")
    with pytest.raises(ValueError, match=r"row 0: .*tokens with its images, above data.max_length=8"):
        short[0]
    with pytest.raises(ValueError, match=r"no column 'pictures'.*data.image_key"):
        SFTDataset(vlm_files["train"], tokenizer, response_key="extra_info.answer", processor=encoder,
                   image_key="pictures")


def _losses(log_dir: str) -> dict[int, float]:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _train_body(model_dir: str, files: dict[str, str], run_dir: str) -> dict:
    from verl.config import SFTConfig, load_config
    from verl.trainer.sft_trainer import SFTTrainer, sft_loss_sums

    cfg = load_config(SFTConfig, config_file="sft_tiny_cpu", overrides=[
        f"model.path={model_dir}", f"data.train_files={files['train']}", f"data.val_files={files['val']}",
        "data.response_key=extra_info.answer", "data.max_length=48",
        "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=16", "optim.lr=2e-2", "optim.lr_warmup_steps=0",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.save_hf=false", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}", f"trainer.log_dir={run_dir}/logs",
    ], world_size=1)

    def nll(trainer, batch) -> float:
        out = trainer.engine.forward(batch, micro_batch_size=4)
        total, tokens = sft_loss_sums(out.outputs["logprobs"].cpu(), batch["loss_mask"])
        return float(total / tokens)

    with SFTTrainer(cfg) as trainer:
        assert trainer.processor is not None  # the model directory is a VLM's
        items = [trainer.val_dataset[i] for i in range(len(trainer.val_dataset))]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        blank = {**batch, "mm_pixel_values": torch.zeros_like(batch["mm_pixel_values"])}
        before = (nll(trainer, batch), nll(trainer, blank))
        trainer.fit()
        after = (nll(trainer, batch), nll(trainer, blank))
    return {"losses": _losses(f"{run_dir}/logs"), "before": before, "after": after}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sft_of_a_vlm_learns_from_the_image(vlm_files, tmp_path):
    from verl.testing.tiny_vlm import cached_tiny_vlm

    out = run_distributed(_train_body, 1, cached_tiny_vlm(), vlm_files, str(tmp_path))[0]
    losses = [out["losses"][s] for s in sorted(out["losses"])]
    assert len(losses) == 16
    # The response is one colour word of two and the end-of-turn tokens: from a random model's
    # loss (~ln(vocab)) sixteen steps at lr 2e-2 fall far; a ratio rather than a value (load-independent).
    assert losses[-1] < 0.5 * losses[0], (losses, out)
    (img0, blank0), (img1, blank1) = out["before"], out["after"]
    # The image reaches the model: blanking the pixels changes the loss (before any training too).
    assert abs(img0 - blank0) > 1e-6, out
    assert abs(img1 - blank1) > 1e-4, out
    assert img1 < img0


@pytest.mark.parametrize("override, message", [
    ("data.image_key=pictures", "no column 'pictures': data.image_key names the column of the rows' images"),
    ("data.multiturn.enable=true", "multi-turn SFT (data.multiturn.enable) of a vision-language model is not supported"),
])
def test_main_sft_refuses_bad_vlm_data_in_one_line(vlm_files, tmp_path, capsys, override, message):
    from verl.testing.commands import run_main
    from verl.testing.tiny_vlm import cached_tiny_vlm
    from verl.trainer.main_sft import main

    proc = run_main(main, [
        "--config", "sft_tiny_cpu", f"model.path={cached_tiny_vlm()}", f"data.train_files={vlm_files['train']}",
        "data.val_files=null", "data.response_key=extra_info.answer", override,
        f"trainer.default_local_dir={tmp_path}/run", f"trainer.log_dir={tmp_path}/run/logs",
    ], capsys=capsys, name="main_sft")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert not os.path.exists(f"{tmp_path}/run/global_step_1")  # refused before any step
