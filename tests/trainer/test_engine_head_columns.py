"""``head_columns``: the log-softmax over the vocabulary for the response columns only.

An RL loss reads the responses' log-probabilities; the prompts' are never used. With
``head_columns=R`` the engine computes log-probabilities (and entropy) for the tokens of the last
``R`` columns only. Those columns must be exactly the numbers of the full computation (the same
per-token reductions), the others 0, and a training step whose loss reads the responses must be
the same step (loss, gradient norm, weights after) — on one rank and with the vocabulary split
over TP=2. The batch is laid out as rollouts are: prompts left-padded, responses right-padded.
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS, PROMPT, RESPONSE = 6, 10, 8


def _rollout_batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=gen)
    mask = torch.zeros(ROWS, PROMPT + RESPONSE, dtype=torch.long)
    prompt_lengths, response_lengths = [10, 3, 7, 5, 10, 4], [8, 1, 5, 8, 2, 6]
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[i, PROMPT - p : PROMPT + r] = 1  # left-padded prompt, right-padded response
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, PROMPT:].float()}


def _with_and_without(model_dir: str, tp: int) -> dict:
    from verl.algos import agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, seed=7)
    out = {}
    for columns in (None, RESPONSE):
        engine = MegatronEngine(
            model=ModelConfig(path=model_dir),
            megatron=MegatronConfig(tensor_model_parallel_size=tp),
            pg=pg,
            optim=OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0),
            total_training_steps=10,
        )
        batch = _rollout_batch(engine.spec.vocab_size)

        def loss_fn(outputs, micro_batch):
            logprobs = outputs["logprobs"][:, -RESPONSE:]
            entropy = outputs["entropy"][:, -RESPONSE:]
            mask = micro_batch["response_mask"]
            return LossShare(agg_loss(-logprobs - 0.01 * entropy, mask, "token-mean"))

        forward = engine.forward(batch, micro_batch_size=4, with_entropy=True, temperature=0.7,
                                 head_columns=columns).outputs
        step = engine.train_step(batch, micro_batch_size=3, loss_fn=loss_fn, with_entropy=True, head_columns=columns)
        after = engine.forward(batch, micro_batch_size=6, head_columns=columns).outputs["logprobs"]
        out[columns] = {"forward": forward, "step": (step.loss, step.grad_norm), "after": after}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_response_columns_are_the_full_computation(tiny_model_dir, tp):
    out = run_distributed(_with_and_without, tp, tiny_model_dir, tp)[0]
    expected, actual = out[None], out[RESPONSE]
    for key in ("logprobs", "entropy"):
        full, only = expected["forward"][key], actual["forward"][key]
        assert torch.equal(only[:, -RESPONSE:], full[:, -RESPONSE:]), key  # exact: the same per-token reductions
        assert not only[:, :-RESPONSE].any() and full[:, :-RESPONSE].any(), key  # prompts: skipped
    assert actual["step"] == expected["step"]  # the same step: loss and gradient norm
    assert torch.equal(actual["after"][:, -RESPONSE:], expected["after"][:, -RESPONSE:])
