"""Run one untrusted program in a confined process and report how it ended.

Confinement (bubblewrap, Debian's ``bubblewrap`` package; see docs/sandbox.md):

- new user, pid, network, ipc, uts and cgroup namespaces (``--unshare-all``), all capabilities
  dropped, no further user namespaces (``--disable-userns``): no network at all (the
  sandbox's own loopback has nothing on it; the host's 127.0.0.1 is another namespace), no
  process of the host visible or signalable;
- a fresh root holding only ``/usr`` (and the ``/lib*``, ``/bin`` links) and the interpreter's
  prefix, read-only; a size-limited tmpfs as the working directory, ``/tmp`` and ``/dev/shm``;
  a minimal ``/dev`` and the namespace's own ``/proc``; an empty environment;
- rlimits set inside by ``prlimit``: CPU seconds, address space, processes (counted in the
  sandbox's own user namespace, so concurrent sandboxes do not share the count), file size,
  open files, no core files;
- the sandbox's init process dies with the runner (``--die-with-parent``) and the kernel kills
  everything else in the pid namespace with it, so killing the runner at a limit, or the
  program's main process exiting, leaves no process behind.

As root, bubblewrap is started as ``nobody`` (uid 65534), an unprivileged user: as root the
kernel exempts the user's processes from RLIMIT_NPROC, and a root sandbox could read every file
it is given. The interpreter must then be readable by ``nobody`` (see ``choose_python``).

Without bubblewrap (or when it cannot start) ``run`` refuses, unless the config allows the
unconfined fallback: the same rlimits, a new session killed as a group, an empty environment
and a private working directory, but the host's network, files and processes stay reachable.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.utils.signals import deferred, interruptible

logger = logging.getLogger(__name__)

Reason = Literal["ok", "error", "timeout", "memory", "output_limit", "killed", "sandbox_error", "cancelled"]

NOBODY_UID = 65534
# Where the program runs inside the sandbox (a private tmpfs).
WORKDIR = "/sandbox"
MAIN_FILE = "main.py"
# Exit status of ``prlimit``/``bwrap`` that means the child was killed by signal N: 128 + N.
_SIGNAL_BASE = 128
# How often the runner wakes to check the deadline while waiting on output.
_POLL_S = 0.05
_CANCELLED = "cancelled by its caller (its client left, or the server stops)"
# How long bwrap may take to reap its killed init and exit before it is killed too.
_REAP_WAIT_S = 5.0


class SandboxUnavailable(RuntimeError):
    """Confinement is not possible here and the unconfined fallback was not allowed."""


@dataclass(frozen=True)
class RunResult:
    """How one execution ended.

    ``reason``: ok (exit status 0), error (another exit status), timeout (wall or CPU time),
    memory (the address-space limit: a MemoryError or an allocation failure), output_limit
    (stdout or stderr over ``output_bytes``), killed (a signal not sent by a limit),
    sandbox_error (the sandbox itself failed to start: bubblewrap, prlimit or the interpreter
    failed before the program's first line; ``detail`` holds their message), cancelled (the
    caller's ``cancel`` event ended it: a server's client left, or the server stops). ``exit_code`` is the program's status
    (None when it was killed by the runner), ``signal`` the signal that ended it, if any.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    reason: Reason
    wall_time_s: float
    signal: int | None = None
    confined: bool = True
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# which confinement is available


@dataclass(frozen=True)
class _Backend:
    bwrap: str | None
    prlimit: str | None
    why_not: str = ""


_backend_cache: dict[str, _Backend] = {}
_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(msg: str) -> None:
    with _warn_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    logger.warning(msg)


def _is_root() -> bool:
    return os.geteuid() == 0


