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
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# Before vLLM is imported: its log handlers would write to stdout, which carries the JSON.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from verl.utils.cli import hf_model_dir, non_negative_float, non_negative_int, positive_float, positive_int, user_errors  # noqa: E402 - after the env

logger = logging.getLogger("verl.tools.bench")

Runner = Callable[[argparse.Namespace], dict[str, Any]]
ParserBuilder = Callable[[argparse.ArgumentParser], Runner]
SUBCOMMANDS: dict[str, tuple[str, ParserBuilder]] = {}


def subcommand(name: str, help: str) -> Callable[[ParserBuilder], ParserBuilder]:
    """Register ``fn(parser) -> runner`` as ``bench.py <name>``."""

    def deco(fn: ParserBuilder) -> ParserBuilder:
        if name in SUBCOMMANDS:
            raise ValueError(f"bench subcommand {name!r} registered twice")
        SUBCOMMANDS[name] = (help, fn)
        return fn

    return deco


# ---------------------------------------------------------------------------------------------
# rollout


def _prompt_batch(tokenizer: Any, count: int, prompt_length: int, seed: int):
    """``count`` left-padded prompts of generated English text, uid per prompt."""
    import numpy as np

    from verl.data.corpus import generate_corpus
    from verl.protocol import Batch

    texts = list(generate_corpus(count, seed=seed))
    enc = tokenizer(
        texts, padding="max_length", truncation=True, max_length=prompt_length, padding_side="left", return_tensors="pt"
    )
    mask = enc["attention_mask"]
    return Batch.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
        {"uid": np.array([f"prompt-{i}" for i in range(count)], dtype=object)},
        {"bench": "rollout"},
    )


def _timed_rollouts(
    engines: dict[str, Any], prompts: Any, seed: int, repeats: int
) -> tuple[Any, dict[str, list[dict[str, float]]]]:
    """Warm every engine up, then time ``repeats`` rounds, the engines interleaved in each round
    (so a load spike on a shared machine hits all of them). Returns the first engine's last output
    and the per-round metrics of every engine (``cpu_s`` added: process CPU time of the call)."""
    for engine in engines.values():
        engine.generate(prompts[: min(4, len(prompts))], seed=seed + 1)  # first-call costs
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    out = None
    first = next(iter(engines))
    for _ in range(repeats):
        for name, engine in engines.items():
            cpu = time.process_time()
            result = engine.generate(prompts, seed=seed)
            metrics = dict(engine.last_metrics, cpu_s=time.process_time() - cpu)
            rounds[name].append(metrics)
            if name == first:
                out = result
    return out, rounds


