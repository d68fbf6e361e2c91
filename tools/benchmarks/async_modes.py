"""``bench.py async``: the rollout modes side by side (``trainer.rollout_mode`` sync, one_step_off,
async) on the same ranks, the same task and the same number of trained samples.

Run under torchrun with 2 ranks: the rollout on rank 1, the actor (and every other role) on rank 0
(``trainer.placement.rollout=[1]``), so in the streaming modes rank 1 generates the next batch
while rank 0 trains. For each mode, in one process, one after the other: a trainer as ``main_ppo``
builds it (validation, checkpoints, loggers off), ``--warmup`` steps, then ``--steps`` measured
steps. Reported per mode: generated tokens per second (the trained batches' response tokens over
the measured steps' wall time), the median step, the phases on each rank (``timing_s/*``: on rank
1 ``gen_ahead`` is the generation ahead, which runs while rank 0 computes the old and reference
log-probs and the update (``verl.trainer.step.stream``), on rank 0 ``exchange`` includes its wait
for rank 1 after the update), the staleness of the trained samples, and the reward
against samples seen. Speed-ups are against the first mode (sync by default). ``--rounds`` repeats
the modes in alternating order (a load spike on a shared machine then hits every mode); medians
over rounds.
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

MODES = ("sync", "one_step_off", "async")
# Modes beyond trainer.rollout_mode's own (asked for with --modes): async with partial rollout, with
# it filling each update window until the update ends (async_training.fill_update_window), and async
# with a generator thread that never stops at step boundaries (async_training.free_running), in whole
# batches and with partial rollout.
EXTRA_MODES = ("async_partial", "async_fill", "async_free", "async_free_partial")
_PARTIAL_MODES = ("async_partial", "async_fill", "async_free_partial")
BENCH_REWARDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_rewards.py")
# Per-rank phases gathered each step (seconds): what ran where.
_PHASES = ("gen", "push", "share", "reward", "gen_ahead", "gen_free", "old_log_prob", "ref", "exchange", "update_actor", "step")


def _one_mode(args: argparse.Namespace, mode: str, overrides: list[str], root: str, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = rl_config(
        args.config,
        [
            "trainer.placement.rollout=[1]",
            f"trainer.rollout_mode={'async' if mode in EXTRA_MODES else mode}",
            f"trainer.async_training.max_staleness={args.max_staleness}",
            *(["trainer.async_training.partial_rollout=true",
               f"trainer.async_training.partial_rollout_tokens={args.partial_tokens}"] if mode in _PARTIAL_MODES else []),
            *(["trainer.async_training.fill_update_window=true"] if mode == "async_fill" else []),
            *(["trainer.async_training.free_running=true"] if mode in ("async_free", "async_free_partial") else []),
            # past the measured steps, so the streaming modes keep generating ahead through the last
            # measured one (a run's final steps have nothing left to generate: not the steady state)
            f"trainer.total_training_steps={args.warmup + args.steps + max(1, args.max_staleness)}",
            *overrides,
        ],
        f"{root}/{mode}",
        world,
    )
    sequences = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    steps: list[dict[str, Any]] = []
    with PPOTrainer(cfg) as trainer:
        for i in range(args.warmup + args.steps):  # (the steps past these are never run)
            start = time.perf_counter()
            m = trainer.train_step()
            wall = time.perf_counter() - start
            if m is None:
                raise ValueError("the data ran out: use more prompts (data.train_files) or fewer steps")
            mine = {k: m.get(f"timing_s/{k}", 0.0) for k in _PHASES}
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, mine)
            if i >= args.warmup:
                steps.append({
                    "wall_s": wall,
                    "generated_tokens": m["response_length/mean"] * sequences,
                    "score_mean": m["critic/score/mean"],
                    "samples_seen": (i + 1) * sequences,
                    "staleness_max": m.get("staleness/max", 0.0),
                    "staleness_mean": m.get("staleness/mean", 0.0),
                    "rank_phases": ranks,
                })
    wall = sum(s["wall_s"] for s in steps)
    return {
        "generated_tokens_per_s": sum(s["generated_tokens"] for s in steps) / wall,
        "step_s": median([s["wall_s"] for s in steps]),
        "staleness_max": max(s["staleness_max"] for s in steps),
        "staleness_mean": sum(s["staleness_mean"] for s in steps) / len(steps),
        "phases_by_rank": [
            {k: median([s["rank_phases"][r][k] for s in steps]) for k in _PHASES} for r in range(world)
        ],
        "reward_curve": [(s["samples_seen"], s["score_mean"]) for s in steps],
        "steps": steps,
    }


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from verl.parallel.bootstrap import distributed_world

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise ValueError(f"bench.py async runs on 2 ranks (rollout on rank 1, actor on rank 0): torchrun "
                         f"--nproc_per_node 2 tools/bench.py async ...; this world has {world}")
    for mode in args.modes:
        if mode not in MODES + EXTRA_MODES:
            raise ValueError(f"--modes {mode!r}: choose from {list(MODES + EXTRA_MODES)}")
    overrides = list(args.overrides)
    if args.reward_wait_ms and args.reward != "words":
        raise ValueError("--reward-wait-ms waits inside the words reward: use --reward words")
    if args.reward == "words":  # a reward a random model earns, so the curves can move
        name = "compute_score_waiting" if args.reward_wait_ms else "compute_score"
        os.environ["VERL_BENCH_REWARD_WAIT_S"] = str(args.reward_wait_ms / 1000)  # (read by tools/bench_rewards.py)
        overrides = [f"custom_reward_function.path={BENCH_REWARDS}", f"custom_reward_function.name={name}", *overrides]
    root = tempfile.mkdtemp(prefix="verl-bench-async-")
    before = machine()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    try:
        torch.set_num_threads(args.threads)
        # The world once for every mode (their trainers start none): the lifecycle's own start and teardown.
        with distributed_world(rl_config(args.config, ["trainer.placement.rollout=[1]", *overrides], f"{root}/probe", world).trainer):
            if args.inputs:  # made once, by rank 0
                shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, prompts=args.prompts)
                if dist.get_rank() == 0:
                    bench_inputs(args.inputs, **shape)
                dist.barrier()
                made = bench_inputs(args.inputs, **shape)
                overrides = [f"actor_rollout_ref.model.path={made['model']}", f"data.train_files={made['train']}",
                             *overrides]
            for r in range(args.rounds):
                order = list(args.modes) if r % 2 == 0 else list(reversed(args.modes))
                for mode in order:
                    runs[mode].append(_one_mode(args, mode, overrides, f"{root}/r{r}", world))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    modes: dict[str, Any] = {}
    for mode, rounds in runs.items():
        modes[mode] = {
            "generated_tokens_per_s": median([x["generated_tokens_per_s"] for x in rounds]),
            "step_s": median([x["step_s"] for x in rounds]),
            "staleness_max": max(x["staleness_max"] for x in rounds),
            "staleness_mean": median([x["staleness_mean"] for x in rounds]),
            "phases_by_rank": rounds[0]["phases_by_rank"] if len(rounds) == 1 else [
                {k: median([x["phases_by_rank"][rank][k] for x in rounds]) for k in _PHASES} for rank in range(world)
            ],
            "reward_curve": rounds[0]["reward_curve"],
            "rounds": rounds,
        }
    base = modes[args.modes[0]]["generated_tokens_per_s"]
    for mode in modes.values():
        mode["speedup"] = mode["generated_tokens_per_s"] / base
    sync_phases = modes[args.modes[0]]["phases_by_rank"]
    gen_share = sync_phases[1]["gen"] / sync_phases[0]["step"] if sync_phases[0]["step"] else None
    result = {
        "bench": "async",
        "config": args.config,
        "overrides": overrides,
        "world_size": world,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "max_staleness": args.max_staleness,
        "reward": args.reward,
        "reward_wait_ms": args.reward_wait_ms,
        # what bounds the speed-up: the share of the first mode's step its generation took
        "first_mode_generation_share": gen_share,
        "modes": modes,
        "machine_before": before,
        "load_average_after": list(os.getloadavg()),
    }
    result["table"] = _table(result)
    return result


def _table(result: dict[str, Any]) -> str:
    rows = [f"{'mode':<14}{'gen tok/s':>11}{'speed-up':>10}{'step s':>9}{'stale max':>11}{'gen@r1':>9}"
            f"{'ahead@r1':>10}{'free@r1':>9}{'reward@r0':>11}{'update@r0':>11}{'exch@r0':>9}"]
    for name, m in result["modes"].items():
        r0, r1 = m["phases_by_rank"]
        rows.append(f"{name:<14}{m['generated_tokens_per_s']:>11.0f}{m['speedup']:>10.2f}{m['step_s']:>9.3f}"
                    f"{m['staleness_max']:>11.0f}{r1['gen']:>9.3f}{r1['gen_ahead']:>10.3f}{r1['gen_free']:>9.3f}"
                    f"{r0['reward']:>11.3f}{r0['update_actor']:>11.3f}"
                    f"{r0['exchange']:>9.3f}")
    return "\n".join(rows)


@subcommand("async", "the rollout modes side by side on 2 ranks: generated tokens/s, staleness, reward curve")
def _async(p: argparse.ArgumentParser) -> Runner:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--config", default="grpo_tiny_cpu", help="a config under configs/ or a YAML path (default %(default)s)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as main_ppo takes them")
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   help="modes, the first the baseline (default: %(default)s; also async_partial: async with partial rollout; async_fill: "
                        "async_partial filling each update window, async_training.fill_update_window; async_free: async with a "
                        "generator thread that never stops at step boundaries, async_training.free_running; async_free_partial: "
                        "the same with partial rollout)")
    p.add_argument("--steps", type=positive_int, default=6, help="measured steps per mode (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=1, help="repeat the modes, order alternating (default %(default)s)")
    p.add_argument("--max-staleness", type=int, default=2, help="async's trainer.async_training.max_staleness (default %(default)s)")
    p.add_argument("--partial-tokens", type=positive_int, default=16,
                   help="modes async_partial, async_fill and async_free_partial (async with partial rollout): their async_training.partial_rollout_tokens (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default %(default)s)")
    p.add_argument("--reward", choices=("words", "arithmetic"), default="words",
                   help="words: tools/bench_rewards.py (a random model earns it, the curves move); arithmetic: the task's scorer")
    p.add_argument("--reward-wait-ms", type=float, default=0.0,
                   help="words reward: wait this long per sample before scoring, as a scorer that waits on a sandbox or a "
                        "remote judge does (default %(default)s)")
    p.add_argument("--inputs", default=None,
                   help="make (once) a random tiny Qwen2 and 2-digit arithmetic prompts in this folder and use them")
    p.add_argument("--hidden", type=positive_int, default=64, help="--inputs model hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="--inputs model layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="--inputs model heads (default %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=2000, help="--inputs prompts made (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        result = _run(args)
        if is_rank_zero():
            logger.info("async modes (%d measured steps each):\n%s", args.steps, result["table"])
        return result

    return run
