"""Uneven pipeline stages: layer counts that do not divide the pipeline, split automatically or by
the reference verl's keys (``num_layers_in_first_pipeline_stage``/``..._last_...`` in
``megatron.override_transformer_config``).

The split rule (``verl.models.pipeline_split``) is checked against Megatron-core's own offset and
count functions; a 3-layer Qwen3 on PP 2 (automatic [2, 1] and hand-set [1, 2]) against
transformers (logits, log-probs), its push into a transformers model through the reshard plan
(bit-exact), its distributed checkpoint saved at one split and loaded at the other, and the
planners' per-stage layers and parameters against a hand count. Megatron's explicit
``pipeline_model_parallel_layout``: verl's reading of it against Megatron's own, wrong layouts refused
with one line naming the key, and 5 layers on PP 2 x VPP 2 (no first/last split can place them)
through the engine against transformers.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import HFDestination, hf_outputs, make_tiny_model, padded_batch, reference_logprobs_entropy
from verl.testing.distributed import run_distributed

ATOL = 1e-5  # float32 both sides, the same math in another order (the model tests' bound)
VOCAB = 1001


# ----------------------------------------------------------------------------------------------
# the split rule


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "expected"),
    [
        (3, 2, None, [2, 1]),
        (5, 2, None, [3, 2]),
        (28, 8, None, [2, 4, 4, 4, 4, 4, 4, 2]),  # Qwen2.5-7B
        (36, 8, None, [3, 5, 5, 5, 5, 5, 5, 3]),  # Qwen3-8B
        (9, 8, None, [2, 1, 1, 1, 1, 1, 1, 1]),
        (6, 2, 2, [4, 2]),
        (8, 4, None, [2, 2, 2, 2]),  # divides: Megatron's uniform split, no first/last counts
    ],
)
def test_automatic_split_balances_the_stages(layers, pp, vpp, expected):
    from verl.models.pipeline_split import resolve_split

    split = resolve_split(layers, pp, vpp)
    assert split.stage_layers() == expected
    assert split.uneven == (layers % (pp * (vpp or 1)) != 0)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "first", "last", "match"),
    [
        (5, 2, 2, None, None, "no num_layers_in_first_pipeline_stage/num_layers_in_last_pipeline_stage split"),
        (3, 2, None, 0, None, "num_layers_in_first_pipeline_stage=0 must be >= 1"),
        (3, 2, None, 1, 1, "leave 1 layers for 0 middle stages"),
        (10, 4, None, 2, None, "not divisible by 3 middle stages"),
        (6, 2, 2, 3, None, "not divisible by virtual pipeline 2"),
        (4, 1, None, 2, None, "need pipeline_model_parallel_size > 1"),
    ],
)
def test_bad_split_is_refused_naming_the_keys(layers, pp, vpp, first, last, match):
    from verl.models.pipeline_split import resolve_split

    with pytest.raises(ValueError, match=match):
        resolve_split(layers, pp, vpp, first, last)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "first", "last"),
    [(3, 2, None, None, None), (3, 2, None, 1, 2), (10, 4, None, None, None), (10, 4, None, 1, None),
     (11, 4, None, None, 2), (36, 8, None, None, None), (6, 2, 2, None, None), (10, 3, 2, 2, 4),
     (12, 4, 2, None, None)],
)
def test_stage_ranges_equal_megatrons(layers, pp, vpp, first, last):
    """Every chunk's (first layer, count) as Megatron-core computes them from the same config."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from verl.models.pipeline_split import resolve_split

    split = resolve_split(layers, pp, vpp, first, last)
    config = TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, **split.megatron_kwargs(),
    )
    covered = []
    for rank in range(pp):
        for v in range(vpp or 1):
            vp = v if vpp else None
            offset, count = split.chunk_range(rank, vp)
            assert offset == get_transformer_layer_offset(config, vp_stage=vp, pp_rank=rank)
            assert count == get_num_layers_to_build(config, vp_stage=vp, pp_rank=rank)
            covered += range(offset, offset + count)
    assert sorted(covered) == list(range(layers))


