"""On-policy distillation through the trainer: the teacher role, its operator, placement and pre-flight.

- A teacher equal to the student gives a zero reverse KL at the first step (the same weights score
  the same tokens), through ``main_ppo``.
- A real teacher (a deeper tiny model of the same tokenizer) colocated on one rank, and the same run
  with the teacher on a rank of its own (``trainer.placement.teacher=[1]``), take the same steps bit
  for bit (as ``test_placement`` checks the other roles), with a sampled-token loss and a top-k one.
- ``forward_kl_topk`` (the teacher's top-k) through ``main_ppo``: 0 against a teacher equal to the
  student, positive against a real one; the student and teacher at TP=2 take TP=1's first step.
- The pre-flight refuses, before any model is built, a teacher of another vocabulary or tokenizer,
  a missing teacher, a layout that cannot split the teacher, a top-k larger than the vocabulary,
  the top-k losses verl does not provide, and a stream without the operator.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

from verl.testing.distributed import run_distributed

from .test_rl_algorithms import FAST

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory) -> str:
    """A deeper, wider tiny Qwen2 on the tiny model's tokenizer (same corpus and seed: the same
    tokenizer files), with weights of its own."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("teacher")
    return make_tiny_model(
        str(out), TinyModelSpec(family="qwen2", hidden=128, heads=4, kv_heads=2, layers=3, corpus_lines=1500)
    )


def _argv(model_dir: str, train: str, root: str, *extra: str) -> list[str]:
    return [
        "--config", "grpo_tiny_cpu", *FAST,
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train}",
        f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs", *extra,
    ]


def _main(argv: list[str]) -> tuple[int, str]:
    from verl.trainer.main_ppo import main

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, stderr.getvalue()


