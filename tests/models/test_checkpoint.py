"""Distributed checkpoints: HF -> Megatron (TP2, PP2) -> HF bit-exact, resharding on load, errors."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.models.tiny import hf_outputs, make_tiny_model, padded_batch
from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

ATOL = 1e-5  # float32 on both sides, rounding only (see test_megatron_models.py)


def _hf_state(model_dir):
    state = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(model_dir, name)))
    return state


def _save_body(model_dir, ckpt_dir, tp, pp, pad_multiple, sp, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights, save_checkpoint
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(vocab_pad_multiple=pad_multiple, sequence_parallel=sp), pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    save_checkpoint(chunks, ckpt_dir, pg=pg, hf_dir=model_dir)
    if batch is None:
        return None
    return pg.tp.rank(), forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logits").outputs["logits"]


def _load_body(ckpt_dir, tp, pp, pad_multiple, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import iter_hf_pieces, iter_hf_weights, load_checkpoint, read_checkpoint_meta
    from verl.models.forward import forward_backward
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _, spec = read_checkpoint_meta(ckpt_dir)
    chunks = build_model_chunks(spec, ModelBuildConfig(vocab_pad_multiple=pad_multiple), pg)
    load_checkpoint(chunks, ckpt_dir, pg=pg)
    weights = {name: t.clone() for name, t in iter_hf_weights(chunks, pg=pg)}
    # The communication-free per-shard view must describe the same tensors.
    for piece, tensor in iter_hf_pieces(chunks, pg=pg):
        expected = weights[piece.name].narrow(piece.dim, piece.start, piece.stop - piece.start)
        assert torch.equal(tensor, expected), piece
    logits = None
    if batch is not None:
        logits = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logits").outputs["logits"]
    return pg.tp.rank(), weights, logits


def _full_logits(results, tp):
    shards = {}
    for tp_rank, *rest in results:
        shards[tp_rank] = rest[-1]
    return torch.cat([shards[i] for i in range(tp)], dim=-1)[..., :1001]


@pytest.fixture(scope="module")
def qwen_tied_ckpt(tmp_path_factory):
    """A tied-embedding Qwen2 written at TP2 x PP2 with sequence parallel (4 ranks), plus its logits."""
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = make_tiny_model(str(root / "hf"), "qwen2_tied", seed=3)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    batch = padded_batch(4, 12, seed=5)
    results = run_distributed(_save_body, 4, model_dir, str(root / "ckpt"), 2, 2, 128, True, batch)
    return model_dir, str(root / "ckpt"), batch, _full_logits(results, 2)


def test_tp2_pp2_sp_logits_match_transformers(qwen_tied_ckpt):
    model_dir, _, batch, actual = qwen_tied_ckpt
    expected = hf_outputs(model_dir, batch)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(actual[mask], expected[mask], rtol=0, atol=ATOL)


def test_round_trip_hf_megatron_hf_is_bit_exact(qwen_tied_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.models.convert import megatron_to_hf

    model_dir, ckpt_dir, _, _ = qwen_tied_ckpt
    report = megatron_to_hf(megatron_dir=ckpt_dir, out_dir=str(tmp_path / "back"), progress=False)
    expected, actual = _hf_state(model_dir), _hf_state(report.out_dir)
    assert set(actual) == set(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    assert os.path.isfile(tmp_path / "back" / "tokenizer_config.json")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".back.")]  # no temporary left behind
    reloaded = AutoModelForCausalLM.from_pretrained(report.out_dir)
    assert reloaded.config.tie_word_embeddings


def test_reshard_on_load_tp2_pp2_to_tp1_pp2(qwen_tied_ckpt):
    model_dir, ckpt_dir, batch, _ = qwen_tied_ckpt
    results = run_distributed(_load_body, 2, ckpt_dir, 1, 2, 128, batch)
    expected = _hf_state(model_dir)
    weights = {**results[0][1], **results[1][1]}  # stage 0 and stage 1 tensors
    assert set(weights) == set(expected)
    for name in expected:
        assert torch.equal(weights[name], expected[name]), name
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(results[1][2][..., :1001][mask], hf_outputs(model_dir, batch)[mask], rtol=0, atol=ATOL)


def test_written_tp2_pp1_loads_at_tp1_pp2_with_other_vocab_padding(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "hf"), "llama3", seed=4)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_body, 2, model_dir, ckpt, 2, 1, 1, False, None)  # vocab 1001 -> 1002 rows
    batch = padded_batch(4, 12, seed=6)
    results = run_distributed(_load_body, 2, ckpt, 1, 2, 128, batch)  # 1024 rows: the extra rows load as zeros
    mask = batch["attention_mask"].bool()
    expected = hf_outputs(model_dir, batch)
    for _, _, logits in results:
        assert logits.shape[-1] == 1024
        torch.testing.assert_close(logits[..., :1001][mask], expected[mask], rtol=0, atol=ATOL)


def _wrong_head_body(ckpt_dir):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_checkpoint, read_checkpoint_meta
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel()
    _, spec = read_checkpoint_meta(ckpt_dir)
    chunks = build_model_chunks(spec, ModelBuildConfig(head="value"), pg)
    try:
        load_checkpoint(chunks, ckpt_dir, pg=pg)
    except ValueError as exc:
        return str(exc)
    return None


def test_load_refuses_other_head_and_partial_checkpoints(qwen_tied_ckpt, tmp_path):
    from verl.models.checkpoint import read_checkpoint_meta

    _, ckpt_dir, _, _ = qwen_tied_ckpt
    (message,) = run_distributed(_wrong_head_body, 1, ckpt_dir)
    assert message is not None and "head='lm'" in message
    partial = tmp_path / "partial"
    shutil.copytree(ckpt_dir, partial)
    os.remove(partial / "metadata.json")
    with pytest.raises(ValueError, match="metadata.json is missing"):
        read_checkpoint_meta(str(partial))
    with pytest.raises(ValueError, match="no such directory"):
        read_checkpoint_meta(str(tmp_path / "nowhere"))


def _non_finite_body(bad_hf_dir, good_hf_dir, ckpt_dir):
    import torch.distributed as dist

    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_checkpoint, load_hf_weights, save_checkpoint
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=2)
    spec = parse_hf_config(good_hf_dir)
    messages = {}
    chunks = build_model_chunks(spec, ModelBuildConfig(), pg)
    try:
        load_hf_weights(chunks, bad_hf_dir, pg=pg)
    except ValueError as exc:
        messages["hf"] = str(exc)
    # A NaN that reaches a distributed checkpoint (saved from a diverged run) on TP rank 1 only.
    load_hf_weights(chunks, good_hf_dir, pg=pg)
    if dist.get_rank() == 1:
        with torch.no_grad():
            dict(chunks[0].named_parameters())["decoder.layers.0.mlp.linear_fc2.weight"][0, 0] = float("nan")
    save_checkpoint(chunks, ckpt_dir, pg=pg)
    fresh = build_model_chunks(spec, ModelBuildConfig(), pg)
    try:
        load_checkpoint(fresh, ckpt_dir, pg=pg)
    except ValueError as exc:
        messages["megatron"] = str(exc)
    return messages


def test_non_finite_weights_are_refused_on_every_rank(tmp_path):
    from safetensors.torch import save_file

    good = make_tiny_model(str(tmp_path / "good"), "qwen2_untied")
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    state = _hf_state(bad)
    # down_proj is row-parallel (split along its input columns): the last column is read by TP
    # rank 1 only, yet every rank must refuse (no rank may go on to the next collective alone).
    state["model.layers.1.mlp.down_proj.weight"][3, -1] = float("inf")
    save_file(state, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    results = run_distributed(_non_finite_body, 2, bad, good, str(tmp_path / "ckpt"))
    assert results[0] == results[1]
    assert re.search(r"bad: non-finite weights \(NaN or inf\) in 'model\.layers\.1\.mlp\.down_proj\.weight' "
                     r"\(.*bad/model\.safetensors\)", results[0]["hf"]), results[0]
    assert re.search(
        r"ckpt: non-finite weights \(NaN or inf\) in 'decoder\.layers\.0\.mlp\.linear_fc2\.weight'",
        results[0]["megatron"],
    ), results[0]
