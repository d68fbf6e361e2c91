"""Rollout engines: vLLM in-process (GPU vLLM or the CPU build) and a transformers fallback.

``build_rollout_engine(cfg.actor_rollout_ref.rollout, model_path, tokenizer)`` returns a
:class:`RolloutEngine`: ``generate(prompts) -> Batch`` (responses, masks, the engine's own
per-token logprobs), ``update_weights((hf_name, tensor) pairs)``, ``named_parameters()``,
``release()``/``resume()`` around training, ``last_metrics`` and ``shutdown()``.
vLLM is imported only when a vLLM engine is built.
"""

from verl.rollout.base import (
    RolloutEngine,
    Sample,
    SamplingSpec,
    assemble_rollout,
    prompt_token_lists,
    rollout_metrics,
    sampling_spec,
)
from verl.rollout.factory import ENGINES, build_rollout_engine, register_engine

__all__ = [
    "ENGINES",
    "RolloutEngine",
    "Sample",
    "SamplingSpec",
    "assemble_rollout",
    "build_rollout_engine",
    "prompt_token_lists",
    "register_engine",
    "rollout_metrics",
    "sampling_spec",
]
