"""Roles on disjoint ranks never run a collective on the whole world while they build or step.

The actor (TP=2, ranks 0-1) and the critic (DP=2, ranks 2-3) each build their real engine
(``RoleEngine``: Megatron model, DDP, ``get_megatron_optimizer``, the LR schedule), run a forward
pass, a training step, a checkpoint save and load and a Hugging Face export, the critic starting a
second late. Every collective is recorded with the group it ran on (``verl.testing.collectives``):
one on the world's group would wait for the other role's ranks, which are elsewhere, so it is a
deadlock that only an unlucky interleaving shows (Megatron's ``_get_param_groups`` gathers over
the default group: inside the role's world, ``megatron_state.activate_role``, that is the role's
ranks). The test asserts none reached the world, and that the recorder saw the role's own ones.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.parallel.test_megatron_equivalence import split_topology
from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

ROWS, PROMPT, RESPONSE = 8, 6, 6


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "input_ids": torch.randint(1, vocab, (ROWS, PROMPT + RESPONSE), generator=gen),
        "attention_mask": torch.ones(ROWS, PROMPT + RESPONSE, dtype=torch.long),
        "response_mask": torch.ones(ROWS, RESPONSE, dtype=torch.long),
        "advantages": torch.randn(ROWS, RESPONSE, generator=gen),
    }


def _make_loss(info, num_micro):
    from verl.algos import agg_loss
    from verl.engine import LossShare
    from verl.roles.engine_role import response_slice

    def loss_fn(outputs, micro):
        name = "logprobs" if "logprobs" in outputs else "values"
        out = response_slice(name, outputs[name], RESPONSE)  # [b, R]
        loss = agg_loss(out * micro["advantages"], micro["response_mask"].float(), "token-mean", global_batch_info=info)
        return LossShare(loss, {})

    return loss_fn


def _roles_apart_body(model_dir: str, root: str) -> dict[str, object]:
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.parallel import megatron_state as ms
    from verl.protocol import Batch
    from verl.roles.engine_role import RoleEngine
    from verl.testing.collectives import record_collectives

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    world = dist.group.WORLD
    with record_collectives() as calls:
        (name, groups), = split_topology().build_groups().items()
        pg = groups.pg_collection
        ms.initialize_role(pg, seed=7)
        head, output = ("lm", "logprobs") if name == "actor" else ("value", "values")
        if name == "critic":
            time.sleep(1.0)  # roles apart build at different moments: the actor is already at its optimizer
        role = RoleEngine(
            model=ModelConfig(path=model_dir),
            megatron=MegatronConfig(tensor_model_parallel_size=groups.layout.tensor_parallel),
            pg=pg,
            optim=OptimConfig(optimizer="adam", lr=1e-3),
            total_training_steps=4,
            head=head,
            name=name,
        )
        batch = Batch.from_dict(_batch(vocab))
        role.forward(batch, output=output, micro_batch_size=2, response_length=RESPONSE)
        role.train(batch, keys=["response_mask", "advantages"], mini_batch_rows=ROWS, micro_batch_size=2,
                   epochs=1, make_loss=_make_loss, output=output)
        ckpt = os.path.join(root, name)
        role.save(ckpt)
        role.load(ckpt)
        if name == "actor":
            with role.active():
                role.engine.export_hf(os.path.join(root, "actor_hf"))
    on_world = sorted({c.op for c in calls if c.group is world})
    return {"role": name, "on_world": on_world, "recorded": len(calls)}


def test_roles_apart_build_and_step_on_their_own_ranks(tiny_model_dir, tmp_path):
    per_rank = run_distributed(_roles_apart_body, 4, tiny_model_dir, str(tmp_path), timeout=300)
    assert [r["role"] for r in per_rank] == ["actor", "actor", "critic", "critic"]
    for rank, r in enumerate(per_rank):
        assert r["on_world"] == [], f"rank {rank} ({r['role']}): collectives on the whole world: {r['on_world']}"
        assert r["recorded"] > 20, f"rank {rank}: only {r['recorded']} collectives recorded; the recorder missed them"
    assert os.path.exists(tmp_path / "actor_hf" / "config.json")
