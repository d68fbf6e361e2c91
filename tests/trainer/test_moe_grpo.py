"""GRPO on a tiny Qwen3-MoE with expert parallel 2 through the trainer main_ppo runs
(configs/grpo_qwen3_moe_tiny_cpu.yaml on 2 ranks, the transformers rollout engine; one test with vLLM's).

The first update's policy ratio is exactly 1 and its KL to the reference 0 (the old log-probs, the
reference's and the update's first forward come from the same weights at the same EP layout); the
engine's log-probs of its samples match the actor's; the second step trains on the pushed weights.
"""

from __future__ import annotations

import math

import pytest

from verl.testing.distributed import run_distributed

# The engine and the Megatron actor compute float32 log-probabilities with different kernels:
# rounding only, the bound of the single-turn trainer tests.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return make_tiny_model(str(out), TinyModelSpec(family="qwen3_moe", kv_heads=2, corpus_lines=1500))


def _grpo_body(model_dir: str, files: dict[str, str], root: str, extra: tuple[str, ...] = ()) -> dict:
    from verl.config import PPOConfig, load_config
    from verl.models.builder import unwrap_model
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(
        PPOConfig,
        config_file="grpo_qwen3_moe_tiny_cpu",
        world_size=2,
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={files['train']}",
            "data.val_files=null",
            "data.train_batch_size=8",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.save_hf=false",
            "trainer.resume_mode=disable",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={root}/ckpt",
            f"trainer.log_dir={root}/logs",
            *extra,
        ],
    )
    with PPOTrainer(cfg) as trainer:
        actor = unwrap_model(trainer.actor.engine.chunks[0])
        local_experts = sum(1 for n, _ in actor.named_parameters() if n.startswith("decoder.layers.0.mlp.experts."))
        reference = unwrap_model(trainer.reference.role.engine.chunks[0])
        critic_ep = unwrap_model(trainer.critic.role.engine.chunks[0]).verl_ep if trainer.critic else None
        steps = [trainer.train_step() for _ in range(2)]
    return {"steps": steps, "ep": actor.verl_ep, "ref_ep": reference.verl_ep, "critic_ep": critic_ep,
            "local_experts": local_experts}