def _accessible_to_nobody(path: str) -> bool:
    """Whether uid ``nobody`` can reach and read ``path`` through "other" permission bits."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        part = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.stat(part)
        except OSError:
            return False
        need = stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else stat.S_IROTH
        if not st.st_mode & need:
            return False
    return True


def choose_python(configured: str | None) -> str:
    """The interpreter path the sandbox runs (resolved, absolute).

    ``configured`` wins; else this Python's base interpreter (outside any virtualenv), if the
    sandbox user can read it; else ``/usr/bin/python3``.
    """
    if configured:
        path = shutil.which(configured) or configured
        if not os.path.isfile(path):
            raise ValueError(f"sandbox.python={configured!r}: no such interpreter; give a path to python3")
        return os.path.realpath(path)
    candidates = [getattr(sys, "_base_executable", None) or sys.executable, "/usr/bin/python3"]
    for cand in candidates:
        if cand and os.path.isfile(cand) and (not _is_root() or _accessible_to_nobody(cand)):
            return os.path.realpath(cand)
    raise ValueError(
        f"sandbox: no interpreter the sandbox user can read among {candidates}; set sandbox.python to a python3 "
        "that every user can read (e.g. /usr/bin/python3)"
    )


def _python_prefix(python: str) -> str:
    """The directory tree an interpreter needs (``<prefix>`` of ``<prefix>/bin/python3``)."""
    return os.path.dirname(os.path.dirname(python))


def _find_tools() -> _Backend:
    """bwrap and prlimit on PATH; ``why_not`` says what is missing."""
    bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
    if bwrap is None:
        return _Backend(None, prlimit, "bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    if prlimit is None:
        return _Backend(None, None, "prlimit (util-linux) is not installed")
    return _Backend(bwrap, prlimit)


def _popen_user_kwargs() -> dict:
    """As root, start the sandbox as ``nobody`` with no supplementary groups."""
    if _is_root():
        return {"user": NOBODY_UID, "group": NOBODY_UID, "extra_groups": []}
    return {}


# ---------------------------------------------------------------------------------------------
# the command line


def _rlimit_args(prlimit: str, limits: SandboxLimitsConfig) -> list[str]:
    mem = limits.memory_mb << 20
    cpu = max(1, math.ceil(limits.cpu_time_s))
    return [
        prlimit,
        # soft:hard; the hard CPU limit one second later turns SIGXCPU into SIGKILL for a program that catches it.
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={mem}:{mem}",
        f"--nproc={limits.max_processes}:{limits.max_processes}",
        f"--fsize={limits.file_size_mb << 20}:{limits.file_size_mb << 20}",
        f"--nofile={limits.open_files}:{limits.open_files}",
        "--core=0:0",
        "--",
    ]


def _bwrap_argv(
    bwrap: str,
    prlimit: str,
    python: str,
    limits: SandboxLimitsConfig,
    program_args: list[str],
    workdir_src: str | None,
    info_fd: int | None = None,
) -> list[str]:
    """``bwrap ... prlimit ... python -I ...``; the work dir is a tmpfs filled from ``workdir_src`` by copy."""
    prefix = _python_prefix(python)
    tmp_bytes = str(limits.tmp_size_mb << 20)
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(NOBODY_UID),
        "--gid",
        str(NOBODY_UID),
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("lib", "lib32", "lib64", "libx32", "bin", "sbin"):
        target = os.readlink(f"/{name}") if os.path.islink(f"/{name}") else None
        if target is not None:
            argv += ["--symlink", target, f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
    if not prefix.startswith("/usr/") and prefix != "/usr":
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        tmp_bytes,
        "--tmpfs",
        "/dev/shm",
        "--size",
        tmp_bytes,
        "--tmpfs",
        "/tmp",
        "--size",
        tmp_bytes,
        "--tmpfs",
        WORKDIR,
    ]
    if workdir_src is not None:
        # The program's files arrive as a read-only bind of the host dir, copied into the tmpfs at start.
        argv += ["--ro-bind", workdir_src, "/.in"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv += [
        "--chdir",
        WORKDIR,
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--setenv",
        "PYTHONHASHSEED",
        "0",
        "--",
    ]
    return argv + _rlimit_args(prlimit, limits) + [python, "-I", *program_args]


def _boot(started_fd: int, copy_inputs: bool) -> str:
    """The entry point the interpreter runs (``python -I -c``): copy the inputs into the writable
    work dir (confined), write one byte to ``started_fd`` and close it, then run main.py as
    __main__ in this same interpreter (one interpreter start per execution).

    The byte tells the runner that the sandbox and the interpreter are up: a run that ends
    without it failed before the program's first line (bubblewrap's or prlimit's error, an
    interpreter that cannot start under ``memory_mb``), which is the sandbox's error
    (``sandbox_error``), not the program's output.
    """
    copy = "shutil.copytree('/.in','.',dirs_exist_ok=True)\n" if copy_inputs else ""
    return (
        "import os,shutil,runpy,sys\n"
        f"{copy}"
        f"os.write({started_fd},b'1');os.close({started_fd})\n"
        f"sys.argv=[{MAIN_FILE!r}]\n"
        "sys.path.insert(0,os.getcwd())\n"
        f"runpy.run_path({MAIN_FILE!r},run_name='__main__')\n"
    )


# ---------------------------------------------------------------------------------------------
# concurrency: lock files shared by every process of the machine


class _Slots:
    """At most ``n`` executions at once on the machine: one flock'd file per running execution.

    Locks are per open file, so threads of one process and separate processes (reward pool
    workers) count alike; a crashed holder's lock is released by the kernel.
    """

    def __init__(self, n: int, directory: str):
        self.n = n
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def acquire(self, cancel: threading.Event | None = None) -> int | None:
        """A held slot's fd; None once ``cancel`` is set while waiting for one."""
        delay = 0.005
        while cancel is None or not cancel.is_set():
            for i in range(self.n):
                fd = os.open(os.path.join(self.directory, f"slot{i}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except OSError as exc:
                    os.close(fd)
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return None

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing drops the flock


def _default_slots_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"verl-sandbox-slots-{os.getuid()}")


# ---------------------------------------------------------------------------------------------
# running


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (``/proc/PID/task/*/children``, else a scan of ``/proc/*/stat``)."""
    found: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(c) for c in f.read().split())
        return found
    except OSError:
        pass
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the fields after the command name, which may hold spaces and parentheses
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """``pid``'s state letter and start time (clock ticks after boot) from ``/proc/PID/stat``;
    None once it is gone or a zombie (dead, only waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X", "x"):
        return None
    return fields[0], int(fields[19])


def _wait_stopped(pid: int, timeout: float) -> None:
    """Wait until ``pid`` is stopped (or gone): ``kill(SIGSTOP)`` returns before the signal is
    delivered, and a process still running may fork after its children were listed."""
    deadline = time.monotonic() + timeout
    while (st := _stat(pid)) is not None and st[0] not in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.001)


def _finish_init(init_pid: int, started: int | None) -> None:
    """Make sure the sandbox's init is gone. bwrap's outer process exits as soon as the init reports
    the program's exit status, while the init (now a child of pid 1) is still tearing down; on a
    loaded machine it may linger for seconds. It is killed (it has nothing left to do) and waited
    for, so that a finished run leaves no process behind. ``started`` (its start time, read while
    it ran) guards against a pid the kernel has already given to someone else."""
    if started is None:
        return
    deadline = time.monotonic() + _REAP_WAIT_S
    while (st := _stat(init_pid)) is not None and st[1] == started:
        try:
            os.kill(init_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            logger.warning("sandbox init %d still alive %.0f s after its run", init_pid, _REAP_WAIT_S)
            return
        time.sleep(0.01)


def _kill_tree(proc: subprocess.Popen, init_pid: int | None) -> None:
    """Kill a confined run: the sandbox's init (the kernel then kills its whole pid namespace), and
    bwrap itself; returns once bwrap has exited.

    bwrap's outer process is stopped first so that it cannot start an init we would miss; its
    children (the init, also one still being set up, when ``init_pid`` is not known yet) are
    killed; then it is let go on, so that it reaps the init and exits by itself (killed only if it
    does not). Killing the outer process first could leave the init behind: during set-up it has
    no parent-death signal yet and waits forever, and even a dead init would be left to pid 1 to
    reap.
    """
    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    _wait_stopped(proc.pid, timeout=1.0)
    targets = _children(proc.pid)
    if init_pid is not None:
        targets.add(init_pid)
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=_REAP_WAIT_S)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_init_pid(fd: int, deadline: float) -> int | None:
    """The sandbox init's host pid from bwrap's ``--info-fd`` JSON (written once at start, then closed)."""
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _to_bytes(text: str | bytes | None) -> bytes:
    """UTF-8 bytes; what cannot be encoded (a lone surrogate in model output) becomes "?"."""
    if text is None:
        return b""
    return text if isinstance(text, bytes) else text.encode("utf-8", errors="replace")


def _write_inputs(
    directory: str, code: str, files: Mapping[str, str | bytes] | None, limits: SandboxLimitsConfig
) -> None:
    """The program and its ``files`` into ``directory``; ValueError for a name or a size the
    work dir cannot take (refused here, not left to fail inside the sandbox)."""
    files = {name: _to_bytes(content) for name, content in (files or {}).items()}
    total = sum(len(content) for content in files.values()) + len(_to_bytes(code))
    if total > limits.tmp_size_mb << 20:
        raise ValueError(
            f"the program and its files are {total} bytes, more than the work dir's {limits.tmp_size_mb} MiB "
            "(limits.tmp_size_mb)"
        )
    for name, content in files.items():
        norm = os.path.normpath(name) if isinstance(name, str) else ""
        if not norm or norm == "." or os.path.isabs(norm) or norm.startswith(".."):
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the work dir")
        if norm == MAIN_FILE:
            raise ValueError(f"sandbox file name {name!r} is the program's own file; give the file another name")
        path = os.path.join(directory, norm)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content)
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
            raise ValueError(
                f"sandbox file name {name!r} clashes with another file's name (one is a folder of the other)"
            ) from exc
    with open(os.path.join(directory, MAIN_FILE), "wb") as f:
        f.write(_to_bytes(code))