def test_planner_counts_each_stages_layers():
    """The memory formula's stages hold the split's layers: 3 Qwen3 layers on PP 2, automatic [2, 1]
    and hand-set [1, 2], parameters counted by hand."""
    from tests.models.test_moe import _config
    from verl.models.hf_config import parse_hf_config
    from verl.planning.memory import MegatronRole, formula_stage_params

    spec = parse_hf_config({**_config("mixtral"), "num_hidden_layers": 3})
    h, e, f = 64, 4, 96
    # One layer: q (2 heads of 32), k and v (2 KV heads), o, two norms, the router, 4 experts' gate/up/down.
    layer = h * (2 + 2 * 2) * 32 + 2 * 32 * h + 2 * h + e * h + e * 3 * h * f
    vocab = 1024 * h  # 1001 padded to vLLM's multiple of 64
    auto = formula_stage_params(spec, MegatronRole(name="actor", tp=1, pp=2))
    assert [s.layers for s in auto] == [2, 1]
    assert [s.params for s in auto] == [2 * layer + vocab, layer + h + vocab]  # final norm, untied head
    hand = formula_stage_params(spec, MegatronRole(name="actor", tp=1, pp=2, first_stage_layers=1, last_stage_layers=2))
    assert [s.layers for s in hand] == [1, 2]
    with pytest.raises(ValueError, match="num_layers_in_first_pipeline_stage=3"):
        formula_stage_params(spec, MegatronRole(name="actor", tp=1, pp=2, first_stage_layers=3))


# ----------------------------------------------------------------------------------------------
# a 3-layer model on PP 2 against transformers


@pytest.fixture(scope="module")
def qwen3_3layers(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("uneven") / "qwen3"), "qwen3_tied", num_hidden_layers=3)


def _pp2_engine(model_dir, overrides, vpp=None):
    """A forward-only Megatron engine on PP 2 (x ``vpp``) with these ``override_transformer_config`` keys."""
    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
    return MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp,
                                override_transformer_config=overrides),
        pg=pg,
    )


