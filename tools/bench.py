"""Benchmarks of verl's phases; each subcommand prints ONE JSON object on stdout (logs go to stderr).

    python tools/bench.py rollout --model HF_DIR --engine vllm --prompts 64 --n 4 --max-tokens 32
    python tools/bench.py rollout --model HF_DIR --engine vllm --baseline hf   # + speed-up vs transformers

Subcommands register themselves with ``@subcommand(name, help)``: a function that adds its
arguments to a parser and returns the function that runs it (``args -> dict``).

rollout: samples ``--prompts`` prompts ``--n`` times with the chosen engine (after a warm-up
call; ``--repeats`` rounds, medians reported; with ``--baseline`` the two engines are
timed alternately), then recomputes the logprobs of the same samples with the trainer's model and reports
``tokens_per_s``, ``logprob_max_abs_diff``, ``logprob_mean_abs_diff`` and
``token_mult_prob_error`` (exp of the mean absolute per-token logprob difference).
``--reference megatron`` (default) is the actor's Megatron model (verl.models, one rank, TP=1),
``hf`` a transformers forward; ``logprob_reference`` in the output says which was used.
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
    (so a load spike on a shared machine hits both). Returns the first engine's last output and
    the per-round metrics of every engine."""
    for engine in engines.values():
        engine.generate(prompts[: min(4, len(prompts))], seed=seed + 1)  # first-call costs
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    out = None
    first = next(iter(engines))
    for _ in range(repeats):
        for name, engine in engines.items():
            result = engine.generate(prompts, seed=seed)
            rounds[name].append(engine.last_metrics)
            if name == first:
                out = result
    return out, rounds


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

    from verl.rollout.checks import megatron_response_logprobs

    own_world = not dist.is_initialized()
    if own_world:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return megatron_response_logprobs(
            model, out["input_ids"], out["attention_mask"], response_length=response_length, temperature=temperature
        )
    finally:
        if own_world:
            dist.destroy_process_group()


@subcommand("rollout", "rollout throughput and rollout-vs-trainer logprob agreement")
def _rollout_parser(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine (default %(default)s)")
    p.add_argument("--prompts", type=int, default=64, help="number of prompts (default %(default)s)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="response length limit (default %(default)s)")
    p.add_argument("--prompt-length", type=int, default=32, help="prompt width after left padding (default %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for every engine (default %(default)s: on a shared CPU more threads spin)")
    p.add_argument("--reference", choices=["megatron", "hf", "none"], default="megatron",
                   help="trainer model that recomputes the logprobs (default %(default)s)")
    p.add_argument("--baseline", choices=["hf", "vllm"], default=None,
                   help="also time this engine on the same prompts and report the speed-up")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds after a warm-up; medians are reported (default %(default)s)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        import torch
        from transformers import AutoTokenizer

        from verl.config.schema import RolloutConfig
        from verl.rollout.checks import logprob_agreement

        torch.set_num_threads(args.threads)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = _prompt_batch(tokenizer, args.prompts, args.prompt_length, args.seed)

        def cfg_for(engine: str) -> RolloutConfig:
            return RolloutConfig(
                name=engine, n=args.n, temperature=args.temperature, prompt_length=args.prompt_length,
                response_length=args.max_tokens, seed=args.seed,
            )

        from verl.rollout import build_rollout_engine

        names = [args.engine] + ([args.baseline] if args.baseline and args.baseline != args.engine else [])
        engines: dict[str, Any] = {}
        startup: dict[str, float] = {}
        try:
            for name in names:
                start = time.perf_counter()
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
            "repeats": args.repeats,
            "sequences": int(metrics["rollout/num_sequences"]),
            "tokens": int(metrics["rollout/num_tokens"]),
            "time_s": _median([m["rollout/time_s"] for m in rounds[args.engine]]),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_rounds": [m["rollout/tokens_per_s"] for m in rounds[args.engine]],
            "startup_s": startup[args.engine],
            "mean_response_length": metrics["rollout/response_length/mean"],
            "max_response_length": metrics["rollout/response_length/max"],
            "clip_ratio": metrics["rollout/clip_ratio"],
        }
        if len(names) > 1:
            base = _median([m["rollout/tokens_per_s"] for m in rounds[args.baseline]])
            result["baseline_engine"] = args.baseline
            result["baseline_tokens_per_s"] = base
            result["baseline_tokens_per_s_rounds"] = [m["rollout/tokens_per_s"] for m in rounds[args.baseline]]
            result["speedup_vs_baseline"] = tokens_per_s / base
            result["speedup_vs_baseline_rounds"] = [
                a["rollout/tokens_per_s"] / b["rollout/tokens_per_s"] for a, b in zip(rounds[args.engine], rounds[args.baseline])
            ]
        if args.reference != "none":
            reference = _reference_logprobs(args.reference, args.model, out, args.max_tokens, args.temperature)
            agreement = logprob_agreement(out["rollout_log_probs"], reference, out["response_mask"])
            result["logprob_reference"] = args.reference
            result.update({k: v for k, v in agreement.items() if k != "num_tokens"})
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
    with contextlib.redirect_stdout(sys.stderr):
        result = runners[args.command](args)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
