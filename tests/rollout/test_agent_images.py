"""Images in the agent loop (verl.rollout.agent.images): a tool answers with an image, the tiny Qwen2.5-VL on the
transformers engine generates the next turn with it, and the trained row holds it token-exactly: the same ids,
the same images in the same order, the same log-probs."""

from __future__ import annotations

import io

import pytest
import torch

from verl.config.schema import RolloutConfig, RolloutMultiTurnConfig
from verl.protocol import Batch
from verl.protocol.images import model_image_inputs, pad_row_images
from verl.rollout.agent import AgentLoop, ToolResponse
from verl.rollout.base import Sample, SamplingSpec, left_pad
from verl.tools import FunctionTool

CALL = '<tool_call>{{"name": "look", "arguments": {{"which": "{which}"}}}}</tool_call>'
RESPONSE = 200  # room for the error turns (up to ~100 tokens of the tiny tokenizer) after a 58-token call
SIDE = 28  # one 2x2 grid of 14-pixel patches: 4 patches, one merged <|image_pad|>


def _png(colour: str, width: int = SIDE, height: int = SIDE) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def look(which: str) -> ToolResponse:
    """Look at a picture."""
    from PIL import Image

    if which == "good":  # a PIL image, with text after it
        return ToolResponse(text="a picture", image=[Image.new("RGB", (SIDE, SIDE), "blue")])
    if which == "broken":
        return ToolResponse(text="", image=[b"not an image at all"])
    return ToolResponse(text="big", image=[_png("green", 200, 200)])  # 40,000 pixels over the tiny budget of 112 x 112


@pytest.fixture(scope="module")
def vlm():
    from verl.data.vlm import ImagePromptEncoder
    from verl.rollout.hf_engine import HFRollout
    from verl.testing.tiny_vlm import cached_tiny_vlm

    path = cached_tiny_vlm()
    enc = ImagePromptEncoder.from_pretrained(path)
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, prompt_length=64, response_length=RESPONSE, seed=5)
    return path, enc, HFRollout(cfg, path, tokenizer=enc.tokenizer, device="cpu")


def _prompts(enc):
    """Two prompts: one with a red image, one text only; left-padded with their mm_* columns."""
    from PIL import Image

    tok = enc.tokenizer
    texts, images = ["<image>What colour is it?", "Look at the picture."], [[Image.new("RGB", (SIDE, SIDE), "red")], []]
    ids, pixels = [], []
    for text, imgs in zip(texts, images):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        pv, grid = enc.pixels(imgs) if imgs else (None, None)
        patches = [int(g.prod()) for g in grid] if imgs else []
        ids.append(tok.encode(enc.expand(rendered, patches, where="test"), add_special_tokens=False))
        pixels.append((pv, grid))
    width = max(map(len, ids))
    input_ids, mask = left_pad(ids, width, tok.pad_token_id)
    dim = pixels[0][0].shape[1]
    cols = [pad_row_images(pv, g, patches=4, images=1, dim=dim) for pv, g in pixels]
    batch = {"input_ids": input_ids, "attention_mask": mask, **{k: torch.stack([c[k] for c in cols]) for k in cols[0]}}
    return Batch.from_dict(batch), width


def _trainer_logprobs(model, out, pixel_values=None, grid=None):
    """Log-probs of the response under a plain transformers forward with the rows' mm inputs (the trainer's)."""
    ids, attention = out["input_ids"], out["attention_mask"]
    images = model_image_inputs({k: out[k] for k in ("mm_pixel_values", "mm_image_grid_thw")})
    if pixel_values is not None:
        images = {"pixel_values": pixel_values, "image_grid_thw": grid}
    with torch.no_grad():
        image_tokens = (ids == model.config.image_token_id).int()
        logits = model(input_ids=ids, attention_mask=attention, mm_token_type_ids=image_tokens,
                       **images).logits[:, -RESPONSE - 1 : -1].float()  # [B, R, V]
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)  # [B, R]


@pytest.fixture(scope="module")
def conversation(vlm):
    """Four conversations (2 prompts x n=2) whose first turn calls ``look``: a good image, a broken one, a huge one;
    the second turn is sampled by the engine. (the rollout batch, the forced first turns, each engine call's
    contexts and images, the loop's metrics, the prompt width)"""
    path, enc, engine = vlm
    tok = enc.tokenizer
    batch, width = _prompts(enc)
    kinds = ["good", "good", "broken", "huge"]  # the rows' first-turn calls (prompt-major, n=2)
    forced = [tok.encode(CALL.format(which=k), add_special_tokens=False) + [tok.eos_token_id] for k in kinds]
    real_sample, seen = engine._sample, []

    def first_turn_forced(prompts, spec):  # the random model never writes a call itself
        seen.append(([list(p) for p in prompts], engine._prompt_images))
        if len(seen) == 1:
            return [Sample(token_ids=f, logprobs=[0.0] * len(f), hit_length_limit=False) for f in forced]
        return real_sample(prompts, spec)

    engine._sample = first_turn_forced
    try:
        loop = AgentLoop(RolloutMultiTurnConfig(enable=True, format="hermes", max_assistant_turns=2), [FunctionTool(look)],
                         tok, response_length=RESPONSE)
        out = loop.generate(engine, batch, seed=3)
    finally:
        engine._sample = real_sample
    return out, forced, seen, loop.last_metrics, width


