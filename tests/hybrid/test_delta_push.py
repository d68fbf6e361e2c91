"""Delta pushes to a rollout apart (``update_weights_mode=delta``): bit-exact after every push.

Rank 0 holds a Megatron actor (Adam), rank 1 the rollout's tensors (``HFShards``: the layout
rules are the code every destination shares). Over one run of pushes: the first is full; after
a real optimizer step every block has changed (float32 Adam moves every weight); a push with
nothing changed sends headers only; a change of one row sends one block per tensor it touches;
the scheduled full push; an engine whose tensors were written behind the push's back is caught
by the bucket checksum and the push redone in full; a block corrupted on the wire likewise.
After each push the rollout's tensors equal the actor's exactly (``torch.equal``: the transfer
only moves bits).
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

BUCKET_BYTES = 64 * 1024
BLOCK_BYTES = 1024


def _actor_weights(actor) -> dict[str, torch.Tensor] | None:
    """The actor's Hugging Face tensors (TP = PP = 1: whole), cloned; None off the actor."""
    from verl.models.checkpoint import iter_hf_weights

    if actor is None:
        return None
    return {name: t.detach().clone() for name, t in iter_hf_weights(actor.chunks, pg=actor.pg)}


def _train_step(actor, seed: int) -> None:
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.engine import LossShare

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, actor.spec.vocab_size, (4, 16), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    info = GlobalBatchInfo.from_masks([batch["attention_mask"].float()], group=actor.pg.dp)

    def loss_fn(outputs, mb):
        return LossShare(agg_loss(-outputs["logprobs"], mb["attention_mask"].float(), "token-mean",
                                  global_batch_info=info))

    assert actor.train_step(batch, micro_batch_size=2, loss_fn=loss_fn).update_successful


def _delta_body(model_dir: str):
    import torch.distributed as dist

    import verl.hybrid.delta as delta_mod
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import MegatronEngine
    from verl.hybrid.weight_sync import DisaggregatedSync, HFShards
    from verl.models.hf_config import parse_hf_config
    from verl.parallel import megatron_state as ms
    from verl.parallel.topology import RoleLayout, Topology

    topo = Topology(world_size=2, roles={"actor": RoleLayout(ranks=(0,)), "rollout": RoleLayout(ranks=(1,))})
    groups = topo.build_groups()
    rank = dist.get_rank()
    actor = dest = None
    if "actor" in groups:
        pg = groups["actor"].pg_collection
        ms.initialize_role(pg)
        with ms.activate_role(pg):
            actor = MegatronEngine(model=ModelConfig(path=model_dir), pg=pg, megatron=MegatronConfig(),
                                   optim=OptimConfig(optimizer="adam", lr=1e-3), total_training_steps=10)
    spec = parse_hf_config(f"{model_dir}/config.json")
    if rank == 1:
        dest = HFShards(spec, tp=1, tp_rank=0, dtype=torch.float32, device="cpu")
    sync = DisaggregatedSync(actor, dest, rollout_rank=0 if rank == 1 else None, bucket_bytes=BUCKET_BYTES,
                             rollout_world=groups["rollout"].groups["all"] if rank == 1 else None,
                             mode="delta", full_every=4, block_bytes=BLOCK_BYTES)
    log = []

    def push(what: str) -> None:
        metrics = sync.push()
        box = [_actor_weights(actor)]
        dist.broadcast_object_list(box, src=0)
        wrong = None
        if dest is not None:
            wrong = sorted(k for k, t in box[0].items() if not torch.equal(dest.tensors[k], t))
        log.append({"what": what, "wrong": wrong, **{k.removeprefix("update_weights/"): v for k, v in metrics.items()
                                                     if k.startswith("update_weights/")}})

    push("first")
    if actor is not None:
        with ms.activate_role(actor.pg):
            _train_step(actor, seed=1)
    push("adam step")
    push("nothing changed")
    if actor is not None:  # one row of one matrix: one block of that tensor
        layer = actor.chunks[0].module if hasattr(actor.chunks[0], "module") else actor.chunks[0]
        weight = dict(layer.named_parameters())["decoder.layers.0.mlp.linear_fc2.weight"]
        with torch.no_grad():
            weight[3, :] += 0.5
    push("one row")
    push("scheduled full")
    if dest is not None:  # the engine's tensors written behind the push's back
        dest.tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] += 1.0
    push("engine drifted")
    if actor is not None:
        with ms.activate_role(actor.pg):
            _train_step(actor, seed=2)
    original = delta_mod._exchange
    flipped = []

    def corrupting_exchange(ops):  # the wire: flips one bit of the first block payload received
        original(ops)
        for op in ops:
            if op.op is dist.irecv and op.tensor.dtype == torch.float32 and not flipped:
                op.tensor.view(torch.int32)[7] ^= 1 << 20
                flipped.append(True)

    delta_mod._exchange = corrupting_exchange
    try:
        push("corrupted on the wire")
    finally:
        delta_mod._exchange = original
    ms.destroy_model_parallel()
    return log


