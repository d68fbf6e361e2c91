"""Benchmarks of verl's phases: ``python tools/bench.py <subcommand> ...`` (``--help`` lists them);
each prints ONE JSON object on stdout. The code is the package ``tools/benchmarks`` (one module per
subcommand, a shared harness); this file is its command line."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: tools.benchmarks

from tools.benchmarks.cli import main

if __name__ == "__main__":
    main()
