"""Hostile "model answers", one per test: each is contained, says why, and leaves the host as it was."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading

import psutil
import pytest

from tests.sandbox.conftest import ROOMY_LIMITS

pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_socket_to_the_host_and_to_loopback_is_refused(sandbox):
    # A listener on the host's 127.0.0.1: the program must not reach it (its loopback is its own).
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"""
import socket
for host in ("127.0.0.1", "8.8.8.8", "1.1.1.1"):
    try:
        s = socket.create_connection((host, {port} if host == "127.0.0.1" else 53), timeout=0.5)
        s.sendall(b"leak")
        print("CONNECTED", host)
    except OSError as exc:
        print("blocked", host, type(exc).__name__)
try:
    socket.getaddrinfo("example.com", 80)
    print("RESOLVED")
except OSError:
    print("no dns")
import dataclasses
import os
print(sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else "no sysfs")
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    try:
        conn, _ = server.accept()
        conn.close()
        reached = True
    except TimeoutError:
        reached = False
    finally:
        server.close()
    assert result.reason == "ok", result
    assert not reached, "the sandboxed program connected to the host's 127.0.0.1"
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout, result.stdout
    assert result.stdout.count("blocked") == 3


def test_fork_bomb_is_contained(sandbox):
    code = """
import dataclasses
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    result = sandbox.run(code)
    assert result.reason == "timeout", result
    assert result.exit_code is None
    # no_leftovers checks that none of the forked processes outlived the run. (The machine's process
    # count is not compared: other jobs start and end processes meanwhile.)


def test_allocating_without_end_hits_the_memory_limit(sandbox):
    code = """
chunks = []
while True:
    chunks.append(bytearray(16 << 20))
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "memory", result
    assert "MemoryError" in result.stderr


def test_filling_the_private_tmpfs_stays_within_its_size(sandbox):
    # /dev/shm and /tmp are tmpfs (host memory): their size is capped, so this ends with ENOSPC.
    code = """
import itertools
for d in ("/dev/shm", "/tmp", "."):
    try:
        for i in itertools.count():
            with open(f"{d}/f{i}", "wb") as f:
                f.write(b"x" * (1 << 20))
    except OSError as exc:
        print(d, exc.errno)
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "ok", result
    assert result.stdout.split() == ["/dev/shm", "28", "/tmp", "28", ".", "28"]  # 28: ENOSPC


def test_busy_loop_is_stopped_by_the_cpu_limit(sandbox):
    result = sandbox.run("while True:\n    pass\n")
    assert result.reason == "timeout", result
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL)


def test_sleeping_forever_is_stopped_by_the_wall_limit(sandbox):
    result = sandbox.run("import time\nwhile True:\n    time.sleep(10)\n")
    assert result.reason == "timeout", result
    assert "wall time" in result.detail


def test_writing_outside_its_dir_changes_nothing_on_the_host(sandbox, tmp_path):
    target = tmp_path / "planted.txt"
    code = f"""
import dataclasses
import os
for path in ({str(target)!r}, "/usr/planted.txt", "/planted.txt", "/etc/planted.txt", "/proc/planted.txt"):
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, exc.errno)
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "ok", result
    assert not target.exists()
    assert not os.path.exists("/usr/planted.txt") and not os.path.exists("/planted.txt")
    assert not os.path.exists("/etc/planted.txt")
    # Writes to new top-level paths land nowhere (the sandbox root is its own); the host is unchanged.
    assert "wrote /usr/planted.txt" not in result.stdout


def test_the_runs_checkpoints_cannot_be_read(sandbox, tmp_path):
    ckpt = tmp_path / "global_step_1" / "model.pt"
    ckpt.parent.mkdir()
    ckpt.write_text("SECRET-CHECKPOINT-BYTES")
    # The needle is assembled at run time so that the program's own source does not contain it.
    code = f"""
import dataclasses
import os
needle = "SECRET-" + "CHECKPOINT"
try:
    print(open({str(ckpt)!r}).read())
except OSError as exc:
    print("cannot open", exc.errno)
for root, dirs, files in os.walk("/"):
    if root.startswith(("/proc", "/usr", "/sys", "/dev")):
        dirs[:] = []
        continue
    for name in files:
        try:
            if needle in open(os.path.join(root, name), errors="ignore").read():
                print("FOUND", root, name)
        except OSError:
            pass
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "ok", result
    assert "SECRET-CHECKPOINT-BYTES" not in result.stdout and "FOUND" not in result.stdout, result.stdout
    assert "cannot open 2" in result.stdout  # ENOENT: the path does not exist in the sandbox


def test_the_trainers_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("VERL_TEST_SECRET_TOKEN", "hunter2-secret")
    code = """
import dataclasses
import os
print(sorted(os.environ))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            print(open(f"/proc/{pid}/environ", "rb").read())
        except OSError:
            pass
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "ok", result
    assert "hunter2" not in result.stdout and "VERL_TEST_SECRET_TOKEN" not in result.stdout


def test_killing_its_parent_and_everything_leaves_the_host_alive(sandbox):
    me = psutil.Process()
    code = f"""
import os, signal
for pid in (os.getppid(), 1, {os.getpid()}, {os.getppid()}, -1):  # its parent, init, the trainer, everything
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled", pid)
    except OSError as exc:
        print("refused", pid, exc.errno)
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert me.is_running() and psutil.Process(os.getppid()).is_running()
    # The sandbox's init ignores SIGKILL from inside its namespace (kill returns 0, nothing happens),
    # the trainer's pids do not exist there (ESRCH = 3), and kill(-1) finds nothing else to kill.
    assert result.reason == "ok", result
    assert f"refused {os.getpid()} 3" in result.stdout and f"refused {os.getppid()} 3" in result.stdout, (
        result.stdout
    )


def test_printing_gigabytes_stops_at_the_output_limit(sandbox):
    code = """
import sys
block = "x" * (1 << 20)
for _ in range(4096):  # 4 GiB
    sys.stdout.write(block)
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "output_limit", result
    assert len(result.stdout) == ROOMY_LIMITS.output_bytes


def test_a_child_left_behind_is_killed_with_the_program(sandbox):
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)   # a daemon, detached twice
    os._exit(0)
print("parent done")
"""
    result = sandbox.run(code, limits=ROOMY_LIMITS)
    assert result.reason == "ok", result
    assert result.stdout == "parent done\n"
    # no_leftovers checks that the daemon is gone.


def test_concurrent_hostile_runs_do_not_disturb_each_other(sandbox):
    results = {}

    def go(name, code, limits=None):
        results[name] = sandbox.run(code, limits=limits)

    threads = [
        threading.Thread(
            target=go, args=("bomb", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n")
        ),
        threading.Thread(target=go, args=("good", "print(sum(range(10)))", ROOMY_LIMITS)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["good"].reason == "ok" and results["good"].stdout == "45\n", results["good"]
    assert results["bomb"].reason == "timeout"


def test_a_run_killed_while_bwrap_sets_up_leaves_nothing(sandbox):
    # Wall limits shorter than bwrap's set-up: the kill lands before the program (or the sandbox's
    # init) is ready. An init killed then must not be left waiting for a parent that is gone.
    for wall in (0.001, 0.003, 0.01, 0.03) * 3:
        result = sandbox.run("print(1)", limits=dataclasses.replace(ROOMY_LIMITS, wall_time_s=wall))
        assert result.reason in ("timeout", "ok"), result
