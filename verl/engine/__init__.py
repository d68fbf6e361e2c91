"""The Megatron-core training engine that SFT and every trained role share (it is not a role).

``MegatronEngine`` composes, for one role on one rank: building the model, optimizer and LR
schedule (:mod:`verl.engine.build`), the train step's clipping, update and metrics
(:mod:`verl.engine.step`), checkpoints (:mod:`verl.engine.state`) and the Hugging Face export
(:mod:`verl.engine.export`). The loss contract is ``verl.models.forward.LossShare``.
"""

from verl.engine.build import lr_schedule_steps, resolve_dtype
from verl.engine.engine import EngineStepResult, MegatronEngine
from verl.models.forward import LossShare, LossShareFn

__all__ = ["EngineStepResult", "LossShare", "LossShareFn", "MegatronEngine", "lr_schedule_steps", "resolve_dtype"]
