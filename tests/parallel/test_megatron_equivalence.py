"""A tiny Megatron GPT gives the same loss and grad norm in every parallel layout.

One set of full (TP1/PP1) weights is defined by name and seed; each layout slices its shards
out of it (Megatron tags every sharded parameter with ``partition_dim``), so TP1, TP2,
TP2+SP, PP2 (1F1B), TP2xPP2 and TP2xDP2 all start from identical weights and see the same
global batch. Every layout runs Megatron DDP + ``finalize_model_grads`` and one SGD step
through ``get_megatron_optimizer``, so the second loss checks the gradients' direction
too, not only their norm.
"""

from __future__ import annotations

import math
import time
import zlib

import pytest
import torch
import torch.distributed as dist

from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ = 128, 64, 4, 128, 2, 32
GLOBAL_BATCH = 4  # sequences per step, split over DP ranks, one sequence per micro-batch
LR = 0.5


def _full_weight(global_name: str, shape: torch.Size) -> torch.Tensor:
    """The TP1/PP1 value of a parameter, from its global name alone (identical on every rank)."""
    gen = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
    noise = torch.randn(shape, generator=gen)
    if "layernorm" in global_name or global_name.endswith("final_layernorm.weight"):
        return 1.0 + 0.1 * noise  # norm scales near 1
    return 0.05 * noise


def _load_sliced_weights(model: torch.nn.Module, layers_per_stage: int, pp_rank: int, tp_rank: int, tp: int) -> None:
    """Fill every local shard from the full weights: global layer index, then the TP slice."""
    offset = pp_rank * layers_per_stage
    with torch.no_grad():
        for name, param in model.named_parameters():
            parts = name.split(".")
            if "layers" in parts:
                idx = parts.index("layers") + 1
                parts[idx] = str(int(parts[idx]) + offset)
            global_name = ".".join(parts)
            full_shape = list(param.shape)
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded:
                full_shape[param.partition_dim] *= tp
            full = _full_weight(global_name, torch.Size(full_shape))
            if sharded:
                full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
            param.copy_(full)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)  # [B, T+1]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # inputs [B, T], labels [B, T]


