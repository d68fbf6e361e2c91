"""``bench.py rl-step``: the real RL trainer's step, phase by phase (time, share, tokens/s, peak memory)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from tools.benchmarks.harness import Runner, bench_inputs, is_rank_zero, median, rl_config, subcommand
from verl.utils.cli import positive_int

logger = logging.getLogger(__name__)



# The trainer's phases (``timing_s/<name>``) in step order. ``gen`` encloses ``update_weights`` (the
# push happens as the rollout phase opens), so the table shows ``gen`` less the push.
_PHASES = (
    "data", "gen", "update_weights", "reward", "old_log_prob", "ref", "values", "exchange", "adv", "update_critic",
    "update_actor", "records",  # exchange: roles on ranks of their own hand over their results (trainer.placement)
    "push", "share", "gen_ahead",  # trainer.rollout_mode=one_step_off|async (verl.trainer.step.stream)
)



class _PhaseMemory:
    """Peak resident memory (CPU) or allocated device memory (CUDA) per trainer phase.

    A thread samples every ``interval_s`` and charges the sample to the phase the trainer last
    posted on its ``PhaseBoard`` (the trainer posts each phase as it enters it). A phase shorter
    than the interval may be missed: its entry is then absent.
    """

    def __init__(self, board: Any, interval_s: float = 0.005) -> None:
        import threading

        import torch

        self.board, self.interval_s = board, interval_s
        self.cuda = torch.cuda.is_available()
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-phase-memory", daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.memory_allocated())
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            phase, value = self.board.phase, self._sample()
            if value > self.peaks.get(phase, 0):
                self.peaks[phase] = value

    def __enter__(self) -> _PhaseMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()



def _step_phases(m: dict[str, float], sequences: int) -> dict[str, Any]:
    """One step's metrics as phases: seconds, share of the step, tokens/s; the unaccounted rest.

    Tokens: the rollout counts the tokens it generated, every other phase (but the weight push) the
    batch's tokens (prompt + response, ``perf/total_num_tokens``) it reads; the whole batch, all
    ranks together.
    """
    step = m["timing_s/step"]
    seconds = {k: m[f"timing_s/{k}"] for k in _PHASES if f"timing_s/{k}" in m}
    if "gen" in seconds:
        seconds["gen"] -= seconds.get("update_weights", 0.0)
    generated = m["response_length/mean"] * sequences
    total = m["perf/total_num_tokens"]
    phases = {
        k: {
            "seconds": v,
            "share": v / step,
            # The push moves weights, not tokens.
            "tokens_per_s": None if k in ("update_weights", "records") or v <= 0 else (generated if k == "gen" else total) / v,
        }
        for k, v in seconds.items()
    }
    for k, ph in phases.items():  # the phase's model FLOPs utilisation (verl.trainer.perf); None: not counted
        ph["mfu"] = m.get(f"perf/mfu/{k}")
    if phases.get("gen", {}).get("mfu") is not None and seconds["gen"] > 0:  # over the row's seconds, less the push
        phases["gen"]["mfu"] *= m["timing_s/gen"] / seconds["gen"]
    accounted = sum(seconds.values())
    return {"step_s": step, "phases": phases, "unaccounted_s": step - accounted,
            "unaccounted_share": (step - accounted) / step, "generated_tokens": generated, "total_tokens": total,
            "mfu": m.get("perf/mfu/step"), "tflops": m.get("perf/tflops/step")}


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _phase_table(result: dict[str, Any]) -> str:
    rows = [f"{'phase':<16}{'seconds':>10}{'share':>8}{'tokens/s':>12}{'peak MiB':>10}{'MFU':>8}"]
    for name, ph in result["phases"].items():
        tps = f"{ph['tokens_per_s']:.0f}" if ph["tokens_per_s"] is not None else "-"
        peak = ph.get("peak_memory_bytes")
        rows.append(f"{name:<16}{ph['seconds']:>10.4f}{ph['share']:>8.1%}{tps:>12}"
                    f"{(f'{peak / 2**20:.0f}' if peak else '-'):>10}{_percent(ph['mfu']):>8}")
    rows.append(f"{'(unaccounted)':<16}{result['unaccounted_s']:>10.4f}{result['unaccounted_share']:>8.1%}")
    rows.append(f"{'step':<16}{result['step_s']:>10.4f}{1:>8.1%}{result['generated_tokens_per_s']:>12.0f}"
                f"{'':>10}{_percent(result['mfu']):>8}   (generated tokens/s; MFU of the step)")
    return "\n".join(rows)


def _median_phases(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase the median over steps (seconds, tokens/s); shares of the median step.

    The unaccounted row is the median of each step's own unaccounted time, not the median step less
    the phases' medians: over an odd number of steps medians do not add up (3 steps of 4.5, 3.3 and
    4.7 s put 12% of the median step in no phase where every step had under 0.1%).
    """
    step = median([s["step_s"] for s in steps])
    phases = {}
    for name in steps[0]["phases"]:
        sec = median([s["phases"][name]["seconds"] for s in steps])
        tps = [s["phases"][name]["tokens_per_s"] for s in steps if s["phases"][name]["tokens_per_s"] is not None]
        mfu = [s["phases"][name]["mfu"] for s in steps if s["phases"][name].get("mfu") is not None]
        phases[name] = {"seconds": sec, "share": sec / step, "tokens_per_s": median(tps) if tps else None,
                        "mfu": median(mfu) if mfu else None}
    unaccounted = median([s["unaccounted_s"] for s in steps])
    mfu = [s["mfu"] for s in steps if s.get("mfu") is not None]
    tflops = [s["tflops"] for s in steps if s.get("tflops") is not None]
    return {"step_s": step, "phases": phases, "unaccounted_s": unaccounted,
            "unaccounted_share": unaccounted / step, "mfu": median(mfu) if mfu else None,
            "tflops_per_device": median(tflops) if tflops else None}


