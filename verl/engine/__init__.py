"""The Megatron-core training engine that SFT and every trained role share (it is not a role).

``MegatronEngine`` composes, for one role on one rank: building the model, optimizer and LR
schedule (:mod:`verl.engine.build`), the train step's clipping, update and metrics
(:mod:`verl.engine.step`), checkpoints (:mod:`verl.engine.state`) and the Hugging Face export
(:mod:`verl.engine.export`). The loss contract is ``verl.models.forward.LossShare``; the engine
contract the engines implement (``MegatronEngine``, ``verl.engine.torch_engine.TorchEngine`` and its
FSDP2-sharded form ``verl.engine.fsdp.FSDPEngine``, strategy=fsdp2) is
:class:`verl.engine.contract.TrainingEngine`, with capability flags (``engine.capabilities``).
"""

from verl.engine.build import lr_schedule_steps, resolve_dtype
from verl.engine.contract import EngineCapabilities, EngineStepResult, TrainingEngine
from verl.engine.engine import MegatronEngine
from verl.models.forward import LossShare, LossShareFn

__all__ = [
    "EngineCapabilities",
    "EngineStepResult",
    "LossShare",
    "LossShareFn",
    "MegatronEngine",
    "TrainingEngine",
    "lr_schedule_steps",
    "resolve_dtype",
]
