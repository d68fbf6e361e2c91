"""Router replay (``verl.models.router_replay``): the experts recorded in one pass decide the experts of a
later pass: on 1 rank, at expert parallel 2 (each rank its own batch), at TP 2 + SP and EP 2 x TP 2 + SP,
padded and packed.

A tiny Qwen3-MoE (4 experts, top 2, renormalised weights, 2 layers). The recording pass's routing
equals transformers' own choice of experts; replayed with the same weights (another micro-batch
size, so other trimmed widths), the update pass's log-probs equal the recording pass's. Then every
router is replaced by a random one, which sends many tokens elsewhere: free routing follows the new
routers (transformers with the new routers is the reference), while the replayed update pass keeps
the recorded experts and takes only their weights from the new routers — transformers with the new
routers forced onto the recorded experts is its reference.

Tolerances: float32, the same math in another order: 1e-5 (the MoE tests' bound; ~3e-7 measured
on logits there). The replayed and free passes differ by far more (asserted), so a replay that did
nothing could not pass.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import make_tiny_model, padded_batch, reference_logprobs_entropy
from verl.testing.distributed import run_distributed

ATOL = 1e-5
LAYERS, EXPERTS, TOPK, HIDDEN = 2, 4, 2, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("replay") / "m"), "qwen3_moe", seed=5)


def _new_routers() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.3 for _ in range(LAYERS)]


def _replay_body(model_dir, tp, ep, pp, batches, new_routers):
    import torch.distributed as dist

    from verl.engine import LossShare
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                   pipeline_model_parallel_size=pp)
    build = ModelBuildConfig(moe_enable_routing_replay=True, sequence_parallel=tp > 1)
    chunks = build_model_chunks(parse_hf_config(model_dir), build, pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    batch = batches[pg.dp.rank()]  # a TP group's (and pipeline's) ranks share their data-parallel rank's batch

    def run(b, mbs, routing, loss=False, pack=False):
        def loss_fn(outputs, mb):  # any loss: the pass runs forward and backward
            return LossShare(loss=-(outputs["logprobs"] * mb["attention_mask"]).sum() / 100.0)

        result = forward_backward(chunks, b, pg=pg, micro_batch_size=mbs, output="logprobs", routing=routing,
                                  pack_sequences=pack, loss_fn=loss_fn if loss else None)
        agreement.append([float(m["router_replay/agreement"]) for m in result.metrics])
        return result.outputs

    agreement = []  # each pass's per-micro-batch agreement (replayed training passes only)

    recorded = run(batch, 2, "record")
    replayed = {**batch, "routed_experts": recorded["routed_experts"]}
    same = run(replayed, 4, "replay", loss=True, pack=True)["logprobs"]  # packed: another cut of S under SP
    with torch.no_grad():
        for layer in (layer for chunk in chunks for layer in chunk.decoder.layers):  # a stage's own layers
            layer.mlp.router.weight.copy_(new_routers[layer.layer_number - 1])
    free = run(batch, 2, None)["logprobs"]
    update = run(replayed, 2, "replay", loss=True)["logprobs"]
    return {"recorded": recorded, "same": same, "free": free, "update": update, "agreement": agreement,
            "dp": pg.dp.rank(), "last_stage": pg.pp.rank() == pp - 1}


def _hf_logprobs(model_dir, batch, routers=None, forced=None):
    """transformers' log-probs [B, T]; ``routers``: replace every router's weight; ``forced`` [B, T, L, K]:
    every MoE layer takes these experts, their weights from its router (renormalised top-k softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chosen = []
    for index, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if routers is not None:
            with torch.no_grad():
                gate.weight.copy_(routers[index])
        if forced is not None:
            experts = forced[:, :, index].reshape(-1, TOPK).long()  # transformers' tokens: [B * T] row-major

            def forward(hidden, gate=gate, experts=experts):
                logits = torch.nn.functional.linear(hidden.reshape(-1, HIDDEN), gate.weight)
                chosen.append(logits.topk(TOPK, dim=-1).indices)  # what free routing would take here
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
                return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts

            gate.forward = forward
        else:
            gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logprobs, _ = reference_logprobs_entropy(logits, batch["input_ids"], mask)
    b, t = mask.shape
    return logprobs, [c.reshape(b, t, TOPK) for c in chosen]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "tp", "ep", "pp"),
    [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 1), (2, 1, 1, 2), pytest.param(4, 2, 2, 1, marks=pytest.mark.slow)],
    ids=["one-rank", "ep2", "tp2-sp", "pp2", "ep2-tp2-sp"],
)
def test_replayed_routing_decides_the_update_pass(model_dir, world, tp, ep, pp):
    """Under TP + sequence parallel each TP rank routes a slice of the sequence: the recording is
    gathered (every TP rank returns the whole routing) and each rank replays its own slice. Under
    pipeline parallel each stage records and replays its own layers, the recording is gathered over the
    stages, and the agreement of a training pass (the last stage's metrics) is the whole pass's share."""
    batches = [padded_batch(4, 12, seed=20 + r) for r in range(world // (tp * pp))]
    new_routers = _new_routers()
    results = run_distributed(_replay_body, world, model_dir, tp, ep, pp, batches, new_routers, timeout=300)
    for r in results:
        batch = batches[r["dp"]]
        mask = batch["attention_mask"].bool()
        expected, hf_chosen = _hf_logprobs(model_dir, batch)
        rec = r["recorded"]
        assert rec["routed_experts"].shape == (4, 12, LAYERS, TOPK) and rec["routed_experts"].dtype == torch.int16
        for layer in range(LAYERS):  # the recorded experts are transformers' (in any order within the top k)
            actual = rec["routed_experts"][:, :, layer][mask].sort(-1).values
            assert torch.equal(actual, hf_chosen[layer][mask].sort(-1).values), layer
        torch.testing.assert_close(rec["logprobs"], expected, rtol=0, atol=ATOL)
        # Same weights, replayed in another micro-batching: the recording pass's log-probs.
        torch.testing.assert_close(r["same"], rec["logprobs"], rtol=0, atol=ATOL)
        # New routers: free routing follows them, the replayed pass keeps the recorded experts.
        free_expected, _ = _hf_logprobs(model_dir, batch, routers=new_routers)
        forced_expected, _ = _hf_logprobs(model_dir, batch, routers=new_routers, forced=rec["routed_experts"])
        torch.testing.assert_close(r["free"], free_expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(r["update"], forced_expected, rtol=0, atol=ATOL)
        # actor/router_replay/agreement: 1 with the recording's own routers; with the new ones, per micro-batch
        # of 2 rows, the share of (real token, layer) whose free top-k (transformers' forced run) is the recorded set
        _, free_there = _hf_logprobs(model_dir, batch, routers=new_routers, forced=rec["routed_experts"])
        same_set = torch.stack([(f.sort(-1).values == rec["routed_experts"][:, :, layer].sort(-1).values).all(-1)
                                for layer, f in enumerate(free_there)], -1)  # [B, T, L]
        expected_agreement = [float(same_set[rows][mask[rows]].float().mean()) for rows in (slice(0, 2), slice(2, 4))]
        if pp > 1:  # per micro-batch, the whole pass's share (the stages' counts are summed after it)
            if not r["last_stage"]:
                assert r["agreement"][1] == r["agreement"][3] == []  # metrics live on the last stage
                continue
            expected_agreement = [float(same_set[mask].float().mean())] * 2
        assert r["agreement"][1] == [1.0]  # the packed replay at the recording's weights: one micro-batch of 4
        assert r["agreement"][3] == pytest.approx(expected_agreement, abs=1e-12) and min(expected_agreement) < 1
        assert (free_expected - forced_expected).abs().max() > 100 * ATOL  # the replay changed the experts


def _packed_body(model_dir, batch, new_routers):
    """Record and replay under different packings: padded rows (fixed micro-batches) and packed THD
    rows (fixed micro-batches or a token budget, which regroups the rows)."""
    from verl.engine import LossShare
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.models.micro_batches import token_split
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel()
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(moe_enable_routing_replay=True), pg)
    load_hf_weights(chunks, model_dir, pg=pg)

    def run(b, routing, *, pack, mbs=None, budget=None, loss=False):
        def loss_fn(outputs, mb):
            return LossShare(loss=-(outputs["logprobs"] * mb["attention_mask"]).sum() / 100.0)

        cut = dict(micro_batch_size=mbs) if budget is None else dict(split=token_split(b["attention_mask"], budget))
        return forward_backward(chunks, b, pg=pg, output="logprobs", routing=routing, pack_sequences=pack,
                                loss_fn=loss_fn if loss else None, **cut).outputs

    out = {
        "padded": run(batch, "record", pack=False, mbs=2),
        "packed": run(batch, "record", pack=True, mbs=3),
        "budget": run(batch, "record", pack=True, budget=24),
    }
    replayed = {**batch, "routed_experts": out["packed"]["routed_experts"]}
    out["same_budget"] = run(replayed, "replay", pack=True, budget=30, loss=True)["logprobs"]
    out["same_padded"] = run(replayed, "replay", pack=False, mbs=4, loss=True)["logprobs"]
    with torch.no_grad():
        for layer, weight in zip(chunks[0].decoder.layers, new_routers):
            layer.mlp.router.weight.copy_(weight)
    out["free"] = run(batch, None, pack=True, mbs=6)["logprobs"]
    out["update_padded"] = run(replayed, "replay", pack=False, mbs=2, loss=True)["logprobs"]
    out["update_packed"] = run(replayed, "replay", pack=True, mbs=6, loss=True)["logprobs"]
    out["update_budget"] = run(replayed, "replay", pack=True, budget=24, loss=True)["logprobs"]
    return out


@pytest.mark.distributed
def test_routing_recorded_under_one_packing_replays_under_another(model_dir):
    """Packed sequences (THD) and token-budget micro-batches: the routing is kept in the batch's [B, T]
    layout, so every packing records the same experts and replays them at the right tokens."""
    batch = padded_batch(6, 12, seed=31)
    new_routers = _new_routers()
    [r] = run_distributed(_packed_body, 1, model_dir, batch, new_routers, timeout=300)
    mask = batch["attention_mask"].bool()
    _, hf_chosen = _hf_logprobs(model_dir, batch)
    for name in ("padded", "packed", "budget"):
        routed = r[name]["routed_experts"]
        assert routed.shape == (6, 12, LAYERS, TOPK), name
        for layer in range(LAYERS):
            actual = routed[:, :, layer][mask].sort(-1).values
            assert torch.equal(actual, hf_chosen[layer][mask].sort(-1).values), (name, layer)
        k = torch.arange(TOPK).expand(int((~mask).sum()), LAYERS, TOPK)
        assert torch.equal(routed[~mask], k), name  # pads hold 0..K-1 (the module docstring's contract)
    expected = r["packed"]["logprobs"]
    for name in ("same_budget", "same_padded"):  # same weights: the recording pass's log-probs
        torch.testing.assert_close(r[name], expected, rtol=0, atol=ATOL)
    # New routers: each packing of the replayed update equals transformers forced onto the recorded experts.
    forced_expected, _ = _hf_logprobs(model_dir, batch, routers=new_routers, forced=r["packed"]["routed_experts"])
    for name in ("update_padded", "update_packed", "update_budget"):
        torch.testing.assert_close(r[name], forced_expected, rtol=0, atol=ATOL)
    assert (r["free"] - forced_expected).abs().max() > 100 * ATOL  # the replay changed the experts


def _chunks_body(model_dir, pp, vpp, batch, new_routers):
    """Record, swap in ``new_routers`` (by each layer's model-wide number), replay in a training pass."""
    from verl.engine import LossShare
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(moe_enable_routing_replay=True), pg,
                              vpp_size=vpp)
    load_hf_weights(chunks, model_dir, pg=pg)

    def loss_fn(outputs, mb):
        return LossShare(loss=-(outputs["logprobs"] * mb["attention_mask"]).sum() / 100.0)

    recorded = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logprobs", routing="record").outputs
    with torch.no_grad():
        for layer in (layer for chunk in chunks for layer in chunk.decoder.layers):
            layer.mlp.router.weight.copy_(new_routers[layer.layer_number - 1])
    replayed = {**batch, "routed_experts": recorded["routed_experts"]}
    update = forward_backward(chunks, replayed, pg=pg, micro_batch_size=2, output="logprobs", routing="replay",
                              loss_fn=loss_fn)
    return {"routed": recorded["routed_experts"], "logprobs": recorded["logprobs"], "update": update.outputs["logprobs"],
            "chunks": len(chunks)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("layers", "pp", "vpp"), [(4, 2, 2), (3, 2, None)], ids=["pp2-vpp2", "3-layers-on-pp2"])
def test_routing_over_pipeline_chunks_equals_one_stage(tmp_path, layers, pp, vpp):
    """Virtual pipeline chunks and uneven stages: each chunk records and replays its own layers of L; the
    recording and the replayed update equal one rank's."""
    model = make_tiny_model(str(tmp_path / "m"), "qwen3_moe", seed=7, num_hidden_layers=layers)
    batch = padded_batch(4, 12, seed=41)
    gen = torch.Generator().manual_seed(321)
    new_routers = [torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.3 for _ in range(layers)]
    [one] = run_distributed(_chunks_body, 1, model, 1, None, batch, new_routers, timeout=300)
    staged = run_distributed(_chunks_body, pp, model, pp, vpp, batch, new_routers, timeout=300)
    for r in staged:
        assert r["chunks"] == (vpp or 1)
        assert r["routed"].shape == (4, 12, layers, TOPK) and torch.equal(r["routed"], one["routed"])
        torch.testing.assert_close(r["logprobs"], one["logprobs"], rtol=0, atol=ATOL)
        torch.testing.assert_close(r["update"], one["update"], rtol=0, atol=ATOL)
    assert (one["update"] - one["logprobs"]).abs().max() > 100 * ATOL  # the new routers' weights changed the output


def _refusal_body(model_dir, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel()
    spec = parse_hf_config(model_dir)
    messages = []
    plain = build_model_chunks(spec, ModelBuildConfig(), pg)
    replayable = build_model_chunks(spec, ModelBuildConfig(moe_enable_routing_replay=True), pg)
    for chunks, b, kwargs in ((plain, batch, dict(routing="record")), (replayable, batch, dict(routing="replay"))):
        try:
            forward_backward(chunks, b, pg=pg, micro_batch_size=2, output="logprobs", **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.distributed
def test_unsupported_replays_are_refused_with_the_fix(model_dir):
    [messages] = run_distributed(_refusal_body, 1, model_dir, padded_batch(4, 12, seed=3), timeout=300)
    assert len(messages) == 2
    assert "moe_enable_routing_replay" in messages[0]
    assert "needs the batch's 'routed_experts'" in messages[1]


def test_a_dense_model_refuses_routing_replay(tmp_path):
    from verl.models.builder import ModelBuildConfig, transformer_config_from_hf
    from verl.models.hf_config import parse_hf_config

    dense = parse_hf_config(make_tiny_model(str(tmp_path / "d"), "qwen3_tied"))
    with pytest.raises(ValueError, match="moe_enable_routing_replay=true on a dense qwen3 model"):
        transformer_config_from_hf(dense, ModelBuildConfig(moe_enable_routing_replay=True), tp_size=1, pp_size=1)


def test_agreement_counts_the_real_tokens_whose_free_top_k_is_the_replayed_set():
    """A hand-made replay on one ``RouterReplay``: 3 real tokens and a pad, top 2 of 4 experts."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from verl.models import router_replay

    router = RouterReplay()
    router_replay.begin([router], "replay")
    try:
        routed = torch.tensor([[1, 3], [2, 0], [0, 1], [3, 2]]).view(1, 4, 1, 2)  # [b, S, L, K]
        router_replay.set_targets([router], routed, torch.tensor([[1, 1, 1, 0]]))  # the last token is a pad
        scores = torch.tensor([
            [0.0, 5.0, 1.0, 4.0],  # free top 2 = {1, 3}: agrees (another order)
            [3.0, 0.0, 2.0, 1.0],  # {0, 2}: agrees
            [0.0, 2.0, 3.0, 1.0],  # {2, 1}: not the replayed {0, 1}
            [9.0, 8.0, 0.0, 0.0],  # a pad (replayed as 0, 1): not counted
        ])
        probs, indices = router.get_replay_topk(scores, 2, None, None, lambda s, k, **_: torch.topk(s, k, dim=-1))
        assert torch.equal(indices, torch.tensor([[1, 3], [2, 0], [0, 1], [0, 1]]))  # the replay itself is unchanged
        assert torch.equal(probs, scores.gather(1, indices))
        assert router_replay.agreement([router]) == (2.0, 3.0)
        assert router_replay.agreement([router]) == (0.0, 0.0)  # counters reset
    finally:
        router_replay.end([router])
    assert "get_replay_topk" not in vars(router)  # ordinary routing afterwards