def _classify(
    exit_code: int | None, killed_for: Reason | None, stderr: bytes, confined: bool
) -> tuple[Reason, int | None, int | None]:
    """(reason, exit code, signal) from the raw status."""
    if killed_for is not None:
        return killed_for, None, signal.SIGKILL
    assert exit_code is not None
    sig = None
    if exit_code < 0:  # unconfined: Popen reports a signal as -N
        sig = -exit_code
    elif confined and exit_code > _SIGNAL_BASE and exit_code <= _SIGNAL_BASE + 64:
        # bwrap's init exits 128 + N when the program died of signal N.
        sig = exit_code - _SIGNAL_BASE
    if sig is not None:
        if sig == signal.SIGXCPU:
            return "timeout", None, sig
        if sig == signal.SIGKILL and b"MemoryError" in stderr[-4096:]:
            return "memory", None, sig
        return "killed", None, sig
    if exit_code == 0:
        return "ok", 0, None
    tail = stderr[-4096:]
    if b"MemoryError" in tail or b"Cannot allocate memory" in tail or b"std::bad_alloc" in tail:
        return "memory", exit_code, None
    return "error", exit_code, None


def _preexec_unconfined(limits: SandboxLimitsConfig):
    import resource

    mem = limits.memory_mb << 20
    cpu = max(1, math.ceil(limits.cpu_time_s))
    fsize = limits.file_size_mb << 20

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # RLIMIT_NPROC counts every process of this user, not of this program: not set here.

    return apply


