"""``Reference``: the frozen initial policy, forward only (the KL term's other side).

Built from the actor's Hugging Face checkpoint without an optimizer, colocated with the actor;
the trainer builds it only when a KL loss (``actor.use_kl_loss``) or an in-reward KL penalty
(``algorithm.use_kl_in_reward``) is asked for. On the first step its log-probabilities equal the
actor's old ones exactly when both use the same layout and micro-batch size (same weights,
same arithmetic).

When the actor trains LoRA adapters (``model.lora_rank`` > 0) the reference is the actor itself
with its adapters switched off (``verl.models.lora.adapters_disabled``): the frozen base weights
are the initial policy, so no second model is built or held.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from verl.models.lora import adapters_disabled, has_adapters
from verl.protocol import Batch
from verl.roles.engine_role import RoleEngine, token_budget

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.config.schema import ModelConfig, RefConfig
    from verl.models.vocab_parallel import SamplingTruncation
    from verl.roles.actor import Actor

__all__ = ["Reference"]


class Reference:
    """The frozen reference policy (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.ref`` (its layout follows the actor's unless set).
        model: ``actor_rollout_ref.model`` (the initial policy's weights).
        pg: the reference's process groups.
        max_sequence_length: prompt + response length.
        temperature: the sampling temperature the log-probabilities are taken at.
        truncation: the rollout's top-k / top-p, replayed as the actor replays it (so that the first
            step's KL is 0); None: full-vocabulary log-probabilities.
        balance: ``trainer.balance_batch``.
        policy: the actor whose LoRA adapters are switched off to give the reference (``pg`` must
            be the actor's layout; nothing is built); None builds a frozen model of ``model``.
    """

    def __init__(
        self,
        cfg: "RefConfig",
        model: "ModelConfig",
        *,
        pg: "ProcessGroupCollection",
        max_sequence_length: int,
        temperature: float,
        balance: bool = False,
        policy: "Actor | None" = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.max_token_len = token_budget(
            cfg.log_prob_use_dynamic_bsz,
            cfg.log_prob_max_token_len_per_gpu,
            flag="actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        )
        self.temperature = temperature if temperature > 0 else 1.0
        self.truncation = truncation if truncation is not None and truncation.active else None
        if policy is not None:
            if not has_adapters(policy.engine.chunks[0]):
                raise ValueError("Reference(policy=...): the actor has no LoRA adapters to switch off")
            self.role = policy.role
            return
        self.role = RoleEngine(
            model=model,
            megatron=cfg.megatron,
            strategy=cfg.strategy,
            fsdp=cfg.fsdp_config,
            pg=pg,
            max_sequence_length=max_sequence_length,
            balance=balance,
            name="reference",
        )

    def compute_log_prob(self, batch: Batch, *, temperature: float | None = None) -> torch.Tensor:
        """Log-probabilities of every response token under the reference policy, [B, R], at the
        sampling temperature and the sampler's truncation (or at ``temperature``, full-vocabulary: DPO's pairs
        use 1)."""
        off = adapters_disabled(self.role.engine.chunks) if self.policy is not None else contextlib.nullcontext()
        with off:
            out = self._forward(batch, temperature)
        return out["logprobs"]

    def _forward(self, batch: Batch, temperature: float | None) -> dict[str, torch.Tensor]:
        return self.role.forward(
            batch,
            output="logprobs",
            micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
            max_token_len=self.max_token_len,
            response_length=batch["responses"].shape[1],
            temperature=self.temperature if temperature is None else temperature,
            truncation=self.truncation if temperature is None else None,
        )
