"""``bench.py soak``: the RL loop for many steps, every rank's memory sampled each step, and the drift.

Runs ``--steps`` steps of verl's RL trainer (``PPOTrainer``, as ``main_ppo`` builds it) with a
checkpoint every ``--save-every`` steps (saves are part of a long run, and where memory was seen
to step up), and after each step records every rank's resident memory (RSS, from
``/proc/self/statm``) and, on CUDA, its allocated and reserved device memory. Reports per rank:
the RSS after the warm-up (``--warmup`` steps, median of the next ``--window``), at the end
(median of the last ``--window``), the drift between them as a share, the largest rise of one
step and the rises at the saves. With ``--plot PATH``, a PNG of RSS per rank against the step,
saves marked. torchrun-able; one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from tools.benchmarks.harness import Runner, bench_inputs, is_rank_zero, machine, median, rl_config, subcommand
from verl.utils.cli import positive_int

logger = logging.getLogger(__name__)

MIB = 2**20


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def drift(series: list[float], *, warmup: int, window: int) -> dict[str, float]:
    """``{"start", "end", "drift"}`` of one rank's per-step ``series`` (index = step - 1): the median
    of the ``window`` steps after ``warmup``, the median of the last ``window``, and
    ``end / start - 1`` (medians, so a single sample caught mid-step does not move it)."""
    if len(series) < warmup + window:
        raise ValueError(f"{len(series)} steps cannot give a drift after a warm-up of {warmup} over a window of {window}")
    start = median(series[warmup : warmup + window])
    end = median(series[-window:])
    return {"start": start, "end": end, "drift": end / start - 1.0}


def _plot(path: str, ranks: list[dict[str, Any]], saves: list[int], warmup: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r, rank in enumerate(ranks):
        steps = list(range(1, len(rank["rss_mib"]) + 1))
        ax.plot(steps, rank["rss_mib"], label=f"rank {r} (drift {100 * rank['drift']:+.1f}%)", linewidth=1)
    for s in saves:
        ax.axvline(s, color="grey", linewidth=0.5, linestyle=":")
    ax.axvline(warmup, color="black", linewidth=0.8, linestyle="--", label=f"end of warm-up (step {warmup})")
    ax.set_xlabel("step (dotted: checkpoint saves)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _soak_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from verl.trainer.entry import trainer_session
    from verl.trainer.ppo_trainer import PPOTrainer

    if args.warmup + args.window > args.steps:
        raise ValueError(f"--steps {args.steps} must be at least --warmup {args.warmup} + --window {args.window}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # One folder for every rank (the checkpoints are shared): named by torchrun's run id.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") if world > 1 else None
    root = os.path.join(tempfile.gettempdir(), f"verl-bench-soak-{run_id}") if run_id else tempfile.mkdtemp(
        prefix="verl-bench-soak-")
    os.makedirs(root, exist_ok=True)
    try:
        overrides = list(args.overrides)
        if args.inputs:
            made = bench_inputs(args.inputs, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                prompts=args.prompts)
            overrides = [f"actor_rollout_ref.model.path={made['model']}", f"data.train_files={made['train']}",
                         *overrides]
        # Checkpoints as a long run writes them (kept few: the disk is not what is measured).
        # As many epochs as the steps need (the data loops), at most --steps steps.
        overrides = [f"trainer.total_training_steps={args.steps}", f"trainer.total_epochs={args.steps}",
                     "trainer.max_actor_ckpt_to_keep=2",
                     "trainer.max_critic_ckpt_to_keep=2", *overrides]
        cfg = rl_config(args.config, overrides, root, world)
        torch.set_num_threads(args.threads)
        rss, allocated, reserved, step_s, saves = [], [], [], [], []
        with trainer_session(cfg, PPOTrainer) as trainer:  # as main_ppo: the world, the trainer, the teardown
            cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
            if trainer.total_steps < args.steps:
                raise ValueError(f"the data gives {trainer.total_steps} steps, fewer than --steps {args.steps}: "
                                 "use more prompts (--prompts, data.train_files) or more epochs "
                                 "(trainer.total_epochs)")
            for step in range(1, args.steps + 1):
                start = time.perf_counter()
                if trainer.train_step() is None:
                    raise ValueError(f"the data ran out at step {step}")
                if args.save_every and step % args.save_every == 0:
                    trainer.save_checkpoint()
                    saves.append(step)
                step_s.append(time.perf_counter() - start)
                rss.append(rss_bytes() / MIB)
                if cuda:
                    allocated.append(torch.cuda.memory_allocated() / MIB)
                    reserved.append(torch.cuda.memory_reserved() / MIB)
                if is_rank_zero() and step % max(1, args.steps // 20) == 0:
                    logger.info("soak: step %d/%d, rank 0 RSS %.1f MiB", step, args.steps, rss[-1])
            mine = {"rss_mib": rss, "allocated_mib": allocated, "reserved_mib": reserved, "step_s": step_s}
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, mine)
    finally:
        if is_rank_zero():
            shutil.rmtree(root, ignore_errors=True)
    out_ranks = []
    for r in ranks:
        d = drift(r["rss_mib"], warmup=args.warmup, window=args.window)
        after = r["rss_mib"][args.warmup :]
        rises = [b - a for a, b in zip(r["rss_mib"], r["rss_mib"][1:])]
        one = {
            "rss_start_mib": round(d["start"], 1),
            "rss_end_mib": round(d["end"], 1),
            "drift": d["drift"],
            "rss_max_after_warmup_mib": round(max(after), 1),
            "largest_step_rise_mib": round(max(rises, default=0.0), 1),
            # RSS after a save step less RSS after the step before it.
            "rise_at_saves_mib": [round(r["rss_mib"][s - 1] - r["rss_mib"][s - 2], 1) for s in saves if s >= 2],
            "median_step_s": median(r["step_s"]),
            "rss_mib": [round(v, 1) for v in r["rss_mib"]],
        }
        if r["allocated_mib"]:
            one["device_allocated_drift"] = drift(r["allocated_mib"], warmup=args.warmup, window=args.window)["drift"]
            one["device_reserved_drift"] = drift(r["reserved_mib"], warmup=args.warmup, window=args.window)["drift"]
            one["device_allocated_mib"] = [round(v, 1) for v in r["allocated_mib"]]
        out_ranks.append(one)
    result: dict[str, Any] = {
        "bench": "soak",
        "config": args.config,
        "overrides": overrides,
        "world_size": world,
        "steps": args.steps,
        "warmup": args.warmup,
        "window": args.window,
        "save_every": args.save_every,
        "saves": saves,
        "max_drift": max(r["drift"] for r in out_ranks),
        "ranks": out_ranks,
        "machine": machine(),
    }
    if args.plot and is_rank_zero():
        _plot(args.plot, out_ranks, saves, args.warmup,
              f"bench.py soak: {args.config}, {world} rank(s), {args.steps} steps, save every {args.save_every}")
        result["plot"] = os.path.abspath(args.plot)
    return result


@subcommand("soak", "the RL loop for many steps with checkpoints: every rank's memory per step and its drift")
def _soak(p: argparse.ArgumentParser) -> Runner:
    p.description = __doc__
    p.add_argument("--config", default="grpo_tiny_cpu", help="a config under configs/ or a YAML path (default %(default)s)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as main_ppo takes them")
    p.add_argument("--steps", type=positive_int, default=1000, help="steps run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=100, help="steps before the drift's start (default %(default)s)")
    p.add_argument("--window", type=positive_int, default=20,
                   help="steps whose median RSS is the start (after the warm-up) and the end (default %(default)s)")
    p.add_argument("--save-every", type=int, default=100, help="a checkpoint every N steps; 0: none (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default %(default)s)")
    p.add_argument("--plot", default=None, help="write a PNG of RSS per rank against the step here")
    p.add_argument("--inputs", default=None,
                   help="make (once) a random tiny Qwen2 and 2-digit arithmetic prompts in this folder and use them "
                        "(else the config's model.path and data.train_files)")
    p.add_argument("--hidden", type=positive_int, default=64, help="--inputs model hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="--inputs model layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="--inputs model heads (default %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=2000, help="--inputs prompts made (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        result = _soak_run(args)
        if is_rank_zero():
            for r, rank in enumerate(result["ranks"]):
                logger.info("soak: rank %d RSS %.1f -> %.1f MiB after step %d: drift %+.2f%%; rises at saves %s MiB",
                            r, rank["rss_start_mib"], rank["rss_end_mib"], args.warmup, 100 * rank["drift"],
                            rank["rise_at_saves_mib"])
        return result

    return run
