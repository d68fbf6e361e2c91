"""``bench.py compare-trl``: our GRPO against TRL's GRPOTrainer on the same work, rounds alternated,
in one process (``--nproc N``: N processes a side, ``tools/benchmarks/compare_trl_nproc.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tools.benchmarks.harness import (
    Runner,
    bench_inputs,
    bench_world,
    machine,
    made_model_arguments,
    median,
    rl_config,
    subcommand,
)
from verl.utils.cli import non_negative_int, positive_float, positive_int

logger = logging.getLogger(__name__)


def _trl_side(args: argparse.Namespace, model: str, train: str, out_dir: str, on_step: Callable[[], None], *,
              before_step: Callable[[], None] | None = None, processes: int = 1):
    """TRL's ``GRPOTrainer`` on the same model, prompts and settings, its defaults otherwise; ``on_step``
    runs after each of its steps and ``before_step`` before each, both outside its timing. ``processes``:
    how many processes TRL's data-parallel launch runs (each takes its share of the step's samples).
    Returns (trainer, per-step records, its config)."""
    import datasets
    import pyarrow.parquet as pq
    import torch
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
        per_device_train_batch_size=args.prompts * args.n // processes, gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.response_length, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.steps + args.warmup,
        # bf16 left to TRL's default (True) unless fp32 is asked for; beta (KL) is TRL's default 0.0.
        **({"bf16": False} if args.trl_dtype == "fp32" else {}),
    )
    records: list[dict[str, float]] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if before_step is not None:
                before_step()
            self.start = time.perf_counter()
            trainer._bench_gen_s = 0.0

        def on_step_end(self, *_, **__):
            step_s = time.perf_counter() - self.start
            m = trainer._metrics["train"]
            records.append({
                "step_s": step_s, "gen_s": trainer._bench_gen_s,
                "generated_tokens": m["completions/mean_length"][-1] * args.prompts * args.n,
                "score_mean": m["reward"][-1],
                "torch_threads": torch.get_num_threads(),
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
# tools/bench_rewards.py, beside the entry point tools/bench.py.
BENCH_REWARDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_rewards.py")
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
    mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
    return {
        "mfu_step": median(mfu) if mfu else None,
        "tflops_step": median([r["tflops"] for r in records if r.get("tflops") is not None] or [0.0]),
        "step_s": median([r["step_s"] for r in records]),
        "generated_tokens_per_s": median([r["generated_tokens"] / r["step_s"] for r in records]),
        "rollout_tokens_per_s": median([r["generated_tokens"] / r["gen_s"] for r in records]),
        "gen_share": median([r["gen_s"] / r["step_s"] for r in records]),
        "generated_tokens_per_step": median([r["generated_tokens"] for r in records]),
        "rounds": records,
    }


_AGREEMENT_KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
                   "training/rollout_logprob_diff_max", "training/token_mult_prob_error")


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
                           train_dtype: str, ranks: int = 1) -> list[str]:
    """Our side's overrides of grpo_tiny_cpu for compare-trl: TRL's work (batch, samples, length, one
    update per step on the whole batch, no KL, learning rate), the training dtype, the reward; the
    user's overrides last. ``ranks``: our data-parallel ranks, each with its share of the samples."""
    sequences = args.prompts * args.n
    per_rank = sequences // ranks
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
        f"{_micro_batch(args.micro_batch, hf['hidden_size'], per_rank)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
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


