"""What every trainer's command line does after parsing: check, start the world, train, tear down.

``main_sft`` and ``main_ppo`` differ only in their config class, their start-up checks, their
trainer and the summary they print; :func:`run_trainer` is the rest, once. Every user-caused
problem exits with status 2 and one message (from rank 0), before any model is built when the
checks can see it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from verl.trainer.resilience import RankFailure
from verl.utils.cli import fail, user_errors
from verl.utils.logging import log_rank0

__all__ = ["run_trainer", "trainer_session"]


@contextlib.contextmanager
def trainer_session(cfg: Any, make_trainer: Callable[[Any], Any]) -> Iterator[Any]:
    """The start-up lifecycle, written once (``main_ppo``/``main_sft`` through :func:`run_trainer`,
    ``verl.RLTrainer``, the benchmarks): start the world ``cfg.trainer`` describes unless one is up
    (``verl.parallel.bootstrap.start_world``: its device and collective timeout), build the trainer,
    yield it inside ``with trainer`` (closing it lists the run's outputs) and tear down the world this
    call started. A ``RankFailure`` leaves the world as it is: tearing it down could wait on the rank
    that is gone (the caller leaves at once). ValueError names a device that cannot serve the launch."""
    from verl.parallel.bootstrap import destroy_distributed, start_world

    try:
        started = start_world(cfg.trainer)
    except ValueError as exc:
        raise ValueError(f"trainer.device={cfg.trainer.device}: {exc}") from None
    lost_rank = False
    try:
        with make_trainer(cfg) as trainer:
            yield trainer
    except RankFailure:
        lost_rank = True
        raise
    finally:
        if started and not lost_rank:
            destroy_distributed()


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
    trainer = None
    try:
        # A setting that only the data or the model reveals (run length, shapes, a bad row), or a
        # device that cannot serve the launch: one message, exit 2.
        with user_errors(prog), trainer_session(cfg, make_trainer) as trainer:
            metrics = trainer.fit()
            log_rank0(
                logging.getLogger(prog.split()[-1]),
                logging.INFO,
                "done: step %d, %s",
                trainer.global_step,
                summary(trainer, metrics),
            )
    except RankFailure as exc:
        # Another rank died or hangs: tearing the world down could wait on it too (the session
        # leaves it). Every rank that noticed says so (the message names this rank) and leaves now,
        # non-zero. The failed collective's own traceback first: the summary below replaces nothing.
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        sys.stderr.write(f"{prog}: error: {exc}\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    stopped = getattr(trainer, "stopped_by", None)
    return 128 + int(signal.Signals[stopped]) if stopped else 0
