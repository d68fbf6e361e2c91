"""The Megatron Qwen2.5-VL (verl.models.megatron_vlm) against transformers' on the same weights.

The tiny Qwen2.5-VL of verl.data.tiny_vlm with two key/value heads, its norms and biases randomised (transformers initialises
them to ones and zeros, which would hide a mapping mistake there). One batch: a text-only row, a
left-padded row with a 28 x 28 image (1 image token) and a right-padded row with a 56 x 42 and a
28 x 56 image (2 x 2 and 1 x 2 merged tokens): images of different sizes, several per row.

Tolerance: float32 on both sides; the same math in another order (fused QKV, TP-split matmuls and
their all-reduce, Megatron's and transformers' rotary code) differs by rounding, ~1e-6 here.
1e-5 absolute on logits leaves margin without hiding a real error: a wrong position (1D instead of
3D), a missing image or a mis-mapped weight moves logits by > 1e-3 (the image case is checked).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from verl.testing.tiny_vlm import cached_tiny_vlm

    config = AutoConfig.from_pretrained(cached_tiny_vlm())
    config.text_config.num_key_value_heads = 2  # two key/value heads: tensor parallel 2 splits them
    torch.manual_seed(3)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    out = str(tmp_path_factory.mktemp("vlm") / "model")
    model.save_pretrained(out)
    return out


def _image_batch(model_dir: str) -> dict[str, torch.Tensor]:
    """input_ids/attention_mask [3, T] and transformers' pixel_values [patches, D] / image_grid_thw [images, 3]."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig

    from verl.data.tiny_vlm import TinyVLMSpec, tiny_image_processor

    config = AutoConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    sizes = [[(28, 28)], [(56, 42), (28, 56)]]  # (width, height) per image of rows 1 and 2
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for row in sizes for w, h in row]
    processed = tiny_image_processor(TinyVLMSpec())(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"]  # [3, 3]
    tokens = (grid.prod(-1) // 4).tolist()  # merged tokens per image (merge 2 x 2)
    gen = torch.Generator().manual_seed(5)

    def text(n: int) -> list[int]:
        return torch.randint(3, 800, (n,), generator=gen).tolist()

    def span(k: int) -> list[int]:
        return [config.vision_start_token_id] + [config.image_token_id] * tokens[k] + [config.vision_end_token_id]

    rows = [text(3) + span(0) + text(6), text(2) + span(1) + text(2) + span(2) + text(1)]
    width = max(len(r) for r in rows) + 3
    rows.insert(0, text(width))
    pads = [(0, 0), (width - len(rows[1]), 0), (0, width - len(rows[2]))]  # row 1 left-padded, row 2 right-padded
    ids = torch.tensor([[0] * left + r + [0] * right for r, (left, right) in zip(rows, pads)])
    mask = torch.tensor([[0] * left + [1] * len(r) + [0] * right for r, (left, right) in zip(rows, pads)])
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": processed["pixel_values"], "image_grid_thw": grid}


def _hf_logits(model_dir: str, batch: dict[str, torch.Tensor], *, images: bool) -> torch.Tensor:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        if not images:  # text only: transformers' 1D positions (cumsum of the mask), on all three rows
            positions = (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
            return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        image_tokens = (ids == model.config.image_token_id).int()
        return model(
            input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=image_tokens,
        ).logits


def _logits_body(model_dir: str, tp: int, batch: dict[str, torch.Tensor], text_batch: dict[str, torch.Tensor]):
    from verl.models.builder import ModelBuildConfig
    from verl.models.megatron_vlm import build_megatron_vlm
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_megatron_vlm(model_dir, ModelBuildConfig(), pg).eval()
    with torch.no_grad():
        images = model(**batch)  # [B, T, V/TP]
        no_images = model(text_batch["input_ids"], text_batch["attention_mask"])
        # 3D positions read from the batch: the row with two images, where they depart from 1D ones
        positions = model.positions(batch["input_ids"], batch["attention_mask"], batch["image_grid_thw"])
    return {"tp_rank": pg.tp.rank(), "images": images, "text": no_images, "positions": positions,
            "vocab": model.verl_vlm_spec.text.vocab_size}


def _text_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 800, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded
    mask[2, 7:] = 0  # right-padded
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(vlm_dir, run_dist, tp):
    batch = _image_batch(vlm_dir)
    text = _text_batch()
    results = run_dist(_logits_body, 2, vlm_dir, tp, batch, text)
    vocab = results[0]["vocab"]
    for key, inputs, expected in (
        ("text", text, _hf_logits(vlm_dir, text, images=False)),
        ("images", batch, _hf_logits(vlm_dir, batch, images=True)),
    ):
        ranks = sorted(results, key=lambda r: r["tp_rank"])[:tp]
        actual = torch.cat([r[key] for r in ranks], dim=-1)[..., :vocab]  # the TP shards side by side
        mask = inputs["attention_mask"].bool()
        err = (actual[mask] - expected[mask]).abs().max().item()
        assert err <= ATOL, f"{key} tp={tp}: max |Megatron - transformers| = {err:.3g}"
    # The image rows really use 3D positions (height/width rows differ from the temporal one)...
    positions = results[0]["positions"]
    assert not torch.equal(positions[1, 2], positions[0, 2])
    # ...and their pixels reach the logits: other pixels move them far beyond the tolerance.
    if tp == 1:
        moved = dict(batch, pixel_values=batch["pixel_values"].flip(0))
        other = _hf_logits(vlm_dir, moved, images=True)
        mask = batch["attention_mask"].bool()
        actual = results[0]["images"][..., :vocab]
        assert (actual[mask] - other[mask]).abs().max().item() > 100 * ATOL


def test_refusals_before_build(vlm_dir, tmp_path):
    import json

    from verl.models.builder import ModelBuildConfig
    from verl.models.megatron_vlm import check_vlm_layout, parse_vlm_config

    with pytest.raises(ValueError, match="pipeline parallel 2"):
        check_vlm_layout(ModelBuildConfig(), tp_size=1, pp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel=true"):
        check_vlm_layout(ModelBuildConfig(sequence_parallel=True), tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match="head='value'"):
        check_vlm_layout(ModelBuildConfig(head="value"), tp_size=1, pp_size=1)
    with open(f"{vlm_dir}/config.json") as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="qwen3_vl")))
    with pytest.raises(ValueError, match="'model_type' is 'qwen3_vl'"):
        parse_vlm_config(str(tmp_path))
    bad = dict(config, text_config=dict(config["text_config"], rope_parameters={"rope_theta": 1e4, "mrope_section": [4, 6]}))
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="mrope_section"):
        parse_vlm_config(str(tmp_path))
    assert parse_vlm_config(vlm_dir).mrope_section == (4, 6, 6)