def _metrics(root: str) -> list[dict[str, float]]:
    with open(os.path.join(root, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_teacher_equal_to_the_student_adds_nothing(tiny_model_dir, arithmetic_files, tmp_path):
    root = str(tmp_path / "same")
    code, err = _main(_argv(
        tiny_model_dir, arithmetic_files["train"], root,
        "distillation.enabled=true", f"distillation.teacher_model.model_path={tiny_model_dir}",
        "distillation.distillation_loss.loss_mode=k3", "trainer.total_training_steps=1",
        # the teacher's forward at the update's micro-batch size: the same arithmetic as the update's
        "distillation.teacher_model.log_prob_micro_batch_size_per_gpu=16",
    ))
    assert code == 0, err[-3000:]
    [step] = _metrics(root)
    # Same weights, same tokens, same kernels: the teacher's log-probs are the student's.
    assert step["distillation/reverse_kl_k1"] == 0.0 and step["distillation/loss"] == 0.0, step
    assert step["distillation/teacher_log_prob_mean"] < 0 and "timing_s/teacher" in step


def test_forward_kl_topk_through_main_ppo(tiny_model_dir, teacher_dir, arithmetic_files, tmp_path):
    """One step with the top-k loss: a teacher equal to the student gives exactly 0 (the same logits
    give the same top-k log-probabilities on both sides); a real teacher a positive loss, with the
    mass of its top-8 on each side logged."""
    topk = ["distillation.enabled=true", "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=8", "trainer.total_training_steps=1",
            "distillation.teacher_model.log_prob_micro_batch_size_per_gpu=16"]
    root = str(tmp_path / "same")
    code, err = _main(_argv(tiny_model_dir, arithmetic_files["train"], root, *topk,
                            f"distillation.teacher_model.model_path={tiny_model_dir}"))
    assert code == 0, err[-3000:]
    [same] = _metrics(root)
    assert same["distillation/loss"] == 0.0, same
    assert 0 < same["distillation/teacher_mass"] <= 1.0
    assert same["distillation/student_mass"] == pytest.approx(same["distillation/teacher_mass"], abs=1e-6)
    root = str(tmp_path / "real")
    code, err = _main(_argv(tiny_model_dir, arithmetic_files["train"], root, *topk,
                            f"distillation.teacher_model.model_path={teacher_dir}"))
    assert code == 0, err[-3000:]
    [real] = _metrics(root)
    assert real["distillation/loss"] > 0 and math.isfinite(real["actor/grad_norm"]), real
    assert 0 < real["distillation/teacher_mass"] <= 1.0 and 0 < real["distillation/student_mass"] <= 1.0


def _topk_layout_body(model_dir: str, teacher: str, train: str, root: str, tp: int) -> dict[str, float]:
    import torch.distributed as dist

    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    world = dist.get_world_size()
    cfg = load_config(PPOConfig, config_file="grpo_tiny_cpu", world_size=world, overrides=[
        *_argv(model_dir, train, root)[2:], f"trainer.n_gpus_per_node={world}", "trainer.logger=[]",
        "distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}",
        "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=4",
        # the teacher follows the actor's layout: TP=2, or DP=2 at TP=1
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ])
    with PPOTrainer(cfg) as trainer:
        return trainer.train_step()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_forward_kl_topk_at_tp2_equals_tp1(tiny_model_dir, teacher_dir, arithmetic_files, tmp_path):
    """Two ranks, the same first rollout: the student and the teacher split over TP=2 (each rank a
    vocabulary half: top-k from gathered candidates, student log-probabilities of those ids from
    all-reduced sums) give the first step of TP=1 with DP=2."""
    args = (tiny_model_dir, teacher_dir, arithmetic_files["train"])
    expected = run_distributed(_topk_layout_body, 2, *args, str(tmp_path / "dp2"), 1, timeout=400)[0]
    actual = run_distributed(_topk_layout_body, 2, *args, str(tmp_path / "tp2"), 2, timeout=400)[0]
    assert actual["response_length/mean"] == expected["response_length/mean"]  # the same samples
    for key in ("distillation/loss", "distillation/teacher_mass", "distillation/student_mass",
                "distillation/teacher_log_prob_mean", "actor/grad_norm"):
        # float32 softmax sums split over two ranks, gradients reduced over TP instead of DP: ~1e-7
        assert actual[key] == pytest.approx(expected[key], rel=1e-5), key
    assert expected["distillation/loss"] > 0


def _steps_body(model_dir: str, teacher: str, train: str, root: str, split: bool) -> dict[str, object]:
    import torch.distributed as dist

    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    world = dist.get_world_size()
    out: dict[str, object] = {}
    for name, mode in (("pg-k1", ["distillation.distillation_loss.use_policy_gradient=true",
                                  "distillation.distillation_loss.loss_mode=k1"]),
                       ("supervised-k3-alone", ["distillation.distillation_loss.use_task_rewards=false"]),
                       ("supervised-topk", ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                                            "distillation.distillation_loss.topk=4"])):
        cfg = load_config(
            PPOConfig,
            config_file="grpo_tiny_cpu",
            overrides=[
                *_argv(model_dir, train, f"{root}/{name}")[2:], f"trainer.n_gpus_per_node={world}",
                "trainer.logger=[]", "distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}",
                *mode, *(["trainer.placement.teacher=[1]"] if split else []),
            ],
            world_size=world,
        )
        with PPOTrainer(cfg) as trainer:
            out[name] = {
                "steps": [trainer.train_step() for _ in range(2)],
                "step": trainer.pipeline.describe(),
                "teacher": trainer.pieces.runs("teacher"),
                "actor": trainer.pieces.runs("actor"),
            }
    return out


def _comparable(step: dict[str, float]) -> dict[str, float]:
    skip = ("timing_s/", "perf/", "memory/", "update_weights/", "rollout/kv_", "rollout/time_s", "rollout/tokens_per_s")
    return {k: v for k, v in step.items() if not k.startswith(skip)}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_teacher_apart_takes_the_steps_of_the_colocated_teacher(tiny_model_dir, teacher_dir, arithmetic_files, tmp_path):
    args = (tiny_model_dir, teacher_dir, arithmetic_files["train"])
    [expected] = run_distributed(_steps_body, 1, *args, str(tmp_path / "one"), False, timeout=300)
    actual = run_distributed(_steps_body, 2, *args, str(tmp_path / "two"), True, timeout=400)
    for name in ("pg-k1", "supervised-k3-alone", "supervised-topk"):
        assert expected[name]["step"] == "RolloutOperator -> RewardOperator -> DistillationOperator -> PPOUpdateOperator"
        assert [a[name]["teacher"] for a in actual] == [False, True]
        assert [a[name]["actor"] for a in actual] == [True, False]
        for a, b in zip(actual[0][name]["steps"], actual[1][name]["steps"]):
            assert _comparable(a) == _comparable(b), name
        for i, (got, want) in enumerate(zip(actual[0][name]["steps"], expected[name]["steps"])):
            got, want = _comparable(got), _comparable(want)
            assert got.keys() == want.keys(), (name, sorted(set(got) ^ set(want)))
            different = {k: (got[k], want[k]) for k in got
                         if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))}
            assert not different, (name, i + 1, different)
        first = expected[name]["steps"][0]
        # an untrained teacher disagrees with the student: a positive reverse-KL estimate
        assert first["distillation/loss"] != 0.0 and first["distillation/teacher_log_prob_mean"] < 0, first
        assert "timing_s/exchange" in actual[0][name]["steps"][0]
    # the top-k fields ([B, R, k], int64 ids among them) reach the actor's ranks from the teacher's
    assert expected["supervised-topk"]["steps"][0]["distillation/teacher_mass"] > 0
    # the policy-gradient form logs its clip fraction (0 at the first update: the ratio is 1)
    assert expected["pg-k1"]["steps"][0]["distillation/pg_clipfrac"] == 0.0


# ------------------------------------------------------------------------------------------------
# pre-flight


def _config(model_dir: str, train: str, root: str, *extra: str):
    from verl.config import PPOConfig, load_config

    return load_config(PPOConfig, config_file="grpo_tiny_cpu",
                       overrides=[*_argv(model_dir, train, root)[2:], "distillation.enabled=true", *extra])


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 whose tokenizer stops at 512 entries: another vocabulary."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("vocab512")), TinyModelSpec(family="qwen2", kv_heads=2,
                                                                                 corpus_lines=1500, vocab=512))