def _forward_step(data_iterator, model):
    input_ids, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(input_ids)
    output = model(input_ids, position_ids, None, labels=labels)  # last stage: per-token loss [b, T]

    def loss_func(output_tensor: torch.Tensor):
        loss = output_tensor.float().mean()
        # clone: the schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _grad_norm(model: torch.nn.Module, pgs) -> float:
    """Global L2 norm of the (DP-synchronised) grads, each TP-replicated parameter counted once."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros(1, dtype=torch.float64)
    for param in model.parameters():
        if param_is_not_tensor_parallel_duplicate(param, tp_group=pgs.tp):
            sq += param.main_grad.double().pow(2).sum()
    dist.all_reduce(sq, group=pgs.mp)  # over TP shards and PP stages, not over DP replicas
    return math.sqrt(sq.item())


def _train_step_losses(
    tp: int, pp: int, sequence_parallel: bool, pgs=None
) -> tuple[float, float, float]:
    """Two steps of loss (before and after one SGD step) and the first step's grad norm.

    Megatron's global parallel state is built for the whole world unless ``pgs`` (a role's
    explicit ProcessGroupCollection from Topology) is given; then the build and the steps run
    inside ``activate_role(pgs)``, as a role's engine runs them (``verl.roles.engine_role``).
    """
    from verl.parallel import megatron_state as ms

    if pgs is None:
        pgs = ms.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        return _build_and_train(tp, pp, sequence_parallel, pgs)
    ms.initialize_role(pgs, seed=1234)
    with ms.activate_role(pgs):
        return _build_and_train(tp, pp, sequence_parallel, pgs)


def _build_and_train(tp: int, pp: int, sequence_parallel: bool, pgs) -> tuple[float, float, float]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.transformer import TransformerConfig

    from verl.models.builder import local_layer_spec

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    spec = local_layer_spec(config, vp_stage=None, pp_rank=pgs.pp.rank())
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pgs.pp.rank() == 0,
        post_process=pgs.pp.rank() == pp - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        pg_collection=pgs,
    )
    _load_sliced_weights(model, LAYERS // pp, pgs.pp.rank(), pgs.tp.rank(), tp)
    ddp_model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
        model,
        pg_collection=pgs,
    )
    optimizer = get_megatron_optimizer(
        # clip_grad=0: Megatron's clipping asserts CUDA tensors (ENVIRONMENT.md).
        OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0),
        [ddp_model],
        use_gloo_process_groups=False,
        pg_collection=pgs,
    )

    inputs, labels = _batch()
    dp_size, dp_rank = pgs.dp.size(), pgs.dp.rank()
    per_rank = GLOBAL_BATCH // dp_size
    mine = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro_batches = [(inputs[i : i + 1], labels[i : i + 1]) for i in mine]

    def step() -> float:
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func(pp_size=pp, vp_size=None)(
            forward_step_func=_forward_step,
            data_iterator=iter(micro_batches),
            model=[ddp_model],
            num_microbatches=len(micro_batches),
            seq_length=SEQ,
            micro_batch_size=1,
            forward_only=False,
            p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config),
            pg_collection=pgs,
        )
        finalize_model_grads([ddp_model], pg_collection=pgs)
        # The loss lives on the last stage; average it over DP and hand it to every stage.
        loss = torch.zeros(1)
        if pgs.pp.rank() == pp - 1:
            loss += torch.stack([x["loss"] for x in losses]).mean()
        dist.all_reduce(loss, group=pgs.dp)
        dist.all_reduce(loss, group=pgs.pp)
        return loss.item() / dp_size

    first_loss = step()
    first_norm = _grad_norm(model, pgs)
    optimizer.step()
    second_loss = step()
    return first_loss, first_norm, second_loss


@pytest.fixture(scope="module")
def reference() -> tuple[float, float, float]:
    """TP1/PP1/DP1 on one rank."""
    return run_distributed(_train_step_losses, 1, 1, 1, False)[0]


@pytest.mark.parametrize(
    ("world_size", "tp", "pp", "sp"),
    [
        (2, 2, 1, False),  # TP2
        (2, 2, 1, True),  # TP2 + sequence parallel
        (2, 1, 2, False),  # PP2, 1F1B
        (4, 2, 2, False),  # TP2 x PP2
        (4, 2, 1, False),  # TP2 x DP2
        (4, 2, 2, True),  # TP2 x PP2 + SP
    ],
    ids=["tp2", "tp2-sp", "pp2", "tp2xpp2", "tp2xdp2", "tp2xpp2-sp"],
)
def test_layout_matches_single_rank_reference(reference, world_size: int, tp: int, pp: int, sp: bool) -> None:
    expected_loss, expected_norm, expected_loss_after_step = reference
    per_rank = run_distributed(_train_step_losses, world_size, tp, pp, sp)
    # Every rank reports the same numbers (they are reduced over the whole model).
    assert all(r == pytest.approx(per_rank[0], rel=1e-12) for r in per_rank)
    actual_loss, actual_norm, actual_loss_after_step = per_rank[0]
    # float32 throughout; the layouts differ only in summation order (TP partial sums reduced
    # by all-reduce, split matmuls, DP-averaged grads): measured <= 4e-8 relative. 1e-6 leaves
    # 25x margin and still catches real sharding bugs: SP norm grads not reduced over TP
    # (an untagged norm) move the grad norm by 2e-4 relative at this size.
    assert actual_loss == pytest.approx(expected_loss, rel=1e-6)
    assert actual_norm == pytest.approx(expected_norm, rel=1e-6)
    assert actual_loss_after_step == pytest.approx(expected_loss_after_step, rel=1e-6)
    assert abs(expected_loss_after_step - expected_loss) > 1e-3, "the SGD step must change the loss"


def split_topology():
    """The actor on ranks 0-1 (TP2), the critic on ranks 2-3 (DP2): two roles apart on 4 ranks."""
    from verl.parallel.topology import RoleLayout, Topology

    return Topology(
        world_size=4,
        roles={"actor": RoleLayout(ranks=(0, 1), tensor_parallel=2), "critic": RoleLayout(ranks=(2, 3))},
    )


def _split_roles_losses() -> tuple[str, tuple[float, float, float], list[str], int]:
    """Actor on ranks 0-1 (TP2) and critic on ranks 2-3 (DP2), each from its Topology groups only.

    The critic starts late (roles apart build at different moments in a real run), and every
    collective of each role's build and steps is recorded: none may run on the whole world,
    whose other role would never join it (a deadlock that load only sometimes reveals).
    """
    from verl.testing.collectives import record_collectives

    world = dist.group.WORLD
    with record_collectives() as calls:
        (role, groups), = split_topology().build_groups().items()
        if role == "critic":
            time.sleep(1.0)  # the unlucky order: the actor is already building its optimizer
        tp = groups.layout.tensor_parallel
        losses = _train_step_losses(tp, 1, False, pgs=groups.pg_collection)
    # build_groups' world-level part (the roles' "all" groups) makes groups, it runs no collective.
    return role, losses, [c.op for c in calls if c.group is world], len(calls)


def test_split_roles_train_on_their_own_groups(reference) -> None:
    """Two roles on disjoint ranks, no global parallel state: each matches the reference, and no
    collective of either role's build or steps ran on the whole world."""
    per_rank = run_distributed(_split_roles_losses, 4)
    assert [role for role, *_ in per_rank] == ["actor", "actor", "critic", "critic"]
    for role, (loss, norm, loss_after_step), on_world, recorded in per_rank:
        assert on_world == [], f"{role}: collectives on the whole world: {on_world}"
        assert recorded > 10, f"{role}: only {recorded} collectives recorded; the recorder missed the role's"
        # Same tolerance and reason as above.
        assert loss == pytest.approx(reference[0], rel=1e-6), role
        assert norm == pytest.approx(reference[1], rel=1e-6), role
        assert loss_after_step == pytest.approx(reference[2], rel=1e-6), role
