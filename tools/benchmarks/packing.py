"""``bench.py packing``: the engine's log-prob pass and update on padded rows against packed
sequences, alternated in one process."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from tools.benchmarks.harness import (
    Runner,
    bench_inputs,
    bench_world,
    machine,
    made_model_arguments,
    median,
    subcommand,
)
from verl.utils.cli import positive_int

logger = logging.getLogger(__name__)


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


def _timed_rounds(engines: dict[bool, Any], batch: dict[str, Any], args: argparse.Namespace):
    """The log-prob pass then the update of both engines per round, alternated: (each round's seconds
    per engine, round 0 unmeasured; the warm-up round's log-probabilities per engine)."""
    import torch

    from verl.algos import agg_loss
    from verl.engine import LossShare

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
    return seconds, first


def _packing_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state as ms

    model, made = args.model, None
    if model is None:
        if args.inputs is None:
            made = tempfile.mkdtemp(prefix="verl-bench-packing-")
        model = bench_inputs(args.inputs or made, hidden=args.hidden, layers=args.layers, heads=args.heads,
                             prompts=64)["model"]
    torch.set_num_threads(args.threads)
    try:
        with bench_world(device="cuda" if torch.cuda.is_available() else "cpu"):
            pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                              seed=args.seed)
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
            seconds, first = _timed_rounds(engines, batch, args)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    padded, packed = median(seconds[False]), median(seconds[True])
    response = args.response_length
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
        "machine": machine(),
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
    made_model_arguments(p, "the model")
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