def _rl_step_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from verl.trainer.entry import trainer_session
    from verl.trainer.ppo_trainer import PPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    root = tempfile.mkdtemp(prefix="verl-bench-rl-step-")
    try:
        overrides = list(args.overrides)
        if args.inputs:
            made = bench_inputs(args.inputs, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                 prompts=args.prompts)
            overrides = [f"actor_rollout_ref.model.path={made['model']}", f"data.train_files={made['train']}",
                         *overrides]
        cfg = rl_config(args.config, overrides, root, world)
        torch.set_num_threads(args.threads)  # before the engine: vLLM's CPU worker pins the setting
        steps, peaks = [], {}
        sequences = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
        with trainer_session(cfg, PPOTrainer) as trainer:  # as main_ppo: the world, the trainer, the teardown
            if trainer.total_steps < args.warmup + args.steps:
                raise ValueError(f"the config runs {trainer.total_steps} steps, fewer than --warmup {args.warmup} "
                                 f"+ --steps {args.steps}: raise trainer.total_training_steps")
            for _ in range(args.warmup):
                trainer.train_step()
            with _PhaseMemory(trainer.board) as memory:
                for _ in range(args.steps):
                    metrics = trainer.train_step()
                    if metrics is None:
                        raise ValueError("the data ran out: use more prompts (data.train_files) or fewer steps")
                    one = _step_phases(metrics, sequences)
                    one["score_mean"] = metrics["critic/score/mean"]
                    one["process_peak_memory_gb"] = metrics["perf/max_memory_allocated_gb"]
                    steps.append(one)
            peaks = dict(memory.peaks)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, {"step_s": [s["step_s"] for s in steps], "peaks": peaks})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "rl-step",
        "config": args.config,
        "overrides": overrides,
        "world_size": world,
        "threads": args.threads,
        "adv_estimator": cfg.algorithm.adv_estimator,
        "rollout": cfg.actor_rollout_ref.rollout.name,
        "prompts_per_step": cfg.data.train_batch_size,
        "n": cfg.actor_rollout_ref.rollout.n,
        "response_length": cfg.data.max_response_length,
        "warmup": args.warmup,
        "steps": steps,
        **_median_phases(steps),
    }
    for name, ph in result["phases"].items():
        board = "gen" if name == "update_weights" else name  # the push runs inside the rollout phase
        ph["peak_memory_bytes"] = max((r["peaks"].get(board, 0) for r in per_rank), default=0) or None
    result["generated_tokens_per_s"] = median([s["generated_tokens"] / s["step_s"] for s in steps])
    result["tokens_per_s"] = median([s["total_tokens"] / s["step_s"] for s in steps])
    result["peak_memory_bytes"] = max((max(r["peaks"].values(), default=0) for r in per_rank), default=0)
    result["rank_step_s"] = [median(r["step_s"]) for r in per_rank]
    # Each step's own, not the medians' (which need not add up).
    result["phases_add_up"] = all(abs(s["unaccounted_share"]) <= 0.05 for s in steps)
    result["table"] = _phase_table(result)
    return result


@subcommand("rl-step", "one RL trainer step, phase by phase: time, share, tokens/s, peak memory")
def _rl_step(p: argparse.ArgumentParser) -> Runner:
    p.description = (
        "Runs --warmup then --steps steps of verl's RL trainer (verl.trainer.ppo_trainer.PPOTrainer, as main_ppo "
        "builds it; validation, checkpoints and loggers off) and reports, per phase (rollout, weight push, "
        "reward, old logprobs, reference, values, advantages, critic and actor updates), the median seconds, "
        "share of the step, tokens/s and peak memory (resident on CPU, allocated on CUDA, sampled every 5 ms), "
        "the model FLOPs utilisation of each phase that computes (perf/mfu/<phase>, verl.trainer.perf; the rollout's "
        "over its seconds less the push) and of the step, and the share of the step no phase accounts for. "
        "torchrun-able; the table goes to stderr."
    )
    p.add_argument("--config", default="grpo_tiny_cpu", help="a config under configs/ or a YAML path (default %(default)s)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as main_ppo takes them")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default %(default)s)")
    p.add_argument("--inputs", default=None,
                   help="make (once) a random tiny Qwen2 and 2-digit arithmetic prompts in this folder and use them "
                        "(else the config's model.path and data.train_files)")
    p.add_argument("--hidden", type=positive_int, default=64, help="--inputs model hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="--inputs model layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="--inputs model heads (default %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=2000, help="--inputs prompts made (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        result = _rl_step_run(args)
        if is_rank_zero():
            logger.info("rl-step, median of %d steps:\n%s", args.steps, result["table"])
        return result

    return run