@pytest.mark.distributed
@pytest.mark.timeout(1500)  # hang guards: 60-94 s here, 602 s beside the loaded suite
def test_moe_grpo_with_expert_parallel_2(moe_model_dir, arithmetic_files, tmp_path):
    results = run_distributed(_grpo_body, 2, moe_model_dir, arithmetic_files, str(tmp_path), timeout=1440)
    assert [r["ep"] for r in results] == [(0, 2), (1, 2)]
    assert [r["ref_ep"] for r in results] == [(0, 2), (1, 2)]  # the reference follows the actor's EP
    assert all(r["local_experts"] == 2 * 4 // 2 for r in results)  # fc1 and fc2 of 2 of the 4 experts
    for r in results:
        first, second = r["steps"]
        assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0
        assert abs(first["actor/kl_loss"]) <= 1e-6
        for step in r["steps"]:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL, step["training/rollout_logprob_diff_max"]
        assert second["training/global_step"] == 2.0


def _replay_counted_body(model_dir: str, files: dict[str, str], root: str, extra: tuple[str, ...]) -> dict:
    """GRPO with ``extra``, counting the micro-batches whose routing was recorded and replayed."""
    from verl.models import router_replay

    calls = {"recorded": 0, "replayed": 0}
    record, replay = router_replay.recorded, router_replay.set_targets

    def counted_record(*args, **kwargs):
        calls["recorded"] += 1
        return record(*args, **kwargs)

    def counted_replay(*args, **kwargs):
        calls["replayed"] += 1
        return replay(*args, **kwargs)

    router_replay.recorded, router_replay.set_targets = counted_record, counted_replay
    try:
        return {**_grpo_body(model_dir, files, root, extra), **calls}
    finally:
        router_replay.recorded, router_replay.set_targets = record, replay


def _r2_body(model_dir: str, files: dict[str, str], root: str, cut: tuple[str, ...] = ()) -> dict:
    """GRPO with R2 router replay: the recipe as it is (packed sequences, use_remove_padding=true) plus the two
    R2 keys and ``cut``."""
    extra = ("actor_rollout_ref.actor.megatron.router_replay.mode=R2", "actor_rollout_ref.actor.old_log_prob=recompute")
    return _replay_counted_body(model_dir, files, root, (*extra, *cut))


TOKEN_BUDGETS = (  # the old-log-prob pass and the update regroup the rows by two different budgets
    "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=150",
)


TP2_SP = (  # the actor at TP 2 with sequence parallel instead of EP 2: each TP rank routes half of S
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron.sequence_parallel=true",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
)


PP2 = (  # the actor on two pipeline stages (a layer each): each stage records and replays its own layer
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
)


@pytest.mark.distributed
@pytest.mark.timeout(1500)  # hang guards: 60-94 s here, 602 s beside the loaded suite
@pytest.mark.parametrize("cut", [(), TOKEN_BUDGETS, TP2_SP, PP2], ids=["recipe", "token-budgets", "tp2-sp", "pp2"])
def test_moe_grpo_with_r2_router_replay(moe_model_dir, arithmetic_files, tmp_path, cut):
    """R2: the old-policy pass records every token's experts and the update replays them, through the
    trainer's batch (sharded over DP, cut into the update's micro-batches); the recipe (EP 2) packs sequences
    (use_remove_padding=true), with token budgets each pass groups the rows its own way, and at TP 2 + SP
    each rank records and replays its slice of the sequence. The first
    update's ratio is 1 and its KL 0, and the engine's log-probs still match the actor's."""
    results = run_distributed(_r2_body, 2, moe_model_dir, arithmetic_files, str(tmp_path), cut, timeout=1440)
    for r in results:
        # both steps: the old-policy pass records (its micro-batches), the update replays (its own micro-batches)
        assert r["ep"][1] == (1 if cut in (TP2_SP, PP2) else 2) and r["recorded"] >= 2 and r["replayed"] >= 2
        first, second = r["steps"]
        # Exactly 0 at EP 2; at TP 2 + SP measured -1.9e-9 (float noise, cause not pinned down: the same run
        # without R2 gives exactly 0); a token sent to other experts moves its log-prob by ~1e-2.
        kl_bound = 1e-6 if cut == TP2_SP else 0.0
        # the first update runs at the recording's weights: free routing would have chosen every recorded set
        assert first["actor/router_replay/agreement"] == 1.0 and 0.5 < second["actor/router_replay/agreement"] <= 1.0
        assert abs(first["actor/ppo_kl"]) <= kl_bound and first["actor/pg_clipfrac"] == 0.0
        # Both steps, also at TP 2 + SP: the second step's rollout and old-policy pass differed by 5-7e-4
        # there while the TP ranks' expert copies drifted apart (#34, experts reduced over DP only).
        for step in r["steps"]:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL
        assert second["training/global_step"] == 2.0


def _r3_body(model_dir: str, files: dict[str, str], root: str) -> dict:
    """GRPO with R3 router replay: nothing recorded in the trainer (the engine records), the old-policy pass and
    the update replay."""
    extra = ("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.actor.old_log_prob=recompute")
    return _replay_counted_body(model_dir, files, root, extra)


@pytest.mark.distributed
@pytest.mark.timeout(1500)  # hang guards: 60-94 s here, 602 s beside the loaded suite
def test_moe_grpo_with_r3_router_replay(moe_model_dir, arithmetic_files, tmp_path):
    """R3: the transformers engine records every token's experts while it generates, the old-policy pass and the
    update replay them. The routers' experts 0..2 nearly tie (``tests.models.tiny.near_tie_routers``), so the
    trainer's free choice differs from the engine's for some tokens (agreement < 1 on the first update, at the
    rollout's weights); replayed, the engine's log-probs match the actor's and the first update's ratio is 1."""
    from tests.models.test_router_replay_r3 import TIE_EPS
    from tests.models.tiny import near_tie_routers

    tied = near_tie_routers(moe_model_dir, str(tmp_path / "tie"), eps=TIE_EPS)
    results = run_distributed(_r3_body, 2, tied, arithmetic_files, str(tmp_path), timeout=1440)
    for r in results:
        assert r["ep"] == (r["ep"][0], 2) and r["recorded"] == 0 and r["replayed"] >= 4  # 2 passes x 2 steps
        first, second = r["steps"]
        assert 0.5 < first["actor/router_replay/agreement"] < 1.0 and 0.5 < second["actor/router_replay/agreement"] <= 1.0
        for step in r["steps"]:  # the old-policy pass: the engine's sets the trainer's free choice would have kept
            assert 0.5 < step["actor/router_replay/rollout_agreement"] < 1.0
        assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0
        for step in r["steps"]:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL
        assert second["training/global_step"] == 2.0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.rollout.name=vllm"),
         "R3 cannot run here: rollout.name=vllm on CPU does not return the experts it routed to .*Model Runner V2, which needs Triton.*rollout.name=hf"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.rollout.multi_turn.enable=true"),
         "R3 cannot run here: rollout.multi_turn.enable=true: the agent loop assembles its turns itself"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "trainer.rollout_mode=async",
          "trainer.async_training.partial_rollout=true"), "R3 cannot run here: .*partial_rollout=true: a resumed segment"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.model.enable_gradient_checkpointing=true"),
         "R3 cannot run here: model.enable_gradient_checkpointing=true"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R2", "actor_rollout_ref.actor.old_log_prob=current",
          "actor_rollout_ref.actor.ppo_mini_batch_size=64"),
         "R2 cannot run here: actor.old_log_prob resolves to current"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R2", "actor_rollout_ref.actor.old_log_prob=recompute",
          "actor_rollout_ref.model.enable_gradient_checkpointing=true"), "enable_gradient_checkpointing=true"),
        (("actor_rollout_ref.actor.megatron.router_replay.mode=R2", "actor_rollout_ref.actor.old_log_prob=recompute",
          "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
          "actor_rollout_ref.actor.megatron.context_parallel_size=2"), "CP 2 .*set context_parallel_size=1"),
        (("actor_rollout_ref.ref.megatron.router_replay.mode=R2",), "only the actor replays routing"),
    ],
)
def test_unsupported_router_replay_is_refused_before_any_model(moe_model_dir, arithmetic_files, extra, match):
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_checks import preflight

    cfg = load_config(
        PPOConfig, config_file="grpo_qwen3_moe_tiny_cpu", world_size=2,
        overrides=[f"actor_rollout_ref.model.path={moe_model_dir}", f"data.train_files={arithmetic_files['train']}",
                   "data.val_files=null", *extra],
    )
    with pytest.raises(ValueError, match=match):
        preflight(cfg, 2)


