"""The Megatron Qwen2.5-VL (verl.models.megatron_vlm) against transformers' on the same weights.

The tiny Qwen2.5-VL of verl.data.tiny_vlm with two key/value heads and three decoder layers (split
unevenly over two pipeline stages), its norms and biases randomised (transformers initialises
them to ones and zeros, which would hide a mapping mistake there). One batch: a text-only row, a
left-padded row with a 28 x 28 image (1 image token) and a right-padded row with a 56 x 42 and a
28 x 56 image (2 x 2 and 1 x 2 merged tokens): images of different sizes, several per row.

Layouts: TP 1/2, PP 2 (uneven: 3 layers), packed (THD) sequences, sequence parallel and TP 2 x PP 2 on
4 ranks, through verl.models.forward.forward_backward as the engine runs the model; conversion at TP 2
and PP 2.

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
    config.text_config.num_hidden_layers = 3  # pipeline parallel 2: an uneven split of the decoder
    config.text_config.layer_types = ["full_attention"] * 3
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


def _hf_logits(model_dir: str, batch: dict[str, torch.Tensor], *, images: bool,
               positions_1d: bool = False) -> torch.Tensor:
    """transformers' logits [B, T, V]; ``positions_1d``: with each token's index in its row on all three
    rotary axes instead of the 3D positions (what a fall back to text positions would compute)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)  # 1D: cumsum of the mask
    with torch.no_grad():
        if not images:  # text only: transformers' 1D positions, on all three rows
            return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        image_tokens = (ids == model.config.image_token_id).int()
        return model(
            input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=image_tokens,
            position_ids=positions if positions_1d else None,
        ).logits


def _logits_body(model_dir: str, tp: int, batch: dict[str, torch.Tensor], text_batch: dict[str, torch.Tensor]):
    from verl.models.builder import ModelBuildConfig
    from verl.models.megatron_vlm import build_megatron_vlm
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_megatron_vlm(model_dir, ModelBuildConfig(), pg).eval()
    with torch.no_grad():
        images = model.logits(**batch)  # [B, T, V/TP]
        no_images = model.logits(text_batch["input_ids"], text_batch["attention_mask"])
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


def _layout_body(model_dir: str, tp: int, pp: int, sp: bool, pack: bool, rows: dict[str, torch.Tensor]):
    from verl.models.builder import ModelBuildConfig
    from verl.models.forward import forward_backward
    from verl.models.megatron_vlm import build_megatron_vlm
    from verl.models.packing import pack_like, pack_micro_batch
    from verl.parallel.megatron_state import initialize_model_parallel
    from verl.protocol.images import model_image_inputs

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = build_megatron_vlm(model_dir, ModelBuildConfig(sequence_parallel=sp), pg).eval()
    # Micro-batches of two rows: the two image rows together (packed: one sequence of both), then the text row.
    logits = forward_backward([model], rows, pg=pg, micro_batch_size=2, output="logits", pack_sequences=pack,
                              broadcast=False).outputs.get("logits")  # [B, T, V/TP] on the last stage
    # The 3D positions of the image rows packed into one row, against each row's own (padded layout).
    ids, mask = rows["input_ids"][:2], rows["attention_mask"][:2]
    grid = model_image_inputs({k: v[:2] for k, v in rows.items()})["image_grid_thw"]
    packed = pack_micro_batch(ids, mask, 48)
    packed_positions = model.positions(packed.input_ids, pack_like(mask, packed.real, 48), grid, packed.seq_params())
    row_positions = model.positions(ids, mask, grid)  # [3, 2, T]
    return {"tp_rank": pg.tp.rank(), "logits": logits, "vocab": model.verl_vlm_spec.text.vocab_size,
            "packed_positions": packed_positions[:, 0, packed.slots],  # [3, real tokens] in packed order
            "row_positions": row_positions.flatten(1)[:, packed.real]}