def _check_plan_and_push(engine, model_dir, vpp=None):
    """The reshard plan's layout of this rank equals the live chunks (from the split alone); then the
    push into a transformers model (every element overwritten first): its parameters after the push."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from verl.hybrid.layout import check_megatron_layout, megatron_layout
    from verl.hybrid.weight_sync import WeightSync
    from verl.models.builder import unwrap_model

    chunk = unwrap_model(engine.chunks[0])
    check_megatron_layout(
        megatron_layout(chunk.verl_spec, tp=1, tp_rank=0, pp=2, pp_rank=engine.pg.pp.rank(), vpp=vpp,
                        vocab_pad_multiple=None, split=chunk.verl_split),
        engine.chunks, where=f"rank {dist.get_rank()}",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sync = WeightSync(engine, HFDestination(model), bucket_bytes=8 * 1024)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    sync.push()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_body(model_dir, overrides, batch, ckpt_dir):
    from verl.models.builder import unwrap_model

    engine = _pp2_engine(model_dir, overrides)
    chunk = unwrap_model(engine.chunks[0])
    out = engine.forward(batch, micro_batch_size=2, output="logprobs").outputs
    logits = engine.forward(batch, micro_batch_size=2, output="logits").outputs.get("logits")
    pushed = _check_plan_and_push(engine, model_dir)
    if ckpt_dir is not None:
        engine.save(ckpt_dir)
    return {"layers": (chunk.verl_layer_offset, len(chunk.decoder.layers)), "logprobs": out["logprobs"],
            "logits": logits, "pushed": pushed}


def _load_body(model_dir, overrides, batch, ckpt_dir):
    engine = _pp2_engine(model_dir, overrides)
    with torch.no_grad():
        for p in engine.chunks[0].parameters():
            p.zero_()
    engine.load(ckpt_dir, load_optimizer=False)
    return engine.forward(batch, micro_batch_size=2, output="logprobs").outputs["logprobs"]


@pytest.mark.distributed
def test_three_layers_on_pp2_equal_transformers(qwen3_3layers, tmp_path):
    """Automatic [2, 1] and hand-set [1, 2]: logits and log-probs equal transformers', the push into a
    transformers model is bit-exact, and a checkpoint written at [2, 1] loads at [1, 2]."""
    from safetensors.torch import load_file

    model_dir = qwen3_3layers
    batch = padded_batch(4, 12, seed=5)
    expected_logits = hf_outputs(model_dir, batch)
    expected_lp, _ = reference_logprobs_entropy(expected_logits, batch["input_ids"], batch["attention_mask"])
    hf = load_file(f"{model_dir}/model.safetensors")
    mask = batch["attention_mask"].bool()
    ckpt = str(tmp_path / "ckpt")
    hand = {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 2}
    for overrides, stages, save in (({}, [(0, 2), (2, 1)], ckpt), (hand, [(0, 1), (1, 2)], None)):
        results = run_distributed(_engine_body, 2, model_dir, overrides, batch, save, timeout=300)
        assert [r["layers"] for r in results] == stages
        torch.testing.assert_close(results[-1]["logits"][..., :VOCAB][mask], expected_logits[mask], rtol=0, atol=ATOL)
        for r in results:
            torch.testing.assert_close(r["logprobs"], expected_lp, rtol=0, atol=ATOL)
            for name, tensor in r["pushed"].items():
                # lm_head is tied to the embedding: transformers names it once
                assert torch.equal(tensor, hf[name]), name
    loaded = run_distributed(_load_body, 2, model_dir, hand, batch, ckpt, timeout=300)
    for lp in loaded:
        torch.testing.assert_close(lp, expected_lp, rtol=0, atol=ATOL)


def test_engine_refuses_a_bad_hand_split_before_building(qwen3_3layers):
    from verl.models.builder import split_problems
    from verl.models.hf_config import parse_hf_config

    problems = split_problems(parse_hf_config(qwen3_3layers), tp_size=1, pp_size=2, first_stage_layers=2,
                              last_stage_layers=2)
    assert len(problems) == 1 and "num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2" in problems[0]


def _interleaved_body(model_dir, batch):
    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.models.checkpoint import load_hf_weights
    from verl.models.forward import forward_backward
    from verl.models.hf_config import parse_hf_config
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    chunks = build_model_chunks(parse_hf_config(model_dir), ModelBuildConfig(), pg, vpp_size=2)
    load_hf_weights(chunks, model_dir, pg=pg)
    result = forward_backward(chunks, batch, pg=pg, micro_batch_size=2, output="logprobs")
    return [(c.verl_layer_offset, len(c.decoder.layers)) for c in chunks], result.outputs["logprobs"]


@pytest.mark.distributed
def test_six_layers_on_pp2_vpp2_equal_transformers(tmp_path):
    """6 layers on PP 2 x VPP 2 (uneven: [4, 2], chunks of 2 and 1 layers) through the interleaved schedule."""
    model_dir = make_tiny_model(str(tmp_path / "hf"), "llama3", num_hidden_layers=6)
    batch = padded_batch(4, 12, seed=9)
    results = run_distributed(_interleaved_body, 2, model_dir, batch, timeout=300)
    # virtual chunk 0 of both stages (layers 0-1 | 2), then chunk 1 (layers 3-4 | 5)
    assert [r[0] for r in results] == [[(0, 2), (3, 2)], [(2, 1), (5, 1)]]
    expected, _ = reference_logprobs_entropy(hf_outputs(model_dir, batch), batch["input_ids"], batch["attention_mask"])
    for _, logprobs in results:
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=ATOL)


def test_dry_run_builds_the_uneven_stages():
    """The dry run's meta-device stages hold the split's layers and equal the formulas (3 layers on PP 2,
    automatic and by hand); Qwen2.5-7B's 28 layers on PP 8 plan as [2, 4, ..., 4, 2]."""
    from verl.models.hf_config import parse_hf_config
    from verl.planning.dry_run import measure_stage_params
    from verl.planning.inputs import load_spec
    from verl.planning.memory import MegatronRole, PlanInputs, RolloutSetup, formula_stage_params

    spec = parse_hf_config({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    })
    roles = (MegatronRole(name="actor", tp=1, pp=2),
             MegatronRole(name="ref", tp=1, pp=2, trains=False, first_stage_layers=1, last_stage_layers=2))
    inputs = PlanInputs(spec=spec, world_size=2, gpus_per_node=2, seq_len=64, response_len=32, roles=roles,
                        rollout=RolloutSetup(tp=1, sequences=8))
    measured = measure_stage_params(inputs)
    assert [s.layers for s in measured["actor"]] == [2, 1] and [s.layers for s in measured["ref"]] == [1, 2]
    for role in roles:
        assert measured[role.name] == formula_stage_params(spec, role), role.name
    qwen7b = formula_stage_params(load_spec("qwen2_7b"), MegatronRole(name="actor", tp=1, pp=8))
    assert [s.layers for s in qwen7b] == [2, 4, 4, 4, 4, 4, 4, 2]


