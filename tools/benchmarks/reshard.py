"""``bench.py reshard``: the 3D-HybridEngine weight transfer (actor -> rollout layout) against the
naive path, measured under torchrun or computed for any cluster with ``--plan-only``."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from tools.benchmarks.harness import Runner, bench_world, median, subcommand
from verl.utils.cli import positive_float, positive_int

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _reshard_layouts(spec: Any, args: argparse.Namespace, world: int) -> tuple[list, list]:
    """Source (actor) and destination layouts of every rank, from the config alone."""
    from verl.hybrid.plan import cluster_layouts

    return cluster_layouts(spec, world_size=world, train_tp=args.train_tp, train_pp=args.train_pp,
                           train_vpp=args.train_vpp, rollout_tp=args.rollout_tp, destination=args.destination)


def _naive_estimate(spec: Any, sources: list, args: argparse.Namespace, elem: int) -> list[dict[str, int]]:
    """What the naive path moves and holds per rank (counted from the layouts, for --plan-only).

    Received: the all-gather over TP of every TP-split tensor of the rank's stage ((TP-1) shards of
    each) plus every tensor of the other stages, whole (broadcast over the pipeline group).
    Peak extra: the gather buffers of one parameter (TP shards = the whole parameter) plus the
    merged whole Hugging Face tensors cut from them, for the largest parameter of the stage; a
    tensor of another stage arrives whole (1x).
    """
    from verl.hybrid.layout import hf_shape

    full = {}
    for layout in sources:
        for box in layout.boxes:
            full[box.hf_name] = hf_shape(spec, box.hf_name)[0] * hf_shape(spec, box.hf_name)[1]
    out = []
    for layout in sources:
        mine = {box.hf_name for box in layout.boxes}
        by_tensor: dict[str, int] = {}
        split = set()
        for box in layout.boxes:
            by_tensor[box.tensor] = by_tensor.get(box.tensor, 0) + box.numel
            if box.numel < full[box.hf_name]:
                split.add(box.tensor)
        gathered = sum(n * (args.train_tp - 1) for k, n in by_tensor.items() if k in split)
        others = sum(n for name, n in full.items() if name not in mine)
        largest_own = max((n * args.train_tp * 2 for k, n in by_tensor.items() if k in split), default=0)
        largest_other = max((n for name, n in full.items() if name not in mine), default=0)
        out.append({"received_bytes": (gathered + others) * elem,
                    "peak_extra_bytes": max(largest_own, largest_other) * elem})
    return out


def _random_weights(args: argparse.Namespace, rank: int) -> str:
    """A temp folder (the same on every rank) holding random weights for ``--config``, saved by rank 0."""
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="verl-bench-reshard-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(args.config)))
        AutoModelForCausalLM.from_config(config).save_pretrained(box[0])
    dist.barrier()
    return box[0]


def _actor(args: argparse.Namespace, model_dir: str) -> Any:
    """The actor's Megatron engine at --train-tp x --train-pp [x --train-vpp]."""
    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state

    megatron = MegatronConfig(tensor_model_parallel_size=args.train_tp, pipeline_model_parallel_size=args.train_pp,
                              virtual_pipeline_model_parallel_size=args.train_vpp)
    pg = megatron_state.initialize_model_parallel(
        tensor_model_parallel_size=args.train_tp, pipeline_model_parallel_size=args.train_pp,
        virtual_pipeline_model_parallel_size=args.train_vpp,
    )
    return MegatronEngine(model=ModelConfig(path=model_dir), megatron=megatron, pg=pg)


