"""One run per output folder: a lock file that names its holder, held for the run's life.

A run's checkpoint and log folders each get ``.verl_run.lock``, taken by global rank 0 before any
model is built (``verl.trainer.run_checks.check_run_outputs``):

- the file is held with ``fcntl.flock`` for as long as the process lives (the kernel releases it
  when the process dies, ``kill -9`` included), and names the holder as JSON: host, pid (and its
  start time, so a reused pid is not taken for the run), the launcher's pid and command line (the
  torchrun agent under torchrun), the folder, when it was taken, and the torchrun world it belongs
  to (so the other ranks of the same run recognise their rank 0);
- a heartbeat thread touches the file every :data:`HEARTBEAT_S` seconds (its mtime is the heartbeat);
- a clean end (the trainer's ``close``, or the interpreter's exit) deletes it.

A second run into the folder is refused with :class:`FolderInUse` naming the folder, the holder
and the fix. A lock left behind by a run that is gone is taken over, with one line saying so:

- on the same host, the kernel says so: the flock is free (the holder died), whatever the file says;
- on another host, ``flock`` over a shared file system (NFS, Lustre, GPFS) may not see the other
  host's lock at all, so the heartbeat decides: a holder on another host whose heartbeat is younger
  than :data:`STALE_AFTER_S` is alive; an older one is gone.

Limits: two hosts that start runs into one shared folder within the same instant can both take it
where the file system gives ``flock`` no cross-host meaning; a holder on another host that stopped
heartbeating (suspended, partitioned) for :data:`STALE_AFTER_S` is taken over; a clock skew between
hosts larger than that misjudges the heartbeat's age.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from verl.utils.outputs import OutputPathError

__all__ = [
    "HEARTBEAT_S", "LOCK_FILE", "STALE_AFTER_S", "FolderInUse", "Holder", "hold_folder", "holder_of",
    "in_use_by_another_run", "release_folder", "release_all",
]

logger = logging.getLogger(__name__)

LOCK_FILE = ".verl_run.lock"
HEARTBEAT_S = 10.0  # how often the holder touches its lock file
STALE_AFTER_S = 120.0  # a holder on another host whose heartbeat is older than this is gone


class FolderInUse(OutputPathError):
    """A live run holds the folder (the message names the folder, the holder and the fix)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a folder's lock, as its lock file says."""

    host: str
    pid: int
    pid_started: float | None  # the pid's start time (Linux clock ticks since boot), against pid reuse
    launcher_pid: int | None  # the torchrun agent's pid, under torchrun
    command: str  # the launcher's command line (else this process's)
    folder: str
    since: float  # time.time() when it was taken
    world: str | None  # the torchrun world (rendezvous run id and master address), None outside one
    heartbeat: float  # the lock file's mtime

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since).strftime("%Y-%m-%d %H:%M:%S")
        who = f"pid {self.pid} on {self.host}" + (f" (launcher pid {self.launcher_pid})" if self.launcher_pid else "")
        return f"{who}, since {since}, command: {self.command}"

    def alive(self) -> bool:
        """Whether the holder still runs: its pid (started when it was) on this host, or a fresh
        heartbeat on another host."""
        if self.host == socket.gethostname():
            return _pid_started(self.pid) is not None and (
                self.pid_started is None or _pid_started(self.pid) == self.pid_started
            )
        return time.time() - self.heartbeat < STALE_AFTER_S


def _pid_started(pid: int) -> float | None:
    """The start time of process ``pid`` (clock ticks since boot; 0.0 where /proc has none), or
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # The command name (field 2) may hold spaces and parentheses: fields after its last ')'.
            return float(f.read().rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip() or None
    except OSError:
        return None


def _world() -> str | None:
    """This process's torchrun world: the same string on every rank of one run, another on any other."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_PORT" not in os.environ:
        return None
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    return "/".join(os.environ.get(k, "") for k in keys)


