"""Packed sequences (``use_remove_padding``): Megatron's THD layout on the local spec equals the padded path.

Each micro-batch's rows are packed into one row of their real tokens (``verl.models.packing``) and
run with ``PackedSeqParams(qkv_format="thd")``: Megatron restarts the rotary positions at each
boundary, verl's ``VarlenDotProductAttention`` keeps each sequence to itself. The checks:

- the layout itself (which token goes where, the boundaries, the padding segment, empty rows);
- per-token log-probabilities, entropy (at temperature 0.7), logits and values of the packed
  path against transformers and against the padded path, on rollout-shaped batches (prompts
  left-padded, responses right-padded, one row empty), for every family feature: llama3 rope
  scaling, grouped-query attention, Mistral's sliding window shorter than the rows, Qwen2 biases;
  at TP 1, TP 2 with sequence parallel (widths a multiple of 8 and 2) and PP 2 (every micro-batch
  at the common width), DP 2;
- ``head_columns`` on the packed path gives exactly the response columns of a full pass;
- gradients of a loss through the packed path equal the padded path's (TP 1 and TP 2 + SP).

Tolerances (float32): against transformers 1e-5 absolute on per-token outputs, as
``test_megatron_models`` (another implementation). Packed against padded is the same model on other
shapes: 2e-6 on per-token outputs (measured at most 4.8e-7 on log-probabilities and entropy, 3.7e-8 on
values), the step's loss to relative 1e-6 (measured equal), gradients relative 1e-4 / absolute 1e-7
(measured at most 2.6e-8 absolute); the response columns alone are exact. A wrong boundary (a
token seeing the previous row) or a rotary position not restarted is off by > 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import hf_outputs, make_tiny_model, reference_logprobs_entropy
from verl.testing.distributed import run_distributed

ATOL = 1e-5  # against transformers
SAME_MATH = 2e-6  # packed against padded: the same model on other shapes
TEMPERATURE = 0.7
PROMPT, RESPONSE = 9, 8


def rollout_batch(rows: int = 6, *, seed: int = 5) -> dict[str, torch.Tensor]:
    """Prompts left-padded in PROMPT columns, responses right-padded in RESPONSE; row 3 empty."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1001, (rows, PROMPT + RESPONSE), generator=gen)
    mask = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    prompts, responses = [9, 3, 6, 0, 2, 7, 5, 4], [8, 2, 5, 0, 8, 1, 3, 6]
    for row in range(rows):
        mask[row, PROMPT - prompts[row] : PROMPT + responses[row]] = 1
    return {"input_ids": ids * mask, "attention_mask": mask}


# ----------------------------------------------------------------------------------------------
# the layout