class _PlainGenerate:
    """transformers' ``model.generate`` as a user would call it, timed like an engine.

    The batch's left-padded prompts, ``num_return_sequences=n``, ``max_new_tokens``, the same
    temperature with top-k/top-p off (set explicitly: transformers' default top-k is 50), eos and
    pad from the tokenizer; no scores, no logprobs, no output batch. ``last_metrics`` counts
    each response up to and including its first eos, as the engines do.
    """

    def __init__(
        self, model_dir: str, tokenizer: Any, *, n: int, max_tokens: int, temperature: float
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        # Where verl's transformers engine would run it (float32, as the engines on CPU).
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        self.n, self.max_tokens, self.temperature = n, max_tokens, temperature
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.last_metrics: dict[str, float] = {}

    def generate(self, prompts: Any, *, seed: int) -> None:
        import torch

        sampling = (
            dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
            if self.temperature > 0 else dict(do_sample=False)
        )
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []), torch.no_grad():
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=prompts["input_ids"].to(self.device),
                attention_mask=prompts["attention_mask"].to(self.device),
                num_return_sequences=self.n, max_new_tokens=self.max_tokens,
                eos_token_id=self.eos, pad_token_id=self.pad, **sampling,
            )
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        generated = out[:, prompts["input_ids"].shape[1]:].cpu()  # [B*n, T]
        is_eos = generated == self.eos
        # Up to and including the first eos; the whole row when there is none.
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, generated.shape[1])
        tokens = float(lengths.sum())
        self.last_metrics = {
            "rollout/tokens_per_s": tokens / seconds,
            "rollout/time_s": seconds,
            "rollout/num_tokens": tokens,
            "rollout/num_sequences": float(generated.shape[0]),
        }

    def shutdown(self) -> None:
        self.model = None


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _reference_logprobs(kind: str, model: str, out: Any, response_length: int, temperature: float):
    import torch

    if kind == "hf":
        from transformers import AutoModelForCausalLM

        from verl.rollout.hf_engine import hf_response_logprobs

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        return hf_response_logprobs(
            hf, out["input_ids"], out["attention_mask"], out["position_ids"],
            response_length=response_length, temperature=temperature,
        )
    import torch.distributed as dist

    from verl.parallel.bootstrap import init_distributed
    from verl.rollout.checks import megatron_response_logprobs

    own_world = not dist.is_initialized()
    if own_world:
        init_distributed(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return megatron_response_logprobs(
            model, out["input_ids"], out["attention_mask"], response_length=response_length, temperature=temperature
        )
    finally:
        if own_world:
            dist.destroy_process_group()


@subcommand("rollout", "rollout throughput and rollout-vs-trainer logprob agreement")
def _rollout_parser(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("--model", required=True, type=hf_model_dir, help="Hugging Face model directory")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine (default %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=64, help="number of prompts (default %(default)s)")
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="response length limit (default %(default)s)")
    p.add_argument("--prompt-length", type=positive_int, default=32, help="prompt width after left padding (default %(default)s)")
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="sampling temperature (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads for every engine (default %(default)s: on a shared CPU more threads spin)")
    p.add_argument("--reference", choices=["megatron", "hf", "none"], default="megatron",
                   help="trainer model that recomputes the logprobs (default %(default)s)")
    p.add_argument("--baseline", nargs="+", choices=["hf", "hf-generate", "vllm"], default=[],
                   help="also time these on the same prompts and report the speed-ups: hf (verl's "
                        "transformers engine), hf-generate (a plain model.generate without logprobs), vllm")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds after a warm-up; medians are reported (default %(default)s)")
    p.add_argument("--cpu-kv-cache-gib", type=positive_float, default=None,
                   help="the CPU vLLM engine's KV cache (rollout.cpu_kv_cache_gib; default: the config's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the engines' dtype (rollout.dtype; auto: float32 on CPU, bfloat16 on GPU); the reference "
                        "recomputes in float32 (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        import torch

        from verl.config.schema import RolloutConfig
        from verl.data.tokenizer import load_tokenizer
        from verl.models.safetensors_io import check_weight_files
        from verl.rollout.checks import logprob_agreement

        check_weight_files(args.model)  # a truncated file named now, not deep inside an engine
        torch.set_num_threads(args.threads)
        tokenizer = load_tokenizer(args.model)
        prompts = _prompt_batch(tokenizer, args.prompts, args.prompt_length, args.seed)

        def cfg_for(engine: str) -> RolloutConfig:
            return RolloutConfig(
                name=engine, n=args.n, temperature=args.temperature, prompt_length=args.prompt_length,
                response_length=args.max_tokens, seed=args.seed, dtype=args.dtype,
                **({"cpu_kv_cache_gib": args.cpu_kv_cache_gib} if args.cpu_kv_cache_gib else {}),
            )

        from verl.rollout import build_rollout_engine

        names = [args.engine] + [b for b in dict.fromkeys(args.baseline) if b != args.engine]
        engines: dict[str, Any] = {}
        startup: dict[str, float] = {}
        try:
            for name in names:
                start = time.perf_counter()
                if name == "hf-generate":
                    engines[name] = _PlainGenerate(
                        args.model, tokenizer, n=args.n, max_tokens=args.max_tokens,
                        temperature=args.temperature,
                    )
                else:
                    engines[name] = build_rollout_engine(cfg_for(name), args.model, tokenizer)
                startup[name] = time.perf_counter() - start
            out, rounds = _timed_rollouts(engines, prompts, args.seed, args.repeats)
        finally:
            for engine in engines.values():
                engine.shutdown()
        metrics = rounds[args.engine][-1]
        tokens_per_s = _median([m["rollout/tokens_per_s"] for m in rounds[args.engine]])
        result: dict[str, Any] = {
            "bench": "rollout",
            "engine": args.engine,
            "model": args.model,
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "sequences": int(metrics["rollout/num_sequences"]),
            "tokens": int(metrics["rollout/num_tokens"]),
            "time_s": _median([m["rollout/time_s"] for m in rounds[args.engine]]),
            "cpu_s": _median([m["cpu_s"] for m in rounds[args.engine]]),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_rounds": [m["rollout/tokens_per_s"] for m in rounds[args.engine]],
            "startup_s": startup[args.engine],
            "mean_response_length": metrics["rollout/response_length/mean"],
            "max_response_length": metrics["rollout/response_length/max"],
            "clip_ratio": metrics["rollout/clip_ratio"],
        }
        baselines: dict[str, Any] = {}
        for name in names[1:]:
            base = _median([m["rollout/tokens_per_s"] for m in rounds[name]])
            # Per round: the engines ran back to back, under about the same load.
            per_round = [
                a["rollout/tokens_per_s"] / b["rollout/tokens_per_s"]
                for a, b in zip(rounds[args.engine], rounds[name])
            ]
            baselines[name] = {
                "tokens_per_s": base,
                "tokens_per_s_rounds": [m["rollout/tokens_per_s"] for m in rounds[name]],
                "cpu_s": _median([m["cpu_s"] for m in rounds[name]]),
                "speedup": tokens_per_s / base,  # ratio of the medians
                "speedup_rounds": per_round,
                "speedup_rounds_median": _median(per_round),
                "startup_s": startup[name],
            }
        if baselines:
            first = names[1]
            result["baseline_engine"] = first
            result["baseline_tokens_per_s"] = baselines[first]["tokens_per_s"]
            result["speedup_vs_baseline"] = baselines[first]["speedup"]
            result["baselines"] = baselines
        if args.reference != "none":
            reference = _reference_logprobs(args.reference, args.model, out, args.max_tokens, args.temperature)
            agreement = logprob_agreement(out["rollout_log_probs"], reference, out["response_mask"])
            result["logprob_reference"] = args.reference
            result.update({k: v for k, v in agreement.items() if k != "num_tokens"})
        return result

    return run


# ---------------------------------------------------------------------------------------------
# reshard


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


def _reshard_run(args: argparse.Namespace) -> dict[str, Any]:
    """Under torchrun: build the actor, push with the plan and with the naive path, measure both."""
    import tempfile

    import torch
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.hybrid.plan import ReshardPlan
    from verl.hybrid.transfer import execute_plan
    from verl.hybrid.weight_sync import HFShards, WeightSync, naive_push
    from verl.parallel import megatron_state
    from verl.parallel.bootstrap import destroy_distributed, init_distributed
    from verl.utils.allocations import track_allocations

    init_distributed(device="cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model_dir = args.model
    tmp = None
    try:
        if model_dir is None:  # random weights for a config.json
            box = [tempfile.mkdtemp(prefix="verl-bench-reshard-") if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            tmp = box[0]
            if rank == 0:
                from transformers import AutoConfig, AutoModelForCausalLM

                config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(args.config)))
                AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
            dist.barrier()
            model_dir = tmp
        megatron = MegatronConfig(tensor_model_parallel_size=args.train_tp, pipeline_model_parallel_size=args.train_pp,
                                  virtual_pipeline_model_parallel_size=args.train_vpp)
        pg = megatron_state.initialize_model_parallel(
            tensor_model_parallel_size=args.train_tp, pipeline_model_parallel_size=args.train_pp,
            virtual_pipeline_model_parallel_size=args.train_vpp,
        )
        actor = MegatronEngine(model=ModelConfig(path=model_dir), megatron=megatron, pg=pg)
        dtype = next(actor.chunks[0].parameters()).dtype
        elem = torch.empty((), dtype=dtype).element_size()

        def destination() -> HFShards:
            return HFShards(actor.spec, tp=args.rollout_tp, tp_rank=rank % args.rollout_tp, dtype=dtype, device="cpu")

        dest = destination()
        sync = WeightSync(actor, dest, bucket_bytes=int(args.bucket_mb * 2**20))
        local_bytes = int(sync.push()["update_weights/bytes_local"])  # warm-up
        # The ceiling: a plain copy of as many bytes as this rank copies locally, timed in each round
        # just before the push, with every rank copying at once as they do in the push.
        copy_src = torch.empty(max(local_bytes, 1 << 20), dtype=torch.uint8)
        copy_dst = torch.empty_like(copy_src)
        copy_dst.copy_(copy_src)
        # The local part alone (the plan's same-rank ranges), so that no rank's copy competes with
        # another rank's network phase on a shared machine; in each round next to the ceiling.
        local_plan = ReshardPlan(world_size=world, src_keys=sync.plan.src_keys, dst_keys=sync.plan.dst_keys,
                                 pairs={k: v for k, v in sync.plan.pairs.items() if k[0] == k[1]})
        pushes, ceilings, local_rates = [], [], []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            copy_dst.copy_(copy_src)
            ceilings.append(copy_src.numel() / (time.perf_counter() - start) / 1e9)
            dist.barrier()
            stats = execute_plan(local_plan, rank, sync._sources(), sync._destinations(),
                                 bucket_elements=sync.bucket_elements)
            local_rates.append(stats.local_bytes / max(stats.local_seconds, 1e-12) / 1e9)
            dist.barrier()
            pushes.append(sync.push())
        del copy_src, copy_dst
        with track_allocations() as reshard_peak:
            sync.push()
        naive_dest = destination()
        naive_push(actor, naive_dest)  # warm-up
        naive_times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            naive_received = naive_push(actor, naive_dest)
            naive_times.append(time.perf_counter() - start)
        with track_allocations() as naive_peak:
            naive_push(actor, naive_dest)
        same = all(torch.equal(a, b) for a, b in zip(dest.tensors.values(), naive_dest.tensors.values()))
        memcpy = _median(ceilings)
        local_s = _median([m["timing_s/update_weights_local"] for m in pushes])
        fractions = [rate / ceiling for rate, ceiling in zip(local_rates, ceilings)]
        mine = {
            "rank": rank,
            "bytes_local": pushes[0]["update_weights/bytes_local"],
            "bytes_received": pushes[0]["update_weights/bytes_received"],
            "bytes_sent": pushes[0]["update_weights/bytes_sent"],
            "time_s": _median([m["timing_s/update_weights"] for m in pushes]),
            "local_time_s": local_s,
            "local_gbps": _median(local_rates),
            "peak_extra_bytes": reshard_peak.peak_bytes,
            "buffer_bytes": pushes[0]["update_weights/buffer_bytes"],
            "naive_bytes_received": naive_received,
            "naive_time_s": _median(naive_times),
            "naive_peak_extra_bytes": naive_peak.peak_bytes,
            "memcpy_gbps": memcpy,
            "local_fraction_of_memcpy": _median(fractions),
            "same_weights_as_naive": same,
        }
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
    finally:
        destroy_distributed()
        if tmp is not None and rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    total = lambda key: sum(r[key] for r in ranks)  # noqa: E731
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
        "memcpy_gbps_median": _median([r["memcpy_gbps"] for r in ranks]),
        # Per rank, the median over rounds of (local copy GB/s) / (plain copy GB/s of the same bytes
        # in the same round); the smallest rank's.
        "local_fraction_of_memcpy": min(r["local_fraction_of_memcpy"] for r in ranks),
        "time_s_max": max(r["time_s"] for r in ranks),
        "naive_time_s_max": max(r["naive_time_s"] for r in ranks),
        "same_weights_as_naive": all(r["same_weights_as_naive"] for r in ranks),
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
    parser.add_argument("--plan-only", action="store_true", help="compute the plan's figures only (no processes, no weights)")
    parser.add_argument("--world", type=positive_int, default=None, help="ranks for --plan-only (default TP x PP)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        if not args.plan_only:
            return _reshard_run(args)
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

    return run


# ---------------------------------------------------------------------------------------------
# rl-step and compare-trl: the real RL trainer's step, phase by phase


# The trainer's phases (``timing_s/<name>``) in step order. ``gen`` encloses ``update_weights`` (the
# push happens as the rollout phase opens), so the table shows ``gen`` less the push.
_PHASES = (
    "data", "gen", "update_weights", "reward", "old_log_prob", "ref", "values", "exchange", "adv", "update_critic",
    "update_actor", "records",  # exchange: roles on ranks of their own hand over their results (trainer.placement)
)


def _bench_inputs(root: str, *, hidden: int, layers: int, heads: int, prompts: int, seed: int = 0) -> dict[str, str]:
    """A tiny Qwen2 (made locally, random weights) and arithmetic prompts under ``root`` (made once,
    reused when present): ``{"model": dir, "train": parquet}``."""
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    model = os.path.join(root, f"qwen2-h{hidden}-l{layers}-a{heads}")
    if not os.path.isfile(os.path.join(model, "config.json")):
        make_tiny_model(model, TinyModelSpec(family="qwen2", hidden=hidden, layers=layers, heads=heads,
                                             kv_heads=heads, seed=seed), overwrite=True)
    train = os.path.join(root, f"arithmetic-2digit-{prompts}.parquet")
    if not os.path.isfile(train):
        records, _ = arithmetic.generate_splits(train=prompts, val=0, digits=2, seed=seed)
        write_parquet(records, train)
    return {"model": model, "train": train}


def _made_model_arguments(p: argparse.ArgumentParser, made: str) -> None:
    """``--model`` or the made one's folder and shape (``_bench_inputs``)."""
    p.add_argument("--model", type=hf_model_dir, default=None, help="a Hugging Face model directory (default: made)")
    p.add_argument("--inputs", default=None, help=f"folder to make (once) {made} in (default: a temp dir)")
    p.add_argument("--hidden", type=positive_int, default=64, help="made model's hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="made model's layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="made model's heads (default %(default)s)")


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

    def __enter__(self) -> "_PhaseMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rl_config(config: str, overrides: list[str], root: str, world: int):
    """The PPO config for a bench run: checkpoints, validation and logging off (they are not part of a
    step), outputs in ``root``; the user's overrides last, so they win."""
    from verl.config import PPOConfig, load_config

    quiet = [
        "trainer.logger=[]", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.save_hf=false", "trainer.resume_mode=disable", "trainer.report_freq=0",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/logs",
        f"trainer.n_gpus_per_node={world}", "trainer.nnodes=1", "data.val_files=null",
    ]
    return load_config(PPOConfig, config_file=config, overrides=[*quiet, *overrides], world_size=world)


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
    accounted = sum(seconds.values())
    return {"step_s": step, "phases": phases, "unaccounted_s": step - accounted,
            "unaccounted_share": (step - accounted) / step, "generated_tokens": generated, "total_tokens": total}


def _phase_table(result: dict[str, Any]) -> str:
    rows = [f"{'phase':<16}{'seconds':>10}{'share':>8}{'tokens/s':>12}{'peak MiB':>10}"]
    for name, ph in result["phases"].items():
        tps = f"{ph['tokens_per_s']:.0f}" if ph["tokens_per_s"] is not None else "-"
        peak = ph.get("peak_memory_bytes")
        rows.append(f"{name:<16}{ph['seconds']:>10.4f}{ph['share']:>8.1%}{tps:>12}"
                    f"{(f'{peak / 2**20:.0f}' if peak else '-'):>10}")
    rows.append(f"{'(unaccounted)':<16}{result['unaccounted_s']:>10.4f}{result['unaccounted_share']:>8.1%}")
    rows.append(f"{'step':<16}{result['step_s']:>10.4f}{1:>8.1%}{result['generated_tokens_per_s']:>12.0f}"
                f"   (generated tokens/s)")
    return "\n".join(rows)


def _median_phases(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase the median over steps (seconds, tokens/s); shares of the median step.

    The unaccounted row is the median of each step's own unaccounted time, not the median step less
    the phases' medians: over an odd number of steps medians do not add up (3 steps of 4.5, 3.3 and
    4.7 s put 12% of the median step in no phase where every step had under 0.1%).
    """
    step = _median([s["step_s"] for s in steps])
    phases = {}
    for name in steps[0]["phases"]:
        sec = _median([s["phases"][name]["seconds"] for s in steps])
        tps = [s["phases"][name]["tokens_per_s"] for s in steps if s["phases"][name]["tokens_per_s"] is not None]
        phases[name] = {"seconds": sec, "share": sec / step, "tokens_per_s": _median(tps) if tps else None}
    unaccounted = _median([s["unaccounted_s"] for s in steps])
    return {"step_s": step, "phases": phases, "unaccounted_s": unaccounted,
            "unaccounted_share": unaccounted / step}


def _rl_step_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from verl.parallel.bootstrap import destroy_distributed, start_world
    from verl.trainer.ppo_trainer import PPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    root = tempfile.mkdtemp(prefix="verl-bench-rl-step-")
    try:
        overrides = list(args.overrides)
        if args.inputs:
            made = _bench_inputs(args.inputs, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                 prompts=args.prompts)
            overrides = [f"actor_rollout_ref.model.path={made['model']}", f"data.train_files={made['train']}",
                         *overrides]
        cfg = _rl_config(args.config, overrides, root, world)
        torch.set_num_threads(args.threads)  # before the engine: vLLM's CPU worker pins the setting
        start_world(cfg.trainer)  # as main_ppo: the config's device and collective timeout
        try:
            steps, peaks = [], {}
            sequences = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
            with PPOTrainer(cfg) as trainer:
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
            destroy_distributed()
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
    result["generated_tokens_per_s"] = _median([s["generated_tokens"] / s["step_s"] for s in steps])
    result["tokens_per_s"] = _median([s["total_tokens"] / s["step_s"] for s in steps])
    result["peak_memory_bytes"] = max((max(r["peaks"].values(), default=0) for r in per_rank), default=0)
    result["rank_step_s"] = [_median(r["step_s"]) for r in per_rank]
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
        "and the share of the step no phase accounts for. torchrun-able; the table goes to stderr."
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
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("rl-step, median of %d steps:\n%s", args.steps, result["table"])
        return result

    return run


# ---------------------------------------------------------------------------------------------
# packing: the engine's passes on padded rows against packed sequences


def _rollout_shaped_batch(vocab: int, rows: int, prompt: int, response: int, seed: int):
    """Token ids and masks as rollouts lay them out: prompts of uniform random length in [prompt/3,
    prompt] left-padded, responses of uniform random length in [1, response] right-padded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=gen)
    mask = torch.zeros_like(ids)
    prompts = torch.randint(max(1, prompt // 3), prompt + 1, (rows,), generator=gen)
    responses = torch.randint(1, response + 1, (rows,), generator=gen)
    for row in range(rows):
        mask[row, prompt - int(prompts[row]) : prompt + int(responses[row])] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "response_mask": mask[:, prompt:].float()}


def _packing_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

    from verl.algos import agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms
    from verl.parallel.bootstrap import destroy_distributed, init_distributed

    model, made = args.model, None
    if model is None:
        if args.inputs is None:
            made = tempfile.mkdtemp(prefix="verl-bench-packing-")
        model = _bench_inputs(args.inputs or made, hidden=args.hidden, layers=args.layers, heads=args.heads,
                              prompts=64)["model"]
    torch.set_num_threads(args.threads)
    init_distributed(device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=args.seed)
        engines = {
            packed: MegatronEngine(
                model=ModelConfig(path=model, use_remove_padding=packed),
                megatron=MegatronConfig(dtype=args.dtype),
                pg=pg,
                optim=OptimConfig(optimizer="adam", lr=1e-6, weight_decay=0.0),
                total_training_steps=args.rounds + 1,
            )
            for packed in (False, True)
        }
        batch = _rollout_shaped_batch(engines[False].spec.vocab_size, args.rows, args.prompt_length,
                                      args.response_length, args.seed)
        response = args.response_length

        def loss_fn(outputs, micro):
            return LossShare(agg_loss(-outputs["logprobs"][:, -response:], micro["response_mask"], "token-mean"))

        seconds: dict[bool, list[float]] = {False: [], True: []}
        first: dict[bool, torch.Tensor] = {}
        for round_index in range(args.rounds + 1):  # round 0 warms up, unmeasured
            for packed in (False, True):  # alternated: a load change hits both
                engine = engines[packed]
                start = time.perf_counter()
                logprobs = engine.forward(batch, micro_batch_size=args.micro_batch, head_columns=response)
                engine.train_step(batch, micro_batch_size=args.micro_batch, loss_fn=loss_fn, head_columns=response)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if round_index:
                    seconds[packed].append(time.perf_counter() - start)
                else:
                    first[packed] = logprobs.outputs["logprobs"].float().cpu()
    finally:
        destroy_distributed()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    padded, packed = _median(seconds[False]), _median(seconds[True])
    real = int(batch["attention_mask"].sum())
    return {
        "bench": "packing",
        "model": model,
        "dtype": engines[False].build_config.dtype,
        "rows": args.rows,
        "micro_batch": args.micro_batch,
        "prompt_length": args.prompt_length,
        "response_length": response,
        "threads": args.threads,
        "rounds": args.rounds,
        "real_tokens": real,
        "token_fill": real / batch["attention_mask"].numel(),
        "padded_s": padded,
        "packed_s": packed,
        "speedup": padded / packed,
        "speedup_rounds": [a / b for a, b in zip(seconds[False], seconds[True])],
        "logprob_max_abs_diff": float((first[True] - first[False]).abs().max()),
        "machine": _machine(),
    }


@subcommand("packing", "the engine's log-prob pass and update on padded rows against packed sequences, alternated")
def _packing(p: argparse.ArgumentParser) -> Runner:
    p.description = (
        "One process, a world of one: two Megatron engines of the same model, one with "
        "model.use_remove_padding=false (each micro-batch padded, trimmed to its longest row) and one with true "
        "(each micro-batch packed into one row of its real tokens, Megatron's THD layout), run the same log-prob "
        "pass and training step (head_columns: the responses, as the RL roles) on one rollout-shaped batch: "
        "prompts left-padded, responses right-padded, lengths uniform at random. A round times both, one after "
        "the other, after one unmeasured round. Reports the median seconds of each, their ratio (speedup) and "
        "each round's, the batch's real-token fill, and the largest log-probability difference between the "
        "two (float rounding: the same math on other shapes)."
    )
    _made_model_arguments(p, "the model")
    p.add_argument("--rows", type=positive_int, default=64, help="sequences in the batch (default %(default)s)")
    p.add_argument("--micro-batch", type=positive_int, default=16, help="rows per micro-batch (default %(default)s)")
    p.add_argument("--prompt-length", type=positive_int, default=16, help="longest prompt (default %(default)s)")
    p.add_argument("--response-length", type=positive_int, default=32, help="longest response (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="training dtype (bfloat16: fp32 master weights; default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=5, help="measured rounds (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the batch's seed (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        result = _packing_run(args)
        logger.info(
            "packing (median of %d rounds, token fill %.2f): padded %.3f s, packed %.3f s, speed-up %.2fx (rounds %s); "
            "largest log-prob difference %.2g",
            args.rounds, result["token_fill"], result["padded_s"], result["packed_s"], result["speedup"],
            ", ".join(f"{r:.2f}" for r in result["speedup_rounds"]), result["logprob_max_abs_diff"],
        )
        return result

    return run


def _trl_side(args: argparse.Namespace, model: str, train: str, out_dir: str, on_step: Callable[[], None]):
    """TRL's ``GRPOTrainer`` on the same model, prompts and settings, its defaults otherwise; ``on_step``
    runs after each of its steps, outside its timing. Returns (trainer, per-step records)."""
    import datasets
    import pyarrow.parquet as pq
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.data.tokenizer import load_tokenizer

    rows = pq.read_table(train).to_pylist()
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
          "data_source": r["data_source"]} for r in rows]
    )
    reward = _trl_reward(args.reward)

    config = GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=args.steps + args.warmup,
        use_cpu=True, seed=args.seed,
        # The same work as our side: B prompts x n samples per step, one optimizer update per step on
        # all of them, the same response length, sampling, learning rate (constant, no warm-up) and steps.
        per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1, num_generations=args.n,
        max_completion_length=args.response_length, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.steps + args.warmup,
        # bf16 left to TRL's default (True) unless fp32 is asked for; beta (KL) is TRL's default 0.0.
        **({"bf16": False} if args.trl_dtype == "fp32" else {}),
    )
    records: list[dict[str, float]] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()
            trainer._bench_gen_s = 0.0

        def on_step_end(self, *_, **__):
            step_s = time.perf_counter() - self.start
            m = trainer._metrics["train"]
            records.append({
                "step_s": step_s, "gen_s": trainer._bench_gen_s,
                "generated_tokens": m["completions/mean_length"][-1] * args.prompts * args.n,
                "score_mean": m["reward"][-1],
            })
            on_step()

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=load_tokenizer(model), callbacks=[Timing()])
    generate = trainer._generate

    def timed_generate(*a, **k):  # TRL's rollout: tokenising, transformers' generate, decoding
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            trainer._bench_gen_s += time.perf_counter() - start

    trainer._generate = timed_generate
    return trainer, records, config