def test_preflight_refuses_a_teacher_that_cannot_score_the_students_tokens(
    tiny_model_dir, teacher_dir, other_vocab_dir, arithmetic_files, tmp_path
):
    from verl.trainer.ppo_checks import check_ppo_inputs

    train, root = arithmetic_files["train"], str(tmp_path / "out")
    cases = [
        ([f"distillation.teacher_model.model_path={other_vocab_dir}"],
         ["its tokenizer differs from the policy's", "the teacher's vocabulary (vocab_size="]),
        ([f"distillation.teacher_model.model_path={tmp_path / 'nowhere'}"], ["distillation.teacher_model.model_path"]),
        ([f"distillation.teacher_model.model_path={teacher_dir}", "distillation.distillation_loss.loss_mode=forward_kl_topk",
          "distillation.distillation_loss.topk=100000"],
         ["distillation.distillation_loss.topk=100000 exceeds the teacher's vocabulary"]),
        # 2 KV heads of the teacher cannot split 4 ways (the tiny student's checks pass at TP=1)
        ([f"distillation.teacher_model.model_path={teacher_dir}",
          "distillation.teacher_model.megatron.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"],
         ["distillation.teacher_model.megatron.tensor_model_parallel_size=4", "cannot split the teacher"]),
    ]
    for extra, expected in cases:
        cfg = _config(tiny_model_dir, train, root, *extra)
        with pytest.raises(ValueError) as info:
            check_ppo_inputs(cfg)
        for text in expected:
            assert text in str(info.value), (extra, str(info.value))


def test_main_ppo_refuses_before_building_any_model(tiny_model_dir, other_vocab_dir, arithmetic_files, tmp_path):
    root = str(tmp_path / "refused")
    code, err = _main(_argv(tiny_model_dir, arithmetic_files["train"], root, "distillation.enabled=true",
                            f"distillation.teacher_model.model_path={other_vocab_dir}"))
    assert code == 2 and "its tokenizer differs from the policy's" in err, err[-2000:]
    assert not os.path.exists(os.path.join(root, "logs", "metrics.jsonl"))
    code, err = _main(_argv(tiny_model_dir, arithmetic_files["train"], root, "distillation.enabled=true"))
    assert code == 2 and "distillation.enabled=true needs distillation.teacher_model.model_path" in err, err[-2000:]


def _stream_body(model_dir: str, teacher: str, train: str, root: str) -> list[str]:
    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.trainer.step import ops
    from verl.trainer.step.pipeline import StepPipeline

    errors = []
    cfg = _config(model_dir, train, f"{root}/s", "trainer.logger=[]", f"distillation.teacher_model.model_path={teacher}")
    with PPOTrainer(cfg) as trainer:
        trainer.use_pipeline(StepPipeline([ops.RolloutOperator(), ops.RewardOperator(), ops.PPOUpdateOperator()]))
        try:
            trainer.train_step()
        except ValueError as exc:
            errors.append(str(exc))
    plain = _config(model_dir, train, f"{root}/p", "trainer.logger=[]", "distillation.enabled=false")
    with PPOTrainer(plain) as trainer:
        try:
            ops.DistillationOperator().bind(trainer.pieces)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_a_stream_without_the_teacher_pass_is_refused(tiny_model_dir, teacher_dir, arithmetic_files, tmp_path):
    """A hand-built pipeline whose config has a teacher but no DistillationOperator fails at the
    update, naming the operator; the operator on a trainer without a teacher fails when bound."""
    [errors] = run_distributed(_stream_body, 1, tiny_model_dir, teacher_dir, arithmetic_files["train"],
                               str(tmp_path), timeout=300)
    assert len(errors) == 2, errors
    assert "put a DistillationOperator before the PPOUpdateOperator" in errors[0]
    assert "the stream's trainer has no teacher" in errors[1]


def test_config_refuses_the_top_k_losses_verl_does_not_provide(tiny_model_dir, arithmetic_files, tmp_path):
    train, root = arithmetic_files["train"], str(tmp_path / "out")
    for mode in ("reverse_kl_topk", "jsd_topk"):
        with pytest.raises(ValueError) as info:
            _config(tiny_model_dir, train, root, f"distillation.teacher_model.model_path={tiny_model_dir}",
                    f"distillation.distillation_loss.loss_mode={mode}")
        assert f"distillation.distillation_loss.loss_mode={mode} is not provided" in str(info.value)
        assert "use forward_kl_topk" in str(info.value)
    with pytest.raises(ValueError, match="did you mean 'forward_kl_topk'"):
        _config(tiny_model_dir, train, root, f"distillation.teacher_model.model_path={tiny_model_dir}",
                "distillation.distillation_loss.loss_mode=forward_kl_tpk")
    cfg = _config(tiny_model_dir, train, root, f"distillation.teacher_model.model_path={tiny_model_dir}",
                  "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=16")
    assert cfg.distillation.distillation_loss.topk == 16