def our_record(m: dict[str, float] | None, sequences: int) -> dict[str, Any]:
    """One of our trainer's steps (its metrics) as a compare-trl record: seconds, generated tokens (the
    whole batch, every rank's), reward, MFU, threads, rollout agreement."""
    import torch

    if m is None:
        raise ValueError("our side ran out of prompts")
    return {
        "step_s": m["timing_s/step"], "gen_s": m["timing_s/gen"] - m.get("timing_s/update_weights", 0.0),
        "generated_tokens": m["response_length/mean"] * sequences,
        "score_mean": m["critic/score/mean"],
        "prompt_tokens_mean": m["prompt_length/mean"],
        # The step's model FLOPs utilisation and achieved TFLOP/s per device (verl.trainer.perf).
        "mfu": m.get("perf/mfu/step"), "tflops": m.get("perf/tflops/step"),
        "torch_threads": torch.get_num_threads(),  # after the step (in one process: TRL's and ours)
        # The update's logprobs against the rollout engine's on the same samples.
        **{k.split("/", 1)[1]: m[k] for k in _AGREEMENT_KEYS if k in m},
    }


def trl_settings(trl_config: Any, trl_trainer: Any) -> dict[str, Any]:
    """What TRL's side ran with, for the JSON: its precision and defaults kept, the model's size."""
    import transformers
    import trl

    return {"version": trl.__version__, "transformers": transformers.__version__,
            "bf16": bool(trl_config.bf16), "gradient_checkpointing": bool(trl_config.gradient_checkpointing),
            "use_vllm": bool(trl_config.use_vllm), "loss_type": trl_config.loss_type, "beta": trl_config.beta,
            "model_parameters": sum(p.numel() for p in trl_trainer.model.parameters())}


