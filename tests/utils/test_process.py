"""Children die with a SIGKILLed parent (verl.utils.process), in the two races the suite met."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.processes import kill_tree

ROOT = Path(__file__).resolve().parents[2]

# Each script prints its child's pid on the first line of stdout.
FORKED = """
import multiprocessing, os, sys, time
sys.path.insert(0, {root!r})
from verl.utils.process import forks_die_with_this_process

def wait_for_an_item(q):  # as Megatron's forked checkpoint writer waits on its count queue
    q.get()

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    outside = ctx.Process(target=wait_for_an_item, args=(q,))
    outside.start()  # outside the block: no parent-death signal
    with forks_die_with_this_process():
        child = ctx.Process(target=wait_for_an_item, args=(q,))
        child.start()
    print(child.pid, outside.pid, flush=True)
    time.sleep(600)
"""

SPAWNED = """
import multiprocessing, os, sys, time
sys.path.insert(0, {root!r})

if __name__ == "__mp_main__":
    time.sleep(1.0)  # the parent dies while this child still imports its __main__
    from verl.utils.process import exit_with_parent
    exit_with_parent(poll_s=0.2)

def forever():
    time.sleep(600)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=forever)
    child.start()
    print(child.pid, flush=True)
    os._exit(0)  # as SIGKILL would: before the child has run a line of this module
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children_of(script: str, tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    path = tmp_path / "parent.py"
    path.write_text(textwrap.dedent(script.format(root=str(ROOT))))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, [int(pid) for pid in proc.stdout.readline().split()]


def _gone_within(pid: int, seconds: float) -> bool:
    # Quiet, the child goes within a second (poll_s); the guard is sized for a loaded machine.
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.timeout(300)
def test_a_child_forked_in_the_block_dies_with_its_killed_parent(tmp_path):
    proc, (child, outside) = _children_of(FORKED, tmp_path)
    try:
        assert _alive(child) and _alive(outside)
        proc.kill()
        proc.wait()
        assert _gone_within(child, 120), "the forked child outlived its parent"
        assert _alive(outside)  # forked outside the block: left alone (the hook does nothing there)
    finally:
        kill_tree(proc)
        for pid in (child, outside):
            if _alive(pid):
                os.kill(pid, 9)


@pytest.mark.timeout(300)
def test_a_spawned_child_dies_when_its_parent_went_before_it_imported_main(tmp_path):
    proc, [child] = _children_of(SPAWNED, tmp_path)
    try:
        proc.wait()
        assert _gone_within(child, 120), "the spawned child outlived its parent"
    finally:
        kill_tree(proc)
        if _alive(child):
            os.kill(child, 9)