def _strided_runs(ranges: Any) -> list[tuple[int, int, int, int, int, int, int, int]]:
    """The plan's local ranges [N, 5] as runs of rows that one strided view covers on each side:
    (src tensor, src offset, src row stride, dst tensor, dst offset, dst row stride, rows, row length),
    in elements; what a copy of the same bytes written as plain torch copies, one ``copy_`` per block of a
    tensor, would do (the access pattern of the plan's own copy)."""
    runs: list[list[int]] = []
    for st, so, dt, do, n in ranges.tolist():
        if runs:
            r = runs[-1]
            if (st, dt, n) == (r[0], r[3], r[7]):
                if r[6] == 1 and so - r[1] >= n and do - r[4] >= n:
                    r[2], r[5], r[6] = so - r[1], do - r[4], 2
                    continue
                if r[6] > 1 and so == r[1] + r[6] * r[2] and do == r[4] + r[6] * r[5]:
                    r[6] += 1
                    continue
        runs.append([st, so, n, dt, do, n, 1, n])
    return [tuple(r) for r in runs]


def _plan_pushes(sync: Any, world: int, rank: int, repeats: int, trials: int) -> tuple[list, dict[str, list[float]], Any]:
    """The plan's pushes, timed: (each round's push metrics, each round's copy rates in GB/s, the tracked
    allocations of one more push). Rates, per second of wall time and (``_cpu``) of this process's CPU
    time: the plan's local copy (``local``), a plain torch copy of as many bytes between two contiguous
    buffers (``memcpy``), and plain torch copies of the same bytes between the same tensors, one strided
    ``copy_`` per block (``torch``)."""
    import torch
    import torch.distributed as dist

    from verl.hybrid.plan import ReshardPlan
    from verl.hybrid.transfer import execute_plan
    from verl.utils.allocations import track_allocations

    local_bytes = int(sync.push()["update_weights/bytes_local"])  # warm-up
    # The ceiling: a plain torch copy of as many bytes as this rank copies locally, between two
    # buffers touched beforehand (as the push's tensors are), on the threads the push has.
    copy_src = torch.empty(max(local_bytes, 1 << 20), dtype=torch.uint8)
    copy_dst = torch.empty_like(copy_src)
    copy_dst.copy_(copy_src)
    # The local part alone (the plan's same-rank ranges), so that no rank's copy competes with
    # another rank's network phase on a shared machine.
    local_plan = ReshardPlan(world_size=world, src_keys=sync.plan.src_keys, dst_keys=sync.plan.dst_keys,
                             pairs={k: v for k, v in sync.plan.pairs.items() if k[0] == k[1]})
    sources, destinations = sync._sources(), sync._destinations()
    views = [
        (destinations[dt].as_strided((rows, n), (ds, 1), destinations[dt].storage_offset() + do),
         sources[st].as_strided((rows, n), (ss, 1), sources[st].storage_offset() + so))
        for st, so, ss, dt, do, ds, rows, n in _strided_runs(local_plan.ranges(rank, rank))
    ]

    def timed(copy: Any) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        nbytes = copy()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return nbytes / max(wall, 1e-12) / 1e9, nbytes / max(cpu, 1e-9) / 1e9

    def local_copy() -> int:
        return execute_plan(local_plan, rank, sources, destinations, bucket_elements=sync.bucket_elements).local_bytes

    def memcpy() -> int:
        copy_dst.copy_(copy_src)
        return copy_src.numel()

    def torch_copies() -> int:
        with torch.no_grad():
            for dst, src in views:
                dst.copy_(src)
        return local_bytes

    copies = {"local": local_copy, "memcpy": memcpy, "torch": torch_copies}
    for copy in copies.values():  # warm-up (the local plan's tables)
        copy()
    rates: dict[str, list[float]] = {f"{name}{unit}": [] for name in copies for unit in ("", "_cpu")}
    pushes = []
    for _ in range(repeats):
        # Like with like: the copies alternate, each started on every rank at once (as in the push),
        # `trials` times each; a round keeps the best of each, so that a copy that lost its core to
        # another process on a loaded machine does not decide the ratio.
        best = dict.fromkeys(rates, 0.0)
        for _ in range(trials):
            for name, copy in copies.items():
                dist.barrier()
                wall, cpu = timed(copy)
                best[name], best[f"{name}_cpu"] = max(best[name], wall), max(best[f"{name}_cpu"], cpu)
        for key, value in best.items():
            rates[key].append(value)
        dist.barrier()
        pushes.append(sync.push())
    del copy_src, copy_dst, views
    with track_allocations() as reshard_peak:
        sync.push()
    return pushes, rates, reshard_peak


