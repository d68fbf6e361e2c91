"""Benchmarks of verl's phases; each subcommand prints ONE JSON object on stdout (logs go to stderr).

    python tools/bench.py rollout --model HF_DIR --engine vllm --prompts 64 --n 4 --max-tokens 32
    python tools/bench.py rollout --model HF_DIR --engine vllm --baseline hf hf-generate   # + speed-ups

Subcommands register themselves with ``@subcommand(name, help)``: a function that adds its
arguments to a parser and returns the function that runs it (``args -> dict``).

rollout: samples ``--prompts`` prompts ``--n`` times with the chosen engine (after a warm-up
call; ``--repeats`` rounds, medians reported; with ``--baseline`` every engine is timed in
each round, one after the other, so a load spike on a shared machine hits all of them), then
recomputes the logprobs of the same samples with the trainer's model and reports
``tokens_per_s``, ``logprob_max_abs_diff``, ``logprob_mean_abs_diff`` and
``token_mult_prob_error`` (exp of the mean absolute per-token logprob difference).
Baselines: ``hf`` is verl's transformers engine (``generate`` with ``output_scores`` for the
logprobs, same output batch); ``hf-generate`` a plain ``model.generate`` call on the same
left-padded prompts (``num_return_sequences=n``, same length limit and sampling settings, no
scores or logprobs: the floor for transformers). ``cpu_s`` is the process CPU time of a round,
less sensitive than wall time to other processes on a shared machine.
``--reference megatron`` (default) is the actor's Megatron model (verl.models, one rank, TP=1),
``hf`` a transformers forward; ``logprob_reference`` in the output says which was used.
What the CPU vLLM build's fast paths were measured to save with it: docs/rollout-performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys

from tools.benchmarks.harness import SUBCOMMANDS, Runner, write_result  # first: sets vLLM's environment
from verl.utils.cli import user_errors

# Each module registers its subcommand on import: in this order (``--help``'s).
for _module in ("rollout", "reshard", "rl_step", "packing", "compare_trl", "soak", "async_modes", "lora_memory",
                "cp_memory"):
    importlib.import_module(f"tools.benchmarks.{_module}")


def main(argv: list[str] | None = None) -> None:
    from verl.utils.logging import setup_logging
    from verl.utils.process import die_with_launcher

    die_with_launcher()  # under torchrun: a kill -9 of the agent takes this rank along
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    runners: dict[str, Runner] = {}
    for name, (help_text, build) in SUBCOMMANDS.items():
        runners[name] = build(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    setup_logging(logging.INFO)
    # Anything a library prints goes to stderr; stdout carries exactly one JSON object.
    with contextlib.redirect_stdout(sys.stderr), user_errors(parser.prog):
        result = runners[args.command](args)
    write_result(result)
