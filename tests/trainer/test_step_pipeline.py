"""The step as data (``verl.trainer.step``) and the one loop (``verl.trainer.loop``).

- ``build_step`` composes each algorithm's step from operators; conflicting step kinds fail
  with one message before anything is built;
- ``python -m verl.trainer.main_ppo data.pairs=true`` trains DPO, and ``algorithm.hybrid.enable``
  runs the hybrid PPO/DPO step from the command line;
- a ``DataStream`` stepped by hand gets the loop's checkpoints and resume: stepped for 6 steps,
  killed (SIGKILL) after step 4's checkpoint and started again, it continues at step 5 with the
  metrics the uninterrupted run logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from verl.config import ConfigError, PPOConfig, load_config

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = os.path.join(HERE, "words_reward.py")

FAST = [
    "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
    "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "trainer.save_hf=false", "trainer.logger=[jsonl]", "data.val_files=null",
]


def _cfg(*overrides: str) -> PPOConfig:
    return load_config(
        PPOConfig,
        config_file="ppo_trainer",
        overrides=["actor_rollout_ref.model.path=/nonexistent", "data.train_files=/nonexistent.parquet", *overrides],
        world_size=1,
    )


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["algorithm.adv_estimator=grpo"], ["RolloutOperator", "RewardOperator", "PPOUpdateOperator"]),
        (["algorithm.adv_estimator=gae"], ["RolloutOperator", "RewardOperator", "PPOUpdateOperator"]),
        (["algorithm.adv_estimator=remax"], ["RolloutOperator", "RewardOperator", "PPOUpdateOperator"]),
        (
            ["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
            ["DynamicSamplingOperator", "PPOUpdateOperator"],
        ),
        (["data.pairs=true", "data.val_files=null", "algorithm.adv_estimator=grpo"], ["PreferenceOperator", "DPOUpdateOperator"]),
        (
            ["algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
             "actor_rollout_ref.rollout.n=4"],
            ["RolloutOperator", "RewardOperator", "ConditionalUpdateOperator"],
        ),
    ],
)
def test_build_step_composes_each_algorithms_step(overrides, names):
    from verl.trainer.step import build_step

    assert [type(op).__name__ for op in build_step(_cfg(*overrides)).operators] == names


def test_the_configs_dpo_and_hybrid_settings_reach_the_operators():
    from verl.trainer.step import build_step

    dpo = build_step(_cfg("data.pairs=true", "data.val_files=null", "algorithm.adv_estimator=grpo",
                          "algorithm.dpo.beta=0.3", "algorithm.dpo.loss_type=ipo")).operators[1]
    assert (dpo.beta, dpo.loss_type) == (0.3, "ipo")
    hybrid = build_step(_cfg("algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true",
                             "algorithm.hybrid.reward_threshold=0.25", "actor_rollout_ref.actor.use_kl_loss=true",
                             "actor_rollout_ref.rollout.n=4")).operators[2]
    assert hybrid.condition({"reward": 0.25}) and not hybrid.condition({"reward": 0.2})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.pairs=true", "data.val_files=null", "algorithm.hybrid.enable=true"], "are different steps; choose one"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "algorithm.hybrid.enable=true",
          "actor_rollout_ref.actor.use_kl_loss=true"], "are different steps; choose one"),
        (["algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true", "actor_rollout_ref.rollout.n=4"],
         "the DPO half needs the reference policy"),
        (["algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.rollout.n=1"], r"actor_rollout_ref.rollout.n=1; sample several"),
        (["algorithm.dpo.loss_type=nope"], "algorithm.dpo.loss_type"),
    ],
)
def test_step_kinds_that_cannot_hold_fail_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


# -- main_ppo runs DPO and the hybrid step ---------------------------------------------------------


def _main_ppo(argv: list[str], cwd: str) -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo ARGV`` as its ``main(argv)`` in this process (a world of one
    that it starts and ends, as test_distillation's runs): the exit status and what it logged,
    without a Python start per run."""
    from verl.testing.commands import run_main
    from verl.trainer.main_ppo import main

    return run_main(main, argv, cwd=cwd, name="main_ppo")


