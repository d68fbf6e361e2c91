"""verl's push through vLLM's public weight-transfer API, on the CPU build.

The vLLM rollout engine starts with ``weight_transfer_config={"backend": "verl_inplace"}``
(``verl.rollout.vllm_transfer``, registered with vLLM's ``register_engine``); a push runs inside
vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` session, in the
engine vLLM built and handed its model. After each push (the checkpoint's weights, then the
weights of a real Adam step) the engine's parameters equal the actor's Hugging Face tensors laid
out as vLLM holds them, bit for bit (the push only moves bits); a write that fails ends vLLM's
session and the next push goes through.
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

MARKER = 0.25


def _expected(sync, rollout, actor) -> dict[str, torch.Tensor]:
    """The engine's tensors as they should be after a push of the actor's current weights."""
    from verl.hybrid.layout import fill_from_hf
    from verl.models.checkpoint import iter_hf_weights

    expected = {k: p.detach().clone() for k, p in rollout.named_parameters()}  # padding as the engine holds it
    fill_from_hf(actor.spec, sync.destination, expected, iter_hf_weights(actor.chunks, pg=actor.pg))
    return expected


def _api_body(model_dir: str) -> dict:
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.config.schema import RolloutConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.hybrid import WeightSync
    from verl.parallel import megatron_state as ms
    from verl.rollout import build_rollout_engine
    from verl.rollout.vllm_transfer import InPlaceTransferEngine

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, seed=3)
    actor = MegatronEngine(model=ModelConfig(path=model_dir), megatron=MegatronConfig(), pg=pg,
                           optim=OptimConfig(optimizer="adam", lr=1e-2), total_training_steps=10)
    rollout = build_rollout_engine(
        RolloutConfig(name="vllm", n=1, prompt_length=16, response_length=8, free_cache_engine=False), model_dir)
    chunks = []
    original = InPlaceTransferEngine.receive_weights

    def counted(self, update_info):
        chunks.append(type(update_info).__name__)
        return original(self, update_info)

    InPlaceTransferEngine.receive_weights = counted
    result: dict = {}
    try:
        sync = WeightSync(actor, rollout, bucket_bytes=16 * 1024)
        with torch.no_grad():
            for _, p in rollout.named_parameters():
                p.fill_(MARKER)
        expected = _expected(sync, rollout, actor)
        sync.push()
        result["first"] = sorted(k for k, p in rollout.named_parameters() if not torch.equal(p, expected[k]))
        result["first_changed"] = sum(int((p != MARKER).sum()) for _, p in rollout.named_parameters())

        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, actor.spec.vocab_size, (4, 16), generator=gen)
        info = GlobalBatchInfo.from_masks([torch.ones_like(ids).float()], group=pg.dp)
        step = actor.train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, micro_batch_size=2,
                                loss_fn=lambda out, mb: LossShare(agg_loss(-out["logprobs"], mb["attention_mask"].float(),
                                                                           "token-mean", global_batch_info=info)))
        assert step.update_successful
        before = {k: p.detach().clone() for k, p in rollout.named_parameters()}
        expected = _expected(sync, rollout, actor)
        sync.push()
        params = dict(rollout.named_parameters())
        result["after_step"] = sorted(k for k, p in params.items() if not torch.equal(p, expected[k]))
        result["step_moved"] = sorted(k for k, p in params.items() if not torch.equal(p, before[k]))

        def failing(params):
            raise ZeroDivisionError("a write that fails")

        try:
            rollout.transfer_weights(failing)
        except ZeroDivisionError:
            result["failure_raised"] = True
        sync.push()  # vLLM's session was ended by the failure: a new one starts
        result["after_failure"] = sorted(k for k, p in rollout.named_parameters() if not torch.equal(p, expected[k]))
        result["chunks"] = chunks
        result["tensors"] = len(params)
    finally:
        InPlaceTransferEngine.receive_weights = original
        rollout.shutdown()
        ms.destroy_model_parallel()
    return result


def test_push_through_vllms_weight_transfer_api_is_bit_exact(tiny_model_dir):
    [result] = run_distributed(_api_body, 1, tiny_model_dir, timeout=300)
    assert result["first"] == [] and result["first_changed"] > 0
    assert result["after_step"] == []
    assert len(result["step_moved"]) == result["tensors"]  # Adam moved every tensor: the push carried the step
    assert result["failure_raised"] and result["after_failure"] == []
    # One update_weights chunk per push, through verl's registered engine (the failed one included).
    assert result["chunks"] == ["InPlaceUpdateInfo"] * 4
