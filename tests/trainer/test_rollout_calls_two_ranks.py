"""``RolloutOperator(dynamic_batch_size=True)`` over two ranks: every rank sizes its engine calls
by the least KV budget any rank reports (``RLTrainer._call_size``'s all-reduce), so the ranks make
the same calls even when their engines report different memory, and greedy samples equal those of
one unsplit call."""

from __future__ import annotations

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Rank 0's engine reports room for everything, rank 1's for 4 sequences of 24 + 8 tokens.
BUDGETS = {0: 10**9, 1: 4 * 32}


def _body(model_dir: str, train_file: str, out: str):
    import dataclasses

    import torch
    import torch.distributed as dist

    from verl.operator import build_config, build_trainer

    from .test_python_api import FAST

    two = {"trainer.n_gpus_per_node": "2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "8",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "8"}
    overrides = [o for o in FAST if o.split("=")[0] not in two] + [f"{k}={v}" for k, v in two.items()]
    cfg = build_config(
        model=model_dir, train_files=train_file,
        overrides=[*overrides, f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs"],
    )
    trainer, started = build_trainer(cfg)
    assert not started  # the two-rank world was already there
    try:
        engine = trainer.rollout.engine
        engine.cfg = dataclasses.replace(engine.cfg, do_sample=False)
        prompts = trainer.pieces.prompt_batch(0)
        seed = trainer.pieces.sampling_seed(0)
        whole, _ = trainer.pieces.generate(prompts, seed=seed)
        engine.kv_token_budget = lambda: BUDGETS[dist.get_rank()]
        split, m = trainer.pieces.generate(prompts, seed=seed, call_sizes=(4, 32))
        same = all(torch.equal(whole[k], split[k]) for k in ("responses", "response_mask", "input_ids"))
        return dist.get_rank(), same, m["rollout/num_calls"], m["rollout/batch_size"], m["rollout/kv_token_budget"]
    finally:
        trainer.close()


@pytest.mark.timeout(300)
def test_calls_are_sized_by_the_least_budget_over_the_ranks(tiny_model_dir, arithmetic_files, tmp_path):
    results = run_distributed(_body, 2, tiny_model_dir, arithmetic_files["train"], str(tmp_path), timeout=280)
    # The least budget, 128 tokens = 4 sequences of 32 per rank, x 2 rollout replicas = 8 sequences (2 prompts
    # of n=4) per call: 2 calls for the 4 prompts, on both ranks; greedy samples as one call's.
    assert results == [(0, True, 2.0, 8.0, 128.0), (1, True, 2.0, 8.0, 128.0)]
