"""What every trainer entry point does once its config is parsed, before anything is built.

Each entry point (``main_sft``, ``main_ppo``) sets up logging for a command line first
(:func:`verl.utils.logging.setup_logging`: the rank in every line, warnings as log records,
the quiet-start filters), so what the parser says about aliases is shown; then, right after
``parse_cli`` and before the trainer's modules (and Megatron-core) are imported,
``prepare_run(cfg.trainer)``:

1. optional packages the run's config does not ask for are not imported by the dependencies
   that merely probe for them (W&B unless ``trainer.logger`` has ``wandb``;
   :func:`verl.utils.imports.defer_import`);
2. the run's relative output paths are made absolute against the working directory
   (:meth:`verl.config.schema.RunConfig.resolve_paths`), so every log line names them absolute.

The run's output locations (:func:`run_outputs` plus the loggers' own) are then listed by
:class:`verl.trainer.tracking.Tracking`, which the trainers create before any model is built,
at the start and again at the end.
"""

from __future__ import annotations

import os

from verl.config.schema import RunConfig
from verl.trainer.report import REPORT_FILE
from verl.trainer.run_checks import hf_export_dir
from verl.utils.imports import defer_import
from verl.utils.outputs import OutputLocation

__all__ = ["prepare_run", "run_outputs"]


def prepare_run(run: RunConfig) -> None:
    """Defer unneeded optional imports and resolve output paths (see the module docstring)."""
    if "wandb" not in run.logger:
        defer_import("wandb")
    run.resolve_paths()


def run_outputs(run: RunConfig, *, model: str = "model") -> list[OutputLocation]:
    """The trainer's own outputs, for the list the loggers add theirs to: checkpoints, the Hugging
    Face export of ``model`` ("model", "actor") and the report built from ``metrics.jsonl``."""
    outputs = []
    if run.save_freq > 0:
        outputs.append(OutputLocation("checkpoints", run.default_local_dir, when=f"every {run.save_freq} steps and at the end"))
    if run.save_hf:
        outputs.append(OutputLocation(f"Hugging Face {model}", hf_export_dir(run), when="at the end"))
    if "jsonl" in run.logger:  # the report is built from metrics.jsonl
        log_dir = os.path.abspath(os.path.expanduser(run.log_dir))
        outputs.append(OutputLocation("report", os.path.join(log_dir, REPORT_FILE),
                                      use=f"build it with `python -m verl.trainer.report {log_dir}`"))
    return outputs
