"""Tiny random Hugging Face models for the model tests, made locally (never downloaded).

Hidden 64, 2 layers, 2 query heads of 32 and a vocabulary of 1001, so that tensor parallel 2
must pad the vocabulary. Each family exercises its own features: llama3 rope scaling (with a
short original context so the scaling changes every frequency band), Qwen2 q/k/v biases with
tied or untied embeddings, Qwen3's q/k norms with a head_dim apart from hidden/heads, a
Mistral sliding window shorter than the test sequences, and Mixture-of-Experts layers (Qwen3-MoE
with and without renormalised top-k weights, Mixtral, Qwen2-MoE with its gated shared expert) with a
router spread wide enough that no two experts nearly tie.
"""

from __future__ import annotations

import os

import torch

VOCAB = 1001

FAMILIES = {
    "llama3": dict(
        model_type="llama",
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_gqa": dict(model_type="llama", num_key_value_heads=1, rope_theta=10000.0),
    "qwen2_tied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_untied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=5),
    # Qwen3: q/k norms and a head_dim apart from hidden/heads (4 heads of 32 on hidden 64).
    "qwen3_tied": dict(
        model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
    ),
    "qwen3_untied": dict(
        model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
    ),
    # Mixture-of-Experts: 4 experts, top 2, every layer sparse.
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, router_aux_loss_coef=0.01,
    ),
    "qwen3_moe_unnormalized": dict(
        model_type="qwen3_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False,
    ),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    # Qwen2-MoE: the routed experts (softmax over all, top 2 as they are) plus a gated shared expert
    # whose width (80) differs from the experts' (48) and the dense one (96), and q/k/v biases.
    "qwen2_moe": dict(
        model_type="qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=80, norm_topk_prob=False,
        router_aux_loss_coef=0.01,
    ),
}


def make_tiny_model(
    directory: str, family: str, *, seed: int = 0, sequence_classification: bool = False, **overrides
) -> str:
    """Save a randomly initialised model of ``family`` to ``directory``; returns the directory."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    settings = dict(FAMILIES[family])
    model_type = settings.pop("model_type")
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        pad_token_id=0,
    )
    base.update(settings)
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    if sequence_classification:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # transformers initialises norms to ones and biases to zeros: randomise them so a
        # mapping mistake there cannot hide.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight") and param.dim() == 2 and param.shape[0] < param.shape[1]:
                param.normal_(0.0, 0.3)  # a router: spread logits, so no two experts nearly tie
            elif name.endswith("shared_expert_gate.weight"):
                param.normal_(0.0, 0.3)  # the shared expert's sigmoid gate: far from 0.5, different per token
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def padded_batch(batch_size: int = 4, seq_len: int = 12, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids [B, T] and a mask with a full row, left-padded prompts and right-padded ends."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=gen)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    for row in range(1, batch_size):
        left = (3 * row) % 5
        right = (2 * row) % 4
        mask[row, :left] = 0
        if right:
            mask[row, seq_len - right :] = 0
    ids = ids * mask  # pad id 0 where masked
    return {"input_ids": ids, "attention_mask": mask}


def hf_outputs(model_dir: str, batch: dict[str, torch.Tensor], *, sequence_classification: bool = False):
    """transformers' float32 logits [B, T, V] (or per-token scores [B, T, 1]) with the usual positions."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        if sequence_classification:
            hidden = model.model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).last_hidden_state
            return model.score(hidden)
        return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits


def reference_logprobs_entropy(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor):
    """Full-vocabulary logprobs/entropy aligned like verl's ([B, T], 0 at pads and first tokens)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy_all = -(logp.exp() * logp).sum(-1)  # [B, T]
    b, t = input_ids.shape
    logprobs = torch.zeros(b, t)
    entropy = torch.zeros(b, t)
    for row in range(b):
        real = mask[row].nonzero().squeeze(-1).tolist()
        for prev, cur in zip(real[:-1], real[1:]):
            logprobs[row, cur] = logp[row, prev, input_ids[row, cur]]
            entropy[row, cur] = entropy_all[row, prev]
    return logprobs, entropy


class HFDestination:
    """The transformers engine's contract for ``WeightSync`` around a plain transformers model."""

    weights_layout = "hf"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_parameters(self):
        return self.model.named_parameters()

    def weights_updated(self) -> None:
        pass


def near_tie_routers(source: str, directory: str, *, eps: float, seed: int = 7) -> str:
    """A copy of the Mixture-of-Experts model folder ``source`` in ``directory`` whose every router has experts 1
    and 2 a hair (``eps`` x a standard normal per weight) from expert 0: the three nearly tie for every token, so
    two implementations' float rounding can pick different top-k sets (R3 router replay's case)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory, dirs_exist_ok=True)
    path = os.path.join(directory, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(weights):
        if name.endswith("mlp.gate.weight"):
            router = weights[name].clone()
            for expert in (1, 2):
                router[expert] = router[0] + eps * torch.randn(router.shape[1], generator=gen, dtype=router.dtype)
            weights[name] = router
    save_file(weights, path, metadata={"format": "pt"})
    return directory