def _sampled(out, forced) -> torch.Tensor:
    """[B, R] the engine's sampled tokens (the forced first turns have no engine log-probs)."""
    sampled = out["response_mask"].bool().clone()
    for i, f in enumerate(forced):
        sampled[i, : len(f)] = False
    return sampled


def test_tool_image_is_generated_with_and_trained_token_exactly(vlm, conversation):
    path, enc, _ = vlm
    tok = enc.tokenizer
    out, forced, seen, metrics, width = conversation
    assert len(out) == 4 and len(seen) == 2

    # The tool turns: the good answer's image span is its grid's merged patches (2 x 2 patches / 4 = 1 image
    # token), the bad images are error turns naming the cause.
    turns = [[x for x in t if x["role"] == "tool"] for t in out["agent_turns"]]
    assert all(len(t) == 1 for t in turns)
    tool_text = [tok.decode(out["responses"][i, t[0]["start"] : t[0]["end"]]) for i, t in enumerate(turns)]
    pad = enc.image_token
    good = f"\n<|im_start|>tool\n<|vision_start|>{pad}<|vision_end|>a picture<|im_end|>\n<|im_start|>assistant\n"
    assert tool_text[0] == tool_text[1] == good
    assert "Error: tool 'look', image 0: unreadable image" in tool_text[2] and pad not in tool_text[2]
    assert "200x200 = 40000 pixels, over the image processor's budget of 12544" in tool_text[3] and pad not in tool_text[3]
    assert metrics["agent/tool_errors/look"] == 2.0

    # (a) Token-exact: the context the engine generated turn 2 from is the trained row's ids up to that turn,
    # and the images it generated with are the trained row's images (prompt image first, then the tool's).
    contexts, images = seen[1]
    ids = out["input_ids"]
    for i, context in enumerate(contexts):
        turn2 = [x for x in out["agent_turns"][i] if x["role"] == "assistant"][1]["start"]
        row = ids[i][out["attention_mask"][i].bool()].tolist()
        assert context == row[: len(row) - int(out["attention_mask"][i, width:].sum()) + turn2]
    assert out["mm_image_grid_thw"].tolist() == [[[1, 2, 2], [1, 2, 2]]] * 2 + [[[0, 0, 0], [0, 0, 0]]] * 2
    torch.testing.assert_close(images["mm_pixel_values"], out["mm_pixel_values"], atol=0, rtol=0)
    torch.testing.assert_close(images["mm_image_grid_thw"], out["mm_image_grid_thw"], atol=0, rtol=0)

    # (b) The trainer's log-probs of every sampled token of turn 2 equal the engine's.
    sampled = _sampled(out, forced)
    assert sampled[:2].sum() > 0
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    expected = _trainer_logprobs(model, out)
    # The engine's cached decode and one full pass sum in another order: fp32 rounding, as for the VLM's single turn.
    torch.testing.assert_close(out["rollout_log_probs"][sampled], expected[sampled], atol=1e-5, rtol=0)

    # The same check fails when the tool's image is dropped (its pixels blank) or the images are swapped in order.
    both = model_image_inputs({k: out[k] for k in ("mm_pixel_values", "mm_image_grid_thw")})
    pv, grid = both["pixel_values"], both["image_grid_thw"]  # [16, D]: rows 0 and 1, 4 patches per image; [4, 3]
    blank = pv.clone()
    blank[4:8] = 0  # row 0's tool image (after its prompt image's 4 patches)
    dropped = _trainer_logprobs(model, out, blank, grid)
    assert (dropped[0][sampled[0]] - out["rollout_log_probs"][0][sampled[0]]).abs().max() > 1e-3
    swapped = torch.cat([pv[4:8], pv[:4], pv[8:]])  # row 0's images in the wrong order (same grids)
    wrong = _trainer_logprobs(model, out, swapped, grid)
    assert (wrong[0][sampled[0]] - out["rollout_log_probs"][0][sampled[0]]).abs().max() > 1e-3


