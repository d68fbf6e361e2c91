"""Tiny Hugging Face checkpoints made offline: a trained BPE tokenizer and random weights.

``make_tiny_model`` writes a directory that ``AutoTokenizer`` / ``AutoModelForCausalLM``
and vLLM (CPU build) load: tokenizer files with a ChatML chat template and pad/bos/eos
tokens, config.json, generation_config.json and float32 safetensors weights. Everything
is a function of the arguments and the seed, so the same call writes identical files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from verl.data.corpus import generate_corpus

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<|im_start|>", "<|endoftext|>")
# Head sizes the CPU attention backend of vLLM accepts (vllm/v1/attention/backends/cpu_attn.py).
CPU_VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# ChatML: every turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the model's turn ends
# with <|im_end|>, which is also the eos token, so generation stops after one answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of a tiny model; defaults fit the CPU vLLM build (head_dim 32)."""

    family: str = "llama"
    """Architecture: one of :data:`FAMILIES`."""
    hidden: int = 64
    """Hidden size."""
    layers: int = 2
    """Number of decoder layers."""
    heads: int = 2
    """Attention heads; hidden / heads must be a head size the CPU vLLM build supports."""
    kv_heads: int = 1
    """Key/value heads (grouped-query attention); must divide ``heads``."""
    head_dim: int = 0
    """Per-head width; 0 means hidden / heads (Qwen3 sets it independently of the hidden size)."""
    intermediate: int = 0
    """MLP size (of each expert, for the MoE families; of Qwen2-MoE's shared expert too); 0 means 4 * hidden."""
    experts: int = 4
    """qwen3_moe, mixtral, qwen2_moe: routed experts per layer."""
    experts_per_token: int = 2
    """qwen3_moe, mixtral, qwen2_moe: experts each token is routed to."""
    vocab: int = 1024
    """Tokenizer (and embedding) vocabulary size."""
    max_position: int = 1024
    """Maximum sequence length (max_position_embeddings)."""
    tie_embeddings: bool = False
    """Share the input embedding and the LM head."""
    seed: int = 0
    """Seed for the tokenizer corpus and the weight initialisation."""
    corpus_lines: int = 4000
    """Lines of generated text the tokenizer is trained on."""

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, or hidden / heads when it is 0."""
        return self.head_dim or self.hidden // self.heads

    def validate(self) -> None:
        """Reject shapes that would not load or would not run in the CPU vLLM build."""
        if self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r} is not one of {FAMILIES}")
        for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "max_position", "corpus_lines"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.head_dim < 0:
            raise ValueError(f"--head-dim must be positive (or 0 for hidden/heads), got {self.head_dim}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads} (or set --head-dim)")
        if self.resolved_head_dim not in CPU_VLLM_HEAD_SIZES:
            raise ValueError(
                f"head_dim = {'' if self.head_dim else 'hidden/heads = '}{self.resolved_head_dim}, but the CPU vLLM build "
                f"only supports head sizes {CPU_VLLM_HEAD_SIZES}; e.g. --hidden 64 --heads 2 (head_dim 32)"
            )
        if self.family in MOE_FAMILIES and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(
                f"--experts-per-token {self.experts_per_token} must be between 1 and --experts {self.experts}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not divisible by --kv-heads {self.kv_heads}")
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"--vocab {self.vocab} is too small: the byte-level alphabet alone needs 256 + "
                f"{len(SPECIAL_TOKENS)} special tokens"
            )


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (digits split one per token) with ChatML and pad/bos/eos.

    Returns a transformers fast tokenizer; plain text gets ``<|bos|>`` prepended, chat text
    gets it from the template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # One token per digit keeps numbers compositional, which tiny models need for arithmetic.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
        clean_up_tokenization_spaces=False,
    )


def model_config(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """The transformers config of ``spec``, with the tokenizer's special token ids."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.resolved_head_dim,
        max_position_embeddings=spec.max_position,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        dtype="float32",
    )
    if spec.family == "llama":
        return LlamaConfig(**common)
    if spec.family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.family == "qwen3":
        return Qwen3Config(**common, use_sliding_window=False, attention_bias=False)
    if spec.family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, use_sliding_window=False,
            num_experts=spec.experts, num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True, router_aux_loss_coef=0.001,
        )
    if spec.family == "qwen2_moe":  # routed experts plus a gated shared expert of the same width
        return Qwen2MoeConfig(
            **common, use_sliding_window=False, num_experts=spec.experts, num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=common["intermediate_size"], shared_expert_intermediate_size=common["intermediate_size"],
            norm_topk_prob=False, router_aux_loss_coef=0.001,
        )
    if spec.family == "mixtral":
        return MixtralConfig(
            **common, sliding_window=None, num_local_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token, router_aux_loss_coef=0.001,
        )
    return MistralConfig(**common, sliding_window=None)


def make_tiny_model(out_dir: str, spec: TinyModelSpec, *, overwrite: bool = False) -> str:
    """Train the tokenizer, build the randomly initialised model and save both to ``out_dir``.

    A non-empty ``out_dir`` is refused (ValueError) unless ``overwrite``: it may hold another model.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec.validate()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is a file; give a folder for the model")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(
            f"{out_dir} already exists and is not empty; choose another folder or pass overwrite=True (--overwrite)"
        )
    tokenizer = train_tokenizer(generate_corpus(spec.corpus_lines, seed=spec.seed), vocab_size=spec.vocab)
    config = model_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Written beside the target and moved in once complete: an interrupted run leaves no
    # half model in out_dir (which a rerun would then refuse as not empty).
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "wrote %s model to %s: %d parameters, vocab %d, hidden %d, layers %d, heads %d/%d",
        spec.family,
        out_dir,
        n_params,
        len(tokenizer),
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.kv_heads,
    )
    return out_dir