def test_rows_packed_in_order_with_boundaries_and_padding_segments():
    from verl.models.packing import pack_like, pack_micro_batch, unpack_to_rows

    batch = rollout_batch(4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = mask.sum(-1).tolist()  # [17, 5, 11, 0]
    packed = pack_micro_batch(ids, mask, 40)
    n = sum(lengths)
    expected = torch.cat([ids[r][mask[r].bool()] for r in range(4)])
    assert torch.equal(packed.input_ids[0, :n], expected)
    assert not packed.input_ids[0, n:].any()  # padding id 0 after the real tokens
    # the empty row takes no segment; the padding is one segment of its own
    assert packed.cu_seqlens.tolist() == [0, 17, 22, 33, 40] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 17
    assert packed.position_ids[0, :n].tolist() == list(range(17)) + list(range(5)) + list(range(11))
    assert packed.starts.nonzero().squeeze(-1).tolist() == [0, 17, 22]
    assert packed.token_segment.tolist() == [0] * 17 + [1] * 5 + [2] * 11 + [3] * 7
    # back to the rows: every real token where it was, zeros at the pads; and the other way round
    assert torch.equal(
        unpack_to_rows(packed.input_ids.unsqueeze(-1).float(), packed.real, 4, 17)[..., 0], ids.float()
    )
    assert torch.equal(pack_like(mask * 7, packed.real, 40)[0], torch.tensor([7] * n + [0] * (40 - n)))
    # exactly full: no padding segment
    assert pack_micro_batch(ids, mask, n).cu_seqlens.tolist() == [0, 17, 22, 33]
    # padding longer than the longest row (a pipeline's common width): segments of at most that length
    wide = pack_micro_batch(ids[1:2], mask[1:2], 16, [5])
    assert wide.cu_seqlens.tolist() == [0, 5, 10, 15, 16] and wide.max_seqlen == 5
    assert wide.starts.nonzero().squeeze(-1).tolist() == [0]
    # the host's lengths, given, build the same layout as the mask read here
    given = pack_micro_batch(ids, mask, 40, lengths)
    for field in ("input_ids", "real", "starts", "cu_seqlens"):
        assert torch.equal(getattr(given, field), getattr(packed, field)), field
    # no real token: padding only
    assert pack_micro_batch(ids[3:4], mask[3:4], 8).cu_seqlens.tolist() == [0, 8]
    with pytest.raises(ValueError, match="33 real tokens do not fit a packed width of 32"):
        pack_micro_batch(ids, mask, 32)


def test_unpacking_is_differentiable():
    from verl.models.packing import pack_micro_batch, unpack_to_rows

    batch = rollout_batch(3)
    packed = pack_micro_batch(batch["input_ids"], batch["attention_mask"], 40)
    x = torch.randn(1, 40, requires_grad=True)
    unpack_to_rows(x, packed.real, 3, PROMPT + RESPONSE).sum().backward()
    n = int(batch["attention_mask"].sum())
    assert x.grad[0, :n].eq(1).all() and not x.grad[0, n:].any()  # the padding gets no gradient


def test_packed_widths_round_up_and_share_one_width_under_pipelining():
    from verl.models.forward import packed_widths
    from verl.models.micro_batches import fixed_split

    lengths = rollout_batch(6)["attention_mask"].sum(-1).tolist()  # rows of 17, 5, 11, 0, 10, 8 tokens
    split = fixed_split(6, 2)
    assert packed_widths(lengths, split, 8, common=False) == [24, 16, 24]  # 22, 11, 18 rounded up to 8
    assert packed_widths(lengths, split, 8, common=True) == [24, 24, 24]
    assert packed_widths(lengths, fixed_split(6, 6), 8, common=False) == [56]  # 51 tokens


# ----------------------------------------------------------------------------------------------
# the model: packed against transformers and against the padded path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_models")
    dirs = {
        family: make_tiny_model(str(root / family), family)
        for family in ("llama3", "llama_gqa", "qwen2_untied", "mistral")
    }
    dirs["qwen2_scores"] = make_tiny_model(
        str(root / "qwen2_scores"), "qwen2_untied", sequence_classification=True
    )
    return dirs


def _outputs_body(model_dir, tp, pp, sp, head, batches):
    import torch.distributed as dist

    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_model_chunks(
        parse_hf_config(model_dir),
        ModelBuildConfig(sequence_parallel=sp, vocab_pad_multiple=1, head=head),
        pg,
    )
    load_hf_weights(chunks, model_dir, pg=pg)
    batch = batches[pg.dp.rank()]
    out = {"rank": dist.get_rank(), "tp_rank": pg.tp.rank(), "dp_rank": pg.dp.rank()}
    for packed in (True, False):
        run = {"pg": pg, "micro_batch_size": 3, "pack_sequences": packed}
        if head == "lm":
            hot = forward_backward(chunks, batch, output="logprobs", temperature=TEMPERATURE, **run).outputs
            only = forward_backward(chunks, batch, output="logprobs", head_columns=RESPONSE, **run).outputs
            logits = forward_backward(chunks, batch, output="logits", **run).outputs["logits"]
            out[packed] = {
                **forward_backward(chunks, batch, output="logprobs", **run).outputs,
                **{f"{k}_hot": v for k, v in hot.items()},
                "head_columns": only["logprobs"],
                "logits": logits,
            }
        else:
            out[packed] = forward_backward(chunks, batch, output="values", **run).outputs
    return out


LM_CASES = [
    # family, tp, pp, sp, world
    pytest.param("llama3", 1, 1, False, 1, id="llama3-rope-scaling"),
    pytest.param("mistral", 1, 1, False, 1, id="mistral-window"),
    pytest.param("llama3", 2, 1, True, 2, id="llama3-tp2-sp"),
    pytest.param("llama_gqa", 1, 2, False, 2, id="llama-gqa-pp2"),
    pytest.param("qwen2_untied", 1, 1, False, 2, id="qwen2-dp2"),
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, tp, pp, sp, world", LM_CASES)
def test_packed_logprobs_match_transformers_and_the_padded_path(models, family, tp, pp, sp, world):
    model_dir = models[family]
    dp = world // (tp * pp)
    batches = [rollout_batch(6, seed=5 + i) for i in range(dp)]
    results = run_distributed(_outputs_body, world, model_dir, tp, pp, sp, "lm", batches)
    for r in results:
        batch = batches[r["dp_rank"]]
        mask = batch["attention_mask"]
        expected_logits = hf_outputs(model_dir, batch)
        expected_lp, expected_ent = reference_logprobs_entropy(expected_logits, batch["input_ids"], mask)
        hot_lp, hot_ent = reference_logprobs_entropy(expected_logits / TEMPERATURE, batch["input_ids"], mask)
        packed, padded = r[True], r[False]
        torch.testing.assert_close(packed["logprobs"], expected_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(packed["entropy"], expected_ent, rtol=0, atol=ATOL)
        torch.testing.assert_close(packed["logprobs_hot"], hot_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(packed["entropy_hot"], hot_ent, rtol=0, atol=ATOL)
        for key in ("logprobs", "entropy", "logprobs_hot"):
            torch.testing.assert_close(packed[key], padded[key], rtol=0, atol=SAME_MATH, msg=key)
        # every row's first real token is predicted by nothing (0), as on the padded path
        first = (mask.cumsum(-1) == 1) & mask.bool()
        assert not packed["logprobs"][first].any() and not packed["logprobs"][~mask.bool()].any()
        # the response columns alone: exactly the same numbers (the same per-token reductions), the prompts' 0
        assert torch.equal(packed["head_columns"][:, -RESPONSE:], packed["logprobs"][:, -RESPONSE:])
        assert not packed["head_columns"][:, :-RESPONSE].any()
        if tp == 1:
            real = mask.bool()
            torch.testing.assert_close(packed["logits"][real], expected_logits[real], rtol=0, atol=ATOL)
            assert not packed["logits"][~real].any()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_packed_values_match_the_padded_path_and_transformers(models):
    batch = rollout_batch(6)
    (r,) = run_distributed(_outputs_body, 1, models["qwen2_scores"], 1, 1, False, "value", [batch])
    scores = hf_outputs(models["qwen2_scores"], batch, sequence_classification=True)[..., 0]  # [B, T]
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(r[True]["values"][mask], scores[mask], rtol=0, atol=ATOL)
    torch.testing.assert_close(r[True]["values"], r[False]["values"], rtol=0, atol=SAME_MATH)
    assert not r[True]["values"][~mask].any()


def _grads_body(model_dir, tp, sp, batch):
    import torch.distributed as dist

    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import LossShare, forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(sequence_parallel=sp), pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    mask = batch["attention_mask"].float()
    out = {}
    for packed in (True, False):
        for p in chunks[0].parameters():
            p.grad = None

        def loss_fn(outputs, micro):
            m = micro["attention_mask"].float()
            loss = -(outputs["logprobs"] * m).sum() + 0.1 * (outputs["entropy"] * m).sum()
            return LossShare(loss / mask.sum())

        result = forward_backward(
            chunks,
            batch,
            pg=pg,
            micro_batch_size=3,
            output="logprobs",
            loss_fn=loss_fn,
            pack_sequences=packed,
        )
        grads = {}
        for name, p in chunks[0].named_parameters():
            g = p.grad.detach().clone()
            if getattr(p, "sequence_parallel", False) and tp > 1:
                dist.all_reduce(g, group=pg.tp)  # each rank holds its sequence shard's part
            grads[name] = g
        out[packed] = {"grads": grads, "loss": sum(float(x) for x in result.losses)}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)], ids=["tp1", "tp2-sp"])
def test_packed_gradients_equal_the_padded_path(models, tp, sp):
    for r in run_distributed(_grads_body, tp, models["llama3"], tp, sp, rollout_batch(6)):
        packed, padded = r[True], r[False]
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-6)
        assert packed["grads"].keys() == padded["grads"].keys() and packed["grads"]
        for name, g in padded["grads"].items():
            assert g.abs().sum() > 0, name  # every weight takes part
            torch.testing.assert_close(
                packed["grads"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_segments_padded_for_context_parallelism():
    """``segment_multiple`` (2 x CP): each row's segment padded at its end; the real tokens at ``slots``."""
    from verl.models.packing import pack_like, pack_micro_batch, unpack_to_rows

    batch = rollout_batch(4)
    ids, mask = batch["input_ids"], batch["attention_mask"]  # rows of 17, 5, 11, 0 tokens
    packed = pack_micro_batch(ids, mask, 40, segment_multiple=4)
    assert packed.cu_seqlens.tolist() == [0, 20, 28, 40]  # 17 -> 20, 5 -> 8, 11 -> 12
    assert packed.slots.tolist() == list(range(17)) + list(range(20, 25)) + list(range(28, 39))
    assert packed.starts.nonzero().squeeze(-1).tolist() == [0, 20, 28]
    assert not packed.input_ids[0, 17:20].any() and not packed.input_ids[0, 25:28].any()
    assert torch.equal(unpack_to_rows(packed.input_ids.unsqueeze(-1), packed.real, 4, 17, packed.slots)[..., 0], ids)
    assert torch.equal(pack_like(ids, packed.real, 40, packed.slots), packed.input_ids)
    with pytest.raises(ValueError, match=r"33 real tokens \(40 in segments of a multiple of 4\) do not fit a packed width of 36"):
        pack_micro_batch(ids, mask, 36, segment_multiple=4)