def _naive_pushes(actor: Any, naive_dest: Any, repeats: int) -> tuple[int, list[float], Any]:
    """The naive path, timed: (bytes received, each round's seconds, the tracked allocations of one more push)."""
    import torch.distributed as dist

    from verl.hybrid.weight_sync import naive_push
    from verl.utils.allocations import track_allocations

    naive_push(actor, naive_dest)  # warm-up
    naive_times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        naive_received = naive_push(actor, naive_dest)
        naive_times.append(time.perf_counter() - start)
    with track_allocations() as naive_peak:
        naive_push(actor, naive_dest)
    return naive_received, naive_times, naive_peak


def _rank_figures(args: argparse.Namespace, model_dir: str, world: int, rank: int) -> tuple[dict[str, Any], int]:
    """This rank's figures, both paths pushed from one actor; and the weights' element size."""
    import torch

    from verl.hybrid.weight_sync import HFShards, WeightSync

    actor = _actor(args, model_dir)
    dtype = next(actor.chunks[0].parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()

    def destination() -> HFShards:
        return HFShards(actor.spec, tp=args.rollout_tp, tp_rank=rank % args.rollout_tp, dtype=dtype, device="cpu")

    dest = destination()
    sync = WeightSync(actor, dest, bucket_bytes=int(args.bucket_mb * 2**20))
    pushes, rates, reshard_peak = _plan_pushes(sync, world, rank, args.repeats, args.copy_trials)
    naive_dest = destination()
    naive_received, naive_times, naive_peak = _naive_pushes(actor, naive_dest, args.repeats)
    same = all(torch.equal(a, b) for a, b in zip(dest.tensors.values(), naive_dest.tensors.values()))
    local_s = median([m["timing_s/update_weights_local"] for m in pushes])

    def fraction(of: str, unit: str = "") -> float:
        """Median over rounds of (local copy rate) / (``of``'s rate in the same round)."""
        return median([a / b for a, b in zip(rates[f"local{unit}"], rates[f"{of}{unit}"])])

    mine = {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "bytes_local": pushes[0]["update_weights/bytes_local"],
        "bytes_received": pushes[0]["update_weights/bytes_received"],
        "bytes_sent": pushes[0]["update_weights/bytes_sent"],
        "time_s": median([m["timing_s/update_weights"] for m in pushes]),
        "local_time_s": local_s,
        "local_gbps": median(rates["local"]),
        "peak_extra_bytes": reshard_peak.peak_bytes,
        "buffer_bytes": pushes[0]["update_weights/buffer_bytes"],
        "naive_bytes_received": naive_received,
        "naive_time_s": median(naive_times),
        "naive_peak_extra_bytes": naive_peak.peak_bytes,
        "memcpy_gbps": median(rates["memcpy"]),
        "torch_copy_gbps": median(rates["torch"]),
        "local_fraction_of_memcpy": fraction("memcpy"),
        "local_fraction_of_memcpy_cpu": fraction("memcpy", "_cpu"),
        "local_fraction_of_torch_copy": fraction("torch"),
        "local_fraction_of_torch_copy_cpu": fraction("torch", "_cpu"),
        "same_weights_as_naive": same,
    }
    return mine, elem


def _reshard_run(args: argparse.Namespace) -> dict[str, Any]:
    """Under torchrun: build the actor, push with the plan and with the naive path, measure both."""
    import torch.distributed as dist

    tmp = None
    with bench_world(device="cpu"):
        world, rank = dist.get_world_size(), dist.get_rank()
        try:
            if args.model is None:  # random weights for a config.json
                tmp = _random_weights(args, rank)
            mine, elem = _rank_figures(args, args.model or tmp, world, rank)
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, mine)
        finally:
            if tmp is not None and rank == 0:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    total = lambda key: sum(r[key] for r in ranks)
    return {
        "bench": "reshard",
        "world_size": world,
        "layout": f"TP{args.train_tp} x PP{args.train_pp} -> TP'{args.rollout_tp}",
        "dtype_bytes": elem,
        "bucket_mb": args.bucket_mb,
        "ranks": ranks,
        "network_bytes": total("bytes_received"),
        "naive_network_bytes": total("naive_bytes_received"),
        "network_ratio_naive_over_reshard": total("naive_bytes_received") / max(total("bytes_received"), 1),
        "peak_extra_bytes_max": max(r["peak_extra_bytes"] for r in ranks),
        "naive_peak_extra_bytes_max": max(r["naive_peak_extra_bytes"] for r in ranks),
        "peak_ratio_naive_over_reshard": max(r["naive_peak_extra_bytes"] for r in ranks)
        / max(max(r["peak_extra_bytes"] for r in ranks), 1),
        "local_gbps_min": min(r["local_gbps"] for r in ranks),
        "memcpy_gbps_median": median([r["memcpy_gbps"] for r in ranks]),
        # The copy threads of each rank (torch.get_num_threads: OMP_NUM_THREADS under torchrun); the
        # local copies of all ranks run at once, so the machine's copy threads are their sum.
        "threads_per_rank": ranks[0]["threads"],
        "copy_threads": sum(r["threads"] for r in ranks),
        "torch_copy_gbps_median": median([r["torch_copy_gbps"] for r in ranks]),
        # Per rank, the median over rounds of (local copy GB/s) / (a plain torch copy's GB/s in the same
        # round, same threads, best of --copy-trials each): "memcpy", as many bytes between two contiguous
        # buffers; "torch_copy", the same bytes between the same tensors, one strided copy_ per block. Rates
        # per second of wall time, and (_cpu) of CPU time, which the time slices a loaded machine takes from
        # a process do not count. The smallest rank's.
        **{key: min(r[key] for r in ranks) for key in (
            "local_fraction_of_memcpy", "local_fraction_of_memcpy_cpu",
            "local_fraction_of_torch_copy", "local_fraction_of_torch_copy_cpu")},
        "time_s_max": max(r["time_s"] for r in ranks),
        "naive_time_s_max": max(r["naive_time_s"] for r in ranks),
        "same_weights_as_naive": all(r["same_weights_as_naive"] for r in ranks),
    }


