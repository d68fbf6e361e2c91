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
   (:meth:`verl.config.schema.RunConfig.resolve_paths`), so every log line names them absolute;
3. where the trainer draws no bar (stderr is a log file or a pipe, ``trainer.progress_bar=false``),
   the dependencies draw none either: ``TQDM_DISABLE`` and ``HF_HUB_DISABLE_PROGRESS_BARS`` are
   set (unless the user set them), which tqdm and transformers read when they are imported
   (transformers' "Loading weights" bar, Megatron's and the tools' bars), and which the
   run's child processes inherit;
4. vLLM logs through verl's logging (``VLLM_CONFIGURE_LOGGING=0`` unless the user set it): one
   format with the rank, the quiet-start filters, and vLLM's INFO chatter off
   (:func:`verl.utils.logging.setup_logging`).

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
from verl.utils.progress import bar_allowed

__all__ = ["prepare_run", "run_outputs"]


def prepare_run(run: RunConfig) -> None:
    """Defer unneeded optional imports, resolve output paths and keep dependencies' progress bars
    out of log files (see the module docstring). Call it before torch or transformers is imported."""
    if "wandb" not in run.logger:
        defer_import("wandb")
    run.resolve_paths()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if not (run.progress_bar and bar_allowed()):
        for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(var, "1")


def run_outputs(run: RunConfig, *, model: str = "model", report_freq: int | None = None) -> list[OutputLocation]:
    """The trainer's own outputs, for the list the loggers add theirs to: checkpoints, the Hugging
    Face export of ``model`` ("model", "actor") and the report built from ``metrics.jsonl``, which
    the trainer writes every ``report_freq`` steps and at the end (-1: at the end; None or 0: the
    trainer does not write it, ``python -m verl.trainer.report`` does)."""
    outputs = []
    if run.save_freq > 0:
        outputs.append(OutputLocation("checkpoints", run.default_local_dir, when=f"every {run.save_freq} steps and at the end"))
    if run.save_hf:
        outputs.append(OutputLocation(f"Hugging Face {model}", hf_export_dir(run), when="at the end"))
    if "jsonl" in run.logger:  # the report is built from metrics.jsonl
        log_dir = os.path.abspath(os.path.expanduser(run.log_dir))
        path = os.path.join(log_dir, REPORT_FILE)
        if report_freq:
            when = "at the end" if report_freq < 0 else f"every {report_freq} steps and at the end"
            outputs.append(OutputLocation("report", path, when=when))
        else:
            outputs.append(OutputLocation("report", path, use=f"build it with `python -m verl.trainer.report {log_dir}`"))
    return outputs
