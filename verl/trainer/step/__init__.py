"""One RL step as data: operators (``base``, ``ops``) and the pipeline that runs them (``pipeline``).

``build_step(cfg)`` is the one function that composes a config's step; the trainer's loop
runs it, and ``verl.DataStream`` is the same pipeline with the user's operators in it.
"""

from verl.trainer.step.base import Operator, declared, operator_name
from verl.trainer.step.pipeline import StepPipeline, build_step, step_kind

__all__ = ["Operator", "StepPipeline", "build_step", "declared", "operator_name", "step_kind"]
