"""The contract both training engines implement: ``MegatronEngine`` (Megatron-core models with
TP/PP/CP) and ``TorchEngine`` (any ``nn.Module``, one process or DDP; ``FSDPEngine`` shards it
with FSDP2).

:class:`TrainingEngine` declares the calls the roles and the trainer make; what only one engine
can do is a flag of :class:`EngineCapabilities` (``engine.capabilities``), which callers test
instead of the engine's class; :class:`EngineStepResult` is what either engine's ``train_step``
reports. ``tests/trainer/test_engine_contract.py`` checks that both engines satisfy the protocol
with the same signatures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from verl.models.forward import ForwardResult, LossShareFn, OutputKind
    from verl.models.micro_batches import MicroBatchSplit
    from verl.models.vocab_parallel import SamplingTruncation

__all__ = ["EngineCapabilities", "EngineStepResult", "TrainingEngine"]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond :class:`TrainingEngine`'s calls."""

    megatron_layout: bool
    """``chunks`` are Megatron-core model chunks sharded by the role's TP/PP/CP: the hybrid
    engine's reshard plan and weight push, the training-state offload and the Megatron
    checkpoint layout (``tools/megatron2hf.py``) apply."""
    hf_checkpoint: bool
    """``export_hf`` writes a Hugging Face checkpoint of a supported family (config.json and
    safetensors in the HF names) that vLLM, transformers and the serving app load."""
    packed_sequences: bool
    """Micro-batches run as packed THD rows when the model asks (``use_remove_padding``)."""
    head_columns: bool
    """``head_columns`` computes the vocabulary head for the last columns only (else every column)."""


@dataclass(kw_only=True)
class EngineStepResult:
    """What one ``train_step`` reports (identical on every rank of the role)."""

    loss: float
    """Loss of the whole step (sum of every micro-batch's share on every DP rank, over the DP size)."""
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    lr: float
    """Learning rate the step was taken with."""
    update_successful: bool
    """False when the step was skipped (non-finite gradient norm)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Other ``loss_fn`` metrics, averaged over micro-batches and DP ranks."""
    micro_batches: int = 0
    """Micro-batches this rank ran (the same on every rank under a token budget)."""
    token_fill: float | None = None
    """Under a token budget: real tokens over micro-batches x budget, over DP ranks; else None."""


@runtime_checkable
class TrainingEngine(Protocol):
    """A role's training engine on one rank (both engines; see the module docstring)."""

    capabilities: EngineCapabilities
    pg: Any  # the role's ProcessGroupCollection (tp, pp, cp, dp)
    trainable: bool  # built with an optimizer
    steps_taken: int  # optimizer steps taken (restored by load)
    total_training_steps: int  # the LR schedule's length in optimizer steps
    chunks: list["torch.nn.Module"]  # the model's parts on this rank (one for a plain module)
    device: "torch.device"

    @property
    def dp_size(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def is_last_stage(self) -> bool: ...

    def current_lr(self) -> float: ...

    def forward(
        self,
        batch: Mapping[str, "torch.Tensor"],
        *,
        micro_batch_size: int | None = None,
        split: "MicroBatchSplit | None" = None,
        output: "OutputKind" = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
        head_columns: int | None = None,
        topk: int | None = None,
        score_ids: str | None = None,
        routing: str | None = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> "ForwardResult": ...

    def train_step(
        self,
        batch: Mapping[str, "torch.Tensor"],
        *,
        micro_batch_size: int | None = None,
        split: "MicroBatchSplit | None" = None,
        loss_fn: "LossShareFn",
        output: "OutputKind" = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
        head_columns: int | None = None,
        topk: int | None = None,
        score_ids: str | None = None,
        routing: str | None = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> EngineStepResult: ...

    def save(self, ckpt_dir: str) -> None: ...

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True) -> None: ...

    def export_hf(self, out_dir: str) -> None: ...
