"""Mixture-of-Experts (Qwen3-MoE, Mixtral, Qwen2-MoE) through Megatron-core's MoE layers, against transformers.

Tiny models: 4 experts, top 2, every layer sparse, a vocabulary of 1001; Qwen3-MoE with and without
renormalised top-k weights (``norm_topk_prob``), Mixtral (softmax over the top k), Qwen2-MoE (plus a
gated shared expert, split over TP; more in test_qwen2_moe.py). Layouts: one rank, expert parallel
1 and 2, TP 2 + SP, EP 2 x TP 2 (+SP) and PP 2 x EP 2 (4 ranks, marked slow).

Tolerances: float32 on both sides; routing picks the same experts (the routers' logits are spread
so that no two experts nearly tie) and the rest is the same math in another order: ~3e-7 measured
on logits. 1e-5 absolute (the issue's bound) catches a wrong expert or weight (>1e-2). Exports
and weight pushes only move bytes: exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.models.tiny import FAMILIES, HFDestination, hf_outputs, make_tiny_model, padded_batch, reference_logprobs_entropy
from verl.testing.distributed import run_distributed

ATOL = 1e-5
VOCAB = 1001
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_unnormalized", "mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: make_tiny_model(str(root / family), family, seed=7) for family in MOE_FAMILIES}


def _config(family: str, **changes) -> dict:
    from transformers import AutoConfig

    settings = dict(FAMILIES[family])
    model_type = settings.pop("model_type")
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2)
    cfg = AutoConfig.for_model(model_type, **{**base, **settings}).to_dict()
    cfg.update(changes)
    return cfg


def test_config_parses_experts_and_routing():
    from verl.models.hf_config import parse_hf_config

    qwen = parse_hf_config(_config("qwen3_moe"))
    assert (qwen.num_experts, qwen.moe_topk, qwen.moe_intermediate_size) == (4, 2, 48)
    assert qwen.is_moe and qwen.qk_layernorm and qwen.moe_renormalize and qwen.router_aux_loss_coef == 0.01
    assert not parse_hf_config(_config("qwen3_moe_unnormalized")).moe_renormalize
    # The hub's Qwen3-MoE configs name the expert count num_experts (transformers 5 writes num_local_experts).
    legacy = _config("qwen3_moe")
    legacy["num_experts"] = legacy.pop("num_local_experts", None) or 4
    assert parse_hf_config(legacy).num_experts == 4
    mixtral = parse_hf_config(_config("mixtral"))
    assert mixtral.moe_intermediate_size == 96 and mixtral.moe_renormalize and not mixtral.qk_layernorm


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_unsupported_moe_features_name_the_field(family, change, field):
    from verl.models.hf_config import parse_hf_config

    with pytest.raises(ValueError, match=f"field '{field}'"):
        parse_hf_config(_config(family, **change))


def test_weight_names_match_the_saved_checkpoints(models):
    from verl.models.hf_config import parse_hf_config
    from verl.models.safetensors_io import SafetensorsReader
    from verl.models.weight_mapping import hf_param_names

    for family, model_dir in models.items():
        assert set(hf_param_names(parse_hf_config(model_dir))) == set(SafetensorsReader(model_dir).names()), family


def test_megatron_moe_settings_route_as_transformers_and_weigh_the_aux_loss():
    from verl.models.builder import ModelBuildConfig, moe_config_kwargs
    from verl.models.hf_config import parse_hf_config

    qwen = parse_hf_config(_config("qwen3_moe"))
    kwargs = moe_config_kwargs(qwen, ModelBuildConfig(), ep_size=2)
    assert kwargs["moe_router_pre_softmax"] is False and kwargs["moe_aux_loss_coeff"] == 0.01
    assert kwargs["moe_router_load_balancing_type"] == "aux_loss" and kwargs["expert_model_parallel_size"] == 2
    off = moe_config_kwargs(qwen, ModelBuildConfig(moe_aux_loss_coeff=0.0), ep_size=1)
    assert off["moe_router_load_balancing_type"] == "none" and off["moe_aux_loss_coeff"] == 0.0
    assert moe_config_kwargs(parse_hf_config(_config("qwen3_moe_unnormalized")), ModelBuildConfig(), ep_size=1)[
        "moe_router_pre_softmax"
    ]


def _lm_body(model_dir, tp, pp, ep, sp, batch):
    import torch.distributed as dist

    from verl.models.builder import ModelBuildConfig, build_model_chunks, verify_model_matches_spec
    from verl.models.checkpoint import iter_hf_weights, load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    spec = parse_hf_config(model_dir)
    chunks = build_model_chunks(spec, ModelBuildConfig(sequence_parallel=sp), pg)
    for chunk in chunks:
        verify_model_matches_spec(chunk, pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    logits = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logits").outputs["logits"]
    logprobs = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logprobs").outputs
    exported = dict(iter_hf_weights(chunks, pg=pg))  # this stage's tensors, experts gathered over EP
    local_experts = sum(1 for n, _ in chunks[0].named_parameters() if n.startswith("decoder.layers.0.mlp.experts."))
    return {"rank": dist.get_rank(), "tp_rank": pg.tp.rank(), "logits": logits, **logprobs,
            "exported": exported, "local_experts": local_experts}


LAYOUTS = [  # family, world, tp, pp, ep, sp
    pytest.param("qwen3_moe", 2, 1, 1, 1, False, id="qwen3_moe-ep1-dp2"),
    pytest.param("qwen3_moe", 2, 1, 1, 2, False, id="qwen3_moe-ep2"),
    pytest.param("qwen3_moe_unnormalized", 2, 1, 1, 2, False, id="qwen3_moe-unnormalized-ep2"),
    pytest.param("mixtral", 2, 1, 1, 2, False, id="mixtral-ep2"),
    pytest.param("qwen3_moe", 4, 2, 1, 2, True, id="qwen3_moe-ep2-tp2-sp", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 4, 1, 2, 2, False, id="qwen3_moe-pp2-ep2", marks=pytest.mark.slow),
    pytest.param("mixtral", 4, 2, 1, 2, True, id="mixtral-ep2-tp2-sp", marks=pytest.mark.slow),
    pytest.param("mixtral", 4, 1, 2, 2, False, id="mixtral-pp2-ep2", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 1, 1, 1, 1, False, id="qwen2_moe-one-rank"),
    pytest.param("qwen2_moe", 2, 1, 1, 2, False, id="qwen2_moe-ep2"),
    pytest.param("qwen2_moe", 2, 2, 1, 1, True, id="qwen2_moe-tp2-sp"),  # the shared expert split over TP
    pytest.param("qwen2_moe", 4, 2, 1, 2, True, id="qwen2_moe-ep2-tp2-sp", marks=pytest.mark.slow),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "world", "tp", "pp", "ep", "sp"), LAYOUTS)
def test_logits_logprobs_and_export_match_transformers(models, family, world, tp, pp, ep, sp):
    from verl.models.safetensors_io import SafetensorsReader

    model_dir = models[family]
    batch = padded_batch(4, 12, seed=2)
    results = run_distributed(_lm_body, world, model_dir, tp, pp, ep, sp, batch, timeout=300)
    expected_logits = hf_outputs(model_dir, batch)  # [B, T, V]
    expected_lp, expected_ent = reference_logprobs_entropy(expected_logits, batch["input_ids"], batch["attention_mask"])
    mask = batch["attention_mask"].bool()
    last = [r for r in results if r["rank"] >= world - tp]  # the last stage's TP ranks (rank order: tp, ep/dp, pp)
    shards = {r["tp_rank"]: r["logits"] for r in last}
    actual_logits = torch.cat([shards[i] for i in range(tp)], dim=-1)
    torch.testing.assert_close(actual_logits[..., :VOCAB][mask], expected_logits[mask], rtol=0, atol=ATOL)
    reader = SafetensorsReader(model_dir)
    exported = {}
    for r in results:
        assert r["local_experts"] == 2 * 4 // ep  # linear_fc1 and linear_fc2 of each local expert
        torch.testing.assert_close(r["logprobs"], expected_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(r["entropy"], expected_ent, rtol=0, atol=ATOL)
        exported.update(r["exported"])
    assert set(exported) == set(reader.names())
    for name, tensor in exported.items():
        assert torch.equal(tensor, reader.read(name)), name


def _engine_body(model_dir, ep, batches, aux_coeff):
    import torch.distributed as dist

    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.hybrid.weight_sync import WeightSync
    from verl.parallel import megatron_state as ms
    from verl.rollout.hf_engine import hf_response_logprobs

    pg = ms.initialize_model_parallel(expert_model_parallel_size=ep, seed=3)
    actor = MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(override_transformer_config={"moe_aux_loss_coeff": aux_coeff}),
        pg=pg, optim=OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0), total_training_steps=4,
    )
    batch = batches[dist.get_rank()]
    info = GlobalBatchInfo.from_masks([batch["attention_mask"].float()], group=pg.dp)

    def loss_fn(outputs, mb):
        return LossShare(agg_loss(-outputs["logprobs"], mb["attention_mask"].float(), "token-mean",
                                  global_batch_info=info))

    step = actor.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    after = actor.forward(batch, micro_batch_size=2, output="logprobs").outputs["logprobs"]

    # The updated weights into a transformers engine (its fused experts), bit-exactly.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    sync = WeightSync(actor, HFDestination(model), bucket_bytes=8 * 1024)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(7.0)
    sync.push()
    untouched = sum(int((p == 7.0).sum()) for p in params.values())
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        engine_lp = hf_response_logprobs(model, batch["input_ids"], batch["attention_mask"], positions,
                                         response_length=batch["input_ids"].shape[1] - 1).float()
    return {"loss": step.loss, "grad_norm": step.grad_norm, "after": after, "engine_lp": engine_lp,
            "untouched": untouched, "fused": sorted(k for k in sync.destination.shapes if "experts" in k)}


@pytest.mark.distributed
def test_engine_step_at_ep2_equals_ep1_and_pushes_into_transformers(models):
    """A training step (Adam, clipping) gives the same loss, gradient norm and new weights at EP 2 as at
    EP 1; the router's load-balancing loss is in the gradient when its coefficient is set; the new
    weights reach a transformers model's fused experts exactly (its logprobs equal the actor's)."""
    model_dir = models["qwen3_moe"]
    batches = [padded_batch(4, 12, seed=10 + r) for r in range(2)]
    ep1 = run_distributed(_engine_body, 2, model_dir, 1, batches, 0.5, timeout=300)
    ep2 = run_distributed(_engine_body, 2, model_dir, 2, batches, 0.5, timeout=300)
    no_aux = run_distributed(_engine_body, 2, model_dir, 1, batches, 0.0, timeout=300)
    for a, b, c, batch in zip(ep1, ep2, no_aux, batches):
        # Same math per expert, reduced over other groups: rounding only (measured ~1e-7).
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
        torch.testing.assert_close(b["after"], a["after"], rtol=0, atol=ATOL)
        # The aux loss leaves the step's loss (the policy's) alone and changes the gradient.
        assert abs(c["loss"] - a["loss"]) < 1e-6 and abs(c["grad_norm"] - a["grad_norm"]) > 1e-4
        assert b["untouched"] == 0 and b["fused"]  # every element of the transformers model was written
        # transformers' float32 kernels against Megatron's: rounding (the rollout tests' 1e-4).
        mask = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).float()
        torch.testing.assert_close(b["engine_lp"] * mask, b["after"][:, 1:] * mask, rtol=0, atol=1e-4)


def _save_body(model_dir, ckpt_dir, tp, ep):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights, save_checkpoint
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(), pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    save_checkpoint(chunks, ckpt_dir, pg=pg, hf_dir=model_dir)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "tp", "ep"),
    [("qwen3_moe", 1, 2), ("mixtral", 1, 2), ("qwen2_moe", 1, 2), ("qwen2_moe", 2, 1)],
    ids=["qwen3_moe-ep2", "mixtral-ep2", "qwen2_moe-ep2", "qwen2_moe-tp2"],
)
def test_megatron2hf_reads_a_checkpoint_written_at_ep2(models, family, tp, ep, tmp_path):
    """A distributed checkpoint written by 2 ranks (expert parallel: each its half of the experts; or
    Qwen2-MoE's shared expert over TP) comes back as the Hugging Face checkpoint bit-exactly
    (tools/megatron2hf.py's function), and loads in transformers as the same class."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from verl.models.convert import megatron_to_hf
    from verl.models.safetensors_io import SafetensorsReader

    model_dir = models[family]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_distributed(_save_body, 2, model_dir, ckpt, tp, ep, timeout=300)
    megatron_to_hf(megatron_dir=ckpt, out_dir=out, progress=False)
    reader = SafetensorsReader(model_dir)
    written = {k: v for f in sorted(os.listdir(out)) if f.endswith(".safetensors")
               for k, v in load_file(os.path.join(out, f)).items()}
    assert set(written) == set(reader.names())
    for name, tensor in written.items():
        assert torch.equal(tensor, reader.read(name)), name
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == type(
        AutoModelForCausalLM.from_pretrained(model_dir)).__name__


def _device_body(model_dir, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel
    from verl.testing.distributed import rank_device

    pg = initialize_model_parallel()
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(), pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    on_device = {k: v.to(rank_device()) for k, v in batch.items()}
    out = forward_backward(chunks, on_device, pg=pg, micro_batch_size=2, output="logprobs").outputs
    return {k: v.float().cpu() for k, v in out.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_one_rank_on_the_device_matches_transformers(models, family):
    """One rank on this machine's device (CUDA under tools/gpu_check.sh: Megatron's MoE layers without
    Transformer Engine, the router's matmul path; Qwen2-MoE's shared-expert gate, which megatron-core
    0.16.1 creates on the CPU and the builder moves), float32, against transformers on CPU."""
    model_dir = models[family]
    batch = padded_batch(4, 12, seed=4)
    [actual] = run_distributed(_device_body, 1, model_dir, batch, timeout=300)
    expected, _ = reference_logprobs_entropy(hf_outputs(model_dir, batch), batch["input_ids"],
                                                   batch["attention_mask"])
    # CUDA's float32 matmuls (TF32 off by default in torch) against CPU's: rounding only.
    torch.testing.assert_close(actual["logprobs"], expected, rtol=0, atol=1e-4)


def _value_body(model_dir, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(expert_model_parallel_size=2)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(head="value"), pg)
    load_hf_weights(chunks, model_dir, pg=pg)
    return forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="values").outputs["values"]


@pytest.mark.distributed
def test_value_head_on_experts_at_ep2_matches_sequence_classification(tmp_path):
    """A critic (value head) on a Qwen3-MoE trunk with its experts over 2 ranks: per-token values equal
    transformers' Qwen3MoeForSequenceClassification scores."""
    model_dir = make_tiny_model(str(tmp_path / "scores"), "qwen3_moe", seed=3, sequence_classification=True)
    batch = padded_batch(4, 12, seed=6)
    results = run_distributed(_value_body, 2, model_dir, batch, timeout=300)
    expected = hf_outputs(model_dir, batch, sequence_classification=True).squeeze(-1)  # [B, T]
    mask = batch["attention_mask"].bool()
    for values in results:
        torch.testing.assert_close(values[mask], expected[mask], rtol=0, atol=ATOL)


def _two_depths_body(shallow, deep, batch):
    """A training pass of a 2-layer MoE model, then of a 3-layer one, in one process (an actor and a deeper
    critic, or a test worker that trained another model before)."""
    from verl.engine import LossShare
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel()
    losses = []
    for model_dir in (shallow, deep):
        chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(), pg)
        load_hf_weights(chunks, model_dir, pg=pg)
        result = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logprobs",
                                  loss_fn=lambda out, mb: LossShare(loss=-(out["logprobs"] * mb["attention_mask"]).sum()))
        losses.append(float(sum(result.losses)))
    return losses


@pytest.mark.distributed
def test_moe_models_of_different_depths_train_in_one_process(tmp_path):
    """megatron-core's process-wide load-balancing-loss tracker is sized by the first MoE model trained;
    verl empties it before each training pass (``verl.models.forward``), else the deeper model's third layer
    indexes past it (IndexError)."""
    shallow = make_tiny_model(str(tmp_path / "two"), "qwen3_moe", seed=3)
    deep = make_tiny_model(str(tmp_path / "three"), "qwen3_moe", seed=3, num_hidden_layers=3)
    [losses] = run_distributed(_two_depths_body, 1, shallow, deep, padded_batch(4, 12, seed=8), timeout=300)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