@pytest.mark.distributed
def test_delta_pushes_are_exact_and_send_only_changed_blocks(tiny_model_dir):
    actor_log, rollout_log = run_distributed(_delta_body, 2, tiny_model_dir, timeout=300)
    steps = [entry["what"] for entry in rollout_log]
    assert all(entry["wrong"] == [] for entry in rollout_log), rollout_log
    by = {entry["what"]: entry for entry in actor_log}
    full_bytes = by["first"]["bytes_full"]
    for what, entry in by.items():
        print(f"{what:>22}: full={entry['full']:.0f} sent {entry['bytes_sent']:.0f} B of {full_bytes:.0f} "
              f"({entry['sent_share']:.4f}), blocks {entry['blocks_sent']:.0f}/{entry['blocks_total']:.0f}, "
              f"checksum failures {entry['checksum_failures']:.0f}, {entry['seconds'] * 1e3:.1f} ms")
    assert steps == list(by)
    assert [by[s]["full"] for s in steps] == [1, 0, 0, 0, 1, 1, 1]
    assert by["first"]["blocks_sent"] == by["first"]["blocks_total"] > 0
    # float32 Adam moves every weight: every block changed.
    assert by["adam step"]["blocks_sent"] == by["adam step"]["blocks_total"]
    # Nothing changed: the headers only (one int64 per block and three per bucket).
    assert by["nothing changed"]["blocks_sent"] == 0
    assert by["nothing changed"]["sent_share"] < 0.01
    # One row of 64 float32 (256 bytes) lies in one 1 KiB block or across two.
    assert 1 <= by["one row"]["blocks_sent"] <= 2
    assert by["one row"]["sent_share"] < 0.02
    # Detected by the checksum, redone in full: the delta attempt plus a full push went out.
    for what in ("engine drifted", "corrupted on the wire"):
        assert by[what]["checksum_failures"] == 1
        assert by[what]["bytes_sent"] > full_bytes
    assert rollout_log[-1]["checksum_failures"] == 1  # the ranks agree


@pytest.mark.parametrize(("extra", "expected"), [
    ([], "trainer.placement.rollout"),
    (["trainer.placement.rollout=[1]", "actor_rollout_ref.actor.strategy=fsdp2"], "actor.strategy=megatron"),
])
def test_delta_mode_is_refused_where_it_cannot_apply(extra, expected):
    from verl.config import ConfigError, PPOConfig, load_config

    with pytest.raises(ConfigError, match="update_weights_mode=delta_sharded") as info:
        load_config(PPOConfig, config_file="configs/grpo_tiny_cpu.yaml", world_size=2, overrides=[
            "actor_rollout_ref.rollout.update_weights_mode=delta_sharded", "trainer.n_gpus_per_node=2", *extra])
    assert expected in str(info.value)


def test_block_bitmask_and_checksum():
    from verl.hybrid.delta import _pack_bits, _unpack_bits, bucket_checksum

    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 63, 64, 65, 1000):
        flags = torch.rand(n, generator=gen) < 0.3
        words = torch.zeros(-(-n // 64), dtype=torch.int64)
        bits = _pack_bits(flags)
        words.view(torch.uint8)[: bits.numel()] = bits
        assert torch.equal(_unpack_bits(words, n), flags), n
    x = torch.randn(1000, generator=gen)
    swapped = x.clone()
    swapped[[3, 500]] = x[[500, 3]]
    assert bucket_checksum(x) == bucket_checksum(x.clone())
    assert bucket_checksum(x) != bucket_checksum(swapped)  # the position-weighted sum sees the order
    flipped = x.clone()
    flipped.view(torch.int32)[999] ^= 1  # the last bit of the last element
    assert bucket_checksum(x) != bucket_checksum(flipped)
    assert bucket_checksum(torch.zeros(3)) != bucket_checksum(torch.tensor([0.0, -0.0, 0.0]))  # bits, not values
    b16 = x.to(torch.bfloat16)
    b16_flipped = b16.clone()
    b16_flipped.view(torch.int16)[10] ^= 1
    assert bucket_checksum(b16) != bucket_checksum(b16_flipped)  # 2-byte elements