def _logged(log_dir: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                steps.setdefault(int(record.pop("step")), {}).update(record)
    return steps


@pytest.mark.slow
def test_main_ppo_trains_dpo_on_pairs(tiny_model_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(
        json.dumps({"prompt": f"What is {a}+{b}?", "chosen": f"Answer: {a + b}", "rejected": f"Answer: {a + b + 1}"}) + "\n"
        for a in range(3) for b in range(3)
    ))
    logs = tmp_path / "logs"
    done = _main_ppo(
        [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={pairs}", "data.pairs=true",
         "data.shuffle=false", "algorithm.adv_estimator=grpo", "algorithm.dpo.beta=0.5", *FAST,
         "trainer.total_training_steps=3", "trainer.save_freq=-1", f"trainer.log_dir={logs}",
         f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dpo (preference pairs, data.pairs; beta=0.5); step PreferenceOperator -> DPOUpdateOperator" in done.stderr
    steps = _logged(str(logs))
    assert sorted(steps) == [1, 2, 3]
    for step, m in steps.items():
        assert math.isfinite(m["dpo/loss"]) and m["actor/grad_norm"] > 0, (step, m)
    # The same pairs train (no shuffle, 9 pairs in batches of 4): the chosen side gains on the rejected one.
    assert steps[1]["dpo/rewards/margin"] == 0.0 and steps[3]["dpo/rewards/margin"] > 0  # step 1 at the reference's weights


@pytest.mark.slow
def test_main_ppo_runs_the_hybrid_step(tiny_model_dir, arithmetic_files, tmp_path):
    logs = tmp_path / "logs"
    done = _main_ppo(
        [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}",
         "algorithm.adv_estimator=grpo", "algorithm.hybrid.enable=true", "algorithm.hybrid.reward_threshold=0.5",
         "actor_rollout_ref.actor.use_kl_loss=true", f"custom_reward_function.path={WORDS}", *FAST,
         "trainer.total_training_steps=2", "trainer.save_freq=-1", f"trainer.log_dir={logs}",
         f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step RolloutOperator -> RewardOperator -> ConditionalUpdateOperator" in done.stderr
    steps = _logged(str(logs))
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["conditional/true_samples"] + m["conditional/false_samples"] == 16
        if m["conditional/true_samples"] > 0:
            assert math.isfinite(m["actor/pg_loss"])
        if m["conditional/dpo_pairs"] > 0:
            assert math.isfinite(m["dpo/loss"])
    assert any(m["conditional/dpo_pairs"] > 0 for m in steps.values())  # the words reward spreads: pairs form


# -- a stream stepped by hand: the loop's checkpoints and resume -----------------------------------

HAND_LOOP = textwrap.dedent(
    """
    import json, os, signal, sys
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from verl import DataStream, PPOUpdateOperator, RewardOperator, RolloutOperator

    def main():
        model, train, out, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
        overrides = json.loads(sys.argv[5])
        stream = DataStream(model=model, train_files=train, overrides=overrides)
        stream.add_operator(RolloutOperator()).add_operator(RewardOperator()).add_operator(PPOUpdateOperator())
        for _ in range(6):
            metrics = stream.step()
            if metrics is None:
                break
            with open(os.path.join(out, "steps.txt"), "a") as f:
                f.write(f"{int(metrics['training/global_step'])}\\n")
            if metrics["training/global_step"] == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        stream.close()


    if __name__ == "__main__":
        main()
    """
)


def _hand_loop_overrides(out: str) -> list[str]:
    return [
        *FAST, "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
        f"custom_reward_function.path={WORDS}", "trainer.total_training_steps=6", "trainer.save_freq=2",
        "trainer.resume_mode=auto", f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs",
    ]


def _hand_loop(model: str, train: str, out: str, *, kill_after: int) -> subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    overrides = _hand_loop_overrides(out)
    script = os.path.join(out, "hand_loop.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(HAND_LOOP)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    # Output to a file, not a pipe: a helper process the killed run leaves behind (a checkpoint
    # writer's) would hold a pipe open; its own session, so that the test can end every process it left.
    log = os.path.join(out, f"run{len(os.listdir(out))}.log")
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            [sys.executable, script, model, train, out, str(kill_after), json.dumps(overrides)],
            cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    with open(log, encoding="utf-8") as f:
        text = f.read()
    return subprocess.CompletedProcess(proc.args, code, text, text)


def _hand_loop_in_process(model: str, train: str, out: str) -> None:
    """The uninterrupted reference run: the same script's ``main()`` in this process (no kill to
    survive, so no Python start of its own), on one torch thread as the script runs
    (``OMP_NUM_THREADS=1``), so that its float32 arithmetic is the killed and resumed runs'."""
    import torch

    os.makedirs(out, exist_ok=True)
    script: dict = {"__name__": "hand_loop"}
    exec(compile(HAND_LOOP, os.path.join(out, "hand_loop.py"), "exec"), script)
    argv, threads, here = sys.argv, torch.get_num_threads(), os.getcwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sys.argv = ["hand_loop.py", model, train, out, "0", json.dumps(_hand_loop_overrides(out))]
    torch.set_num_threads(1)
    os.chdir(out)
    try:
        script["main"]()
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        os.chdir(here)
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.mark.slow
def test_a_stream_stepped_by_hand_resumes_after_a_kill_with_equal_metrics(tiny_model_dir, arithmetic_files, tmp_path):
    train = arithmetic_files["train"]
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    _hand_loop_in_process(tiny_model_dir, train, whole)
    killed = _hand_loop(tiny_model_dir, train, parts, kill_after=4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # (and the killed run's lock file, which the next run takes over: verl.utils.run_lock)
    assert sorted(os.listdir(os.path.join(parts, "ckpt"))) == [
        ".verl_run.lock", "global_step_2", "global_step_4", "latest_checkpointed_iteration.txt"
    ]
    again = _hand_loop(tiny_model_dir, train, parts, kill_after=0)
    assert again.returncode == 0, again.stderr[-3000:]

    # The second start's first step() resumed at step 4: it ran steps 5 and 6, then the run was over.
    with open(os.path.join(parts, "steps.txt"), encoding="utf-8") as f:
        assert [int(line) for line in f] == [1, 2, 3, 4, 5, 6]
    expected, actual = _logged(os.path.join(whole, "logs")), _logged(os.path.join(parts, "logs"))
    assert sorted(expected) == sorted(actual) == [1, 2, 3, 4, 5, 6]  # steps 5-6 logged once
    for step in (5, 6):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "reward_mean"):
            # Bit-equal on CPU: the same samples (seeded by the step), the same weights and optimizer
            # state (restored from the checkpoint), the same float32 arithmetic.
            assert actual[step][key] == expected[step][key], (step, key)
    assert all(expected[s]["actor/grad_norm"] > 1e-3 for s in (5, 6))  # the steps train
    # Both runs ended as fit() ends: the final checkpoint at step 6.
    assert os.path.isdir(os.path.join(parts, "ckpt", "global_step_6"))
    assert os.path.isdir(os.path.join(whole, "ckpt", "global_step_6"))


@pytest.mark.parametrize(
    "overrides, warned",
    [
        (["trainer.rollout_mode=one_step_off"], True),
        (["trainer.rollout_mode=async", "trainer.async_training.max_staleness=2"], True),
        (["trainer.rollout_mode=async", "trainer.async_training.max_staleness=0"], False),  # the sync step
        (["trainer.rollout_mode=async", "algorithm.rollout_correction.rollout_is=token"], False),
        (["trainer.rollout_mode=one_step_off", "algorithm.rollout_correction.rollout_rs=token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"], False),
        (["trainer.rollout_mode=one_step_off", "algorithm.rollout_correction.bypass_mode=true"], False),
        (["trainer.rollout_mode=sync"], False),
    ],
)
def test_streaming_modes_without_rollout_correction_warn(overrides, warned, caplog):
    """Stale samples trained with no correction cost learning (docs/async.md): the step says so once."""
    from verl.trainer.step import build_step

    with caplog.at_level("WARNING", logger="verl.trainer.step.pipeline"):
        build_step(_cfg("algorithm.adv_estimator=grpo", *overrides))
    said = [r.getMessage() for r in caplog.records if "no rollout correction" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert "algorithm.rollout_correction.rollout_is=token" in said[0] and "docs/async.md" in said[0]



def test_a_non_finite_score_is_refused_at_the_reward_step():
    """Every reward step ends in ``StepPieces.place_scores`` (RewardOperator, MultiRewardScorer,
    the trainer's compute_reward): the scores plus an agent rollout's interaction rewards become
    ``token_level_scores``, and a non-finite one on a response token (a reward model's, an
    interaction's) stops the step there, with the step and sample named, on every rank alike:
    with the rollout on ranks of its own it was refused on those ranks only after the update they
    generate through. A rule-based scorer's NaN is already a failed score of 0 (verl.rewards)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import numpy as np
    import torch

    from verl.protocol import Batch
    from verl.roles.reward_model import RewardResult
    from verl.trainer.step.ops import RewardOperator
    from verl.trainer.step.pieces import StepPieces

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    turns = torch.zeros(2, 3)
    turns[0, 2] = float("nan")  # beyond sample 0's response: never read
    batch = Batch.from_dict({"response_mask": mask, "interaction_scores": turns},
                            {"data_source": np.array(["a", "b"], dtype=object)})
    trainer = SimpleNamespace(global_step=4)
    placed, more = StepPieces.place_scores(trainer, batch, torch.ones(2, 3))
    assert torch.equal(placed["token_level_scores"][1], torch.ones(3)) and "reward/interaction/mean" in more

    batch["interaction_scores"][1, 1] = float("inf")  # an interaction's reward on sample 1
    with pytest.raises(ValueError, match=r"step 5: token_level_scores is inf for sample 1 \(data_source='b'\); "
                                         r"the update was not made"):
        StepPieces.place_scores(trainer, batch, torch.ones(2, 3))

    # The reward operator goes through it (its scorer isolated: a reward model's NaN for sample 0).
    op = RewardOperator()
    batch.pop(["interaction_scores"])
    nan = torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 1.0]])
    op._role = SimpleNamespace(score=lambda b: RewardResult(token_level_scores=nan, scores=nan.sum(-1)))
    fake = SimpleNamespace(global_step=0, phase=lambda name: nullcontext())
    fake.place_scores = lambda b, s: StepPieces.place_scores(fake, b, s)
    op._trainer = fake  # (bind() would build the scorers from a trainer's config)
    with pytest.raises(ValueError, match=r"step 1: token_level_scores is nan for sample 0 \(data_source='a'\)"):
        op.process(batch)


class _StepTrainer:
    """What ``StepPipeline.run`` and ``Loop`` use of a trainer, without models."""

    def __init__(self, total_steps: int) -> None:
        from types import SimpleNamespace

        self.world, self.global_step, self.total_steps, self.step_ctx = None, 0, total_steps, None
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(total_epochs=1, collective_timeout_s=60.0))
        self.last_checkpoint, self.stopped_by = None, None

    def begin_step(self, schedule):
        from verl.trainer.step.context import PhaseTimer, StepContext

        self.step_ctx = StepContext(step=self.global_step + 1, timer=PhaseTimer(), schedule=schedule)
        return self.step_ctx

    def end_step(self):
        self.step_ctx = None

    def resume(self):
        return self.global_step

    def post_phase(self, phase):
        pass


def _scored(rewards):
    import torch

    from verl.protocol import Batch

    return Batch.from_dict({"token_level_scores": torch.tensor(rewards).unsqueeze(-1)}, non_tensors={"uid": ["a", "a", "b", "b"]})


@pytest.mark.parametrize("keeper", ["threshold", "predicate", "groups"])
def test_a_step_whose_filter_keeps_no_sample_is_skipped_and_counted_and_the_run_goes_on(keeper, caplog):
    """#58: FilterOperator (and GroupFilterOperator) raised when they kept nothing, ending fit()."""
    from verl.trainer.loop import Loop
    from verl.trainer.step import StepPipeline
    from verl.trainer.step.ops import FilterOperator, GroupFilterOperator

    draws = iter([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    updated: list[int] = []

    class Draw:
        inputs, outputs = (), ("token_level_scores", "uid")

        def process(self, batch):
            return next((_scored(r) for r in draws), None)

    class Update:
        inputs, outputs = ("token_level_scores",), ()

        def process(self, batch):
            updated.append(len(batch))
            return batch

    trainer = _StepTrainer(total_steps=10)
    if keeper == "groups":  # the groups of step 2 and step 3 have no reward spread
        keep = GroupFilterOperator()
        keep.bind(type("T", (), {"filter_metric": lambda self, b, m: b["token_level_scores"].sum(-1).numpy()})())
    else:
        keep = FilterOperator(0.5) if keeper == "threshold" else FilterOperator(predicate=lambda s: s["reward"] > 0.5)
    pipeline = StepPipeline([Draw(), keep, Update()])
    loop = Loop(trainer, lambda: pipeline.run(trainer), callbacks=[])
    with caplog.at_level("WARNING", logger="verl.trainer.step.pipeline"):
        steps = []
        while (m := loop.step()) is not None:
            steps.append(m)
    assert trainer.global_step == 4 and len(steps) == 4  # the run went on to the end of the data
    skipped = [2, 3] if keeper == "groups" else [2]
    assert len(updated) == 4 - len(skipped)  # no update in a skipped step
    for step in skipped:
        m = steps[step - 1]
        assert m["training/global_step"] == step and "timing_s/step" in m
        assert m["training/empty_steps"] == skipped.index(step) + 1
        assert f"step {step}: operator {type(keep).__name__} left no sample of 4 in the batch; the step is skipped" in caplog.text
    assert "training/empty_steps" not in steps[0] and steps[-1]["training/empty_steps"] == len(skipped)