def _launcher_pid() -> int | None:
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def holder_of(folder: str) -> Holder | None:
    """The holder the lock file in ``folder`` names, or None (no file, or not one of ours)."""
    path = os.path.join(folder, LOCK_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        heartbeat = os.stat(path).st_mtime
        return Holder(
            host=str(doc["host"]), pid=int(doc["pid"]), pid_started=doc.get("pid_started"),
            launcher_pid=doc.get("launcher_pid"), command=str(doc.get("command", "?")), folder=str(doc.get("folder", folder)),
            since=float(doc["since"]), world=doc.get("world"), heartbeat=heartbeat,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refusal(key: str, folder: str, holder: Holder | None) -> FolderInUse:
    if holder is None:
        who = "another process on this host (its lock file names none)"
    else:
        who = holder.describe()
        if holder.host != socket.gethostname():
            age = time.time() - holder.heartbeat
            who += (f"; its heartbeat is {age:.0f} s old, and a lock on another host is taken over once that is "
                    f"{STALE_AFTER_S:.0f} s")
    return FolderInUse(
        f"{key}={folder} is in use by another run: {who}; wait for that run to end, or choose another {key} "
        f"(lock file {os.path.join(folder, LOCK_FILE)}; nothing was changed)"
    )


def in_use_by_another_run(folder: str, key: str) -> FolderInUse | None:
    """Without taking the lock: the refusal when a live run other than this process's own torchrun
    world holds ``folder`` (what the ranks other than 0 check before the world starts), else None."""
    folder = _real(folder)
    if folder in _held:
        return None
    holder = holder_of(folder)
    if holder is None or not holder.alive():
        return None
    if holder.world is not None and holder.world == _world():
        return None  # this run's own rank 0
    return _refusal(key, folder, holder)


def _real(folder: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(folder)))


class _FolderLock:
    """One folder's lock, held by this process: the flock'd file and the thread that heartbeats it."""

    def __init__(self, folder: str, fd: int, *, created: list[str]) -> None:
        self.folder, self.fd, self.created = folder, fd, created
        self.path = os.path.join(folder, LOCK_FILE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="verl-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)
            except OSError:  # the folder went away: nothing to heartbeat
                pass

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            # Deleted while still held: a process that opened the file before this cannot then take
            # this (now nameless) file for the folder's lock (hold_folder checks the inode).
            os.unlink(self.path)
        except OSError:
            pass
        _remove_empty(self.created)
        os.close(self.fd)


def _remove_empty(folders: list[str]) -> None:
    """Remove ``folders`` (innermost first) while they are empty: a run that ends having written
    nothing there (refused, or failed before its first output) leaves no folder it made."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


_held: dict[str, _FolderLock] = {}
_held_lock = threading.Lock()


def _open_locked(path: str, key: str, folder: str) -> int:
    """The lock file's descriptor, flock'd by this process; FolderInUse when a live process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _refusal(key, folder, holder_of(folder)) from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a file system without flock: heartbeat only
                return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder deleted it as we took it: take the new one


def hold_folder(folder: str, key: str) -> bool:
    """Take ``folder``'s lock for this process (created if missing), held until :func:`release_folder`
    or the process ends; returns False for a folder this process holds already (kept). Raises :class:`FolderInUse` when
    a live run holds it; logs one line when it takes over the lock of a run that is gone."""
    folder = _real(folder)
    with _held_lock:
        if folder in _held:
            return False
        created = []  # the folders made for the lock, innermost first
        missing = folder
        while not os.path.lexists(missing):
            created.append(missing)
            missing = os.path.dirname(missing)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK_FILE)
        try:
            fd = _open_locked(path, key, folder)
        except BaseException:
            _remove_empty(created)
            raise
        try:
            left = holder_of(folder)
            if left is not None and left.host != socket.gethostname() and left.alive():
                raise _refusal(key, folder, left)  # flock cannot see across hosts; its heartbeat can
            launcher = _launcher_pid()
            doc = {
                "host": socket.gethostname(), "pid": os.getpid(), "pid_started": _pid_started(os.getpid()),
                "launcher_pid": launcher,
                "command": (_cmdline(launcher) if launcher else None) or " ".join([sys.executable, *sys.argv]),
                "folder": folder, "since": time.time(), "world": _world(),
            }
            data = (json.dumps(doc) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _held[folder] = _FolderLock(folder, fd, created=created)
    if left is not None:
        logger.warning(
            "%s=%s: took over the lock left by a run that is gone (%s)", key, folder, left.describe()
        )
    return True


def release_folder(folder: str) -> None:
    """Release (and delete) this process's lock on ``folder``, if it holds one."""
    with _held_lock:
        lock = _held.pop(_real(folder), None)
    if lock is not None:
        lock.release()


def release_all() -> None:
    """Release every lock this process holds (at the interpreter's exit too)."""
    with _held_lock:
        locks = list(_held.values())
        _held.clear()
    for lock in locks:
        lock.release()


atexit.register(release_all)
