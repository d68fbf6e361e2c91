"""Experts at tensor parallel 2 + sequence parallel with expert parallel 1 (#34): one optimizer step.

verl builds experts whole (expert TP 1), so at TP 2 / EP 1 each TP rank holds a full copy of every
expert but, under sequence parallel, computes its gradient from its own half of the tokens. The
copies must get the sum over both halves: the same update as one rank (TP 1) with the whole batch,
the two copies equal, and the gradient norm counting each expert once.

Tolerances: float32; TP 2 adds the two halves' gradients where one rank sums all tokens at once:
rounding only, measured ~1e-6 of the largest element on the gradients and 2e-7 relative on the
expert norm (bounds 1e-5). Adam at lr 1e-2 moves a weight by up to lr whatever the gradient's size,
so a gradient from half the tokens shows as differences of order lr (measured 2e-2 between the TP
copies before the fix); rounding, amplified where Adam normalises a near-zero gradient element,
stays below 1e-5 (measured 5e-6), hence 1e-4 on the weights. The copies on the two TP ranks step
with one all-reduced gradient and one norm: exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import make_tiny_model, padded_batch
from verl.testing.distributed import run_distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("moe_tp") / "qwen3_moe"), "qwen3_moe", seed=7)


def _step_body(model_dir, tp, batch):
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, seed=3)
    actor = MegatronEngine(
        model=ModelConfig(path=model_dir),
        # The router's load-balancing loss is on (0.5) so its gradient reaches the experts too.
        megatron=MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                override_transformer_config={"moe_aux_loss_coeff": 0.5}),
        pg=pg, optim=OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0), total_training_steps=4,
    )
    info = GlobalBatchInfo.from_masks([batch["attention_mask"].float()], group=pg.dp)

    def loss_fn(outputs, mb):
        return LossShare(agg_loss(-outputs["logprobs"], mb["attention_mask"].float(), "token-mean",
                                  global_batch_info=info))

    step = actor.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    experts = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if ".mlp.experts." in n}
    routers = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if ".mlp.router." in n}
    # The optimizer's norm of the experts' gradients alone (clipped by the step, by the same factor
    # on every layout): the rest zeroed, its grads are the reduced ones it stepped with.
    grads = {n: p.grad.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if ".mlp.experts." in n}
    for chunk in actor.chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." not in name and param.grad is not None:
                param.grad.zero_()
    expert_norm = float(actor.optimizer.get_grad_norm())
    return {"grad_norm": step.grad_norm, "loss": step.loss, "experts": experts, "routers": routers,
            "grads": grads, "expert_norm": expert_norm}


@pytest.mark.distributed
def test_experts_at_tp2_sp_ep1_step_as_on_one_rank(model_dir):
    """Adam at lr 1e-2, one step: the experts on the two TP ranks are equal and equal to one rank's step
    on the whole batch, and the gradient norm (verl's clip) is the one-rank norm."""
    batch = padded_batch(4, 12, seed=10)
    [one] = run_distributed(_step_body, 1, model_dir, 1, batch, timeout=300)
    tp0, tp1 = run_distributed(_step_body, 2, model_dir, 2, batch, timeout=300)
    assert one["experts"] and set(tp0["experts"]) == set(one["experts"]) == set(tp1["experts"])
    for name, weight in one["experts"].items():
        assert torch.equal(tp0["experts"][name], tp1["experts"][name]), f"{name}: the TP ranks' copies drifted apart"
        diff = (tp0["experts"][name] - weight).abs()
        assert diff.max() < 1e-4 and diff.mean() < 1e-6, (name, float(diff.max()), float(diff.mean()))
    for name, weight in one["routers"].items():
        torch.testing.assert_close(tp0["routers"][name], weight, rtol=0, atol=1e-4)
    assert abs(tp0["loss"] - one["loss"]) < 1e-5
    # The norm counts every expert once (not once per TP copy): rounding only.
    assert tp0["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert tp1["grad_norm"] == tp0["grad_norm"]
    # The experts' share of it (small beside the embeddings'): once per expert, on both TP ranks.
    for r in (tp0, tp1):
        assert r["expert_norm"] == pytest.approx(one["expert_norm"], rel=1e-5)
        for name, grad in one["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=0, atol=1e-5 * float(grad.abs().max()))


def _resume_body(model_dir, ckpt_dir, batch):
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=2, seed=3)

    def engine():
        return MegatronEngine(
            model=ModelConfig(path=model_dir),
            megatron=MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True),
            pg=pg, optim=OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0),
            total_training_steps=4,
        )

    info = GlobalBatchInfo.from_masks([batch["attention_mask"].float()], group=pg.dp)

    def loss_fn(outputs, mb):
        return LossShare(agg_loss(-outputs["logprobs"], mb["attention_mask"].float(), "token-mean",
                                  global_batch_info=info))

    def experts(actor):
        return {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if ".mlp.experts." in n}

    first = engine()
    first.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    first.save(ckpt_dir)
    second = first.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    resumed = engine()
    resumed.load(ckpt_dir)
    again = resumed.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    return {"norms": (second.grad_norm, again.grad_norm), "experts": (experts(first), experts(resumed))}


@pytest.mark.distributed
def test_experts_at_tp2_sp_ep1_resume_from_a_checkpoint(model_dir, tmp_path):
    """The experts' optimizer state (now in Megatron's expert optimizer at EP 1) is saved and restored:
    the second step after a resume equals the second step of the run that saved (same math: exact)."""
    batch = padded_batch(4, 12, seed=11)
    for r in run_distributed(_resume_body, 2, model_dir, str(tmp_path / "ckpt"), batch, timeout=300):
        assert r["norms"][0] == r["norms"][1]
        kept, resumed = r["experts"]
        assert kept and set(kept) == set(resumed)
        for name, weight in kept.items():
            assert torch.equal(resumed[name], weight), name