# compare-trl --reward: the scorer both sides use. arithmetic: the built-in scorer of the prompts'
# data source (verl.rewards.arithmetic; a random model scores 0 on it). words: tools/bench_rewards.py,
# the share of the response's characters that are spaces, which a raw model earns, so the curves move.
BENCH_REWARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_rewards.py")
REWARDS = ("arithmetic", "words")


def _score_fn(kind: str) -> Callable[..., Any]:
    """The scoring function our trainer calls for ``kind`` (``data_source, solution_str, ground_truth``
    keywords): the very function TRL's side calls too."""
    if kind == "arithmetic":
        from verl.rewards.registry import default_compute_score

        return default_compute_score
    if kind == "words":
        from verl.rewards import load_custom_reward_fn

        return load_custom_reward_fn(BENCH_REWARDS, "compute_score")
    raise ValueError(f"unknown reward {kind!r}; choose from {REWARDS}")


def _reward_overrides(kind: str) -> list[str]:
    """Our side's config for ``kind``: nothing for arithmetic (the prompts' data source picks the
    built-in scorer), ``custom_reward_function`` pointing at tools/bench_rewards.py for words."""
    if kind == "arithmetic":
        return []
    if kind == "words":
        return [f"custom_reward_function.path={BENCH_REWARDS}", "custom_reward_function.name=compute_score"]
    raise ValueError(f"unknown reward {kind!r}; choose from {REWARDS}")


