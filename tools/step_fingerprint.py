"""Every logged non-timing number of a fixed set of short runs, to prove a redesign of the step
changes none of them.

    python tools/step_fingerprint.py run --out before.json [--cases grpo,dpo] [--work DIR]
    python tools/step_fingerprint.py compare before.json after.json

``run`` makes a tiny Qwen2, 1-digit addition and preference pairs locally, then trains each case
(the algorithms on one rank for 2 steps; the streaming modes on 2 ranks, the rollout on rank 1,
for 4 steps; an async run stopped after step 2 and resumed) in the persistent worker pool, and
writes each step's metrics less timings and speeds. ``compare`` prints every number that differs
(``==``, no tolerance: the same code path on the same machine gives the same floats) and exits 1
if any does. Cases whose numbers depend on thread timing (the free-running generator) are
compared on what does not: the steps run and the per-step staleness bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Not compared: timings, speeds and memory (they differ run to run).
_NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "rollout/time_s", "memory/", "update_weights/time")

_FAST = [
    "trainer.device=cpu", "actor_rollout_ref.rollout.name=hf",
    "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "critic.ppo_micro_batch_size_per_gpu=16", "critic.forward_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0.1",
    "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_hf=false",
    "trainer.logger=[jsonl]", "data.val_files=null", "trainer.save_freq=-1",
]
_STREAM = [
    "trainer.n_gpus_per_node=2", "trainer.placement.rollout=[1]", "trainer.total_training_steps=4",
    "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
]
_ASYNC2 = ["trainer.rollout_mode=async", "trainer.async_training.max_staleness=2"]
_PARTIAL = ["trainer.async_training.partial_rollout=true", "trainer.async_training.partial_rollout_tokens=3"]

# name -> (ranks, overrides, stop after / resume); {words}, {pairs}, {model} filled in at run time.
CASES: dict[str, tuple[int, list[str], str]] = {
    "grpo": (1, ["algorithm.adv_estimator=grpo", "custom_reward_function.path={words}", "trainer.total_training_steps=2"], ""),
    "ppo_gae": (1, ["algorithm.adv_estimator=gae", "critic.model.path={model}", "custom_reward_function.path={words}",
                    "trainer.total_training_steps=2"], ""),
    "dapo": (1, ["algorithm.adv_estimator=grpo", "custom_reward_function.path={words}", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=3",
                 "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                 "trainer.total_training_steps=2"], ""),
    "dpo": (1, ["data.pairs=true", "data.shuffle=false", "algorithm.adv_estimator=grpo", "algorithm.dpo.beta=0.5",
                "data.train_files={pairs}", "trainer.total_training_steps=2"], ""),
    "hybrid": (1, ["algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true", "algorithm.hybrid.reward_threshold=0.5",
                   "actor_rollout_ref.actor.use_kl_loss=true", "custom_reward_function.path={words}",
                   "trainer.total_training_steps=2"], ""),
    "distill": (1, ["algorithm.adv_estimator=grpo", "custom_reward_function.path={words}", "distillation.enabled=true",
                    "distillation.teacher_model.model_path={model}", "distillation.distillation_loss.loss_mode=k3",
                    "trainer.total_training_steps=2"], ""),
    "one_step_off": (2, ["custom_reward_function.path={words}", *_STREAM, "trainer.rollout_mode=one_step_off"], ""),
    "async2": (2, ["custom_reward_function.path={words}", *_STREAM, *_ASYNC2], ""),
    "async2_partial": (2, ["custom_reward_function.path={words}", *_STREAM, *_ASYNC2, *_PARTIAL], ""),
    "async2_resumed": (2, ["custom_reward_function.path={words}", *_STREAM, *_ASYNC2, *_PARTIAL, "trainer.save_freq=1"],
                       "kill_after_2"),
    "free_running": (2, ["custom_reward_function.path={words}", *_STREAM, *_ASYNC2, *_PARTIAL,
                         "trainer.async_training.free_running=true"], "timing"),
}


def _metrics(log_dir: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            step = str(record.pop("step"))
            out.setdefault(step, {}).update({k: v for k, v in record.items() if not k.startswith(_NOT_COMPARED)})
    return out


def _body(overrides: list[str], folder: str, how: str) -> dict:
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    import torch.distributed as dist

    def cfg(resume: str) -> PPOConfig:
        return load_config(
            PPOConfig, config_file="ppo_trainer",
            overrides=[*overrides, f"trainer.default_local_dir={folder}", f"trainer.log_dir={folder}/logs",
                       f"trainer.resume_mode={resume}"],
            world_size=dist.get_world_size(),
        )

    if how == "kill_after_2":
        with PPOTrainer(cfg("disable")) as trainer:
            trainer.resume()
            trainer.fit(stop_after=2)
    with PPOTrainer(cfg("auto" if how == "kill_after_2" else "disable")) as trainer:
        start = trainer.resume()
        trainer.fit()
        end = trainer.global_step
    return {"start": start, "end": end}


def run(out: str, names: list[str], work: str) -> None:
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model
    from verl.testing.distributed import run_distributed

    model = os.path.join(work, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_tiny_model(model, TinyModelSpec(family="qwen2", kv_heads=2, corpus_lines=1500))
    train = os.path.join(work, "train.parquet")
    rows, _ = arithmetic.generate_splits(train=400, val=0, digits=1, seed=0)
    write_parquet(rows, train)
    pairs = os.path.join(work, "pairs.jsonl")
    with open(pairs, "w", encoding="utf-8") as f:
        for a in range(3):
            for b in range(3):
                f.write(json.dumps({"prompt": f"What is {a}+{b}?", "chosen": f"Answer: {a + b}",
                                    "rejected": f"Answer: {a + b + 1}"}) + "\n")
    words = os.path.join(ROOT, "tests", "trainer", "words_reward.py")
    result: dict[str, dict] = {}
    for name in names:
        ranks, overrides, how = CASES[name]
        filled = [o.format(words=words, pairs=pairs, model=model) for o in overrides]
        base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", *_FAST,
                f"trainer.n_gpus_per_node={ranks}"]
        folder = os.path.join(work, "runs", name)
        steps = run_distributed(_body, ranks, [*base, *filled], folder, how, timeout=900)[0]
        metrics = _metrics(os.path.join(folder, "logs"))
        if how == "timing":  # what does not depend on the thread's pace
            metrics = {s: {k: v for k, v in m.items() if k in ("training/global_step", "staleness/max")}
                       for s, m in metrics.items()}
        result[name] = {"steps": steps, "metrics": metrics}
        print(f"{name}: steps {steps['start']} -> {steps['end']}, {sum(len(m) for m in metrics.values())} numbers",
              flush=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)


def compare(a: str, b: str) -> int:
    with open(a, encoding="utf-8") as f:
        before = json.load(f)
    with open(b, encoding="utf-8") as f:
        after = json.load(f)
    bad = 0
    for name in sorted(set(before) | set(after)):
        x, y = before.get(name), after.get(name)
        if x is None or y is None:
            print(f"{name}: only in {'after' if x is None else 'before'}")
            bad += 1
            continue
        if x["steps"] != y["steps"]:
            print(f"{name}: steps {x['steps']} != {y['steps']}")
            bad += 1
        same = 0
        for step in sorted(set(x["metrics"]) | set(y["metrics"]), key=int):
            mx, my = x["metrics"].get(step, {}), y["metrics"].get(step, {})
            for key in sorted(set(mx) | set(my)):
                if mx.get(key) != my.get(key):
                    print(f"{name} step {step} {key}: {mx.get(key, '(none)')} != {my.get(key, '(none)')}")
                    bad += 1
                else:
                    same += 1
        print(f"{name}: {same} numbers equal")
    print("identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every case and write its numbers")
    r.add_argument("--out", required=True, help="the JSON file to write")
    r.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    r.add_argument("--work", default=None, help="a folder for the model, data and runs (default: a temporary one)")
    c = sub.add_parser("compare", help="print every number that differs between two runs' files")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args()
    if args.cmd == "compare":
        return compare(args.before, args.after)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        run(args.out, names, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="verl-fingerprint-") as work:
            run(args.out, names, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