# ----------------------------------------------------------------------------------------------
# Megatron's explicit pipeline_model_parallel_layout: 5 layers on PP 2 x VPP 2


LAYOUT_5 = "Et|tt|t|tL"  # chunk 0 of stages 0, 1 (layers 0 | 1-2), then chunk 1 (layer 3 | 4)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "layout"),
    [(5, 2, 2, LAYOUT_5), (5, 2, 2, "E(t|)*3ttL"), (7, 2, None, "Ettt|ttttL"), (9, 4, 2, "Et|(t|)*6ttL"),
     (5, 2, 2, [["embedding", "decoder"], ["decoder", "decoder"], ["decoder"], ["decoder", "loss"]])],
)
def test_layout_ranges_equal_megatrons(layers, pp, vpp, layout):
    """Every chunk's (first layer, count) from verl's reading of the layout equals Megatron-core's
    ``PipelineParallelLayerLayout`` built by its ``TransformerConfig`` from the same string/list."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl.models.pipeline_split import normalize_layout, resolve_split

    split = resolve_split(layers, pp, vpp, layout=normalize_layout(layout))
    config = TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, **split.megatron_kwargs(),
    )
    megatron_layout = config.pipeline_model_parallel_layout
    # Megatron's layout reads the virtual size from parallel_state (set by verl's bootstrap in a run).
    saved = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        covered = []
        for rank in range(pp):
            for v in range(vpp or 1):
                vp = v if vpp else None
                offset, count = split.chunk_range(rank, vp)
                assert offset == megatron_layout.get_layer_offset(vp_stage=vp, pp_rank=rank)
                assert count == megatron_layout.get_num_layers_to_build(vp_stage=vp, pp_rank=rank)
                covered += range(offset, offset + count)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(saved)
    assert sorted(covered) == list(range(layers))


@pytest.mark.parametrize(
    ("layout", "first", "match"),
    [
        ("Et|tt|ttL", None, "has 3 stages, not 4"),
        ("tE|tt|t|tL", None, "the embedding E must open the first stage"),
        ("Et|tt|tL|t", None, "the loss L must close the last stage"),
        ("Et|tt|t|ttL", None, "places 6 decoder layers"),
        ("Et|ttt||tL", None, "chunk 2 holds no decoder layer"),
        ("Et|tt|m|tL", None, r"has \['m'\]"),
        ("Et|(tt|t|tL", None, "unbalanced"),
        (LAYOUT_5, 1, "pipeline_model_parallel_layout and num_layers_in_first_pipeline_stage"),
    ],
)
def test_a_wrong_layout_is_refused_naming_the_key(layout, first, match):
    from verl.models.pipeline_split import resolve_split

    with pytest.raises(ValueError, match=match) as info:
        resolve_split(5, 2, 2, first, None, layout)
    assert "pipeline_model_parallel_layout" in str(info.value) and "\n" not in str(info.value)


def test_a_wrong_layout_is_refused_by_the_builder_and_the_engine_before_building():
    """One message from the builder's pre-check and from the engine (``override_transformer_config``),
    with no model built (the engine's check runs before the process groups are touched)."""
    from tests.models.test_moe import _config
    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.models.builder import ModelBuildConfig, split_problems
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config({**_config("mixtral"), "num_hidden_layers": 5})
    [problem] = split_problems(spec, tp_size=1, pp_size=2, vpp_size=2, pipeline_layout="Et|tt|ttL")
    assert "pipeline_model_parallel_layout='Et|tt|ttL' has 3 stages, not 4" in problem
    assert split_problems(spec, tp_size=1, pp_size=2, vpp_size=2, pipeline_layout=LAYOUT_5) == []
    with pytest.raises(ValueError, match="pipeline_model_parallel_layout"):
        ModelBuildConfig(pipeline_model_parallel_layout=[["embedding", "decoder", "attention"]])
    with pytest.raises(ValueError, match="not applied by verl's model builder"):
        MegatronEngine(model=ModelConfig(path="unused"), pg=None,
                       megatron=MegatronConfig(override_transformer_config={"pipeline_layout": LAYOUT_5}))


def test_planners_follow_the_layout():
    """The memory formulas and the dry run's meta-device build hold the layout's layers per stage."""
    from verl.models.hf_config import parse_hf_config
    from verl.planning.dry_run import measure_stage_params
    from verl.planning.memory import MegatronRole, PlanInputs, RolloutSetup, formula_stage_params

    spec = parse_hf_config({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    })
    role = MegatronRole(name="actor", tp=1, pp=2, vpp=2, pipeline_layout=LAYOUT_5)
    assert [s.layers for s in formula_stage_params(spec, role)] == [2, 3]
    inputs = PlanInputs(spec=spec, world_size=2, gpus_per_node=2, seq_len=64, response_len=32, roles=(role,),
                        rollout=RolloutSetup(tp=1, sequences=8))
    measured = measure_stage_params(inputs)
    assert [s.layers for s in measured["actor"]] == [2, 3]
    assert measured["actor"] == formula_stage_params(spec, role)


def _layout_body(model_dir, batch, ckpt_dir):
    from verl.models.builder import unwrap_model

    engine = _pp2_engine(model_dir, {"pipeline_model_parallel_layout": LAYOUT_5}, vpp=2)
    out = engine.forward(batch, micro_batch_size=2, output="logprobs").outputs
    pushed = _check_plan_and_push(engine, model_dir, vpp=2)
    engine.save(ckpt_dir)
    chunks = [unwrap_model(c) for c in engine.chunks]
    return {"layers": [(c.verl_layer_offset, len(c.decoder.layers)) for c in chunks], "logprobs": out["logprobs"],
            "pushed": pushed}


@pytest.mark.distributed
def test_five_layers_on_pp2_vpp2_by_layout_equal_transformers(tmp_path):
    """5 layers on PP 2 x VPP 2 (no first/last split can place them) by Megatron's explicit layout in
    ``override_transformer_config``: the interleaved schedule's log-probs equal transformers', the
    reshard plan's layout equals the live chunks, the push into transformers is bit-exact, and the
    checkpoint saved under the layout loads at PP 2 without VPP."""
    from safetensors.torch import load_file

    model_dir = make_tiny_model(str(tmp_path / "hf"), "qwen3_untied", num_hidden_layers=5)
    batch = padded_batch(4, 12, seed=9)
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_layout_body, 2, model_dir, batch, ckpt, timeout=300)
    assert [r["layers"] for r in results] == [[(0, 1), (3, 1)], [(1, 2), (4, 1)]]
    expected, _ = reference_logprobs_entropy(hf_outputs(model_dir, batch), batch["input_ids"], batch["attention_mask"])
    hf = load_file(f"{model_dir}/model.safetensors")
    for r in results:
        torch.testing.assert_close(r["logprobs"], expected, rtol=0, atol=ATOL)
        assert set(r["pushed"]) == set(hf)
        for name, tensor in r["pushed"].items():
            assert torch.equal(tensor, hf[name]), name
    # PP 2 without VPP: the automatic [3, 2]
    for logprobs in run_distributed(_load_body, 2, model_dir, {}, batch, ckpt, timeout=300):
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=ATOL)
