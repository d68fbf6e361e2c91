"""Token-budget micro-batches (``use_dynamic_bsz``) give the fixed-size split's numbers.

``RoleEngine.forward`` and ``RoleEngine.train`` on 12 rows whose lengths (4 to 24 tokens) make
the token split differ from any row split: the first six rows are long and the last six short,
so at DP=2 rank 0 needs more micro-batches than rank 1 and the ranks must agree on the count.
Each layout's forward log-probabilities and entropy, and one SGD step's loss, gradient norm and
updated weights, are compared with one rank running all 12 rows as one micro-batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS, PROMPT, RESPONSE = 12, 12, 12
# Long rows first, short rows last (see the module docstring).
PROMPT_LENGTHS = [12, 11, 12, 10, 12, 9, 3, 2, 4, 2, 3, 2]
RESPONSE_LENGTHS = [12, 10, 11, 12, 9, 12, 2, 3, 1, 2, 4, 2]
BUDGET = 48  # two of the longest rows


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (ROWS, PROMPT + RESPONSE), generator=gen)
    columns = torch.arange(PROMPT + RESPONSE)
    prompt = torch.tensor(PROMPT_LENGTHS).unsqueeze(1)
    response = torch.tensor(RESPONSE_LENGTHS).unsqueeze(1)
    attention = ((columns >= PROMPT - prompt) & (columns < PROMPT + response)).long()  # [B, P+R]
    response_mask = (torch.arange(RESPONSE) < response).long()  # [B, R]
    advantages = torch.randn(ROWS, RESPONSE, generator=gen) * response_mask
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "advantages": advantages,
    }


def _make_loss(info, num_micro):
    from verl.algos import agg_loss
    from verl.engine import LossShare

    def loss_fn(outputs, micro):
        log_prob = outputs["logprobs"][:, -RESPONSE:]  # [b, R]
        mask = micro["response_mask"].float()
        # A token mean and a sequence mean: both global denominators (tokens, sequences) matter.
        loss = agg_loss(-micro["advantages"] * log_prob, mask, "token-mean", global_batch_info=info)
        loss = loss + 0.1 * agg_loss(log_prob * log_prob, mask, "seq-mean-token-mean", global_batch_info=info)
        return LossShare(loss, {"loss_metric": loss.detach() * num_micro})

    return loss_fn


def _make_value_loss(info, num_micro):
    from verl.algos import agg_loss
    from verl.engine import LossShare
    from verl.roles.engine_role import response_slice

    def loss_fn(outputs, micro):
        values = response_slice("values", outputs["values"], RESPONSE)  # [b, R], the critic's columns
        mask = micro["response_mask"].float()
        loss = agg_loss((values - micro["advantages"]) ** 2, mask, "token-mean", global_batch_info=info)
        return LossShare(loss, {"loss_metric": loss.detach() * num_micro})

    return loss_fn


def _runs(model_dir: str, pp: int, modes: list[tuple[str, str, int]], packed: bool = False) -> list[dict]:
    """For each (head, mode, size): a fresh engine (seeded alike, so a value head starts the same),
    a forward of the batch and one update, cut by ``size`` rows (``rows``) or tokens (``tokens``);
    ``packed``: each micro-batch run as packed sequences (``model.use_remove_padding``)."""
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.parallel import megatron_state as ms
    from verl.protocol import Batch
    from verl.roles.engine_role import RoleEngine

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    pg = ms.initialize_model_parallel(pipeline_model_parallel_size=pp, seed=7)
    out = []
    for head, mode, size in modes:
        ms.initialize_role(pg, seed=7)
        role = RoleEngine(
            model=ModelConfig(path=model_dir, use_remove_padding=packed),
            megatron=MegatronConfig(pipeline_model_parallel_size=pp),
            pg=pg,
            # SGD with an active clip (as test_engine_parallel): the update is the gradient itself.
            optim=OptimConfig(optimizer="sgd", lr=1.0, clip_grad=1.0, weight_decay=0.0),
            total_training_steps=4,
            head=head,
            name="actor" if head == "lm" else "critic",
        )
        kwargs = {"micro_batch_size": size} if mode == "rows" else {"micro_batch_size": 1, "max_token_len": size}
        batch = Batch.from_dict(_batch(vocab))
        if head == "lm":
            forward = role.forward(batch, output="logprobs", response_length=RESPONSE, with_entropy=True, **kwargs)
            output, make_loss = "logprobs", _make_loss
        else:
            forward = role.forward(batch, output="values", response_length=RESPONSE, **kwargs)
            output, make_loss = "values", _make_value_loss
        (step,) = role.train(
            batch, keys=["response_mask", "advantages"], mini_batch_rows=ROWS, epochs=1, make_loss=make_loss,
            output=output, **kwargs,
        )
        weights = {}
        for chunk in role.engine.chunks:
            for name, p in chunk.named_parameters():
                weights[name] = p.detach().clone()
        out.append(
            {
                "forward": forward,
                "loss": step.loss,
                "grad_norm": step.grad_norm,
                "loss_metric": step.metrics["loss_metric"],
                "micro_batches": step.micro_batches,
                "token_fill": step.token_fill,
                "weights": weights,
            }
        )
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """One rank, all 12 rows in one micro-batch: the policy and a value head."""
    policy, value = run_distributed(_runs, 1, tiny_model_dir, 1, [("lm", "rows", ROWS), ("value", "rows", ROWS)])[0]
    return {"lm": policy, "value": value}


def _same_as_reference(actual: dict, expected: dict, *, weights: bool = True) -> None:
    assert sorted(actual["forward"]) == sorted(expected["forward"])
    for key, tensor in expected["forward"].items():
        # Each micro-batch runs at its own trimmed width, so the matmuls' float32 sums differ in
        # length and order (~1e-7 relative each; measured <= 5e-7 on log-probabilities of ~-10).
        torch.testing.assert_close(actual["forward"][key], tensor, rtol=0, atol=2e-6, msg=lambda m, k=key: f"{k}: {m}")
    # One step: the loss shares add up in another order (micro-batches, DP average): float32
    # rounding only (measured <= 6e-8 relative); a wrong denominator would be off by percents.
    assert actual["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-7)
    assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    # The metric scaled by the micro-batch count reads as the step's loss.
    assert actual["loss_metric"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-7)
    if not weights:
        return
    assert sorted(actual["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        # A clipped unit-norm SGD step: weights differ by the gradients' rounding (measured <= 3e-8).
        torch.testing.assert_close(actual["weights"][name], tensor, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _local_split(rank: int, world: int):
    from verl.models.micro_batches import token_split

    mask = _batch(100)["attention_mask"]
    per = ROWS // world
    return token_split(mask[rank * per : (rank + 1) * per], BUDGET)


ALL_MODES = [("lm", "rows", 2), ("lm", "tokens", BUDGET), ("value", "rows", 2), ("value", "tokens", BUDGET)]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_one_rank_token_budget_matches_one_micro_batch(reference, tiny_model_dir):
    runs = run_distributed(_runs, 1, tiny_model_dir, 1, ALL_MODES)[0]
    split = _local_split(0, 1)
    # The token split is not a row split: 4 micro-batches (162 tokens, 3 to 4 rows each) where
    # rows of 2 make 6, with rows drawn from both ends of the batch.
    assert split.count == runs[1]["micro_batches"] == 4 and runs[0]["micro_batches"] == 6
    assert all(p.max() - p.min() >= len(p) for p in split.parts)
    assert runs[1]["token_fill"] == pytest.approx(split.fill) and 0.5 < split.fill <= 1.0
    assert runs[0]["token_fill"] is None
    for (head, _, _), run in zip(ALL_MODES, runs):
        _same_as_reference(run, reference[head])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_ranks_agree_on_the_count_and_match_one_rank(reference, tiny_model_dir):
    per_rank = run_distributed(_runs, 2, tiny_model_dir, 1, ALL_MODES)
    long_rank, short_rank = _local_split(0, 2), _local_split(1, 2)
    assert long_rank.count > short_rank.count  # alone, the ranks would run different counts
    for runs in per_rank:
        assert runs[1]["micro_batches"] == runs[3]["micro_batches"] == long_rank.count  # both run the larger
        for (head, _, _), run in zip(ALL_MODES, runs):
            _same_as_reference(run, reference[head])
    # The fill is over both ranks' tokens and the agreed count.
    total = int(_batch(100)["attention_mask"].sum())
    assert per_rank[0][1]["token_fill"] == pytest.approx(total / (2 * long_rank.count * BUDGET))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_pipeline_stages_pad_token_micro_batches_to_one_shape(reference, tiny_model_dir):
    # With pipeline stages the micro-batches are padded to one row count (fixed p2p shapes).
    per_rank = run_distributed(_runs, 2, tiny_model_dir, 2, [("lm", "tokens", BUDGET)])
    assert per_rank[0][0]["micro_batches"] == per_rank[1][0]["micro_batches"] == _local_split(0, 1).count
    for (run,) in per_rank:
        # Each stage holds its own layers (weights are compared at DP above); the forward reaches
        # every stage and the step's numbers are the role's.
        _same_as_reference(run, reference["lm"], weights=False)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_packed_micro_batches_under_a_token_budget_match_one_micro_batch(reference, tiny_model_dir):
    # use_remove_padding: each micro-batch (rows or a token budget) packed into one row of its real
    # tokens; on one rank every mode, and with two pipeline stages the token split (the packed
    # micro-batches then share one width). The same tolerances: float32 sums of other lengths.
    runs = run_distributed(_runs, 1, tiny_model_dir, 1, ALL_MODES, True)[0]
    for (head, _, _), run in zip(ALL_MODES, runs):
        _same_as_reference(run, reference[head])
    for (run,) in run_distributed(_runs, 2, tiny_model_dir, 2, [("lm", "tokens", BUDGET)], True):
        assert run["micro_batches"] == _local_split(0, 1).count
        _same_as_reference(run, reference["lm"], weights=False)


class _OneRank:
    """A process group of one rank (the token split skips its collectives)."""

    def size(self) -> int:
        return 1


def test_out_of_memory_halves_the_budget_but_never_below_the_longest_row(caplog):
    from types import SimpleNamespace

    from verl.roles.engine_role import RoleEngine

    # The OOM fallback needs no model: a RoleEngine shell whose engine is one chunk on one rank.
    role = object.__new__(RoleEngine)
    role.name, role.micro_batch_cap = "actor", {}
    role.pg = SimpleNamespace(pp=_OneRank(), tp_dp_cp=_OneRank(), dp=_OneRank(), cp=_OneRank())
    role.engine = SimpleNamespace(chunks=[None])
    tried = []

    def run(size, split, fits_at=30):
        assert size is None
        tried.append(split.budget)
        if split.budget > fits_at:
            raise torch.OutOfMemoryError("injected")
        return split

    def mask(lengths):
        return (torch.arange(32) < torch.tensor(lengths).unsqueeze(1)).long()

    split = role._fit("update", 4, 100, mask([24, 5, 7, 20]), run)
    assert tried == [100, 50, 25] and split.budget == 25
    assert "out of memory at token budget 100; now 50" in caplog.text
    # Later calls start at the lowered budget, raised to their own longest row.
    tried.clear()
    assert role._fit("update", 4, 100, mask([28, 3]), run).budget == 28 and tried == [28]
    # At the longest row there is nothing left to lower: the error propagates.
    with pytest.raises(torch.OutOfMemoryError):
        role._fit("update", 4, 100, mask([31, 3]), run)


def _agreement(rank_lengths: list[list[int]], budget: int) -> tuple[int, list[list[int]]] | str:
    import torch.distributed as dist

    from verl.models.micro_batches import token_split
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel()
    lengths = rank_lengths[dist.get_rank()]
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    try:
        split = token_split(mask, budget, pg=pg, what="actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    except ValueError as exc:
        return str(exc)
    return split.count, [p.tolist() for p in split.parts]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_agree_on_the_count_and_raise_together():
    # Rank 0 alone would need 3 micro-batches, rank 1 one: both run 3.
    per_rank = run_distributed(_agreement, 2, [[20, 20, 20, 1], [2, 2, 2, 2]], 24)
    assert [count for count, _ in per_rank] == [3, 3]
    assert all(sorted(sum(parts, [])) == [0, 1, 2, 3] for _, parts in per_rank)
    # A row over the budget on rank 1 only: both ranks raise (none is left waiting in a collective).
    per_rank = run_distributed(_agreement, 2, [[5, 5], [5, 30]], 24)
    assert per_rank[0] == per_rank[1]
    assert "a sequence of 30 tokens is longer than actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24" in per_rank[0]
    # Rank 0 needs more micro-batches than rank 1 has rows: both raise.
    per_rank = run_distributed(_agreement, 2, [[20, 20, 20], [1]], 24)
    assert per_rank[0] == per_rank[1] and "every rank must run 3 micro-batches" in per_rank[0]