LAYOUTS = {  # world size, (tp, pp, sequence parallel, packed sequences)
    "pp2": (2, (1, 2, False, False)),
    "tp2-packed": (2, (2, 1, False, True)),
    "tp2-sp-packed": (2, (2, 1, True, True)),
    "pp2-packed": (2, (1, 2, False, True)),
    "tp2xpp2-sp": (4, (2, 2, True, False)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_transformers(vlm_dir, run_dist, layout):
    """Pipeline stages, packed (THD) sequences, sequence parallel: the logits of every row equal
    transformers' on the rows unpacked; an image row's 3D positions in a packed row are its own."""
    world, (tp, pp, sp, pack) = LAYOUTS[layout]
    batch = _image_batch(vlm_dir)
    order = [1, 2, 0]  # the two image rows first: one micro-batch (one packed sequence) of both
    rows = {k: v[order] for k, v in _rows_batch(batch).items()}
    # Four ranks on two loaded cores start slowly (~70 s measured, mostly the pool's start): a generous limit.
    results = run_dist(_layout_body, world, vlm_dir, tp, pp, sp, pack, rows, timeout=360)
    expected = _hf_logits(vlm_dir, batch, images=True)[order]
    last = sorted((r for r in results if r["logits"] is not None), key=lambda r: r["tp_rank"])
    assert len(last) == tp  # the last stage's TP ranks
    actual = torch.cat([r["logits"] for r in last], dim=-1)[..., : results[0]["vocab"]]
    mask = rows["attention_mask"].bool()
    err = (actual[mask] - expected[mask]).abs().max().item()
    assert err <= ATOL, f"{layout}: max |Megatron - transformers| = {err:.3g}"
    for r in results:
        torch.testing.assert_close(r["packed_positions"], r["row_positions"], rtol=0, atol=0)
    # The check can fail: the rows' 3D positions are not 1D ones (each real token's index in its row)...
    positions = results[0]["row_positions"]
    assert not torch.equal(positions[1], positions[0])
    # ...transformers with 1D positions, or with the images' patches in another order (features on
    # other tokens), gives logits far beyond the tolerance.
    one_d = _hf_logits(vlm_dir, batch, images=True, positions_1d=True)[order]
    moved = _hf_logits(vlm_dir, dict(batch, pixel_values=batch["pixel_values"].flip(0)), images=True)[order]
    for wrong in (one_d, moved):
        assert (actual[mask] - wrong[mask]).abs().max().item() > 100 * ATOL


def test_refusals_before_build(vlm_dir, tmp_path):
    import json

    from verl.models.builder import ModelBuildConfig
    from verl.models.megatron_vlm import check_vlm_layout, parse_vlm_config

    check_vlm_layout(ModelBuildConfig(sequence_parallel=True), tp_size=2, pp_size=2)  # the layouts it runs
    with pytest.raises(ValueError, match="virtual pipeline stages"):
        check_vlm_layout(ModelBuildConfig(), tp_size=1, pp_size=2, vpp_size=2)
    with pytest.raises(ValueError, match="context parallel 2"):
        check_vlm_layout(ModelBuildConfig(), tp_size=1, pp_size=1, cp_size=2)
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
    # The text-model path (the Megatron engine, the converters) names what to use instead.
    from verl.models.hf_config import parse_hf_config

    with pytest.raises(ValueError, match="strategy=fsdp2"):
        parse_hf_config(vlm_dir)


LR = 0.5  # SGD: large enough that one step moves the log-probabilities far beyond the tolerance


def _rows_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch as verl's Batch carries it: each row's images in its own ``mm_*`` columns."""
    from verl.protocol.images import pad_row_images

    grid, pixels = batch["image_grid_thw"], batch["pixel_values"]
    patches = grid.prod(-1).tolist()
    starts = [sum(patches[:k]) for k in range(len(patches) + 1)]
    per_row = [[], [0], [1, 2]]  # image indices of each row
    width, dim = max(sum(patches[k] for k in row) for row in per_row), pixels.shape[1]
    cols = []
    for row in per_row:
        pv = torch.cat([pixels[starts[k]:starts[k + 1]] for k in row]) if row else None
        cols.append(pad_row_images(pv, grid[row] if row else None, patches=width, images=2, dim=dim))
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            **{k: torch.stack([c[k] for c in cols]) for k in cols[0]}}


def _step_body(model_dir: str, rows: dict[str, torch.Tensor], freeze: bool, tp: int, pp: int = 1, sp: bool = False,
               pack: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from verl.config.schema import OptimConfig
    from verl.engine.build import build_optimizer
    from verl.engine.step import optimizer_step
    from verl.models.builder import ModelBuildConfig
    from verl.models.forward import LossShare, forward_backward
    from verl.models.megatron_vlm import build_megatron_vlm
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = build_megatron_vlm(model_dir, ModelBuildConfig(sequence_parallel=sp), pg, freeze_vision_tower=freeze)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
                                  pg_collection=pg)
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer(OptimConfig(optimizer="sgd", lr=LR, weight_decay=0.0), [ddp], pg,
                                dtype=torch.float32, use_distributed_optimizer=False)
    tokens = rows["attention_mask"].sum()

    def loss_fn(outputs, mb):  # the mean of every token's -log p over the batch: each micro-batch's share
        return LossShare(-(outputs["logprobs"] * mb["attention_mask"]).sum() / tokens, {})

    # Micro-batches of 2 rows: the images travel with their rows (rows 0-1, then row 2's two images).
    run = dict(pg=pg, micro_batch_size=2, output="logprobs", pack_sequences=pack)
    before = forward_backward([ddp], rows, **run).outputs["logprobs"]
    ddp.zero_grad_buffer()
    forward_backward([ddp], rows, loss_fn=loss_fn, **run)
    tower = model.vision  # the first pipeline stage's only
    vision_grads = {} if tower is None else {
        n: p.main_grad.clone() for n, p in tower.named_parameters() if p.requires_grad
    }
    _, ok = optimizer_step(optimizer, 0.0)
    after = forward_backward([ddp], rows, **run).outputs["logprobs"]
    vision = {} if tower is None else {n: p.detach().clone() for n, p in tower.named_parameters()}
    return {"before": before, "after": after, "ok": ok, "vision_grads": vision_grads, "vision": vision,
            "first_stage": tower is not None}


def _hf_step(model_dir: str, batch: dict[str, torch.Tensor], freeze: bool):
    """transformers' log-probs before and after the same SGD step, its vision gradients and weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.models.tiny import reference_logprobs_entropy

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if freeze:
        model.model.visual.requires_grad_(False)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def logprobs():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
        return reference_logprobs_entropy(logits, ids, mask)[0]  # [B, T]; differentiable

    before = logprobs()
    (-(before * mask).sum() / mask.sum()).backward()
    grads = {n[len("model.visual."):]: p.grad.clone() for n, p in model.named_parameters()
             if n.startswith("model.visual.") and p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = logprobs()
    vision = {n: p.detach().clone() for n, p in model.model.visual.named_parameters()}
    return before.detach(), after, grads, vision


STEP_LAYOUTS = {  # (tp, pp, sequence parallel, packed sequences, frozen tower); two ranks each
    "tp2-trained-tower": (2, 1, False, False, False),
    "tp1-frozen-tower": (1, 1, False, False, True),
    "pp2-trained-tower": (1, 2, False, False, False),
    "tp2-sp-packed-trained-tower": (2, 1, True, True, False),
}


@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_logprobs_and_one_sgd_step_match_transformers(vlm_dir, run_dist, layout):
    tp, pp, sp, pack, freeze = STEP_LAYOUTS[layout]
    batch = _image_batch(vlm_dir)
    results = run_dist(_step_body, 2, vlm_dir, _rows_batch(batch), freeze, tp, pp, sp, pack)
    before, after, grads, vision = _hf_step(vlm_dir, batch, freeze)
    mask = batch["attention_mask"].bool()
    assert (after - before)[mask].abs().max() > 100 * ATOL  # the step moves the log-probs
    assert sum(r["first_stage"] for r in results) == 2 // pp  # the tower on the first stage's ranks only
    for r in results:  # every rank: the same log-probs; every first-stage rank: the same (replicated) tower
        assert r["ok"]
        torch.testing.assert_close(r["before"], before, rtol=0, atol=ATOL)
        # After a step of lr 0.5 the log-probs carry the gradients' rounding too: 1e-4 is still
        # far below a wrong or missing gradient (the step moves them by > 1e-3).
        torch.testing.assert_close(r["after"], after, rtol=0, atol=1e-4)
        if not r["first_stage"]:
            continue
        assert set(r["vision_grads"]) == (set() if freeze else set(grads))
        for name, grad in r["vision_grads"].items():
            # Sums of many rounded products: relative 1e-4 / absolute 1e-6, far below a missing
            # TP reduction (a factor of 2) or a gradient that did not reach the tower (0).
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
        for name, weight in r["vision"].items():
            torch.testing.assert_close(weight, vision[name], rtol=0, atol=1e-6, msg=name)


def _convert_body(hf_dir: str, ckpt_dir: str, tp: int, pp: int) -> tuple[float, float]:
    """Convert at TP ``tp`` x PP ``pp``; --check's difference there and at the other layout of two ranks."""
    from verl.models.convert import check_conversion, hf_to_megatron

    hf_to_megatron(hf_dir=hf_dir, out_dir=ckpt_dir, tp=tp, pp=pp, progress=False)
    return check_conversion(ckpt_dir=ckpt_dir, hf_dir=hf_dir, tp=tp, pp=pp), check_conversion(
        ckpt_dir=ckpt_dir, hf_dir=hf_dir, tp=pp, pp=tp)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_conversion_round_trip_and_check(vlm_dir, run_dist, tmp_path, tp, pp):
    """HF -> Megatron (TP 2 or PP 2) -> HF: every tensor bit-exact, the same config; --check's logits
    (images of three sizes) equal transformers' within ATOL (float32: rounding only), at the layout
    written and loaded resharded at the other one (TP 2 <-> PP 2)."""
    import json

    from safetensors.torch import load_file

    from verl.models.convert import megatron_to_hf

    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    diffs = run_dist(_convert_body, 2, vlm_dir, ckpt, tp, pp)
    assert diffs[0] == diffs[1] and max(diffs[0]) <= ATOL, diffs
    megatron_to_hf(megatron_dir=ckpt, out_dir=back, progress=False)
    expected, actual = load_file(f"{vlm_dir}/model.safetensors"), load_file(f"{back}/model.safetensors")
    assert set(actual) == set(expected)
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    with open(f"{vlm_dir}/config.json") as f, open(f"{back}/config.json") as g:
        assert json.load(f) == json.load(g)
