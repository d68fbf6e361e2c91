"""MegatronEngine invariances: TP=2, DP=2, PP=2 and micro-batching give the single-rank step.

Each layout takes two optimizer steps (SGD, clipping active) on the same 8 SFT rows with the
loss as the SFT trainer computes it (masked token mean over the global batch). The first
step's loss and gradient norm check the forward and backward; the second step's check the
update. The HF export after the steps must hold the same weights in every layout.
"""

from __future__ import annotations

import glob

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS = 8
MAX_LENGTH = 32


def _engine_steps(
    model_dir: str, data_file: str, tp: int, pp: int, micro: int, export_dir: str | None
) -> list[tuple[float, float]]:
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.data.sft_dataset import SFTDataset
    from verl.data.tokenizer import load_tokenizer
    from verl.parallel import megatron_state as ms
    from verl.engine import LossShare, MegatronEngine

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    engine = MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        pg=pg,
        # SGD, not Adam: Adam divides by sqrt(v), turning rounding noise in near-zero gradient
        # entries into lr-sized weight differences, which would hide layout bugs in the
        # exported weights. Clip 1.0 is below the first gradient norms (~3-5), so clipping is
        # exercised; lr 1.0 then moves the weights by a unit-norm step the second loss shows.
        optim=OptimConfig(optimizer="sgd", lr=1.0, clip_grad=1.0, weight_decay=0.0),
        total_training_steps=10,
    )
    dataset = SFTDataset(
        data_file, load_tokenizer(model_dir), max_length=MAX_LENGTH, response_key="extra_info.answer"
    )
    rows = [dataset[i] for i in range(ROWS)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    dp, dp_rank = pg.dp.size(), pg.dp.rank()
    per = ROWS // dp
    local = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in batch.items()}
    info = GlobalBatchInfo.from_masks([local["loss_mask"].float()], group=pg.dp)

    def loss_fn(outputs, micro_batch):
        return LossShare(
            agg_loss(-outputs["logprobs"], micro_batch["loss_mask"].float(), "token-mean", global_batch_info=info)
        )

    results = []
    for _ in range(2):
        r = engine.train_step(local, micro_batch_size=micro, loss_fn=loss_fn)
        assert r.update_successful
        results.append((r.loss, r.grad_norm))
    if export_dir is not None:
        engine.export_hf(export_dir)
    return results


@pytest.fixture(scope="module")
def reference(tiny_model_dir, arithmetic_files, tmp_path_factory):
    """Single rank, one micro-batch of all 8 rows."""
    export = str(tmp_path_factory.mktemp("ref-export"))
    steps = run_distributed(_engine_steps, 1, tiny_model_dir, arithmetic_files["train"], 1, 1, ROWS, export)[
        0
    ]
    return steps, export


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "tp", "pp", "micro"),
    [(1, 1, 1, 2), (2, 2, 1, 4), (2, 1, 1, 4), (2, 1, 2, 2)],
    ids=["micro2x4", "tp2", "dp2", "pp2"],
)
def test_layout_matches_single_rank(
    reference, tiny_model_dir, arithmetic_files, tmp_path, world, tp, pp, micro
):
    from safetensors.torch import load_file

    expected_steps, ref_export = reference
    export = str(tmp_path / "export")
    per_rank = run_distributed(
        _engine_steps, world, tiny_model_dir, arithmetic_files["train"], tp, pp, micro, export
    )
    # Every rank reports the same numbers (metrics are reduced over DP and sent to every stage).
    for rank_steps in per_rank[1:]:
        assert rank_steps == per_rank[0]
    actual = torch.tensor(per_rank[0], dtype=torch.float64)
    expected = torch.tensor(expected_steps, dtype=torch.float64)
    # float32 sums in a different order (TP all-reduce, DP gradient average, micro-batch
    # accumulation): ~1e-7 relative per op; 1e-5 leaves room for two steps of it.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    expected_weights = load_file(f"{ref_export}/model.safetensors")
    actual_weights = {}
    for path in sorted(glob.glob(f"{export}/*.safetensors")):
        actual_weights.update(load_file(path))
    assert sorted(actual_weights) == sorted(expected_weights)
    for name, tensor in expected_weights.items():
        # Two clipped SGD steps of norm <= 1 from the same start: weights differ by rounding
        # only (~1e-7 x the step); a layout bug in the export would be off by O(0.01-1).
        torch.testing.assert_close(
            actual_weights[name], tensor, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def _export_targets(model_dir: str, root: str) -> dict[str, object]:
    """Export a frozen engine onto its own model, a user's directory, and the same place twice."""
    import os

    from verl.config import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state as ms
    from verl.utils.outputs import OutputPathError

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=2)
    engine = MegatronEngine(model=ModelConfig(path=model_dir), megatron=MegatronConfig(tensor_model_parallel_size=2),
                            pg=pg)
    refusals = {}
    mine = os.path.join(root, "mine")
    for name, target in (("model", model_dir), ("inside-model", os.path.join(model_dir, "hf")), ("users", mine)):
        try:
            engine.export_hf(target)
            refusals[name] = None
        except OutputPathError as exc:  # raised on every rank, not only where the check ran
            refusals[name] = str(exc)
    out = os.path.join(root, "export")
    engine.export_hf(out)
    first = sorted(os.listdir(out))
    engine.export_hf(out)  # a verl export is replaced without being asked
    return {"refusals": refusals, "first": first, "second": sorted(os.listdir(out)),
            "siblings": sorted(os.listdir(root))}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_export_never_destroys_the_model_or_a_users_files(tiny_model_dir, tmp_path):
    import os

    model_files = {name: open(os.path.join(tiny_model_dir, name), "rb").read() for name in os.listdir(tiny_model_dir)}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    results = run_distributed(_export_targets, 2, tiny_model_dir, str(tmp_path))
    assert results[0] == results[1]
    refusals = results[0]["refusals"]
    assert "is the input model.path" in refusals["model"] and "is inside the input model.path" in refusals["inside-model"]
    assert "was not written by verl" in refusals["users"]
    assert results[0]["first"] == results[0]["second"]
    assert ".verl_output.json" in results[0]["first"] and "model.safetensors" in results[0]["first"]
    assert results[0]["siblings"] == ["export", "mine"]  # no staging or old copies left
    assert {n: open(os.path.join(tiny_model_dir, n), "rb").read() for n in os.listdir(tiny_model_dir)} == model_files
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
