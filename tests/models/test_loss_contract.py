"""The one loss contract (``verl.models.forward.LossShare``): a micro-batch's share of the global loss.

A loss written to the other contract (a bare micro-batch mean, as an older docstring once
described) must fail loudly, and shares computed with the step's global denominators must give
gradients that do not depend on the micro-batch size.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import make_tiny_model, padded_batch
from verl.testing.distributed import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("loss-contract") / "llama"), "llama3")


def _grads_body(model_dir, batch, micro_batch_size, contract):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import LossShare, forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel()
    (chunk,) = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(), pg)
    load_hf_weights([chunk], model_dir, pg=pg)
    ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), chunk,
                                  pg_collection=pg)
    chunk.config.finalize_model_grads_func = finalize_model_grads
    device = next(chunk.parameters()).device  # cuda under NCCL: the batch goes where the model is
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch["attention_mask"].float()
    info = GlobalBatchInfo.from_masks([mask])

    def loss_fn(outputs, mb):
        m = mb["attention_mask"].float()
        if contract == "share":
            return LossShare(agg_loss(-outputs["logprobs"], m, "token-mean", global_batch_info=info))
        mean = agg_loss(-outputs["logprobs"], m, "token-mean")  # this micro-batch's own mean
        if contract == "mean-as-share":
            return LossShare(mean)
        return mean, {}  # "mean": the tuple of the other contract

    ddp.zero_grad_buffer()
    result = forward_backward([ddp], batch, pg=pg, micro_batch_size=micro_batch_size, output="logprobs",
                              loss_fn=loss_fn)
    grads = {name: p.main_grad.detach().cpu().clone() for name, p in chunk.named_parameters()}
    return grads, float(sum(result.losses))


def test_a_loss_written_as_a_micro_batch_mean_is_refused(model_dir):
    batch = padded_batch(4, 10, seed=1)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_grads_body, 1, model_dir, batch, 2, "mean")
    message = str(info.value)
    assert "TypeError: loss_fn returned tuple, not a LossShare" in message
    assert "global_batch_info" in message  # it says how to write a share


def test_shares_give_the_same_gradients_at_every_micro_batch_size(model_dir):
    # Rows of different lengths: a per-micro-batch mean weights tokens differently from the
    # global token mean, so only the global denominator makes micro-batching invisible.
    batch = padded_batch(4, 10, seed=2)
    (expected, expected_loss), = run_distributed(_grads_body, 1, model_dir, batch, 4, "share")
    for micro in (1, 2):
        (actual, loss), = run_distributed(_grads_body, 1, model_dir, batch, micro, "share")
        # Same math, accumulated over micro-batches in another order: float32 rounding only.
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # The guard's other side: a micro-batch mean passed off as a share is off by the number of
    # micro-batches (and by the token weighting), which the comparison above would catch.
    (wrong, _), = run_distributed(_grads_body, 1, model_dir, batch, 1, "mean-as-share")
    name = "embedding.word_embeddings.weight"
    ratio = wrong[name].norm() / expected[name].norm()
    assert ratio > 2.0, f"a mean posing as a share scaled the gradient by {ratio:.3f}, expected about 4"
