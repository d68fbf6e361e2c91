"""Megatron ``dist_checkpointing`` saves that start no spawned process (the one place verl touches
the private parts of ``megatron.core.dist_checkpointing.strategies.filesystem_async``).

Megatron-core's torch_dist writer (``FileSystemWriterAsync``) serves async and sync saves alike.
For its results it makes, once per process, a ``multiprocessing`` Manager queue with the *spawn*
start method (``filesystem_async._get_write_results_queue``). A spawned process imports the
parent's ``__main__`` again: a user's script without ``if __name__ == "__main__":`` runs its whole
body a second time inside it (a second training run), and when that run fails the parent dies
with ``EOFError`` in the save. verl saves synchronously (``dist_checkpointing.save``): the results
are put and read by this process only (the writer's forked workers report through their own
fork-context queue), so a plain in-process queue is all the save needs. :func:`save_sharded`
hands the writer one for the duration of the save.

The files written are the same: Megatron's writer workers still fork and ``fsync`` each file,
and the checkpoint's crash safety (``verl.utils.checkpoint``: a temporary folder renamed when
complete) does not depend on the queue.

| private name | checked on | why |
| --- | --- | --- |
| ``filesystem_async._get_write_results_queue`` (replaced during a save) | megatron-core 0.16.x | its spawn Manager re-imports ``__main__`` |

Outside those versions :func:`save_sharded` calls ``dist_checkpointing.save`` unchanged and logs
once that a script without a main guard would run twice. The tests that fail when Megatron's
behaviour changes: ``tests/models/test_dist_save.py``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Iterator
from typing import Any

from verl.utils.logging import warn_once

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = ("0.16.",)
"""Prefixes of the megatron-core versions whose writer :func:`save_sharded` was checked on."""


def installed_megatron_version() -> str:
    """The installed megatron-core's version string."""
    import megatron.core

    return str(megatron.core.__version__)


def in_process_queue_applies() -> bool:
    """Whether the installed megatron-core is a checked version that has the queue factory."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return installed_megatron_version().startswith(CHECKED_VERSIONS) and callable(
        getattr(filesystem_async, "_get_write_results_queue", None)
    )


@contextlib.contextmanager
def in_process_results_queue() -> Iterator[None]:
    """While open, Megatron's torch_dist writer collects its results in an in-process queue.

    Sync saves only: an async save (a persistent writer process) needs the process-shared queue.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not in_process_queue_applies():
        warn_once(
            logger,
            "megatron-core %s is not one of the versions verl's checkpoint save was checked on (%s): "
            "Megatron's writer starts a spawned process, which re-runs a script that has no "
            "`if __name__ == \"__main__\":` guard",
            installed_megatron_version(),
            ", ".join(v + "x" for v in CHECKED_VERSIONS),
        )
        yield
        return
    results: queue.Queue = queue.Queue()
    original = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = lambda: results
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = original


def save_sharded(sharded_state_dict: dict[str, Any], ckpt_dir: str) -> None:
    """``dist_checkpointing.save(sharded_state_dict, ckpt_dir)`` (collective), in this process and
    the writer's forked workers only: nothing imports ``__main__`` again. The workers die with this
    process: one killed mid-save would leave them waiting for its queue items (the suite, 2026-12-05)."""
    from megatron.core import dist_checkpointing

    from verl.utils.process import forks_die_with_this_process

    with in_process_results_queue(), forks_die_with_this_process():
        dist_checkpointing.save(sharded_state_dict, ckpt_dir)
