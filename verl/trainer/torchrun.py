"""``python -m verl.trainer.torchrun``: torchrun (the same command line) whose stop signals end a run
the way the trainer does; the ``launch/`` scripts start it (``launch/common.sh``).

Plain torchrun, sent SIGTERM (a scheduler's preemption, ``kill``), forwards the signal to its
workers, which finish the step, save a checkpoint and exit 143; but the agent kills them
:data:`DEFAULT_SHUTDOWN_TIMEOUT_S`'s 30-second default after forwarding it, whatever their save
still needs, and then ends in a ``SignalException`` traceback with exit 1. Here:

- the workers get ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default
  :data:`DEFAULT_SHUTDOWN_TIMEOUT_S`; torchrun's ``--shutdown-timeout`` wins) to end before SIGKILL;
- a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) to this agent ends it with 128 + the signal's
  number and one line, no traceback; so does a stop that reached the workers directly (every one
  of them exited 143, 130 or 138), which torchrun reports as a failed child;
- the workers die with this agent when it is killed outright (``kill -9``): each rank arms Linux's
  parent-death signal at start (:func:`verl.utils.process.die_with_launcher`);
- ``VERL_DIES_WITH_PARENT=1``: this agent dies with its parent too (a launch script that
  does not ``exec`` it, e.g. ``launch/sft_tiny_cpu.sh``, which forwards SIGTERM/SIGINT itself).

With plain ``torchrun``, set ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (or ``--shutdown-timeout``) to the
time a checkpoint needs; the exit status is then torchrun's own.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "main"]

DEFAULT_SHUTDOWN_TIMEOUT_S = 600  # a 70B checkpoint's save, with room; a scheduler's own grace period still applies

# A worker's exit status after a stop signal: the trainer's 128 + SIGTERM/SIGINT/SIGUSR1.
_STOPPED = {128 + int(s): s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(DEFAULT_SHUTDOWN_TIMEOUT_S))
    from verl.utils.process import die_with_launcher

    die_with_launcher()  # with VERL_DIES_WITH_PARENT=1: a launch script's kill -9 takes this agent (and its workers)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as exc:
        sig = signal.Signals(exc.sigval)
        sys.stderr.write(
            f"torchrun: {sig.name}: forwarded to the workers, which have ended (a stop signal saves a "
            f"checkpoint first: see their last lines); exit {128 + int(sig)}\n"
        )
        return 128 + int(sig)
    except ChildFailedError as exc:
        # A worker the signal ended before the trainer caught it reports minus its number.
        codes = {f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for f in exc.failures.values()}
        if len(codes) == 1 and (code := codes.pop()) in _STOPPED:
            sys.stderr.write(f"torchrun: the workers stopped on {_STOPPED[code].name} (exit {code})\n")
            return code
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
