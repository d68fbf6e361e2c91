"""``bench.py rollout``: rollout throughput and rollout-vs-trainer logprob agreement (see the
command's module docstring in :mod:`tools.benchmarks.cli`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tools.benchmarks.harness import Runner, median, subcommand
from verl.utils.cli import hf_model_dir, non_negative_float, positive_float, positive_int


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


def _rollout_arguments(p: argparse.ArgumentParser) -> None:
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


def _build_engines(args: argparse.Namespace, names: list[str], tokenizer: Any,
                   engines: dict[str, Any], startup: dict[str, float]) -> None:
    """Start every engine of ``names`` into ``engines`` (filled as they start, so the caller shuts
    down the ones that did), their start-up seconds into ``startup``."""
    from verl.config.schema import RolloutConfig
    from verl.rollout import build_rollout_engine

    def cfg_for(engine: str) -> RolloutConfig:
        return RolloutConfig(
            name=engine, n=args.n, temperature=args.temperature, prompt_length=args.prompt_length,
            response_length=args.max_tokens, seed=args.seed, dtype=args.dtype,
            **({"cpu_kv_cache_gib": args.cpu_kv_cache_gib} if args.cpu_kv_cache_gib else {}),
        )

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


def _rollout_result(args: argparse.Namespace, names: list[str], rounds: dict[str, list[dict[str, float]]],
                    startup: dict[str, float]) -> dict[str, Any]:
    """The JSON object of a run: the engine's medians, and each baseline's with its speed-ups."""
    metrics = rounds[args.engine][-1]
    tokens_per_s = median([m["rollout/tokens_per_s"] for m in rounds[args.engine]])
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
        "time_s": median([m["rollout/time_s"] for m in rounds[args.engine]]),
        "cpu_s": median([m["cpu_s"] for m in rounds[args.engine]]),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_rounds": [m["rollout/tokens_per_s"] for m in rounds[args.engine]],
        "startup_s": startup[args.engine],
        "mean_response_length": metrics["rollout/response_length/mean"],
        "max_response_length": metrics["rollout/response_length/max"],
        "clip_ratio": metrics["rollout/clip_ratio"],
    }
    baselines: dict[str, Any] = {}
    for name in names[1:]:
        base = median([m["rollout/tokens_per_s"] for m in rounds[name]])
        # Per round: the engines ran back to back, under about the same load.
        per_round = [
            a["rollout/tokens_per_s"] / b["rollout/tokens_per_s"]
            for a, b in zip(rounds[args.engine], rounds[name])
        ]
        baselines[name] = {
            "tokens_per_s": base,
            "tokens_per_s_rounds": [m["rollout/tokens_per_s"] for m in rounds[name]],
            "cpu_s": median([m["cpu_s"] for m in rounds[name]]),
            "speedup": tokens_per_s / base,  # ratio of the medians
            "speedup_rounds": per_round,
            "speedup_rounds_median": median(per_round),
            "startup_s": startup[name],
        }
    if baselines:
        first = names[1]
        result["baseline_engine"] = first
        result["baseline_tokens_per_s"] = baselines[first]["tokens_per_s"]
        result["speedup_vs_baseline"] = baselines[first]["speedup"]
        result["baselines"] = baselines
    return result


def _rollout_run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from verl.data.tokenizer import load_tokenizer
    from verl.models.safetensors_io import check_weight_files
    from verl.rollout.checks import logprob_agreement

    check_weight_files(args.model)  # a truncated file named now, not deep inside an engine
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    prompts = _prompt_batch(tokenizer, args.prompts, args.prompt_length, args.seed)
    names = [args.engine] + [b for b in dict.fromkeys(args.baseline) if b != args.engine]
    engines: dict[str, Any] = {}
    startup: dict[str, float] = {}
    try:
        _build_engines(args, names, tokenizer, engines, startup)
        out, rounds = _timed_rollouts(engines, prompts, args.seed, args.repeats)
    finally:
        for engine in engines.values():
            engine.shutdown()
    result = _rollout_result(args, names, rounds, startup)
    if args.reference != "none":
        reference = _reference_logprobs(args.reference, args.model, out, args.max_tokens, args.temperature)
        agreement = logprob_agreement(out["rollout_log_probs"], reference, out["response_mask"])
        result["logprob_reference"] = args.reference
        result.update({k: v for k, v in agreement.items() if k != "num_tokens"})
    return result


@subcommand("rollout", "rollout throughput and rollout-vs-trainer logprob agreement")
def _rollout_parser(p: argparse.ArgumentParser) -> Runner:
    _rollout_arguments(p)
    return _rollout_run