def _trl_reward(kind: str) -> Callable[..., list[float]]:
    """TRL's reward function for ``kind``: our side's scorer on each completion's text (TRL decodes
    completions with ``skip_special_tokens=True``, as our reward manager does)."""
    score = _score_fn(kind)

    def reward(prompts, completions, ground_truth, data_source, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [score(data_source=d, solution_str=t, ground_truth=g)
               for t, g, d in zip(texts, ground_truth, data_source)]
        return [float(v["score"]) if isinstance(v, dict) else float(v) for v in out]

    reward.__name__ = f"{kind}_reward"  # TRL's metric name: rewards/<name>/mean
    return reward


def _side_summary(records: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "step_s": _median([r["step_s"] for r in records]),
        "generated_tokens_per_s": _median([r["generated_tokens"] / r["step_s"] for r in records]),
        "rollout_tokens_per_s": _median([r["generated_tokens"] / r["gen_s"] for r in records]),
        "gen_share": _median([r["gen_s"] / r["step_s"] for r in records]),
        "generated_tokens_per_step": _median([r["generated_tokens"] for r in records]),
        "rounds": records,
    }


_AGREEMENT_KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
                   "training/rollout_logprob_diff_max", "training/token_mult_prob_error")


def _machine() -> dict[str, Any]:
    """What a figure was measured on: CPU model, its matrix-relevant flags, cores, library versions."""
    import platform

    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "load_average": list(os.getloadavg()), "torch": torch.__version__}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
        info["cpu"] = model or info["cpu"]
        info["cpu_flags"] = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                                              "amx_bf16", "amx_tile", "amx_int8"))
    except OSError:
        pass
    for name in ("vllm", "megatron.core", "transformers", "trl"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", None)
        except ImportError:
            info[name] = None
    return info


_VERL_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Our training dtype under --verl-dtype auto: bf16 (fp32 master weights) from this hidden size up, on
# a CPU with bf16 matrix instructions. Measured on 2-core development CPUs: with avx512_bf16, bf16
# steps were slower than fp32 at hidden 64 (per-op overhead) and about 3x faster at hidden 512
# (ENVIRONMENT.md); on an AVX2-only CPU a bf16 matmul ran at 0.8-19 GFLOP/s against fp32's 60-75
# (docs/benchmarks.md), so there bf16 is never faster.
_BF16_FROM_HIDDEN = 512
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> list[str]:
    """This CPU's ``/proc/cpuinfo`` flags ([] where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (``/proc/cpuinfo`` flags; False where unreadable)."""
    return any(flag in _cpu_flags() for flag in _BF16_CPU_FLAGS)


def _verl_train_dtype(choice: str, hidden_size: int, flags: list[str] | None = None) -> str:
    """auto: bf16 from hidden 512 up on a CPU with avx512_bf16 or amx_bf16, else fp32 (at the tiny default
    on an AMX CPU, idle, bf16 and fp32 training measured the same against TRL: 0.91x both)."""
    if choice != "auto":
        return choice
    flags = _cpu_flags() if flags is None else flags
    return "bf16" if hidden_size >= _BF16_FROM_HIDDEN and any(f in flags for f in _BF16_CPU_FLAGS) else "fp32"


# Our rollout engine under --engine auto: vLLM from this hidden size up, transformers' generate below
# (measured on an AMX CPU: at hidden 64 our transformers engine generated ~2,000 tokens in 0.17-0.28 s
# where vLLM took 0.33-0.36 s, its per-step scheduling dominating; at hidden 512 vLLM in bf16 took 5.5-7 s
# for ~7,900 tokens where transformers' generate (TRL's) took 14-23 s). The crossover is not measured.
_VLLM_FROM_HIDDEN = 512


def _verl_engine(choice: str, hidden_size: int) -> str:
    if choice != "auto":
        return choice
    return "vllm" if hidden_size >= _VLLM_FROM_HIDDEN else "hf"


def _verl_rollout_dtype(choice: str, train_dtype: str) -> str:
    """Our rollout engine's dtype under --rollout-dtype: auto follows the training dtype (bf16 training,
    picked only on a CPU with bf16 matrix instructions, rolls out in bf16 too; else fp32)."""
    return train_dtype if choice == "auto" else choice


# Our update's micro-batch under --micro-batch auto: 16 rows from this hidden size up (measured at ~30M on
# an AMX CPU: 1.84-1.96x TRL against 1.56-1.59x with the whole 64; docs/benchmarks.md), the whole batch
# below (at the tiny default each micro-batch costs Megatron's fixed per-micro-batch overhead).
_MICRO_BATCH_FROM_HIDDEN = 512
_MICRO_BATCH_ROWS = 16


def _micro_batch(choice: int | None, hidden_size: int, rows: int) -> int:
    """Rows per micro-batch of our update: ``choice`` (0: the whole batch), or auto (None)."""
    if choice is None:
        choice = _MICRO_BATCH_ROWS if hidden_size >= _MICRO_BATCH_FROM_HIDDEN else 0
    return min(choice or rows, rows)


def _compare_trl_overrides(args: argparse.Namespace, model: str, train: str, hf: dict[str, Any],
                           train_dtype: str) -> list[str]:
    """Our side's overrides of grpo_tiny_cpu for compare-trl: TRL's work (batch, samples, length, one
    update per step on the whole batch, no KL, learning rate), the training dtype, the reward; the
    user's overrides last."""
    sequences = args.prompts * args.n
    # A KV cache that holds the whole step's batch at once (float32 keys and values, twice over for
    # the engine's blocks and padding), so our engine is not throttled by the small config default.
    kv_bytes = (sequences * (64 + args.response_length)  # 64: grpo_tiny_cpu's data.max_prompt_length
                * hf["num_hidden_layers"] * 2
                * hf["num_key_value_heads"] * (hf["hidden_size"] // hf["num_attention_heads"]) * 4)
    kv_gib = max(0.25, round(2 * kv_bytes / 2**30, 2))
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
        f"data.max_response_length={args.response_length}", f"actor_rollout_ref.rollout.name={_verl_engine(args.engine, hf['hidden_size'])}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",  # one update per step, as TRL's side
        # Micro-batches change the update only by float rounding (each one's loss is its share of the
        # step's), and the speed: 16 rows measured faster than the whole 64 at ~30M on CPU
        # (docs/benchmarks.md). TRL runs its batch whole.
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
        f"{_micro_batch(args.micro_batch, hf['hidden_size'], sequences)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={sequences}",
        "actor_rollout_ref.actor.use_kl_loss=false",  # TRL's default beta=0: no reference model
        f"actor_rollout_ref.rollout.cpu_kv_cache_gib={kv_gib}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.optim.lr_decay_style=constant",
        f"trainer.total_training_steps={args.steps + args.warmup}", f"trainer.seed={args.seed}",
        f"actor_rollout_ref.actor.megatron.dtype={_VERL_DTYPES[train_dtype]}",
        f"actor_rollout_ref.rollout.dtype={_VERL_DTYPES[_verl_rollout_dtype(args.rollout_dtype, train_dtype)]}",
        *_reward_overrides(args.reward),
        *args.overrides,
    ]


def _compare_trl_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

    from verl.parallel.bootstrap import destroy_distributed, init_distributed
    from verl.trainer.ppo_trainer import PPOTrainer

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("compare-trl runs in one process (TRL's side is one process): start it without torchrun")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both sides on the CPU
    # Accelerate (TRL's side) calls torch.set_num_threads(physical cores) when OMP_NUM_THREADS is unset
    # and a process group exists, for the whole process: both sides would then run on more threads than
    # --threads says (verl's vLLM engine puts the real torch.set_num_threads back after its start-up, so
    # the call takes effect with either engine: accelerate logged "we set it at 2" in those runs).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)  # both sides; before vLLM starts (its CPU worker pins the setting)
    root = tempfile.mkdtemp(prefix="verl-bench-compare-trl-")
    try:
        made = _bench_inputs(args.inputs or root, hidden=args.hidden, layers=args.layers, heads=args.heads,
                             prompts=max(512, 4 * args.prompts * (args.steps + args.warmup)))
        model = args.model or made["model"]
        sequences = args.prompts * args.n
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        train_dtype = _verl_train_dtype(args.verl_dtype, hf["hidden_size"])
        overrides = _compare_trl_overrides(args, model, made["train"], hf, train_dtype)
        cfg = _rl_config("grpo_tiny_cpu", overrides, root, 1)
        init_distributed(device="cpu")
        try:
            with PPOTrainer(cfg) as ours:
                ours_records: list[dict[str, float]] = []

                def our_step() -> None:  # right after each TRL step: a round is one step of each
                    m = ours.train_step()
                    if m is None:
                        raise ValueError("our side ran out of prompts")
                    ours_records.append({
                        "step_s": m["timing_s/step"], "gen_s": m["timing_s/gen"] - m.get("timing_s/update_weights", 0.0),
                        "generated_tokens": m["response_length/mean"] * sequences,
                        "score_mean": m["critic/score/mean"],
                        "torch_threads": torch.get_num_threads(),  # after the TRL step and ours
                        # The update's logprobs against the rollout engine's on the same samples.
                        **{k.split("/", 1)[1]: m[k] for k in _AGREEMENT_KEYS if k in m},
                    })
                    logger.info("compare-trl round %d: TRL %.3f s/step (%.3f s generating), ours %.3f s/step "
                                "(%.3f s generating)", len(ours_records), trl_records[-1]["step_s"],
                                trl_records[-1]["gen_s"], ours_records[-1]["step_s"], ours_records[-1]["gen_s"])

                trl_trainer, trl_records, trl_config = _trl_side(args, model, made["train"], f"{root}/trl", our_step)
                trl_trainer.train()
        finally:
            destroy_distributed()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if len(trl_records) != args.steps + args.warmup or len(ours_records) != len(trl_records):
        raise RuntimeError(f"expected {args.steps + args.warmup} rounds, got TRL {len(trl_records)}, "
                           f"ours {len(ours_records)}")
    mine, theirs = _side_summary(ours_records[args.warmup:]), _side_summary(trl_records[args.warmup:])
    per_round = [
        (a["generated_tokens"] / a["step_s"]) / (b["generated_tokens"] / b["step_s"])
        for a, b in zip(ours_records[args.warmup:], trl_records[args.warmup:])
    ]
    step_rounds = [b["step_s"] / a["step_s"] for a, b in zip(ours_records[args.warmup:], trl_records[args.warmup:])]
    import transformers
    import trl

    return {
        "bench": "compare-trl",
        "model": model,
        "model_parameters": sum(p.numel() for p in trl_trainer.model.parameters()),
        "reward": args.reward,
        "prompts_per_step": args.prompts, "n": args.n, "response_length": args.response_length, "lr": args.lr,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        # torch's intra-op threads seen after each round (one process: both sides share the setting).
        "threads_seen": sorted({r["torch_threads"] for r in ours_records}),
        "machine": _machine(),
        "ours": {"engine": cfg.actor_rollout_ref.rollout.name, "train_dtype": _VERL_DTYPES[train_dtype],
                 "rollout_dtype": cfg.actor_rollout_ref.rollout.dtype, **mine},
        "trl": {"version": trl.__version__, "transformers": transformers.__version__,
                "bf16": bool(trl_config.bf16), "gradient_checkpointing": bool(trl_config.gradient_checkpointing),
                "use_vllm": bool(trl_config.use_vllm), "loss_type": trl_config.loss_type, "beta": trl_config.beta,
                **theirs},
        # ours / TRL: > 1 means ours generates more tokens per second of step.
        "tokens_per_s_ratio_of_medians": mine["generated_tokens_per_s"] / theirs["generated_tokens_per_s"],
        "tokens_per_s_ratio_rounds": per_round,
        "tokens_per_s_ratio_median_of_rounds": _median(per_round),
        "step_time_ratio_trl_over_ours_median_of_rounds": _median(step_rounds),
        "reward_curve_ours": [r["score_mean"] for r in ours_records],
        "reward_curve_trl": [r["score_mean"] for r in trl_records],
        # Mean reward of each step's samples, drawn before that step's update: the last entry is the
        # policy after the same number of updates on both sides.
        "reward_last_ours": ours_records[-1]["score_mean"], "reward_last_trl": trl_records[-1]["score_mean"],
    }


@subcommand("compare-trl", "our GRPO against TRL's GRPOTrainer on the same work, rounds alternated, in one run")
def _compare_trl(p: argparse.ArgumentParser) -> Runner:
    p.description = (
        "One process, one machine: verl's RL trainer (GRPO, world of one) and TRL's GRPOTrainer on the same local "
        "tiny Qwen2 (random weights unless --model), the same 2-digit arithmetic prompts and scorer (--reward), prompts x n "
        "samples per step, response length, learning rate (constant), one optimizer update per step, no KL. A "
        "round is one TRL step then one of ours (after --warmup rounds). Reports each side's generated tokens "
        "per second of step, seconds per step, share of the step spent generating, the ratio ours/TRL (of the "
        "medians, and the median of per-round ratios) and both reward curves. TRL keeps its defaults (bf16 "
        "autocast, gradient checkpointing, transformers generate) unless --trl-dtype fp32."
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides for our side (main_ppo's)")
    _made_model_arguments(p, "the model and prompts")
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per step (default %(default)s)")
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--response-length", type=positive_int, default=32, help="max response tokens (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=2e-4, help="learning rate, both sides (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=5, help="measured rounds (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first, not measured (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads, both sides (default %(default)s)")
    p.add_argument("--verl-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help=f"our actor's training dtype (bf16: fp32 master weights); auto: bf16 from hidden size "
                        f"{_BF16_FROM_HIDDEN} up on a CPU with bf16 matrix instructions (avx512_bf16/amx_bf16), "
                        f"where it is faster, else fp32 (default %(default)s)")
    p.add_argument("--micro-batch", type=non_negative_int, default=None,
                   help=f"rows per micro-batch of our update (0: the whole batch, as TRL's side); the update is the "
                        f"same either way; default: {_MICRO_BATCH_ROWS} from hidden size {_MICRO_BATCH_FROM_HIDDEN} up "
                        f"(measured faster than the whole 64 at ~30M on CPU), the whole batch below")
    p.add_argument("--rollout-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="our rollout engine's dtype; auto: the training dtype, so bf16 where --verl-dtype auto picks "
                        "bf16 (measured at ~30M on an AMX CPU: the vLLM rollout 3-4x faster than in fp32, the "
                        "trainer's agreement with it unchanged; docs/benchmarks.md) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed, both sides (default %(default)s)")
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto",
                   help=f"our rollout engine; auto: vllm from hidden size {_VLLM_FROM_HIDDEN} up, hf (transformers' "
                        f"generate) below, where vLLM's per-step cost dominates (default %(default)s)")
    p.add_argument("--trl-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="TRL's precision: bf16 (its default) or fp32 (default %(default)s)")
    p.add_argument("--reward", choices=REWARDS, default="arithmetic",
                   help="the scorer, the same function on both sides: arithmetic (the prompts' 2-digit sums; a random "
                        "model scores 0) or words (tools/bench_rewards.py: the share of the response's characters that are "
                        "spaces, which a raw model earns, so the curves move) (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        result = _compare_trl_run(args)
        logger.info(
            "compare-trl (median of %d rounds): ours %.0f generated tokens/s, %.3f s/step, %.0f%% generating; "
            "TRL (%s) %.0f tokens/s, %.3f s/step, %.0f%% generating; ours/TRL %.2fx (ratio of medians), %.2fx "
            "(median of per-round ratios); reward ours %s, TRL %s",
            args.steps, result["ours"]["generated_tokens_per_s"], result["ours"]["step_s"],
            100 * result["ours"]["gen_share"], "bf16" if result["trl"]["bf16"] else "fp32",
            result["trl"]["generated_tokens_per_s"], result["trl"]["step_s"], 100 * result["trl"]["gen_share"],
            result["tokens_per_s_ratio_of_medians"], result["tokens_per_s_ratio_median_of_rounds"],
            [round(v, 3) for v in result["reward_curve_ours"]], [round(v, 3) for v in result["reward_curve_trl"]],
        )
        return result

    return run


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    from verl.utils.logging import setup_logging

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
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank has the (gathered) result
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
