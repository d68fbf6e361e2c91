"""What every trainer entry point does once its config is parsed, before anything is built.

``prepare_run(cfg.trainer)`` (``main_sft``; ``main_ppo`` the same) right after ``parse_cli``:

1. logging for a command line (:func:`verl.utils.logging.setup_logging`): the rank in every
   line, warnings as log records, and the quiet-start filters (one line for the absent optional
   accelerators, dependency config dumps at DEBUG);
2. optional packages the run's config does not ask for are not imported by the dependencies
   that merely probe for them (W&B unless ``trainer.logger`` has ``wandb``;
   :func:`verl.utils.imports.defer_import`);
3. the run's relative output paths are made absolute against the working directory
   (:meth:`verl.config.schema.RunConfig.resolve_paths`), so every log line names them absolute.

The run's output locations are then listed by :class:`verl.trainer.tracking.Tracking` (created
before any model is built), at the start and again at the end.
"""

from __future__ import annotations

import logging

from verl.config.schema import RunConfig
from verl.utils.imports import defer_import
from verl.utils.logging import setup_logging

__all__ = ["prepare_run"]


def prepare_run(run: RunConfig, *, level: int = logging.INFO) -> None:
    """Set up logging, defer unneeded optional imports and resolve output paths (see module docstring)."""
    setup_logging(level)
    if "wandb" not in run.logger:
        defer_import("wandb")
    run.resolve_paths()
