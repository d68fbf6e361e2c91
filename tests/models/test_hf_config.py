"""config.json parsing: each family, both transformers config layouts, and every refusal names its field."""

from __future__ import annotations

import json

import pytest
import torch

from verl.models.hf_config import parse_hf_config, rope_inv_freq

BASE = dict(
    model_type="llama",
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    rms_norm_eps=1e-5,
)


def test_llama31_v4_layout(tmp_path):
    cfg = dict(
        BASE,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = parse_hf_config(tmp_path)
    assert spec.rope.rope_type == "llama3" and spec.rope.theta == 500000.0 and spec.rope.factor == 8.0
    assert (spec.num_kv_heads, spec.head_dim, spec.q_per_group, spec.qkv_bias) == (1, 32, 2, False)


def test_v5_rope_parameters_and_legacy_type_key():
    spec = parse_hf_config(dict(BASE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    assert (spec.rope.rope_type, spec.rope.factor) == ("linear", 2.0)
    legacy = parse_hf_config(dict(BASE, rope_scaling={"type": "linear", "factor": 4.0}))
    assert (legacy.rope.rope_type, legacy.rope.factor, legacy.rope.theta) == ("linear", 4.0, 10000.0)


def test_qwen2_and_mistral_features():
    qwen = parse_hf_config(dict(BASE, model_type="qwen2", tie_word_embeddings=True, use_sliding_window=False))
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    mistral = parse_hf_config(dict(BASE, model_type="mistral", sliding_window=4096, head_dim=16))
    assert mistral.sliding_window == 4096 and mistral.head_dim == 16


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_parameters.rope_type"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling.low_freq_factor"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_key_value_heads=3, num_attention_heads=4), "num_key_value_heads"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_unsupported_features_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        parse_hf_config(dict(BASE, **change))


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no Hugging Face config.json"):
        parse_hf_config(tmp_path)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ],
)
def test_rope_frequencies_equal_transformers(rope_parameters):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=rope_parameters)
    spec = parse_hf_config(hf.to_dict())
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    actual = rope_inv_freq(spec.rope, spec.head_dim)
    assert torch.equal(actual, expected.float())


@pytest.mark.parametrize(("model_type", "expected"), [("llama", 2048), ("qwen2", 32768)])
def test_missing_max_position_embeddings_takes_the_transformers_default_and_says_so(
    model_type, expected, caplog, monkeypatch
):
    from verl.utils import logging as verl_logging

    monkeypatch.setattr(verl_logging, "_warned", set())  # warn_once: a fresh slate for each case
    assert "max_position_embeddings" not in BASE
    with caplog.at_level("WARNING", logger="verl.models.hf_config"):
        spec = parse_hf_config(dict(BASE, model_type=model_type), source=f"{model_type}/config.json")
    assert spec.max_position_embeddings == expected
    assert f"{model_type}/config.json has no max_position_embeddings: using {expected}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="verl.models.hf_config"):
        spec = parse_hf_config(dict(BASE, model_type=model_type, max_position_embeddings=64))
    assert spec.max_position_embeddings == 64 and "max_position_embeddings" not in caplog.text