class _TextEngine:
    """A text policy's engine stand-in: one forced tool call, token ids only."""

    pad_token_id = 0

    def __init__(self, call: list[int]) -> None:
        self.call = call

    def sample(self, prompts, spec, *, seed=None):
        return [Sample(token_ids=self.call, logprobs=[0.0] * len(self.call), hit_length_limit=False) for _ in prompts]


def test_tool_image_for_a_text_policy_is_refused(vlm):
    _, enc, _ = vlm
    tok = enc.tokenizer
    call = tok.encode(CALL.format(which="good"), add_special_tokens=False) + [tok.eos_token_id]
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True, format="hermes"), [FunctionTool(look)], tok,
                     response_length=RESPONSE)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="tool 'look' answered with 1 image"):
        loop.run(_TextEngine(call), [prompt], SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8))


def test_tool_text_spelling_a_vision_token_is_an_error_turn(vlm):
    """A VLM's tool text holding ``<|image_pad|>`` would be an image slot without an image in the trained row."""
    from verl.rollout.agent.images import ToolImages
    from verl.rollout.agent.trajectory import CallRecord

    _, enc, _ = vlm
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True, format="hermes"), [FunctionTool(look)], enc.tokenizer,
                     response_length=RESPONSE)
    loop._vision = ToolImages(enc)  # as run() sets it for a VLM engine
    records = [CallRecord(name="look", error=False) for _ in range(3)]
    answers = [f"see {enc.image_token}", ToolResponse(text="<|vision_start|>", image=[_png("red")]), "plain"]
    messages, images = loop._tool_messages(list(zip(answers, records)))
    assert [r.error for r in records] == [True, True, False] and images == []
    assert "holds the vision token text ['<|image_pad|>']" in messages[0]["content"]
    assert messages[2] == {"role": "tool", "content": "plain"}


def _fsdp_logprobs(path: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The FSDP2 engine's log-probs of the response columns (one rank)."""
    from transformers import AutoModelForImageTextToText

    from verl.config.schema import FSDPConfig
    from verl.engine.fsdp import FSDPEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    try:
        module = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        engine = FSDPEngine(module, pg=pg, fsdp=FSDPConfig(), optim=None, total_training_steps=1, hf_dir=path,
                            name="actor")
        return engine.forward(batch, micro_batch_size=2).outputs["logprobs"][:, -RESPONSE:]
    finally:
        ms.destroy_model_parallel()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_fsdp2_trainer_reads_the_tool_images(vlm, conversation):
    """The trainer's own forward (FSDP2 engine, ImageFeed from the batch's mm_* columns) on the agent rows."""
    from verl.testing.distributed import run_distributed

    path = vlm[0]
    out, forced = conversation[:2]
    keys = ("input_ids", "attention_mask", "response_mask", "mm_pixel_values", "mm_image_grid_thw")
    batch = {k: out[k] for k in keys}
    actual = run_distributed(_fsdp_logprobs, 1, path, batch)[0]
    sampled = _sampled(out, forced)
    # fp32; the engine's cached decode and one full pass sum in another order.
    torch.testing.assert_close(actual[sampled], out["rollout_log_probs"][sampled], atol=1e-5, rtol=0)


def _gather_rollouts(rows: int, patches: int, images: int) -> dict[str, list]:
    """Rank r's agent rollout with ``patches``/``images`` image widths (0: no image columns), aligned and gathered."""
    import torch.distributed as dist

    from verl.protocol.collectives import all_gather
    from verl.rollout.agent.images import align_image_columns

    cols = {"input_ids": torch.zeros(rows, 3, dtype=torch.long)}
    if images:
        cols["mm_pixel_values"] = torch.full((rows, patches, 2), float(dist.get_rank() + 1))
        cols["mm_image_grid_thw"] = torch.ones(rows, images, 3, dtype=torch.long)
    whole = all_gather(align_image_columns(Batch.from_dict(cols), None), None)
    return {k: list(whole[k].shape) for k in ("mm_pixel_values", "mm_image_grid_thw")}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_with_other_tool_images_gather_one_rollout():
    """Each rank's image widths follow its own conversations (here: 4 patches / 1 image, none): padded to the
    widest, the ranks' rollouts gather into one batch."""
    from verl.testing.distributed import run_distributed

    out = run_distributed(_gather_by_rank, 2)
    assert out == [{"mm_pixel_values": [3, 4, 2], "mm_image_grid_thw": [3, 1, 3]}] * 2


def _gather_by_rank() -> dict[str, list]:
    import torch.distributed as dist

    return _gather_rollouts(2, 4, 1) if dist.get_rank() == 0 else _gather_rollouts(1, 0, 0)
