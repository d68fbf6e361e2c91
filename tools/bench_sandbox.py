"""Throughput of the code sandbox: confined executions per second of a short program.

    python tools/bench_sandbox.py [--runs 200] [--threads 2] [--program add|prelude|noop] [--unconfined]

Runs ``--runs`` executions from ``--threads`` threads (each execution its own bubblewrap sandbox,
at most ``max_concurrent`` = the number of CPUs at once) and prints ONE JSON object on stdout:
executions per second, the mean and p50/p95 wall time of one execution as the runner saw it,
and how many ended other than "ok" (must be 0). ``--program``: ``add`` reads two numbers and
prints their sum (a stdin/stdout test), ``prelude`` is the same under the code scorers' prelude
of imports (what one test of ``verl.rewards.code`` costs), ``noop`` is ``pass``.
``--unconfined`` measures the rlimits-only fallback, for the cost of the confinement itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl.config.schema import SandboxConfig
from verl.rewards.code import _PRELUDE
from verl.sandbox import (
    Sandbox,
    runner,
)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
PROGRAMS = {"add": ADD, "prelude": _PRELUDE + ADD, "noop": "pass\n"}


def bench(runs: int, threads: int, program: str, unconfined: bool) -> dict:
    box = Sandbox(SandboxConfig(allow_unconfined=unconfined))
    if unconfined:
        real_which = runner.shutil.which
        with mock.patch.object(runner.shutil, "which", lambda n: None if n == "bwrap" else real_which(n)):
            runner._backend_cache.clear()
            confined = box.confined
    else:
        confined = box.confined
    code = PROGRAMS[program]
    box.run(code, stdin="1 2")  # warm the page cache
    times: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    counter = iter(range(runs))

    def worker() -> None:
        while True:
            with lock:
                if next(counter, None) is None:
                    return
            result = box.run(code, stdin="1 2")
            with lock:
                times.append(result.wall_time_s)
                if not result.ok or result.stdout.strip() not in ("3", ""):
                    failures.append(f"{result.reason}: {result.stderr[-200:]}")

    start = time.monotonic()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - start
    times.sort()
    return {
        "program": program,
        "confined": confined,
        "runs": runs,
        "threads": threads,
        "max_concurrent": box.config.max_concurrent or os.cpu_count(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "executions_per_s": round(runs / elapsed, 2),
        "mean_s": round(statistics.fmean(times), 4),
        "p50_s": round(times[len(times) // 2], 4),
        "p95_s": round(times[min(len(times) - 1, int(len(times) * 0.95))], 4),
        "not_ok": len(failures),
        "first_failure": failures[0] if failures else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="executions in all (default 200)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="caller threads (default: CPUs)"
    )
    parser.add_argument("--program", choices=sorted(PROGRAMS), default="add", help="what each execution runs")
    parser.add_argument(
        "--unconfined", action="store_true", help="the rlimits-only fallback instead of bubblewrap"
    )
    args = parser.parse_args()
    print(json.dumps(bench(args.runs, args.threads, args.program, args.unconfined)))


if __name__ == "__main__":
    main()
