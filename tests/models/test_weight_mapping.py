"""The HF <-> Megatron weight layout, as pure tensor functions (no Megatron, no processes).

Expected layouts are built independently of the mapping code: q/k/v interleaved group by group
with a Python loop, Megatron's column-parallel TP split as a plain contiguous chunk of the
TP=1 layout, gate/up as per-rank [gate_r; up_r], the vocabulary zero-padded then chunked.
"""

from __future__ import annotations

import pytest
import torch

from verl.models.hf_config import parse_hf_config
from verl.models.weight_mapping import (
    assemble_shard,
    hf_param_names,
    megatron_param_names,
    merge_pieces,
    padded_vocab_size,
    param_mapping,
    read_piece,
    split_shard,
)


def _spec(**overrides):
    cfg = dict(
        model_type="qwen2",
        vocab_size=1001,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=4,
    )
    cfg.update(overrides)
    return parse_hf_config(cfg)


def _random_hf_state(spec):
    gen = torch.Generator().manual_seed(0)
    h, d = spec.hidden_size, spec.head_dim
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (spec.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, spec.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
            p + "mlp.up_proj.weight": (spec.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate_size),
        })
        if spec.qkv_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (spec.num_attention_heads * d,),
                p + "self_attn.k_proj.bias": (spec.num_kv_heads * d,),
                p + "self_attn.v_proj.bias": (spec.num_kv_heads * d,),
            })
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _load(state, name, spec, tp_rank, tp_size, padded):
    mapping = param_mapping(name, spec, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=padded)
    return mapping, assemble_shard(mapping, [read_piece(state[p.name], p) for p in mapping.pieces])


def test_padded_vocab_size():
    assert padded_vocab_size(1001, 2, 1) == 1002
    assert padded_vocab_size(1001, 2, 128) == 1024
    assert padded_vocab_size(1024, 4, 128) == 1024
    assert padded_vocab_size(128256, 8, 128) == 129024


def test_qkv_interleaving_per_gqa_group():
    spec = _spec()
    state = _random_hf_state(spec)
    d, rep = spec.head_dim, spec.q_per_group
    for suffix in ("weight", "bias"):
        q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.{suffix}"] for n in "qkv")
        expected = torch.cat(
            [torch.cat([q[g * rep * d : (g + 1) * rep * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
             for g in range(spec.num_kv_heads)]
        )
        _, full = _load(state, f"decoder.layers.1.self_attention.linear_qkv.{suffix}", spec, 0, 1, 1024)
        assert torch.equal(full, expected)
        for tp in (2, 4):  # column parallel: contiguous split of the TP=1 layout (whole groups per rank)
            for rank in range(tp):
                _, shard = _load(state, f"decoder.layers.1.self_attention.linear_qkv.{suffix}", spec, rank, tp, 1024)
                assert torch.equal(shard, expected.chunk(tp)[rank])


def test_gate_up_fusion_is_per_rank():
    spec = _spec()
    state = _random_hf_state(spec)
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    for tp in (1, 2, 4):
        for rank in range(tp):
            _, shard = _load(state, "decoder.layers.0.mlp.linear_fc1.weight", spec, rank, tp, 1024)
            assert torch.equal(shard, torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]))


def test_row_parallel_and_vocab_padding():
    spec = _spec()
    state = _random_hf_state(spec)
    down = state["model.layers.2.mlp.down_proj.weight"]
    for rank in range(2):
        _, shard = _load(state, "decoder.layers.2.mlp.linear_fc2.weight", spec, rank, 2, 1002)
        assert torch.equal(shard, down.chunk(2, dim=1)[rank])
    emb = state["model.embed_tokens.weight"]
    padded = torch.cat([emb, torch.zeros(1024 - 1001, spec.hidden_size)])
    for tp in (1, 2, 4):
        for rank in range(tp):
            _, shard = _load(state, "embedding.word_embeddings.weight", spec, rank, tp, 1024)
            assert torch.equal(shard, padded.chunk(tp)[rank])


@pytest.mark.parametrize("tp, tied, head", [(1, False, "lm"), (2, True, "lm"), (4, False, "lm"), (2, False, "value")])
def test_round_trip_through_every_rank_is_bit_exact(tp, tied, head):
    spec = _spec(tie_word_embeddings=tied)
    state = _random_hf_state(spec)
    if head != "lm":
        state["score.weight"] = torch.randn(1, spec.hidden_size)
    padded = padded_vocab_size(spec.vocab_size, tp, 1)
    # PP=2 with layer offsets: stage 0 holds layers 0-1 and the embedding, stage 1 layer 2 and the head.
    stages = [
        (megatron_param_names(spec, num_layers=2, pre_process=True, post_process=False, head=head), 0),
        (megatron_param_names(spec, num_layers=1, pre_process=False, post_process=True, head=head), 2),
    ]
    pieces = []
    for names, offset in stages:
        for name in names:
            per_rank = []
            for rank in range(tp):
                mapping = param_mapping(name, spec, tp_rank=rank, tp_size=tp, padded_vocab=padded, layer_offset=offset, head=head)
                shard = assemble_shard(mapping, [read_piece(state[p.name], p) for p in mapping.pieces])
                assert tuple(shard.shape) == mapping.shard_shape
                if not mapping.duplicate:
                    per_rank += split_shard(mapping, shard)
            for hf_name in dict.fromkeys(p.name for p, _ in per_rank):
                pieces += [(p, t) for p, t in per_rank if p.name == hf_name]
    rebuilt = dict(merge_pieces(pieces))
    expected_names = set(hf_param_names(spec, head=head))
    assert set(rebuilt) == expected_names
    for name in expected_names:
        assert torch.equal(rebuilt[name], state[name]), name


def test_errors_name_the_problem():
    spec = _spec(num_key_value_heads=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        param_mapping("decoder.layers.0.self_attention.linear_qkv.weight", spec, tp_size=4, padded_vocab=1024)
    with pytest.raises(ValueError, match="no Hugging Face mapping"):
        param_mapping("decoder.layers.0.mlp.router.weight", spec, padded_vocab=1024)
    mapping = param_mapping("decoder.layers.0.mlp.linear_fc2.weight", spec, padded_vocab=1024)
    with pytest.raises(ValueError, match="does not match its config.json"):
        assemble_shard(mapping, [torch.zeros(3, 3)])
    with pytest.raises(ValueError, match="gap or overlap"):
        piece = mapping.pieces[0]
        half = type(piece)(name=piece.name, full_shape=piece.full_shape, dim=1, start=0, stop=4)
        rest = type(piece)(name=piece.name, full_shape=piece.full_shape, dim=1, start=8, stop=24)
        list(merge_pieces([(half, torch.zeros(16, 4)), (rest, torch.zeros(16, 16))]))