def _reshard_plan_only(args: argparse.Namespace) -> dict[str, Any]:
    """--plan-only: the plan's figures for --world ranks, computed from the config (nothing allocated)."""
    from verl.hybrid.plan import build_plan
    from verl.models.hf_config import parse_hf_config

    path = args.config or os.path.join(args.model, "config.json")
    spec = parse_hf_config(path)
    world = args.world or args.train_tp * args.train_pp
    elem = _DTYPE_BYTES[args.dtype]
    start = time.perf_counter()
    sources, dests = _reshard_layouts(spec, args, world)
    plan = build_plan(sources, dests)
    seconds = time.perf_counter() - start
    # The plan as a table on stderr (stdout carries the JSON object).
    logger.info("reshard plan for %s, %d ranks:\n%s", path, world, plan.describe(elem))
    bucket = int(args.bucket_mb * 2**20)
    naive = _naive_estimate(spec, sources, args, elem)
    ranks = []
    for rank in range(world):
        st = plan.rank_stats(rank)
        ranks.append({
            "rank": rank,
            "bytes_local": st.local_elements * elem,
            "bytes_received": st.received_elements * elem,
            "bytes_sent": st.sent_elements * elem,
            "peers": len(st.received),
            "tensors_touched": st.tensors_touched,
            "peak_extra_bytes_bound": plan.peak_extra_bound(rank, elem, bucket),
            "naive_bytes_received": naive[rank]["received_bytes"],
            "naive_peak_extra_bytes": naive[rank]["peak_extra_bytes"],
        })
    return {
        "bench": "reshard",
        "plan_only": True,
        "config": path,
        "world_size": world,
        "layout": f"TP{args.train_tp} x PP{args.train_pp} -> TP'{args.rollout_tp}",
        "dtype_bytes": elem,
        "bucket_mb": args.bucket_mb,
        "plan_seconds": seconds,
        "ranks": ranks,
        "network_bytes": sum(r["bytes_received"] for r in ranks),
        "naive_network_bytes": sum(r["naive_bytes_received"] for r in ranks),
        "max_rank_received_bytes": max(r["bytes_received"] for r in ranks),
        "naive_max_rank_received_bytes": max(r["naive_bytes_received"] for r in ranks),
        "peak_extra_bytes_bound_max": max(r["peak_extra_bytes_bound"] for r in ranks),
        "naive_peak_extra_bytes_max": max(r["naive_peak_extra_bytes"] for r in ranks),
    }


