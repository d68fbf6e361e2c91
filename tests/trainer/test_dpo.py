"""DPO on the RL trainer's roles (``data.pairs``, ``PreferenceOperator`` + ``DPOUpdateOperator``):
the surrogate loss's gradient against the DPO loss's own, hand-worked loss values, and a few
steps on the tiny model raising the chosen-vs-rejected margin."""

from __future__ import annotations

import json
import math

import pytest
import torch

from verl.algos import compute_preference_loss


def test_dpo_loss_hand_worked_and_the_surrogate_gradient_is_the_losss():
    # Two pairs: policy / reference sequence log-probs (chosen, rejected).
    pc, pr = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -5.0])
    rc, rr = torch.tensor([-4.5, -6.0]), torch.tensor([-4.5, -5.5])
    beta = 0.1
    # margins h = (pc - pr) - (rc - rr): pair 0: 1 - 0 = 1; pair 1: -1 - (-0.5) = -0.5
    expected = (-math.log(1 / (1 + math.exp(-0.1))) - math.log(1 / (1 + math.exp(0.05)))) / 2
    policy = torch.stack([pc, pr], 1).flatten().double().requires_grad_(True)  # rows 2i chosen, 2i+1 rejected
    loss, metrics = compute_preference_loss(
        "sigmoid", policy_chosen_logps=policy[0::2], policy_rejected_logps=policy[1::2],
        reference_chosen_logps=rc.double(), reference_rejected_logps=rr.double(), beta=beta,
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["rewards/margin"]) == pytest.approx(beta * (1 - 0.5) / 2, rel=1e-12)
    (coef,) = torch.autograd.grad(loss, policy)
    # d/dlogp_chosen = -beta * sigmoid(-beta h) / num_pairs; the rejected side the opposite.
    s = [1 / (1 + math.exp(0.1)), 1 / (1 + math.exp(-0.05))]
    assert coef.tolist() == pytest.approx([-beta * s[0] / 2, beta * s[0] / 2, -beta * s[1] / 2, beta * s[1] / 2])
    # Actor.update_preference back-propagates sum_i c_i * logp_i(theta): through a toy "model"
    # whose sequence log-probs depend on theta, its gradient equals the DPO loss's.
    theta = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -1.0]], dtype=torch.float64)

    def seq_logps(t):
        return policy.detach() + feats @ t  # [4]

    logps = seq_logps(theta)
    true_loss, _ = compute_preference_loss(
        "sigmoid", policy_chosen_logps=logps[0::2], policy_rejected_logps=logps[1::2],
        reference_chosen_logps=rc.double(), reference_rejected_logps=rr.double(), beta=beta,
    )
    (expected_grad,) = torch.autograd.grad(true_loss, theta)
    at = seq_logps(theta.detach()).requires_grad_(True)
    l_at, _ = compute_preference_loss(
        "sigmoid", policy_chosen_logps=at[0::2], policy_rejected_logps=at[1::2],
        reference_chosen_logps=rc.double(), reference_rejected_logps=rr.double(), beta=beta,
    )
    (c,) = torch.autograd.grad(l_at, at)
    (actual_grad,) = torch.autograd.grad((c * seq_logps(theta)).sum(), theta)
    assert actual_grad.tolist() == pytest.approx(expected_grad.tolist(), rel=1e-12)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [
        {"prompt": f"What is {a}+{b}?", "chosen": f"Answer: {a + b}", "rejected": f"Answer: {a + b + 1}"}
        for a in range(3) for b in range(3)
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    return str(out)


DPO = [
    "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
    "algorithm.adv_estimator=grpo", "data.val_files=null", "data.max_prompt_length=24",
    "data.max_response_length=8", "data.train_batch_size=4", "data.shuffle=false",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "trainer.save_hf=false",
    "trainer.logger=[jsonl]", "trainer.total_training_steps=4", "trainer.resume_mode=disable",
]


@pytest.mark.slow
def test_dpo_steps_raise_the_margin_on_the_tiny_model(tiny_model_dir, pairs_file, tmp_path):
    import torch.distributed as dist

    from verl import DataStream, DPOUpdateOperator, PreferenceOperator

    stream = DataStream(
        model=tiny_model_dir, train_files=pairs_file,
        overrides=[*DPO, f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"],
    )
    # Micro-batches of 1: every pair is split over two micro-batches (the surrogate loss allows it).
    stream.add_operator(PreferenceOperator()).add_operator(DPOUpdateOperator(beta=0.1, lr=1e-3))
    try:
        trainer = stream.trainer
        assert trainer.reference is not None and trainer.critic is None
        # The same 4 pairs every step (2 batches of the 8 rows, no shuffle: steps 1 and 3 see the same).
        steps = [stream.step() for _ in range(3)]
        batch = stream.last_batch
        assert len(batch) == 8 and batch["pair_side"].tolist() == [0, 1] * 4
        for m in steps:
            assert math.isfinite(m["dpo/loss"]) and m["loss"] == m["dpo/loss"] and m["actor/grad_norm"] > 0
        # Step 1 runs at the reference's weights: margin 0 and loss log 2, exactly as DPO starts.
        assert steps[0]["dpo/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
        assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
        # Step 3 sees step 1's pairs again after two updates: their margin went up, the loss down.
        assert steps[2]["dpo/rewards/margin"] > 0.0
        assert steps[2]["dpo/loss"] < steps[0]["dpo/loss"]
    finally:
        stream.close()
    assert not dist.is_initialized()
