"""Unlinking the multiprocessing semaphores that SIGKILLed process groups leave in /dev/shm.

The test session (tests/conftest.py) removes, at its end, the ``/dev/shm/sem.mp-*`` files that no
live process maps and that were not there when it started: tests kill worker pools and trainer
runs with SIGKILL on purpose, which takes their resource trackers with them.
"""

from __future__ import annotations

import os

_SHM_DIR = "/dev/shm"
_SEMAPHORE_PREFIX = "sem.mp-"  # multiprocessing's named semaphores (spawn/forkserver contexts)


def _mapped_shm_inodes() -> set[int]:
    """Inodes of the /dev/shm files that some live process (that we may inspect) has mapped.

    By inode, not name: glibc's ``sem_open`` creates a semaphore under a temporary name, maps
    it and only then links it to its final name, so its creator's mapping shows the temporary
    (deleted) name.
    """
    inodes: set[int] = set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if _SHM_DIR + "/" in line:
                        # address perms offset dev inode pathname
                        inodes.add(int(line.split(None, 5)[4]))
        except (OSError, ValueError, IndexError):  # gone, not ours to read, or an odd line
            continue
    return inodes


def orphaned_semaphores(known: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """multiprocessing semaphore files in /dev/shm that no live process has mapped, except ``known``.

    A process group killed with SIGKILL (on purpose in tests, or a killed worker pool) takes its
    resource tracker with it, so the named semaphores it created are never unlinked.
    """
    if not os.path.isdir(_SHM_DIR):
        return []
    candidates = [n for n in os.listdir(_SHM_DIR) if n.startswith(_SEMAPHORE_PREFIX) and n not in known]
    if not candidates:
        return []
    mapped = _mapped_shm_inodes()
    orphans = []
    for name in candidates:
        try:
            inode = os.stat(os.path.join(_SHM_DIR, name)).st_ino
        except FileNotFoundError:
            continue
        if inode not in mapped:
            orphans.append(name)
    return sorted(orphans)


def remove_orphaned_semaphores(known: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Unlink :func:`orphaned_semaphores` (those not in ``known``); returns the names removed.

    Pass the names present before the work whose leftovers you clean (``known``), so that
    semaphores of unrelated jobs that are between creating and mapping one are left alone.
    """
    removed = []
    for name in orphaned_semaphores(known):
        try:
            os.remove(os.path.join(_SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:  # its owner unlinked it meanwhile
            pass
    return removed
