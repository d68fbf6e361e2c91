"""The transformers rollout engine with a vision-language model: it never samples an image token (the trainer's
forward would read one in a response as an image slot without an image), and its log-probs stay the policy's over
the whole vocabulary, as the trainer computes them."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

RESPONSE = 16


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"), TinyVLMSpec(corpus_lines=500))


def _png(colour: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_no_image_token_is_sampled_and_logprobs_are_the_trainers(vlm_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from verl.config.schema import RolloutConfig
    from verl.data.rl_dataset import RLPromptDataset, collate_fn
    from verl.data.vlm import ImagePromptEncoder
    from verl.protocol import Batch
    from verl.protocol.images import model_image_inputs
    from verl.rollout.hf_engine import HFRollout

    rows = [{"prompt": f"<image>Which colour? {i}", "images": [{"bytes": _png(c), "path": None}], "data_source": "x"}
            for i, c in enumerate(["red", "blue", "green", "yellow"] * 8)]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    enc = ImagePromptEncoder.from_pretrained(vlm_dir)
    ds = RLPromptDataset(path, enc.tokenizer, processor=enc, max_prompt_length=32)
    prompts = collate_fn([ds[i] for i in range(len(ds))])
    batch = Batch.from_dict({k: v for k, v in prompts.items() if torch.is_tensor(v)})
    engine = HFRollout(RolloutConfig(name="hf", n=4, temperature=1.0, prompt_length=32, response_length=RESPONSE,
                                     seed=5, ignore_eos=True), vlm_dir, device="cpu", micro_batch_size=128)
    out = engine.generate(batch)
    config = AutoConfig.from_pretrained(vlm_dir)
    responses = out["input_ids"][:, -RESPONSE:]
    mask = out["response_mask"].bool()
    # 128 rows x 16 tokens of a random model: ~4.5 image/video tokens were expected among them (2 of 905 ids;
    # measured without the engine's rule: 2).
    assert mask.sum() == 128 * RESPONSE
    assert not bool(torch.isin(responses, torch.tensor([config.image_token_id, config.video_token_id])).any())

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    ids, attention = out["input_ids"], out["attention_mask"]
    images = model_image_inputs({k: out[k] for k in ("mm_pixel_values", "mm_image_grid_thw")})
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, mm_token_type_ids=(ids == config.image_token_id).int(),
                       **images).logits[:, -RESPONSE - 1 : -1].float()  # [B, R, V]
    expected = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)[mask]
    actual = out["rollout_log_probs"][mask]
    # The engine's cached decode and one full pass sum in another order: fp32 rounding (1e-5, as for text). Had the
    # removed image tokens' mass been left out of the normaliser, every log-prob would move by ~log(1 - 2/905) = -2.2e-3.
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
