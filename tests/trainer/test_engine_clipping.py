"""MegatronEngine gradient clipping and step skipping, both sides of each guard, on one rank.

One SGD step (lr 1, no momentum, no weight decay), so the update is exactly ``-coeff * grad``:

- ``clip_grad`` 0 (off): the update's norm is the reported gradient norm;
- ``clip_grad`` far above the norm: the update equals the unclipped one (clipping never scales
  gradients up);
- ``clip_grad`` below the norm: the update is the unclipped one times
  ``clip / (norm + 1e-6)``, so its norm is ``clip`` (hand-computed);
- a non-finite gradient norm: the step is skipped, weights unchanged, and the next step equals
  a fresh engine's first step (no NaN left in the gradient buffers).
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS = 4
CLIP_LOW = 0.5  # below the first gradient norm of the tiny model on this batch (~3-5)
CLIP_HIGH = 1e3  # far above it


def _clip_body(model_dir: str, data_file: str) -> dict:
    from verl.algos import agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.data.sft_dataset import SFTDataset
    from verl.data.tokenizer import load_tokenizer
    from verl.parallel import megatron_state as ms
    from verl.engine import LossShare, MegatronEngine

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    dataset = SFTDataset(
        data_file, load_tokenizer(model_dir), max_length=32, response_key="extra_info.answer"
    )
    rows = [dataset[i] for i in range(ROWS)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def loss_fn(outputs, micro_batch):
        return LossShare(agg_loss(-outputs["logprobs"], micro_batch["loss_mask"].float(), "token-mean"))

    def nan_loss_fn(outputs, micro_batch):
        share = loss_fn(outputs, micro_batch)
        return LossShare(share.loss * float("nan"), share.metrics)

    def engine(clip: float) -> MegatronEngine:
        return MegatronEngine(
            model=ModelConfig(path=model_dir),
            megatron=MegatronConfig(),
            pg=pg,
            optim=OptimConfig(optimizer="sgd", lr=1.0, clip_grad=clip, weight_decay=0.0),
            total_training_steps=10,
        )

    def weights(e: MegatronEngine) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in e.chunks[0].named_parameters()}

    def step(e: MegatronEngine, fn=loss_fn):
        before = weights(e)
        r = e.train_step(batch, micro_batch_size=2, loss_fn=fn)
        after = weights(e)
        return r, {n: after[n] - before[n] for n in before}, after

    out = {}
    for clip in (0.0, CLIP_HIGH, CLIP_LOW):
        r, delta, _ = step(engine(clip))
        out[clip] = (r.grad_norm, r.update_successful, delta)
    e = engine(CLIP_HIGH)
    r_nan, delta_nan, _ = step(e, nan_loss_fn)
    r_next, delta_next, after_next = step(e)
    out["nan"] = (r_nan.grad_norm, r_nan.update_successful, delta_nan, e.steps_taken)
    out["after_nan"] = (r_next.grad_norm, r_next.update_successful, delta_next, after_next)
    return out


@pytest.fixture(scope="module")
def steps(tiny_model_dir, arithmetic_files):
    return run_distributed(_clip_body, 1, tiny_model_dir, arithmetic_files["train"])[0]


def _norm(delta: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(d.double().square().sum()) for d in delta.values()))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_unclipped_update_is_minus_the_gradient(steps):
    grad_norm, ok, delta = steps[0.0]
    assert ok
    assert grad_norm > CLIP_LOW * 2 and grad_norm < CLIP_HIGH / 10, grad_norm  # the premise of the cases
    # SGD, lr 1: ||update|| = ||grad||; float32 weights differ by rounding of w - g (~1e-7 x |w|).
    assert _norm(delta) == pytest.approx(grad_norm, rel=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_clip_above_the_norm_leaves_the_update_unchanged(steps):
    expected_norm, _, expected = steps[0.0]
    grad_norm, ok, actual = steps[CLIP_HIGH]
    assert ok and grad_norm == expected_norm
    for name, d in expected.items():
        # Same computation, no scaling: bit-identical.
        torch.testing.assert_close(actual[name], d, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_clip_below_the_norm_scales_the_update_to_the_clip(steps):
    grad_norm, _, unclipped = steps[0.0]
    clipped_norm, ok, actual = steps[CLIP_LOW]
    assert ok and clipped_norm == grad_norm  # reported before clipping
    coeff = CLIP_LOW / (grad_norm + 1e-6)  # the engine's clip coefficient, by hand
    for name, d in unclipped.items():
        # w - c*g against c*(w - (w - g)): float32 rounding of the weights (~1e-7 x |w|).
        torch.testing.assert_close(
            actual[name], d * coeff, rtol=1e-3, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert _norm(actual) == pytest.approx(CLIP_LOW, rel=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_non_finite_gradient_skips_the_step_and_leaves_no_nan_behind(steps):
    grad_norm, ok, delta, steps_taken = steps["nan"]
    assert not math.isfinite(grad_norm) and ok is False and steps_taken == 1  # 1: the step after it
    assert all(torch.count_nonzero(d) == 0 for d in delta.values()), "a skipped step changed weights"
    next_norm, next_ok, next_delta, after = steps["after_nan"]
    expected_norm, _, expected = steps[CLIP_HIGH]
    assert next_ok and next_norm == pytest.approx(expected_norm, rel=1e-6)
    assert all(torch.isfinite(w).all() for w in after.values())
    for name, d in expected.items():
        torch.testing.assert_close(
            next_delta[name], d, rtol=0, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