class Sandbox:
    """Runs programs under one ``SandboxConfig`` (interpreter, default limits, concurrency)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        # The interpreter, the slots and the backend are found on first use, so that a trainer
        # without code tasks never fails on them.
        self._python: str | None = None
        self._slots: _Slots | None = None
        self._backend: _Backend | None = None

    @property
    def python(self) -> str:
        """The interpreter the programs run with (``choose_python``)."""
        if self._python is None:
            self._python = choose_python(self.config.python)
        return self._python

    @property
    def confined(self) -> bool:
        """Whether executions are confined by bubblewrap (probed once)."""
        return self._get_backend().bwrap is not None

    def _probe(self) -> _Backend:
        """The tools, and a trial run of the real path (cached per interpreter): namespaces may be
        forbidden here (some containers), or the sandbox user unable to read what it needs."""
        if self.python in _backend_cache:
            return _backend_cache[self.python]
        backend = _find_tools()
        if backend.bwrap is not None:
            trial_limits = SandboxLimitsConfig(wall_time_s=60.0, cpu_time_s=30.0)
            trial = self._run_in_slot(
                backend, "print(open('probe.txt').read())", None, {"probe.txt": "ok"}, trial_limits
            )
            if trial.reason != "ok" or trial.stdout != "ok\n":
                backend = _Backend(
                    None,
                    backend.prlimit,
                    f"bwrap failed to run a program here ({trial.reason}): {(trial.detail + ' ' + trial.stderr)[-500:]}",
                )
        _backend_cache[self.python] = backend
        return backend

    def _get_backend(self) -> _Backend:
        if self._backend is None:
            self._backend = self._probe()
            if self._backend.bwrap is None:
                if not self.config.allow_unconfined:
                    raise SandboxUnavailable(
                        f"cannot confine untrusted code: {self._backend.why_not}. Install bubblewrap "
                        "(tools/setup_env.sh does as root), or set sandbox.allow_unconfined=true to run it with "
                        "rlimits only (the program can then reach the network and the host's files)"
                    )
                _warn_once(
                    f"sandbox: running untrusted code UNCONFINED (rlimits only; network, files and processes of "
                    f"the host are reachable) because {self._backend.why_not}; sandbox.allow_unconfined=true allows it"
                )
        return self._backend

    def run(
        self,
        code: str,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        limits: SandboxLimitsConfig | None = None,
        cancel: threading.Event | None = None,
    ) -> RunResult:
        """Run the Python program ``code`` with ``stdin``, the extra ``files`` in its work dir, and ``limits``.

        Setting ``cancel`` (from another thread) ends the run within ``_POLL_S`` and its whole
        process tree with it (reason cancelled), also while it waits for a free slot.
        Never raises for anything the program does; raises ValueError for bad arguments and
        SandboxUnavailable when confinement is impossible and not waived.
        """
        limits = limits or self.config.limits
        backend = self._get_backend()
        if self._slots is None:
            self._slots = _Slots(
                self.config.max_concurrent or os.cpu_count() or 1,
                self.config.slots_dir or _default_slots_dir(),
            )
        slot = self._slots.acquire(cancel)
        if slot is None:
            return RunResult(
                "", "", None, "cancelled", 0.0, confined=backend.bwrap is not None,
                detail="cancelled while waiting for a free slot",
            )
        try:
            return self._run_in_slot(backend, code, stdin, files, limits, cancel)
        finally:
            self._slots.release(slot)

    def _run_in_slot(
        self,
        backend: _Backend,
        code: str,
        stdin: str | bytes | None,
        files: Mapping[str, str | bytes] | None,
        limits: SandboxLimitsConfig,
        cancel: threading.Event | None = None,
    ) -> RunResult:
        confined = backend.bwrap is not None
        with tempfile.TemporaryDirectory(prefix="verl-sbx-") as host_dir:
            in_dir = os.path.join(host_dir, "in")
            os.mkdir(in_dir)
            _write_inputs(in_dir, code, files, limits)
            stdin_path = os.path.join(host_dir, "stdin")
            with open(stdin_path, "wb") as f:
                f.write(_to_bytes(stdin))
            if confined:
                if _is_root():
                    # nobody must read the inputs (bwrap binds them as that user).
                    for path in (host_dir, in_dir):
                        os.chmod(path, 0o755)
                    for dirpath, dirnames, filenames in os.walk(in_dir):
                        for name in dirnames:
                            os.chmod(os.path.join(dirpath, name), 0o755)
                        for name in filenames:
                            os.chmod(os.path.join(dirpath, name), 0o644)
            started_r, started_w = os.pipe()
            if confined:
                info_r, info_w = os.pipe()
                argv = _bwrap_argv(
                    backend.bwrap,
                    backend.prlimit,
                    self.python,
                    limits,
                    ["-c", _boot(started_w, copy_inputs=True)],
                    in_dir,
                    info_w,
                )
                kwargs = {**_popen_user_kwargs(), "pass_fds": [info_w, started_w]}
                cwd = host_dir
            else:
                info_r = info_w = None
                argv = [self.python, "-I", "-c", _boot(started_w, copy_inputs=False)]
                kwargs = {"preexec_fn": _preexec_unconfined(limits), "pass_fds": [started_w]}
                cwd = in_dir
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "PYTHONHASHSEED": "0",
                "HOME": cwd,
            }
            try:
                with open(stdin_path, "rb") as stdin_file:
                    return self._supervise(
                        argv, stdin_file, cwd, env, kwargs, limits, info_r, info_w, (started_r, started_w), cancel
                    )
            finally:
                os.close(started_r)
                if info_r is not None:
                    os.close(info_r)

    def _supervise(
        self,
        argv,
        stdin_file,
        cwd,
        env,
        kwargs,
        limits: SandboxLimitsConfig,
        info_r: int | None,
        info_w: int | None,
        started_pipe: tuple[int, int],
        cancel: threading.Event | None,
    ) -> RunResult:
        """Start ``argv`` and watch it to the end: wall time, output size, the confinement's start
        report; kill the whole tree at a limit; the result with its reason.

        Longer than most functions: one loop over one child's lifetime, whose exits (each limit,
        the child's end, a failed start) share the same clean-up; split, the clean-up would be
        repeated per exit.
        """
        confined = info_r is not None
        started_r, started_w = started_pipe
        start = time.monotonic()
        # A scorer's time limit raises from a signal handler, between any two bytecodes. Here it is
        # held back (deferred) from the start to the end of the clean-up and let through only in the
        # waits (interruptible), where the clean-up below covers whatever state the run is in. In
        # suite17 (load 39) it fired while bwrap's start report was awaited, outside any clean-up,
        # and left bwrap running.
        with deferred():
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **kwargs,
                )
            except OSError as exc:
                return RunResult(
                    "", "", None, "sandbox_error", 0.0, confined=confined, detail=f"could not start: {exc}"
                )
            finally:
                os.close(started_w)  # the boot code holds its own copy
                if info_w is not None:
                    os.close(info_w)  # bwrap holds its own copy; EOF on info_r once it has written
            init_pid: int | None = None
            init_stat = None
            out, err, started = bytearray(), bytearray(), bytearray()
            killed_for: Reason | None = None
            detail = ""
            try:
                if confined:
                    with interruptible():
                        init_pid = _read_init_pid(info_r, start + limits.wall_time_s)
                    init_stat = _stat(init_pid) if init_pid is not None else None
                sel = selectors.DefaultSelector()
                sel.register(proc.stdout, selectors.EVENT_READ, out)
                sel.register(proc.stderr, selectors.EVENT_READ, err)
                sel.register(started_r, selectors.EVENT_READ, started)
                deadline = start + limits.wall_time_s
                open_streams = 2
                while open_streams:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        killed_for, detail = "timeout", f"wall time over {limits.wall_time_s:g} s"
                        break
                    if cancel is not None and cancel.is_set():
                        killed_for, detail = "cancelled", _CANCELLED
                        break
                    with interruptible():
                        events = sel.select(min(left, _POLL_S))
                    if not events and proc.poll() is not None:
                        # The main process is gone and its pipes are quiet: whatever still holds them (a
                        # child left behind, outside a sandbox) is not waited for.
                        break
                    for key, _ in events:
                        chunk = os.read(key.fd, 65536)
                        if not chunk:
                            sel.unregister(key.fileobj)
                            if key.data is not started:
                                open_streams -= 1
                            continue
                        buf = key.data
                        if buf is started:
                            started += chunk
                            continue
                        buf += chunk
                        if len(buf) > limits.output_bytes:
                            del buf[limits.output_bytes :]
                            killed_for = "output_limit"
                            detail = f"{'stdout' if buf is out else 'stderr'} over {limits.output_bytes} bytes"
                            break
                    if killed_for:
                        break
                # Output closed: the program is done (or closed its pipes); wait what is left of the
                # wall time, watching ``cancel``.
                while killed_for is None:
                    try:
                        with interruptible():
                            proc.wait(timeout=min(max(deadline - time.monotonic(), 0.001), _POLL_S))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            killed_for, detail = "timeout", f"wall time over {limits.wall_time_s:g} s"
                        elif cancel is not None and cancel.is_set():
                            killed_for, detail = "cancelled", _CANCELLED
                if not started and proc.poll() is not None:
                    # A start byte may be in the pipe still when the program ended at once.
                    ready, _, _ = select.select([started_r], [], [], 0)
                    if ready:
                        started += os.read(started_r, 1)
                sel.close()
            finally:
                # On every exit, a scorer's time limit included: never leave the tree running. Still
                # deferred: the limit's timer fires again every 50 ms until its block has unwound, and
                # on a loaded machine the clean-up can take longer (suite16: a re-fire cut it short
                # after bwrap was stopped, leaving it stopped and the program running).
                self._clean_up(proc, init_pid, init_stat, confined)
        wall = time.monotonic() - start
        if killed_for is None and not started and proc.returncode != 0:
            # It ended before the program's first line: the sandbox's failure, not the program's.
            message = err.decode("utf-8", errors="replace").strip().splitlines()
            return RunResult(
                out.decode("utf-8", errors="replace"),
                err.decode("utf-8", errors="replace"),
                None,
                "sandbox_error",
                time.monotonic() - start,
                confined=confined,
                detail=(
                    f"the sandbox failed to start the program (exit status {proc.returncode}): "
                    f"{message[-1] if message else 'no message'}"
                ),
            )
        reason, exit_code, sig = _classify(
            proc.returncode if killed_for is None else None, killed_for, bytes(err), confined
        )
        if reason == "timeout" and not detail:
            detail = f"CPU time over {limits.cpu_time_s:g} s"
        if sig is not None and not detail:
            detail = (
                f"killed by signal {sig} ({signal.Signals(sig).name})"
                if sig in signal.valid_signals()
                else f"signal {sig}"
            )
        return RunResult(
            out.decode("utf-8", errors="replace"),
            err.decode("utf-8", errors="replace"),
            exit_code,
            reason,
            wall,
            signal=sig,
            confined=confined,
            detail=detail,
        )


    @staticmethod
    def _clean_up(proc: subprocess.Popen, init_pid: int | None, init_stat, confined: bool) -> None:
        """:meth:`_supervise`'s end, on every exit: kill the tree if it still runs, reap it, close the pipes."""
        if proc.poll() is None:
            if confined:
                _kill_tree(proc, init_pid)
            else:
                # The program itself is the group's leader: killing only its children (as for bwrap,
                # whose children are the sandbox) left it running until the 5 s reap wait ran out.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        # bwrap's outer process exits once its init has reported the program's exit status; the init
        # exits only after every process of its pid namespace, and _finish_init waits for it: once
        # this returns, nothing of the program is left.
        proc.wait()
        if init_pid is not None:
            _finish_init(init_pid, init_stat[1] if init_stat else None)
        proc.stdout.close()
        proc.stderr.close()
        if not confined:
            # Anything left in the program's session (a child that kept running). The group
            # outlives its leader while members remain, so this reaches them after the wait.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ---------------------------------------------------------------------------------------------
