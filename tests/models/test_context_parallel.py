"""Context parallelism on the Megatron engine: CP 2 gives CP 1's numbers.

The same rollout-shaped batch (prompts left-padded, responses right-padded, uneven lengths, one
row empty) through ``MegatronEngine`` at CP 1 and CP 2 (and TP 2 x CP 2 against TP 2, also with
sequence parallel and packed sequences; DP 2 x CP 2 and PP 2 x CP 2 against one rank), padded rows
and packed (THD) sequences: logits,
log-probabilities and entropy of a forward pass, then one Adam step of a token-mean loss over
log-probabilities and entropy: its loss, gradient norm, every parameter's gradient (Megatron's
``main_grad`` after the all-reduce over the data-and-context-parallel group) and every weight after
the step, for a llama3 (rope scaling) and a Mistral whose sliding window is shorter than the rows.

Tolerances: 1e-5 absolute on outputs, gradients and weights (the issue's bar): the same math in
another order of float32 sums (attention over gathered keys, the gradient reduction over CP);
measured below 1e-6 on every output and gradient. Adam's first step moves a weight by about
``lr`` times the sign of its gradient, so ``lr`` is 1e-3 and gradients that are rounding noise
(|g| < 1e-7 at either layout) are left out of the weights' comparison. A wrong chunk, a mask or
rotary position taken from local instead of global positions, or a gradient summed twice is off by
far more (O(0.01-1) on log-probabilities; a factor 2 on gradients).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_packed_sequences import rollout_batch
from tests.models.tiny import make_tiny_model
from verl.testing.distributed import run_distributed

ATOL = 1e-5
LR = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_models")
    return {family: make_tiny_model(str(root / family), family) for family in ("llama3", "mistral")}


def _engine_body(model_dir: str, tp: int, cp: int, batch: dict, pack: bool = False, sp: bool = False, pp: int = 1):
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.models.builder import unwrap_model
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp, seed=7
    )
    engine = MegatronEngine(
        model=ModelConfig(path=model_dir, use_remove_padding=pack),
        megatron=MegatronConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                                pipeline_model_parallel_size=pp),
        pg=pg,
        optim=OptimConfig(optimizer="adam", lr=LR, clip_grad=0.0, weight_decay=0.0),
        total_training_steps=10,
    )
    rows = batch["input_ids"].shape[0] // pg.dp.size()  # each data-parallel rank its share of the rows
    batch = {k: v[pg.dp.rank() * rows : (pg.dp.rank() + 1) * rows] for k, v in batch.items()}
    out = engine.forward(batch, micro_batch_size=3, output="logprobs", with_entropy=True).outputs
    logits = engine.forward(batch, micro_batch_size=3, output="logits").outputs["logits"]
    mask = batch["attention_mask"].float()
    info = GlobalBatchInfo.from_masks([mask], group=pg.dp)

    def loss_fn(outputs, micro):
        m = micro["attention_mask"].float()
        loss = agg_loss(-outputs["logprobs"] + 0.1 * outputs["entropy"], m, "token-mean", global_batch_info=info)
        return LossShare(loss)

    step = engine.train_step(batch, micro_batch_size=3, loss_fn=loss_fn, with_entropy=True)
    chunk = unwrap_model(engine.chunks[0])
    offset = chunk.verl_layer_offset

    def single_stage_name(name: str) -> str:  # decoder.layers.<i>. of this stage -> of the whole model
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + offset)
        return ".".join(parts)

    grads = {name: p.main_grad.detach().clone() for name, p in chunk.named_parameters()}
    weights = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    return {
        "tp_rank": pg.tp.rank(),
        "cp_rank": pg.cp.rank(),
        "rows": (pg.dp.rank() * rows, (pg.dp.rank() + 1) * rows),
        "pp_rank": pg.pp.rank(),
        "logprobs": out["logprobs"],
        "entropy": out["entropy"],
        "logits": logits,
        "loss": step.loss,
        "grad_norm": step.grad_norm,
        "grads": grads,
        "weights": weights,
        "stage_names": {name: single_stage_name(name) for name in grads},
    }


def _max_diffs(expected: dict, actual: dict) -> dict[str, float]:
    lo, hi = actual["rows"]
    diffs = {k: (actual[k] - expected[k][lo:hi]).abs().max().item() for k in ("logprobs", "entropy", "logits")}
    names = actual["stage_names"]  # this pipeline stage's parameters, by the single-stage model's names
    diffs["grads"] = max((actual["grads"][n] - expected["grads"][names[n]]).abs().max().item() for n in names)
    noise = {n: (expected["grads"][names[n]].abs() < 1e-7) | (actual["grads"][n].abs() < 1e-7) for n in names}
    diffs["weights"] = max(
        ((actual["weights"][n] - expected["weights"][names[n]]).abs() * ~noise[n]).max().item() for n in names
    )
    return diffs


def _check(reference: list[dict], results: list[dict]) -> dict[str, float]:
    by_tp = {r["tp_rank"]: r for r in reference}
    worst: dict[str, float] = {}
    for r in results:
        expected = by_tp[r["tp_rank"]]
        assert r["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-7)
        assert r["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        for key, diff in _max_diffs(expected, r).items():
            assert diff <= ATOL, f"tp rank {r['tp_rank']} cp rank {r['cp_rank']}: max |CP2 - CP1| of {key} = {diff:.3g}"
            worst[key] = max(worst.get(key, 0.0), diff)
    return worst


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_cp2_equals_cp1(models, family, pack):
    batch = rollout_batch(6)
    (reference,) = run_distributed(_engine_body, 1, models[family], 1, 1, batch, pack)
    worst = _check([reference], run_distributed(_engine_body, 2, models[family], 1, 2, batch, pack))
    print(f"{family} {'packed' if pack else 'padded'} CP2 vs CP1 max abs diffs: {worst}")


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sp, pack", [(False, False), (True, True)], ids=["padded", "sp-packed"])
def test_tp2_cp2_equals_tp2(models, sp, pack):
    batch = rollout_batch(6)
    reference = run_distributed(_engine_body, 2, models["llama3"], 2, 1, batch, pack, sp)
    worst = _check(reference, run_distributed(_engine_body, 4, models["llama3"], 2, 2, batch, pack, sp))
    print(f"TP2xCP2 {'SP packed' if sp else 'padded'} vs TP2 max abs diffs: {worst}")


def _checkpoint_body(model_dir: str, scores_dir: str, cp: int, root: str, batch: dict, load_from: str | None):
    """One Adam step (or, with ``load_from``, a checkpoint written at another CP size), then a save, an
    HF export and one more step; a critic's values besides."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(context_parallel_size=cp, seed=7)
    megatron = MegatronConfig(context_parallel_size=cp)
    optim = OptimConfig(optimizer="adam", lr=LR, clip_grad=0.0, weight_decay=0.0)
    engine = MegatronEngine(model=ModelConfig(path=model_dir), megatron=megatron, pg=pg, optim=optim,
                            total_training_steps=10)
    info = GlobalBatchInfo.from_masks([batch["attention_mask"].float()], group=pg.dp)

    def loss_fn(outputs, micro):
        return LossShare(agg_loss(-outputs["logprobs"], micro["attention_mask"].float(), "token-mean", global_batch_info=info))

    if load_from is None:
        engine.train_step(batch, micro_batch_size=3, loss_fn=loss_fn)
        engine.save(f"{root}/ckpt-cp{cp}")
        engine.export_hf(f"{root}/export-cp{cp}")
    else:
        engine.load(load_from)
    after = engine.train_step(batch, micro_batch_size=3, loss_fn=loss_fn)
    critic = MegatronEngine(model=ModelConfig(path=scores_dir), megatron=megatron, pg=pg, head="value")
    values = critic.forward(batch, micro_batch_size=3, output="values").outputs["values"]
    return {"loss": after.loss, "grad_norm": after.grad_norm, "values": values}


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_checkpoints_exports_and_values_are_unchanged_by_cp(models, tmp_path):
    """CP ranks hold the same weights: a checkpoint saved at CP 2 resumes at CP 1 (and back) to the same next
    step, the HF export equals CP 1's, and a critic's values equal CP 1's."""
    import glob

    from safetensors.torch import load_file

    from tests.models.tiny import make_tiny_model

    scores = make_tiny_model(str(tmp_path / "scores"), "qwen2_untied", sequence_classification=True)
    batch, root, model = rollout_batch(6), str(tmp_path), models["llama3"]
    (cp1,) = run_distributed(_checkpoint_body, 1, model, scores, 1, root, batch, None)
    cp2 = run_distributed(_checkpoint_body, 2, model, scores, 2, root, batch, None)
    (cp1_from_cp2,) = run_distributed(_checkpoint_body, 1, model, scores, 1, root, batch, f"{root}/ckpt-cp2")
    cp2_from_cp1 = run_distributed(_checkpoint_body, 2, model, scores, 2, root, batch, f"{root}/ckpt-cp1")
    for actual in (*cp2, cp1_from_cp2, *cp2_from_cp1):
        assert actual["loss"] == pytest.approx(cp1["loss"], rel=1e-6)
        assert actual["grad_norm"] == pytest.approx(cp1["grad_norm"], rel=1e-5)
        torch.testing.assert_close(actual["values"], cp1["values"], rtol=0, atol=ATOL)
    expected = load_file(f"{root}/export-cp1/model.safetensors")
    actual = {}
    for path in sorted(glob.glob(f"{root}/export-cp2/*.safetensors")):
        actual.update(load_file(path))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["dp2-cp2", "pp2-cp2"])
def test_dp2_or_pp2_with_cp2_equals_one_rank(models, layout):
    """Data parallel (the loss's token counts over DP, gradients averaged over DP x CP) and pipeline stages
    (CP's share of the row sent between stages) beside CP 2, against one rank with the whole batch."""
    batch = rollout_batch(6)
    (reference,) = run_distributed(_engine_body, 1, models["llama3"], 1, 1, batch)
    pp = 2 if layout == "pp2-cp2" else 1
    results = run_distributed(_engine_body, 4, models["llama3"], 1, 2, batch, False, False, pp)
    worst = _check([reference], [r for r in results if pp == 1 or r["pp_rank"] == pp - 1])
    for r in results:  # every stage's gradients and weights (the outputs are broadcast from the last)
        for key in ("grads", "weights"):
            diff = _max_diffs(reference, r)[key]
            assert diff <= ATOL, f"{layout} rank pp {r['pp_rank']} cp {r['cp_rank']}: {key} {diff:.3g}"
    print(f"{layout} vs one rank max abs diffs: {worst}")
