"""Qwen3-VL on the FSDP2 engine and the transformers rollout engine (#53).

The tiny Qwen3-VL (``make_tiny_vlm`` with ``family="qwen3_vl"``: patch 16, learned vision positions, a
deepstack merger, interleaved mrope) generates from prompts with images of two sizes; the FSDP2 engine's
log-probabilities of those samples are a plain transformers forward's; an update on two ranks, one of
whose rows have no image, is one process's update (every vision parameter, the deepstack merger's
included, gets its gradient on both ranks).
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl.testing.distributed import run_distributed

RESPONSE = 4


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _engine(path: str, *, trainable: bool):
    from transformers import AutoModelForImageTextToText

    from verl.config import OptimConfig
    from verl.config.schema import FSDPConfig
    from verl.engine.fsdp import FSDPEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    optim = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0, weight_decay=0.0) if trainable else None
    module = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return pg, FSDPEngine(module, pg=pg, fsdp=FSDPConfig(), optim=optim, total_training_steps=2, hf_dir=path,
                          name="actor")


def _logprobs_and_step(path: str, batch: dict[str, torch.Tensor], forward: bool) -> dict:
    """This rank's half of ``batch``: (with ``forward``) the engine's log-probs of the whole batch, then one
    SGD step on the half; the loss, gradient norm and the weights after it."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.engine import LossShare
    from verl.parallel import megatron_state as ms

    pg, engine = _engine(path, trainable=True)
    try:
        out = {}
        if forward:
            out["logprobs"] = engine.forward(batch, micro_batch_size=2).outputs["logprobs"][:, -RESPONSE:]
        dp, rank = pg.dp.size(), pg.dp.rank()
        per = batch["input_ids"].shape[0] // dp
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        info = GlobalBatchInfo.from_masks([local["response_mask"].float()], group=pg.dp if dp > 1 else None)

        def loss_fn(outputs, mb):
            return LossShare(agg_loss(-outputs["logprobs"][:, -RESPONSE:], mb["response_mask"], "token-mean",
                                      global_batch_info=info))

        result = engine.train_step(local, micro_batch_size=2, loss_fn=loss_fn)
        out["loss"], out["norm"] = result.loss, result.grad_norm
        out["weights"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                          for n, p in engine.module.named_parameters()}
        return out
    finally:
        ms.destroy_model_parallel()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_qwen3_vl_generates_and_trains_on_fsdp2(tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from verl.config.schema import RolloutConfig
    from verl.data.rl_dataset import RLPromptDataset, collate_fn
    from verl.data.vlm import ImagePromptEncoder
    from verl.protocol import Batch
    from verl.protocol.images import model_image_inputs
    from verl.rollout.hf_engine import HFRollout
    from verl.testing.tiny_vlm import cached_tiny_vlm

    path = cached_tiny_vlm(family="qwen3_vl")
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3_vl" and config.vision_config.deepstack_visual_indexes == [0]

    def img(color, size):
        return {"bytes": _png(color, size), "path": None}

    rows = [
        {"prompt": "<image>Which colour?", "images": [img("red", (32, 32))]},
        {"prompt": "<image> or <image>?", "images": [img("green", (64, 32)), img("blue", (32, 32))]},
        {"prompt": "Bigger: <image>", "images": [img("yellow", (64, 32))]},
        {"prompt": "<image>Which colour?", "images": [img("blue", (64, 32))]},
    ]
    data = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{**r, "data_source": "colour"} for r in rows]), data)
    enc = ImagePromptEncoder.from_pretrained(path)
    ds = RLPromptDataset(data, enc.tokenizer, processor=enc, max_prompt_length=40)
    prompts = collate_fn([ds[i] for i in range(len(ds))])
    engine = HFRollout(RolloutConfig(name="hf", n=1, temperature=1.0, prompt_length=40, response_length=RESPONSE,
                                     seed=3, ignore_eos=True), path, device="cpu", micro_batch_size=4)
    out = engine.generate(Batch.from_dict({k: v for k, v in prompts.items() if torch.is_tensor(v)}))
    batch = {k: out[k] for k in ("input_ids", "attention_mask", "response_mask", "mm_pixel_values",
                                 "mm_image_grid_thw")}
    ids, mask = batch["input_ids"], batch["response_mask"].bool()
    # Patch 16, merge 2: a 32 x 32 image is a 2 x 2 grid (one image token), a 64 x 32 one 2 x 4 (two).
    grids = {tuple(g.tolist()) for g in batch["mm_image_grid_thw"].reshape(-1, 3) if g.any()}
    assert grids == {(1, 2, 2), (1, 2, 4)}
    assert (ids == config.image_token_id).sum() == 1 + 2 + 1 + 2 + 2

    # The expected log-probs: one plain transformers forward with the rows' images and mm_token_type_ids.
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"],
                       mm_token_type_ids=(ids == config.image_token_id).int(),
                       **model_image_inputs(batch)).logits[:, -RESPONSE - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, -RESPONSE:].unsqueeze(-1)).squeeze(-1)

    one = run_distributed(_logprobs_and_step, 1, path, batch, True)[0]
    # fp32, the same weights and positions; micro-batches of 2 rows are padded to other widths than the one
    # pass: rounding only (the Qwen2.5-VL test measured 4.8e-7). The rollout's cached decode likewise.
    torch.testing.assert_close(one["logprobs"][mask], expected[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["rollout_log_probs"][mask], expected[mask], atol=1e-5, rtol=0)

    # Two ranks, rank 1's rows text only: it runs the vision encoder (deepstack merger included) on a blank
    # image, so FSDP2's collectives pair up and the update is one process's on the same rows.
    text_only = {k: v.clone() for k, v in batch.items()}
    text_only["input_ids"][2:][text_only["input_ids"][2:] == config.image_token_id] = 100
    text_only["mm_image_grid_thw"][2:] = 0
    text_only["mm_pixel_values"][2:] = 0
    single = run_distributed(_logprobs_and_step, 1, path, text_only, False)[0]
    before = {n: p.detach() for n, p in model.named_parameters()}
    moved = [n for n in before if not torch.equal(single["weights"][n], before[n])]
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in moved)
    assert any(n.startswith("model.visual.blocks.") for n in moved) and "lm_head.weight" in moved
    for got in run_distributed(_logprobs_and_step, 2, path, text_only, False, timeout=300):
        # The halves' shares are summed in another order (per rank, then the reduce-scatter): fp32 rounding.
        assert abs(got["loss"] - single["loss"]) <= 1e-6 and abs(got["norm"] - single["norm"]) <= 1e-6 * single["norm"]
        for name, value in single["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0, msg=name)
