"""The 3D-HybridEngine's resharding: every (TP, PP[, VPP]) actor layout into every rollout TP', bit-exact.

Each rollout rank's destination tensors must equal the Hugging Face checkpoint's tensors sliced
for that rank, exactly (the transfer only copies bytes). Models: a Llama (untied embeddings,
GQA: 8 query heads over 4 K/V heads) and a Qwen2 (q/k/v biases, tied embeddings), both with a
vocabulary of 1001 (padded differently by Megatron at every TP and by vLLM) and 4 layers (so
PP=2 x VPP=2 has one layer per chunk). Destinations here are ``HFShards`` (the layout rules
are the same code for every destination); the vLLM and transformers engines are covered in
test_weight_sync_engines.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.tiny import make_tiny_model
from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

SHAPE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=384, num_hidden_layers=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard-models")
    return {
        "llama": make_tiny_model(str(root / "llama"), "llama_gqa", seed=3, **SHAPE),
        "qwen2": make_tiny_model(str(root / "qwen2"), "qwen2_tied", seed=4, **SHAPE),
    }


def _full_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from verl.models.safetensors_io import SafetensorsReader

    reader = SafetensorsReader(model_dir)
    return {name: reader.read(name) for name in reader.names()}


def _reshard_body(model_dir: str, tp: int, pp: int, vpp: int | None, rollout_tps: tuple[int, ...], bucket_bytes: int):
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.hybrid.weight_sync import HFShards, WeightSync
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    engine = MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp),
        pg=pg,
    )
    full = _full_weights(model_dir)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for rollout_tp in rollout_tps:
        dest = HFShards(engine.spec, tp=rollout_tp, tp_rank=rank % rollout_tp, dtype=torch.float32, device="cpu")
        sync = WeightSync(engine, dest, bucket_bytes=bucket_bytes)
        metrics = sync.push()
        expected = HFShards(engine.spec, tp=rollout_tp, tp_rank=rank % rollout_tp, dtype=torch.float32, device="cpu")
        expected.update_weights(full.items())
        wrong = [k for k in expected.tensors if not torch.equal(dest.tensors[k], expected.tensors[k])]
        planned = sync.plan.rank_stats(rank)
        out[rollout_tp] = {
            "wrong": wrong,
            "tensors": len(expected.tensors),
            "received": metrics["update_weights/bytes_received"],
            "planned_received": planned.received_elements * 4,
            "sent": metrics["update_weights/bytes_sent"],
            "planned_sent": planned.sent_elements * 4,
            "local": metrics["update_weights/bytes_local"],
            "buffer": metrics["update_weights/buffer_bytes"],
            "world": world,
        }
    return out


LAYOUTS = [  # (world, tp, pp, vpp): every layout with TP, PP in {1, 2, 4} on at most 4 ranks
    (2, 1, 1, None),
    (2, 2, 1, None),
    (2, 1, 2, None),
    (4, 4, 1, None),
    (4, 2, 2, None),
    (4, 1, 4, None),
    (4, 2, 1, None),  # DP = 2: replicas hold the same shards
    (4, 1, 2, 2),  # interleaved pipeline, DP = 2
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("world", "tp", "pp", "vpp"), LAYOUTS, ids=[f"w{w}-tp{t}-pp{p}-vpp{v}" for w, t, p, v in LAYOUTS])
def test_every_layout_reshards_bit_exactly(models, family, world, tp, pp, vpp):
    rollout_tps = tuple(t for t in (1, 2, 4) if world % t == 0)
    bucket = 64 * 1024  # bytes: far below a layer's traffic, so buckets split ranges
    results = run_distributed(_reshard_body, world, models[family], tp, pp, vpp, rollout_tps, bucket, timeout=300)
    for rank, per_tp in enumerate(results):
        for rollout_tp, r in per_tp.items():
            assert r["wrong"] == [], f"rank {rank} TP'={rollout_tp}: {r['wrong'][:5]}"
            # What moved is exactly what the plan says.
            assert r["received"] == r["planned_received"] and r["sent"] == r["planned_sent"]
            assert r["buffer"] <= 2 * bucket
            if rollout_tp == tp and pp == 1:
                assert r["received"] == 0 and r["sent"] == 0  # TP == TP', PP = 1: nothing crosses the network
    # Every byte a rank receives is sent by another.
    for rollout_tp in results[0]:
        assert sum(r[rollout_tp]["received"] for r in results) == sum(r[rollout_tp]["sent"] for r in results)


def test_plan_covers_every_element_once_and_balances_replicas():
    """Pure plan (no processes): TP1 x DP4 actor into TP'4: each rank takes its quarter locally."""
    from verl.hybrid.layout import megatron_layout, vllm_layout
    from verl.hybrid.plan import build_plan
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config(dict(model_type="llama", vocab_size=1001, max_position_embeddings=64, **SHAPE))
    sources = [megatron_layout(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, vocab_pad_multiple=128) for _ in range(4)]
    dests = [vllm_layout(spec, tp=4, tp_rank=r) for r in range(4)]
    plan = build_plan(sources, dests)
    for rank in range(4):
        stats = plan.rank_stats(rank)
        assert stats.received_elements == 0 and stats.local_elements > 0
    # TP2 x PP2 into TP'1 x DP'4: ranks 2, 3 (stage 1) send their layers to 0 and 1; the load is split.
    sources = [megatron_layout(spec, tp=2, tp_rank=r % 2, pp=2, pp_rank=r // 2, vocab_pad_multiple=128) for r in range(4)]
    dests = [vllm_layout(spec, tp=1, tp_rank=0) for _ in range(4)]
    plan = build_plan(sources, dests)
    sent = [plan.rank_stats(r).sent_elements for r in range(4)]
    total = sum(int(np.prod(s)) for s in dests[0].shapes.values()) - (1024 - 1001) * 256 * 2  # minus vLLM padding
    for rank in range(4):
        st = plan.rank_stats(rank)
        assert st.local_elements + st.received_elements == total
    assert max(sent) <= 1.5 * min(sent), f"unbalanced senders {sent}"
    assert "received from" in plan.describe(element_size=4)


def test_impossible_rollout_layouts_are_refused_naming_every_degree():
    from verl.hybrid.layout import check_rollout_degrees, vllm_layout
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config(dict(model_type="llama", vocab_size=1001, max_position_embeddings=64, **SHAPE))
    assert check_rollout_degrees(spec, 8) == []  # K/V heads replicated over 8 ranks
    problems = check_rollout_degrees(spec, 3)
    assert any("num_attention_heads=8 is not divisible by rollout TP' 3" in p for p in problems)
    assert any("intermediate_size=384 is not divisible" in p for p in problems) is False
    with pytest.raises(ValueError, match="rollout layout TP'=16: num_attention_heads=8 is not divisible"):
        vllm_layout(spec, tp=16, tp_rank=0)


def _bad_destinations_body(model_dir: str) -> dict[str, str]:
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.hybrid.weight_sync import HFShards, WeightSync
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=2)
    engine = MegatronEngine(model=ModelConfig(path=model_dir), megatron=MegatronConfig(tensor_model_parallel_size=2),
                            pg=pg)
    rank = dist.get_rank()
    out = {}

    def attempt(name: str, dest) -> None:
        try:
            WeightSync(engine, dest, bucket_bytes=1 << 20)
            out[name] = ""
        except ValueError as exc:  # every rank raises, none waits in a collective
            out[name] = str(exc)

    wide = HFShards(engine.spec, tp=1, tp_rank=0, dtype=torch.float32, device="cpu")
    wide.tp = 4  # a rollout TP' of 4 on a world of 2
    attempt("tp_too_wide", wide)
    lacking = HFShards(engine.spec, tp=2, tp_rank=rank, dtype=torch.float32, device="cpu")
    if rank == 1:  # only one rank's engine lacks it: still every rank must fail
        del lacking.tensors["model.layers.1.mlp.down_proj.weight"]
    attempt("lacking", lacking)
    odd = HFShards(engine.spec, tp=2, tp_rank=rank, dtype=torch.float32, device="cpu")
    odd.tensors["model.norm.weight"] = torch.zeros(3)
    attempt("wrong_shape", odd)
    return out


@pytest.mark.timeout(180)
def test_bad_destinations_fail_at_construction_on_every_rank(models):
    results = run_distributed(_bad_destinations_body, 2, models["llama"], timeout=170)
    for r in results:
        assert "rollout TP'=4 does not divide the actor's 2 ranks" in r["tp_too_wide"]
        assert "actor tp=2 pp=1 vpp=None cp=1 dp=1, rollout TP'=4" in r["tp_too_wide"]  # every degree
        assert "world_size=2" in r["tp_too_wide"]
        assert "rank 1: the rollout engine lacks 1 parameter(s) the plan fills, e.g. " \
               "['model.layers.1.mlp.down_proj.weight']" in r["lacking"]
        assert "model.norm.weight has shape [3], the plan [256]" in r["wrong_shape"]


# -- generation disaggregated: the actor's shards sent to a rollout on other ranks ----------------------


def _disaggregated_body(model_dir: str, tp: int, pp: int, rollout_tp: int, bucket_bytes: int):
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.hybrid.weight_sync import DisaggregatedSync, HFShards
    from verl.models.hf_config import parse_hf_config
    from verl.parallel import megatron_state as ms
    from verl.parallel.topology import RoleLayout, Topology

    # The actor on ranks 0-1 (TP x PP = 2), the rollout on ranks 2-3: each in a world of its own.
    topo = Topology(world_size=4, roles={
        "actor": RoleLayout(ranks=(0, 1), tensor_parallel=tp, pipeline_parallel=pp),
        "rollout": RoleLayout(ranks=(2, 3), tensor_parallel=rollout_tp),
    })
    groups = topo.build_groups()
    rank = dist.get_rank()
    engine = dest = None
    if "actor" in groups:
        pg = groups["actor"].pg_collection
        ms.initialize_role(pg)
        with ms.activate_role(pg):
            engine = MegatronEngine(model=ModelConfig(path=model_dir), pg=pg, megatron=MegatronConfig(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    local = groups["rollout"].coords.local_rank if "rollout" in groups else None
    spec = parse_hf_config(f"{model_dir}/config.json")
    if local is not None:
        dest = HFShards(spec, tp=rollout_tp, tp_rank=local % rollout_tp, dtype=torch.float32, device="cpu")
    sync = DisaggregatedSync(engine, dest, rollout_rank=local, bucket_bytes=bucket_bytes,
                             rollout_world=groups["rollout"].groups["all"] if local is not None else None)
    metrics = sync.push()
    wrong = None
    if dest is not None:
        expected = HFShards(spec, tp=rollout_tp, tp_rank=local % rollout_tp, dtype=torch.float32, device="cpu")
        expected.update_weights(_full_weights(model_dir).items())
        wrong = [k for k in expected.tensors if not torch.equal(dest.tensors[k], expected.tensors[k])]
    ms.destroy_model_parallel()
    return {"wrong": wrong, "sent": metrics["update_weights/bytes_sent"],
            "received": metrics["update_weights/bytes_received"], "buffer": metrics["update_weights/buffer_bytes"]}


@pytest.mark.parametrize(("tp", "pp", "rollout_tp"), [(2, 1, 2), (1, 2, 1)], ids=["tp2-to-tp2", "pp2-to-tp1x2"])
def test_shards_sent_to_a_rollout_on_other_ranks_arrive_bit_exactly(models, tp, pp, rollout_tp):
    bucket = 64 * 1024
    results = run_distributed(_disaggregated_body, 4, models["qwen2"], tp, pp, rollout_tp, bucket, timeout=300)
    # The rollout's ranks hold exactly the checkpoint's tensors, sliced for their TP' rank; only they receive.
    assert [r["wrong"] for r in results] == [None, None, [], []]
    assert results[0]["received"] == results[1]["received"] == 0 and results[2]["sent"] == results[3]["sent"] == 0
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results) > 0
    assert all(r["buffer"] <= 2 * bucket for r in results)
