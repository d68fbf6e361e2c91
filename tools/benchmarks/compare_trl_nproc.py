"""``bench.py compare-trl --nproc N``: TRL's GRPOTrainer on N processes (its own data-parallel launch)
against ours on N ranks, the two launches alive side by side and stepped in turn.

Both sides cannot share one process any more, so the bench starts two torchrun launches (through
``verl.trainer.torchrun``, so they die with the bench): TRL's (accelerate reads torchrun's
environment: DDP over gloo, each process generating and training on its share of the step's samples)
and ours (the trainer as ``main_ppo`` builds it on N ranks). Each rank of each launch waits, before
every step, for a go key in a ``TCPStore`` that this process holds; rank 0 posts the step's record
under a done key. The bench gives TRL step k, waits for it, then our step k, and so on: one side runs
while the other waits in a socket read, so a load change on the machine hits both sides alike, as in
the one-process bench's alternate rounds. Start-up runs before the first go, both launches at once.

The worker half of this file runs on every rank: ``python -m tools.benchmarks.compare_trl_nproc SPEC``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from tools.benchmarks.harness import bench_inputs, median, rl_config  # first: sets vLLM's environment

logger = logging.getLogger(__name__)

_SIDES = ("trl", "ours")
_WORKER = "tools.benchmarks.compare_trl_nproc"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# How long a rank waits for its next go: the other side's step and any start-up in between (a 135M
# TRL step on one loaded core took minutes); the bench itself ends a launch that outlives it.
_GO_TIMEOUT = datetime.timedelta(hours=2)


def _key(kind: str, side: str, step: int | None = None) -> str:
    return f"{kind}/{side}" if step is None else f"{kind}/{side}/{step}"


class _Launches:
    """The two torchrun launches and the store they step by: start, hand out steps, collect records."""

    def __init__(self, root: str, spec: dict[str, Any], nproc: int, threads: int,
                 sides: tuple[str, ...] = _SIDES) -> None:
        import torch.distributed as dist

        self.root = root
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        spec = dict(spec, store_port=self.store.port)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="",
                   VERL_DIES_WITH_PARENT="1",  # a killed bench takes its launches along
                   TORCH_ELASTIC_SHUTDOWN_TIMEOUT="30")  # nothing of theirs to save
        env.pop("WORLD_SIZE", None)
        for side in sides:
            path = os.path.join(root, f"spec-{side}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(dict(spec, side=side), f)
            self.logs[side] = os.path.join(root, f"{side}.log")
            with open(self.logs[side], "w", encoding="utf-8") as log:
                self.procs[side] = subprocess.Popen(
                    [sys.executable, "-m", "verl.trainer.torchrun", "--standalone", f"--nproc_per_node={nproc}",
                     "-m", _WORKER, path],
                    cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _tail(self, side: str, chars: int = 3000) -> str:
        with open(self.logs[side], encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def wait_key(self, key: str, side: str) -> Any:
        """The JSON value ``side``'s launch posted under ``key``; raises, with the launch's log tail, if that
        launch ends first or the other fails (the other may end well: TRL's, after its last step)."""
        awaited = side
        while not self.store.check([key]):
            for side, proc in self.procs.items():
                if proc.poll() is not None and (side == awaited or proc.returncode != 0):
                    raise RuntimeError(f"compare-trl --nproc: {side}'s launch exited with {proc.returncode} "
                                       f"before {key}; the end of its log:\n{self._tail(side)}")
            time.sleep(0.05)  # a poll of the store and the processes, not a synchronisation
        return json.loads(self.store.get(key))

    def step(self, side: str, step: int, nproc: int) -> dict[str, Any]:
        """One step of ``side``: its record, with ``cpu_s``, the CPU seconds all its processes spent in it."""
        self.store.set(_key("go", side, step), "1")
        record = self.wait_key(_key("done", side, step), side)
        record["cpu_s"] = sum(self.wait_key(f"{_key('cpu', side, step)}/{rank}", side) for rank in range(nproc))
        return record

    def finish(self, timeout_s: float = 300.0) -> None:
        """Wait for both launches to exit after their last step; a failed exit raises with its log."""
        for side, proc in self.procs.items():
            rc = proc.wait(timeout=timeout_s)
            if rc != 0:
                raise RuntimeError(f"compare-trl --nproc: {side}'s launch exited with {rc} after its last step; "
                                   f"the end of its log:\n{self._tail(side)}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()  # verl.trainer.torchrun forwards it to its ranks
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def compare_trl_nproc(args: argparse.Namespace) -> dict[str, Any]:
    """The parent: inputs, both launches, ``--warmup + --steps`` steps of each in turn, the JSON."""
    import shutil

    import torch

    from tools.benchmarks.compare_trl import (
        _VERL_DTYPES,
        _compare_trl_overrides,
        _verl_train_dtype,
        compare_trl_result,
    )

    nproc = args.nproc
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("compare-trl --nproc starts its own torchrun launches (one per framework): start it "
                         "with plain python, not torchrun")
    if args.prompts % nproc:
        raise ValueError(f"--prompts {args.prompts} does not split over --nproc {nproc} processes (each process "
                         f"takes whole groups of --n samples): use a multiple of {nproc}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)  # this process measures the CPU's matmul peak for TRL's MFU
    root = tempfile.mkdtemp(prefix="verl-bench-compare-trl-nproc-")
    launches = None
    try:
        made = bench_inputs(args.inputs or root, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            prompts=max(512, 4 * args.prompts * (args.steps + args.warmup)))
        model = args.model or made["model"]
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        train_dtype = _verl_train_dtype(args.verl_dtype, hf["hidden_size"])
        overrides = _compare_trl_overrides(args, model, made["train"], hf, train_dtype, ranks=nproc)
        cfg = rl_config("grpo_tiny_cpu", overrides, root, nproc)  # a bad override fails here, before any launch
        spec = {"args": {k: v for k, v in vars(args).items() if k != "run"}, "model": model, "train": made["train"],
                "root": root, "overrides": overrides, "nproc": nproc}
        records: dict[str, list[dict[str, Any]]] = {side: [] for side in _SIDES}
        info: dict[str, Any] = {}
        # together: both launches alive, stepped in turn; apart: one launch at a time, TRL's then ours (half
        # the memory: at SmolLM2-135M four processes of ~5 GiB did not fit beside others' work in 24 GiB).
        for sides in ([_SIDES] if args.launch == "together" else [(side,) for side in _SIDES]):
            launches = _Launches(root, spec, nproc, args.threads, sides)
            info.update({side: launches.wait_key(_key("ready", side), side) for side in sides})  # built and warm
            for step in range(args.warmup + args.steps):
                for side in sides:  # TRL's step, then ours
                    records[side].append(launches.step(side, step, nproc))
                    logger.info("compare-trl --nproc %d, %s step %d: %.3f s (%.3f s generating)", nproc, side,
                                step + 1, records[side][-1]["step_s"], records[side][-1]["gen_s"])
            launches.finish()
            launches.close()
            launches = None
    finally:
        if launches is not None:
            launches.close()
        shutil.rmtree(root, ignore_errors=True)
    ours_info = {"engine": cfg.actor_rollout_ref.rollout.name, "train_dtype": _VERL_DTYPES[train_dtype],
                 "rollout_dtype": cfg.actor_rollout_ref.rollout.dtype, **info["ours"]}
    result = compare_trl_result(args, model, ours_info, info["trl"], records["trl"], records["ours"], devices=nproc)
    # Generated tokens per CPU second of the step (both processes' CPU time): what a side gets from the
    # cores it is given, much less moved than wall time by others' processes on a shared machine.
    for side in _SIDES:
        result[side]["generated_tokens_per_cpu_s"] = median(
            [r["generated_tokens"] / r["cpu_s"] for r in records[side][args.warmup:]])
    result["tokens_per_cpu_s_ratio_rounds"] = [
        (a["generated_tokens"] / a["cpu_s"]) / (b["generated_tokens"] / b["cpu_s"])
        for a, b in zip(records["ours"][args.warmup:], records["trl"][args.warmup:])]
    result["tokens_per_cpu_s_ratio_median_of_rounds"] = median(result["tokens_per_cpu_s_ratio_rounds"])
    result["nproc"] = nproc
    result["launch"] = args.launch
    result["launch_how"] = (
        "two torchrun launches of nproc processes each, alive together; TRL's step k, then ours, each side waiting "
        "for its turn (a TCPStore key) outside its timing" if args.launch == "together" else
        "two torchrun launches of nproc processes each, one after the other: TRL's through all its steps, then ours")
    return result


# ---- the worker: one rank of one side's launch ----


def _trl_worker(spec: dict[str, Any], args: argparse.Namespace, store: Any, rank: int) -> None:
    from tools.benchmarks.compare_trl import _trl_side, trl_settings

    step = {"k": 0}

    def before_step() -> None:
        store.wait([_key("go", "trl", step["k"])], _GO_TIMEOUT)
        step["cpu"] = time.process_time()

    def on_step() -> None:
        store.set(f"{_key('cpu', 'trl', step['k'])}/{rank}", json.dumps(time.process_time() - step["cpu"]))
        if rank == 0:
            store.set(_key("done", "trl", step["k"]), json.dumps({**records[-1], "load_average": os.getloadavg()}))
        step["k"] += 1

    trainer, records, config = _trl_side(args, spec["model"], spec["train"], os.path.join(spec["root"], "trl"),
                                         on_step, before_step=before_step, processes=spec["nproc"])
    if rank == 0:
        store.set(_key("ready", "trl"), json.dumps({**trl_settings(config, trainer),
                                                    "processes": trainer.accelerator.num_processes,
                                                    "per_device_train_batch_size": config.per_device_train_batch_size}))
    trainer.train()


def _our_worker(spec: dict[str, Any], args: argparse.Namespace, store: Any, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from tools.benchmarks.compare_trl import our_record
    from verl.trainer.entry import trainer_session
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = rl_config("grpo_tiny_cpu", spec["overrides"], spec["root"], spec["nproc"])
    torch.set_num_threads(args.threads)  # before the engine: vLLM's CPU worker pins the setting
    sequences = args.prompts * args.n
    with trainer_session(cfg, PPOTrainer) as trainer:
        if rank == 0:
            store.set(_key("ready", "ours"), json.dumps({
                "layout": f"colocated on {spec['nproc']} ranks: actor and rollout engine on every rank, "
                          f"data parallel {spec['nproc']}, rollout_mode={cfg.trainer.rollout_mode}",
                "rollout_tensor_parallel": cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                "processes": dist.get_world_size()}))
        for k in range(args.warmup + args.steps):
            store.wait([_key("go", "ours", k)], _GO_TIMEOUT)
            cpu = time.process_time()
            metrics = trainer.train_step()
            store.set(f"{_key('cpu', 'ours', k)}/{rank}", json.dumps(time.process_time() - cpu))
            record = {**our_record(metrics, sequences), "load_average": os.getloadavg()}
            if rank == 0:
                store.set(_key("done", "ours", k), json.dumps(record))


def _worker_main(spec_path: str) -> None:
    import torch.distributed as dist

    from verl.utils.logging import setup_logging
    from verl.utils.process import die_with_launcher

    die_with_launcher()
    setup_logging(logging.INFO)
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=_GO_TIMEOUT)
    rank = int(os.environ.get("RANK", "0"))
    (_trl_worker if spec["side"] == "trl" else _our_worker)(spec, args, store, rank)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