def _alternate_rounds(args: argparse.Namespace, cfg: Any, model: str, train: str, root: str,
                      sequences: int) -> tuple[Any, Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """One TRL step then one of ours, ``--warmup + --steps`` times, in a world of one started through
    the harness: (TRL's trainer, its config, its per-step records, ours)."""
    from verl.trainer.ppo_trainer import PPOTrainer

    with bench_world(device="cpu"), PPOTrainer(cfg) as ours:
        ours_records: list[dict[str, float]] = []

        def our_step() -> None:  # right after each TRL step: a round is one step of each
            ours_records.append(our_record(ours.train_step(), sequences))
            logger.info("compare-trl round %d: TRL %.3f s/step (%.3f s generating), ours %.3f s/step "
                        "(%.3f s generating)", len(ours_records), trl_records[-1]["step_s"],
                        trl_records[-1]["gen_s"], ours_records[-1]["step_s"], ours_records[-1]["gen_s"])

        trl_trainer, trl_records, trl_config = _trl_side(args, model, train, f"{root}/trl", our_step)
        trl_trainer.train()
    return trl_trainer, trl_config, trl_records, ours_records


def _compare_trl_run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

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
        made = bench_inputs(args.inputs or root, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            prompts=max(512, 4 * args.prompts * (args.steps + args.warmup)))
        model = args.model or made["model"]
        sequences = args.prompts * args.n
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        train_dtype = _verl_train_dtype(args.verl_dtype, hf["hidden_size"])
        overrides = _compare_trl_overrides(args, model, made["train"], hf, train_dtype)
        cfg = rl_config("grpo_tiny_cpu", overrides, root, 1)
        trl_trainer, trl_config, trl_records, ours_records = _alternate_rounds(
            args, cfg, model, made["train"], root, sequences)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if len(trl_records) != args.steps + args.warmup or len(ours_records) != len(trl_records):
        raise RuntimeError(f"expected {args.steps + args.warmup} rounds, got TRL {len(trl_records)}, "
                           f"ours {len(ours_records)}")
    ours_info = {"engine": cfg.actor_rollout_ref.rollout.name, "train_dtype": _VERL_DTYPES[train_dtype],
                 "rollout_dtype": cfg.actor_rollout_ref.rollout.dtype}
    return compare_trl_result(args, model, ours_info, trl_settings(trl_config, trl_trainer), trl_records,
                              ours_records)


def compare_trl_result(args: argparse.Namespace, model: str, ours_info: dict[str, Any], trl_info: dict[str, Any],
                       trl_records: list[dict[str, Any]], ours_records: list[dict[str, Any]], *,
                       devices: int = 1) -> dict[str, Any]:
    """The JSON object: both sides' medians over the measured rounds, their ratios, the reward curves.
    ``devices``: processes per side (TRL's MFU is per device, as ours)."""
    _trl_mfu(model, trl_info["bf16"], trl_records, ours_records, sequences=args.prompts * args.n, devices=devices)
    mine, theirs = _side_summary(ours_records[args.warmup:]), _side_summary(trl_records[args.warmup:])
    per_round = [
        (a["generated_tokens"] / a["step_s"]) / (b["generated_tokens"] / b["step_s"])
        for a, b in zip(ours_records[args.warmup:], trl_records[args.warmup:])
    ]
    step_rounds = [b["step_s"] / a["step_s"] for a, b in zip(ours_records[args.warmup:], trl_records[args.warmup:])]
    trl_info = dict(trl_info)
    return {
        "bench": "compare-trl",
        "model": model,
        "model_parameters": trl_info.pop("model_parameters"),
        "reward": args.reward,
        "prompts_per_step": args.prompts, "n": args.n, "response_length": args.response_length, "lr": args.lr,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        # torch's intra-op threads seen after each round (one process: both sides share the setting).
        "threads_seen": sorted({r["torch_threads"] for r in ours_records + trl_records if "torch_threads" in r}),
        "machine": machine(),
        "ours": {**ours_info, **mine},
        "trl": {**trl_info, **theirs},
        # ours / TRL: > 1 means ours generates more tokens per second of step.
        "tokens_per_s_ratio_of_medians": mine["generated_tokens_per_s"] / theirs["generated_tokens_per_s"],
        "tokens_per_s_ratio_rounds": per_round,
        "tokens_per_s_ratio_median_of_rounds": median(per_round),
        "step_time_ratio_trl_over_ours_median_of_rounds": median(step_rounds),
        # Samples trained on before each entry of the curves (warm-up included): the same on both sides.
        "samples_seen": [i * args.prompts * args.n for i in range(len(ours_records))],
        "reward_curve_ours": [r["score_mean"] for r in ours_records],
        "reward_curve_trl": [r["score_mean"] for r in trl_records],
        # Mean reward of each step's samples, drawn before that step's update: the last entry is the
        # policy after the same number of updates on both sides.
        "reward_last_ours": ours_records[-1]["score_mean"], "reward_last_trl": trl_records[-1]["score_mean"],
    }


def _trl_mfu(model: str, bf16: bool, trl_records: list[dict[str, Any]], ours_records: list[dict[str, Any]],
             *, sequences: int, devices: int = 1) -> None:
    """Each TRL round's ``mfu`` and ``tflops``: its step's model FLOPs counted as ours are
    (verl.trainer.perf) on its mean completion length and the prompts' mean length of our same round
    (both sides draw from the same prompts), generation plus one forward and backward with the head on
    the completion tokens and the one before them (TRL's ``logits_to_keep``), over its step's seconds and
    the peak of its dtype (bf16 or fp32), per device (``devices`` processes share the step's FLOPs).
    Gradient checkpointing's recomputation is not counted (model FLOPs)."""
    import dataclasses

    from verl.config.schema import ModelConfig
    from verl.engine.build import load_model_spec
    from verl.trainer.perf import ModelShape, device_peak, generation_terms, training_flops, training_terms

    shape = ModelShape.from_spec(load_model_spec(ModelConfig(path=model), key="--model"))
    peak = device_peak("cpu")
    rate = peak.of("bf16" if bf16 else "fp32") if peak is not None else None
    for trl, ours in zip(trl_records, ours_records):
        prompt = round(ours["prompt_tokens_mean"])
        completion = round(trl["generated_tokens"] / sequences)
        gen = generation_terms(shape, [prompt] * sequences, [completion] * sequences).forward
        terms = training_terms(shape, [prompt + completion] * sequences)
        terms = dataclasses.replace(terms, head=2.0 * (completion + 1) * sequences * shape.hidden * shape.vocab)
        flops = (gen + training_flops(shape, terms)) / devices
        trl["tflops"] = flops / trl["step_s"] / 1e12
        trl["mfu"] = flops / trl["step_s"] / (rate * 1e12) if rate else None


@subcommand("compare-trl", "our GRPO against TRL's GRPOTrainer on the same work, rounds alternated, in one run "
                           "(--nproc N: N processes a side)")
def _compare_trl(p: argparse.ArgumentParser) -> Runner:
    p.description = (
        "One process, one machine: verl's RL trainer (GRPO, world of one) and TRL's GRPOTrainer on the same local "
        "tiny Qwen2 (random weights unless --model), the same 2-digit arithmetic prompts and scorer (--reward), prompts x n "
        "samples per step, response length, learning rate (constant), one optimizer update per step, no KL. A "
        "round is one TRL step then one of ours (after --warmup rounds). Reports each side's generated tokens "
        "per second of step, seconds per step, share of the step spent generating, the ratio ours/TRL (of the "
        "medians, and the median of per-round ratios) and both reward curves. TRL keeps its defaults (bf16 "
        "autocast, gradient checkpointing, transformers generate) unless --trl-dtype fp32. With --nproc N each "
        "side runs on N processes (two torchrun launches stepped in turn), each process on --threads threads."
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides for our side (main_ppo's)")
    made_model_arguments(p, "the model and prompts")
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per step (default %(default)s)")
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--response-length", type=positive_int, default=32, help="max response tokens (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=2e-4, help="learning rate, both sides (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=5, help="measured rounds (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first, not measured (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads, both sides (per process under --nproc) (default %(default)s)")
    p.add_argument("--nproc", type=positive_int, default=1,
                   help="processes per side: 1 runs both trainers in this process, rounds alternated; N > 1 starts "
                        "two torchrun launches of N processes, TRL's data-parallel launch and ours on N ranks "
                        "(colocated, data parallel N, sync), alive together and stepped in turn: TRL's step k, "
                        "then ours (tools/benchmarks/compare_trl_nproc.py) (default %(default)s)")
    p.add_argument("--launch", choices=["together", "apart"], default="together",
                   help="with --nproc N: together keeps both launches alive and steps them in turn (a load change "
                        "hits both alike; 2N processes' memory at once); apart runs TRL's launch through all its "
                        "steps, then ours (N processes' memory; the sides' steps minutes apart) (default %(default)s)")
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
        if args.nproc > 1:
            from tools.benchmarks.compare_trl_nproc import compare_trl_nproc

            result = compare_trl_nproc(args)
        else:
            result = _compare_trl_run(args)
        logger.info(
            "compare-trl, %d process(es) a side (median of %d rounds): ours %.0f generated tokens/s, %.3f s/step, %.0f%% generating; "
            "TRL (%s) %.0f tokens/s, %.3f s/step, %.0f%% generating; ours/TRL %.2fx (ratio of medians), %.2fx "
            "(median of per-round ratios); MFU of the step ours %s, TRL %s; reward ours %s, TRL %s",
            args.nproc, args.steps, result["ours"]["generated_tokens_per_s"], result["ours"]["step_s"],
            100 * result["ours"]["gen_share"], "bf16" if result["trl"]["bf16"] else "fp32",
            result["trl"]["generated_tokens_per_s"], result["trl"]["step_s"], 100 * result["trl"]["gen_share"],
            result["tokens_per_s_ratio_of_medians"], result["tokens_per_s_ratio_median_of_rounds"],
            *(f"{side['mfu_step']:.1%}" if side["mfu_step"] is not None else "-"
              for side in (result["ours"], result["trl"])),
            [round(v, 3) for v in result["reward_curve_ours"]], [round(v, 3) for v in result["reward_curve_trl"]],
        )
        return result

    return run

