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

from verl.utils.cli import hf_model_dir, non_negative_float, positive_int, user_errors  # noqa: E402 - after the env

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
                response_length=args.max_tokens, seed=args.seed,
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
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
