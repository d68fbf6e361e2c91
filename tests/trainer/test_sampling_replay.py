"""Top-k / top-p replay (``actor_rollout_ref.actor.replay_sampling_mask``) through the whole GRPO step.

The engine (the CPU vLLM build, and transformers) samples with ``top_k=20, top_p=0.9`` and reports the
log-probabilities of that truncated distribution; the Megatron actor's and reference's passes replay the
same truncation, so on the first step (the engine's and the actor's weights are the same):

- with vLLM, the old (recomputed) log-probabilities equal the engine's to float32 rounding
  (``ENGINE_ATOL``), and the ratio is exactly 1 and the KL to the reference 0 (``KL_ATOL``: two engines'
  rounding, as in test_rl_trainer.py);
- with transformers in bypass mode (the engine's log-probabilities are the old ones, which the replay
  makes allowed) the ratio is 1 and the KL 0 to the same rounding;
Both fail when the mask is dropped: with ``replay_sampling_mask=false`` the recomputed log-probabilities
are the full vocabulary's, measured 3.5 off the engine's at most on this batch (and the bypass ratio as
far from 1). One 2-rank pooled call (DP=2, an engine per rank) runs the two trainers. Measured: the
same 4.8e-7 and exact ratio with either engine under recompute, a bypass ppo_kl of ~1e-8 with either.
"""

from __future__ import annotations

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRUNCATION = ["actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.top_p=0.9"]
FAST = [
    "data.max_prompt_length=24",
    "data.max_response_length=12",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.temperature=0.8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.save_hf=false",
    "trainer.resume_mode=disable",
    "trainer.n_gpus_per_node=2",
    "trainer.logger=[]",
]
# The engine's log-probabilities (KV-cached decoding) and the Megatron actor's (one packed forward) are
# float32 with different kernels: rounding only.
ENGINE_ATOL = 1e-5
# The reference's pass runs in another engine (test_rl_trainer.py's docstring): rounding only.
KL_ATOL = 1e-6
CASES = {
    "recompute": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.old_log_prob=recompute"],
    "bypass": ["actor_rollout_ref.rollout.name=hf", "algorithm.rollout_correction.bypass_mode=true"],
}


def _body(model_dir: str, files: dict[str, str], root: str) -> dict[str, dict[str, float]]:
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    out = {}
    for name, extra in CASES.items():
        cfg = load_config(
            PPOConfig,
            config_file="grpo_tiny_cpu",
            overrides=[f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={files['train']}",
                       "data.val_files=null", *FAST, *TRUNCATION, *extra, f"trainer.default_local_dir={root}/{name}"],
            world_size=2,
        )
        with PPOTrainer(cfg) as trainer:
            out[name] = trainer.train_step()
    return out


@pytest.mark.timeout(400)
def test_top_k_top_p_replay_matches_the_engine_and_keeps_the_first_step_on_policy(
    tiny_model_dir, arithmetic_files, tmp_path
):
    [results, _] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=360)
    recompute, bypass = results["recompute"], results["bypass"]
    # recompute: the actor's old log-probs are the engine's, the ratio exactly 1, the KL to the reference 0
    assert recompute["training/rollout_logprob_diff_max"] < ENGINE_ATOL
    assert recompute["actor/ppo_kl"] == 0.0 and recompute["actor/pg_clipfrac"] == 0.0
    assert abs(recompute["actor/kl_loss"]) <= KL_ATOL
    # bypass: the engine's log-probs are the old ones; the update's replayed ones equal them
    assert abs(bypass["actor/ppo_kl"]) < ENGINE_ATOL and bypass["actor/pg_clipfrac"] == 0.0
    assert abs(bypass["actor/kl_loss"]) <= KL_ATOL
    assert bypass["training/rollout_logprob_diff_max"] < ENGINE_ATOL
