"""What every trainer's command line does after parsing: check, start the world, train, tear down.

``main_sft`` and ``main_ppo`` differ only in their config class, their start-up checks, their
trainer and the summary they print; :func:`run_trainer` is the rest, once. Every user-caused
problem exits with status 2 and one message (from rank 0), before any model is built when the
checks can see it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from verl.trainer.resilience import RankFailure
from verl.utils.cli import fail, user_errors
from verl.utils.logging import log_rank0

__all__ = ["run_trainer"]


def run_trainer(
    cfg: Any,
    *,
    prog: str,
    check: Callable[[Any], None],
    make_trainer: Callable[[Any], Any],
    summary: Callable[[Any, dict[str, float]], str],
) -> int:
    """``check(cfg)`` (a user error: exit 2), start torch.distributed on ``cfg.trainer.device``,
    ``make_trainer(cfg)`` and ``fit()`` inside ``with trainer`` (a user error: exit 2), log
    ``summary(trainer, metrics)`` before the trainer closes (its list of outputs comes last) and
    tear the world down; returns the exit status: 0 when the run finished, 128 + the signal's
    number when a stop signal ended it after a checkpoint (143 for SIGTERM, 130 for SIGINT, 138
    for SIGUSR1: the shell's convention, so a scheduler tells a preempted run from a finished one)."""
    with user_errors(prog):
        check(cfg)
    from verl.parallel.bootstrap import destroy_distributed, start_world

    trainer = None
    try:
        start_world(cfg.trainer)
    except ValueError as exc:
        fail(prog, f"trainer.device={cfg.trainer.device}: {exc}")
    try:
        # A setting that only the data or the model reveals (run length, shapes, a bad row);
        # the finally below tears the world down.
        try:
            with user_errors(prog):
                trainer = make_trainer(cfg)
                with trainer:  # closing it lists the run's outputs: the last lines a user reads
                    metrics = trainer.fit()
                    log_rank0(
                        logging.getLogger(prog.split()[-1]),
                        logging.INFO,
                        "done: step %d, %s",
                        trainer.global_step,
                        summary(trainer, metrics),
                    )
        except RankFailure as exc:
            # Another rank died or hangs: tearing the world down could wait on it too. Every
            # rank that noticed says so (the message names this rank) and leaves now, non-zero.
            # The failed collective's own traceback first: the summary below replaces nothing.
            traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
            sys.stderr.write(f"{prog}: error: {exc}\n")
            sys.stderr.flush()
            logging.shutdown()
            os._exit(1)
    finally:
        destroy_distributed()
    stopped = getattr(trainer, "stopped_by", None)
    return 128 + int(signal.Signals[stopped]) if stopped else 0