# the process-wide default


_default: Sandbox | None = None
_default_key: str | None = None
_default_lock = threading.Lock()
ENV_CONFIG = "VERL_SANDBOX_CONFIG"


def _config_key(config: SandboxConfig) -> str:
    import json

    from verl.config.loader import to_dict

    return json.dumps(to_dict(config), sort_keys=True)


def configure(config: SandboxConfig) -> None:
    """Make ``config`` the default of ``run`` in this process and in processes it starts later.

    The config travels to spawned workers (the reward manager's pool) in the environment
    variable ``VERL_SANDBOX_CONFIG``.
    """
    global _default, _default_key
    key = _config_key(config)
    with _default_lock:
        os.environ[ENV_CONFIG] = key
        if key != _default_key:
            _default, _default_key = Sandbox(config), key


def default_sandbox() -> Sandbox:
    """The sandbox ``run`` uses: the configured one, else one built from ``VERL_SANDBOX_CONFIG`` or the defaults."""
    global _default, _default_key
    with _default_lock:
        key = os.environ.get(ENV_CONFIG)
        if _default is None or (key is not None and key != _default_key):
            import json

            from verl.config.loader import from_dict

            config = from_dict(SandboxConfig, json.loads(key)) if key else SandboxConfig()
            _default, _default_key = Sandbox(config), key
        return _default


def run(
    code: str,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    limits: SandboxLimitsConfig | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Run the Python program ``code`` confined, with the process-wide sandbox (see ``Sandbox.run``)."""
    return default_sandbox().run(code, stdin=stdin, files=files, limits=limits, cancel=cancel)