def test_r3_with_vllm_is_a_gpu_path(moe_model_dir, arithmetic_files):
    """R3 with the vLLM engine: refused on CPU (the CPU build cannot return the routed experts), let through
    on CUDA, where vLLM's enable_return_routed_experts records them (tools/gpu_check.sh moe-r3)."""
    from verl.config import PPOConfig, load_config
    from verl.models.hf_config import parse_hf_config
    from verl.trainer.ppo_checks import _router_replay_problems

    def problems(device: str) -> list[str]:
        cfg = load_config(
            PPOConfig, config_file="grpo_qwen3_moe_tiny_cpu", world_size=2,
            overrides=[f"actor_rollout_ref.model.path={moe_model_dir}", f"data.train_files={arithmetic_files['train']}",
                       "data.val_files=null", "actor_rollout_ref.rollout.name=vllm",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "actor_rollout_ref.actor.megatron.router_replay.mode=R3", f"trainer.device={device}"],
        )
        return _router_replay_problems(cfg, parse_hf_config(moe_model_dir))

    assert problems("cuda") == []
    [refused] = problems("cpu")
    assert "rollout.name=vllm on CPU does not return the experts" in refused


def test_vllm_rollout_of_a_moe_model_passes_the_preflight_with_one_replica(moe_model_dir, arithmetic_files):
    """The weight push into vLLM's fused experts exists (verl.hybrid.layout.vllm_layout): MoE + vLLM is
    accepted with one engine replica (TP' = the rollout's ranks); replicas are refused (vLLM couples them)."""
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_checks import preflight

    def config(tp: int):
        return load_config(
            PPOConfig, config_file="grpo_qwen3_moe_tiny_cpu", world_size=2,
            overrides=[f"actor_rollout_ref.model.path={moe_model_dir}", f"data.train_files={arithmetic_files['train']}",
                       "data.val_files=null", "actor_rollout_ref.rollout.name=vllm",
                       f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"],
        )

    preflight(config(2), 2)
    with pytest.raises(ValueError, match=r"runs one engine replica: set actor_rollout_ref.rollout.tensor_model_parallel_size=2"):
        preflight(config(1), 2)


@pytest.mark.distributed
@pytest.mark.timeout(1500)  # hang guards: 60-94 s here, 602 s beside the loaded suite
def test_moe_grpo_with_vllm_rollout(moe_model_dir, arithmetic_files, tmp_path):
    """GRPO at EP 2 with the vLLM engine (one replica of TP' 2): the actor's experts are pushed into
    vLLM's fused experts before each rollout; the engine's log-probs match the actor's at both steps
    (the second on the pushed, updated weights) and the first update has ratio 1 and KL 0."""
    results = run_distributed(_grpo_body, 2, moe_model_dir, arithmetic_files, str(tmp_path),
                              ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
                              timeout=1440)
    assert [r["ep"] for r in results] == [(0, 2), (1, 2)]
    for r in results:
        first, second = r["steps"]
        assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0
        for step in r["steps"]:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL, step["training/rollout_logprob_diff_max"]
        assert any(k.startswith("update_weights/") for k in second)  # the push ran into the engine
        assert second["training/global_step"] == 2.0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1500)  # hang guards: 60-94 s here, 602 s beside the loaded suite
def test_moe_ppo_with_a_critic_at_expert_parallel_2(moe_model_dir, arithmetic_files, tmp_path):
    """PPO (GAE) with a critic on the MoE trunk, its experts over both ranks too: two steps train."""
    extra = ("algorithm.adv_estimator=gae", "critic.megatron.expert_model_parallel_size=2",
             "critic.ppo_micro_batch_size_per_gpu=8", "critic.forward_micro_batch_size_per_gpu=8")
    results = run_distributed(_grpo_body, 2, moe_model_dir, arithmetic_files, str(tmp_path), extra, timeout=1440)
    assert [r["critic_ep"] for r in results] == [(0, 2), (1, 2)]
    for r in results:
        first, second = r["steps"]
        assert first["actor/ppo_kl"] == 0.0 and "critic/vf_loss" in first
        assert math.isfinite(second["critic/vf_loss"]) and second["training/global_step"] == 2.0
