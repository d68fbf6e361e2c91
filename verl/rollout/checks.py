"""Does the rollout engine agree with the trainer? Logprob comparison on the same samples.

RL's importance ratios assume the engine samples from the policy the trainer evaluates. The
check: recompute the logprobs of the sampled responses with the trainer's model (same weights,
same temperature) and compare them token by token with the engine's ``rollout_log_probs``:

- ``logprob_max_abs_diff``  = max |rollout - trainer| over response tokens;
- ``logprob_mean_abs_diff`` = mean |rollout - trainer|;
- ``token_mult_prob_error`` = mean over tokens of exp(|rollout - trainer|), as NeMo-RL defines
  it (its ``ClippedPGLossFn``): 1.0 is perfect agreement; the factor by which a token's
  probability is off, on average.

:func:`megatron_response_logprobs` is the trainer side with verl's Megatron model (the actor's
computation); ``verl.rollout.hf_engine.hf_response_logprobs`` is the transformers one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["logprob_agreement", "megatron_response_logprobs"]


def logprob_agreement(
    rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Agreement metrics (see module docstring) over the tokens where ``response_mask`` is 1. All ``[B, R]``."""
    if not (rollout_log_probs.shape == trainer_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"shapes differ: rollout_log_probs {list(rollout_log_probs.shape)}, trainer_log_probs "
            f"{list(trainer_log_probs.shape)}, response_mask {list(response_mask.shape)}"
        )
    device = rollout_log_probs.device
    mask = response_mask.to(device=device, dtype=torch.bool)
    diff = (rollout_log_probs.double() - trainer_log_probs.double().to(device))[mask].abs()
    if diff.numel() == 0:
        return {"logprob_max_abs_diff": 0.0, "logprob_mean_abs_diff": 0.0, "token_mult_prob_error": 1.0, "num_tokens": 0}
    return {
        "logprob_max_abs_diff": float(diff.max()),
        "logprob_mean_abs_diff": float(diff.mean()),
        "token_mult_prob_error": float(diff.exp().mean()),
        "num_tokens": int(diff.numel()),
    }


def megatron_response_logprobs(
    model_dir: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_length: int,
    temperature: float = 1.0,
    tensor_parallel_size: int = 1,
    micro_batch_size: int = 8,
    pg: ProcessGroupCollection | None = None,
) -> torch.Tensor:
    """Logprobs of the last ``response_length`` tokens under verl's Megatron model of ``model_dir``.

    The actor's computation: ``verl.engine.MegatronEngine`` (frozen) built from the
    Hugging Face directory, ``forward(..., output="logprobs", temperature=...)``. Inputs are
    rollout rows ``[B, P+R]``; returns ``[B, R]`` on every rank. ``torch.distributed`` must be
    initialised; without ``pg``, Megatron's global state is built over the whole world with
    ``tensor_parallel_size`` and torn down afterwards.
    """
    from verl.config.schema import MegatronConfig, ModelConfig
    from verl.parallel import megatron_state
    from verl.engine import MegatronEngine

    own_state = pg is None
    if own_state:
        pg = megatron_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    try:
        engine = MegatronEngine(
            model=ModelConfig(path=model_dir),
            megatron=MegatronConfig(dtype="float32"),
            pg=pg,
            max_sequence_length=input_ids.shape[1],
        )
        result = engine.forward(
            {"input_ids": input_ids, "attention_mask": attention_mask},
            micro_batch_size=micro_batch_size,
            output="logprobs",
            temperature=temperature if temperature > 0 else 1.0,
        )
        return result.outputs["logprobs"][:, -response_length:].float().cpu()  # [B, R]
    finally:
        if own_state:
            megatron_state.destroy_model_parallel()