@subcommand("reshard", "3D-HybridEngine weight transfer (actor -> rollout layout) against the naive path")
def _reshard(parser: argparse.ArgumentParser) -> Runner:
    """Measured under torchrun (one process per rank), or computed for any cluster with --plan-only."""
    parser.description = (
        "Push the actor's weights (Megatron, --train-tp x --train-pp [x --train-vpp], DP = world / (TP x PP)) into "
        "rollout-layout tensors at --rollout-tp, with verl's reshard plan and with the naive path (whole tensors "
        "gathered on every rank); per rank and in total: bytes over the network, bytes copied locally, time, GB/s, "
        "peak extra memory (allocation tracking), and this machine's memcpy bandwidth as the ceiling. Run it under "
        "torchrun. With --plan-only --world N nothing is allocated: the plan's traffic and the memory bound are "
        "computed from the config for N ranks (e.g. configs/models/llama3_70b.json at TP8 x PP4 -> TP'8) and "
        "the plan is logged as a table (per rank: bytes copied locally, received, sent, tensors touched, and "
        "bytes received from each peer)."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face model directory (its weights are pushed)")
    source.add_argument("--config", help="a Hugging Face config.json (random weights; only config is read with --plan-only)")
    parser.add_argument("--train-tp", type=positive_int, default=1, help="actor tensor parallel (default 1)")
    parser.add_argument("--train-pp", type=positive_int, default=1, help="actor pipeline parallel (default 1)")
    parser.add_argument("--train-vpp", type=positive_int, default=None, help="actor virtual pipeline stages per rank")
    parser.add_argument("--rollout-tp", type=positive_int, default=1, help="rollout engine tensor parallel TP' (default 1)")
    parser.add_argument("--bucket-mb", type=positive_float, default=512.0, help="transfer bucket in MiB (default 512)")
    parser.add_argument("--destination", choices=["hf-shards", "vllm"], default="hf-shards",
                        help="destination layout for --plan-only (default hf-shards; measured runs use hf-shards)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bf16", help="weight dtype for --plan-only (default bf16)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed pushes per path (median; default 5)")
    parser.add_argument("--copy-trials", type=positive_int, default=3,
                        help="per round, the local copy and the plain copy alternate this many times; the best of "
                             "each makes the round's ratio (default 3)")
    parser.add_argument("--plan-only", action="store_true", help="compute the plan's figures only (no processes, no weights)")
    parser.add_argument("--world", type=positive_int, default=None, help="ranks for --plan-only (default TP x PP)")


    def run(args: argparse.Namespace) -> dict[str, Any]:
        return _reshard_run(args) if not args.plan_only else _reshard_plan_only(args)

    return run
