"""Real trainer checkpoints (SFT at TP=2) against corruption: one flipped byte in any file is
refused naming the file, resume falls back to the previous checkpoint with a warning, and
NaN weights saved through a consistent manifest are refused at load and by megatron2hf."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_checkpoint_manager import each_file_flipped, flip_one_byte
from tests.trainer.test_sft_trainer import _sft_config as sft_config
from verl.testing.distributed import run_distributed
from verl.utils.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointManager

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
NAN_PARAM = "decoder.layers.0.mlp.linear_fc1.weight"  # column-parallel: rank 1 holds the second half


def _sft_config(model_dir: str, files: dict[str, str], run_dir: str):
    """The resume test's SFT run at TP=2 on two ranks: 4 steps, checkpoints at 2 and 4, both kept."""
    return sft_config(
        model_dir, files, run_dir,
        "megatron.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.max_ckpt_to_keep=null",
        world_size=2,
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _sft_body(model_dir: str, files: dict[str, str], run_dir: str, resume_only: bool) -> dict:
    import torch.distributed as dist

    from verl.trainer.sft_trainer import SFTTrainer

    records = _Records()
    logging.getLogger("verl.utils.checkpoint").addHandler(records)
    try:
        with SFTTrainer(_sft_config(model_dir, files, run_dir)) as trainer:
            resumed = trainer.resume()
            if not resume_only:
                trainer.fit()
            step = trainer.global_step
    finally:
        logging.getLogger("verl.utils.checkpoint").removeHandler(records)
    return {"rank": dist.get_rank(), "resumed": resumed, "step": step, "warnings": records.messages}


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, arithmetic_files, tmp_path_factory) -> Path:
    """Checkpoints of steps 2 and 4 of a TP=2 SFT run."""
    run_dir = tmp_path_factory.mktemp("sft-tp2") / "run"
    results = run_distributed(_sft_body, 2, tiny_model_dir, arithmetic_files, str(run_dir), False)
    assert [r["step"] for r in results] == [4, 4]
    assert (run_dir / "global_step_2").is_dir() and (run_dir / "global_step_4").is_dir()
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


@pytest.mark.timeout(300)
def test_one_flipped_byte_in_any_file_of_a_trainer_checkpoint_is_refused(sft_run, tmp_path):
    run = _copy(sft_run, tmp_path)
    path = run / "global_step_4"
    rels = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    # Every kind of file a trainer checkpoint holds is here (so each is tried below).
    kinds = (
        r"actor/model/__\d+_\d+\.distcp",
        r"actor/optim/__\d+_\d+\.distcp",
        r"actor/model/\.metadata",
        r"actor/optim/\.metadata",
        r"actor/extra/rank_00000\.pt",
        r"actor/extra/rank_00001\.pt",
        r"actor/engine\.json",
        r"trainer_state\.json",
        r"actor/model/hf/config\.json",
        r"actor/model/verl_model\.json",
        re.escape(MANIFEST_FILE),
    )
    for pattern in kinds:
        assert any(re.fullmatch(pattern, rel) for rel in rels), (pattern, rels)
    manager = CheckpointManager(str(run))
    for rel in each_file_flipped(path):
        with pytest.raises(CheckpointError, match=rf"global_step_4 .*{re.escape(rel)}"):
            manager.validate(str(path))
    assert manager.validate(str(path)) == 4


@pytest.mark.timeout(300)
def test_resume_falls_back_past_a_corrupt_model_shard(sft_run, tmp_path, tiny_model_dir, arithmetic_files):
    run = _copy(sft_run, tmp_path)
    shard = sorted((run / "global_step_4" / "actor" / "model").glob("*.distcp"))[-1]
    flip_one_byte(shard)
    results = run_distributed(_sft_body, 2, tiny_model_dir, arithmetic_files, str(run), True)
    # Every rank resumed from step 2, before any engine loaded the bad shard.
    assert [r["resumed"] for r in results] == [2, 2]
    bad = f"actor/model/{shard.name}"
    assert any("names step 4, which cannot be used" in m and bad in m and "global_step_2" in m
               for m in results[0]["warnings"]), results[0]["warnings"]


def _nan_body(model_dir: str, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.parallel import megatron_state as ms
    from verl.engine import MegatronEngine

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, seed=7)
    engine = MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(tensor_model_parallel_size=2),
        pg=pg,
        optim=OptimConfig(optimizer="sgd", lr=0.1),
        total_training_steps=4,
    )
    if dist.get_rank() == 1:  # only one TP rank's shard is bad: every rank must still raise
        params = dict(engine.chunks[0].named_parameters())
        name = next(n for n in params if n.endswith(NAN_PARAM))
        with torch.no_grad():
            params[name][0, 0] = float("nan")
    manager = CheckpointManager(root)
    path = manager.save(7, lambda tmp: engine.save(os.path.join(tmp, "actor")), {})
    step = manager.validate(path)  # the manifest is consistent: the NaN was saved as such
    try:
        engine.load(os.path.join(path, "actor"))
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"step": step, "error": error}


@pytest.fixture(scope="module")
def nan_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nan") / "run"
    results = run_distributed(_nan_body, 2, tiny_model_dir, str(root))
    return root, results


@pytest.mark.timeout(300)
def test_nan_weights_are_refused_at_load_on_every_rank(nan_checkpoint):
    root, results = nan_checkpoint
    assert [r["step"] for r in results] == [7, 7]
    for r in results:
        assert r["error"] is not None, "loading NaN weights did not fail"
        assert "non-finite weights (NaN or inf)" in r["error"] and NAN_PARAM in r["error"]
        assert str(root / "global_step_7" / "actor" / "model") in r["error"]


def _megatron2hf(megatron_dir: Path, out_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "megatron2hf.py"), "--megatron-dir", str(megatron_dir),
         "--out-dir", str(out_dir), "--no-progress"],
        capture_output=True, text=True, timeout=240, env=env,
    )


def _megatron2hf_in_process(capsys, megatron_dir: Path, out_dir: Path) -> subprocess.CompletedProcess:
    """The tool's ``main(argv)`` in this process (what its command runs): exit status and output as
    :func:`_megatron2hf` returns them, without a Python start per case."""
    from verl.testing.commands import load_script, run_main

    tool = load_script(ROOT / "tools" / "megatron2hf.py")
    return run_main(tool.main, ["--megatron-dir", str(megatron_dir), "--out-dir", str(out_dir), "--no-progress"],
                    capsys=capsys, name="megatron2hf")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_megatron2hf_refuses_nan_weights_and_corrupt_trainer_checkpoints(
    nan_checkpoint, sft_run, tmp_path, capsys
):
    root, _ = nan_checkpoint
    # Inside a trainer checkpoint (consistent manifest) and as a bare copy (as hf2megatron writes):
    # the first as a command, the others by the command's main() in this process.
    bare = tmp_path / "bare"
    shutil.copytree(root / "global_step_7" / "actor" / "model", bare)
    for source, convert in ((root / "global_step_7" / "actor" / "model", _megatron2hf),
                            (bare, lambda *a: _megatron2hf_in_process(capsys, *a))):
        out = convert(source, tmp_path / "hf")
        assert out.returncode == 2, out.stderr[-3000:]
        # Rank 1's first row of the fused gate/up weight (fused per TP rank): a gate_proj row, in
        # the file rank 1 wrote.
        expected = (
            r"megatron2hf: error: .*: model\.layers\.0\.mlp\.gate_proj\.weight holds non-finite values "
            r"\(NaN or inf\), e\.g\. 'decoder\.layers\.0\.mlp\.linear_fc1\.weight'\[\d+, 0\] "
            r"stored in __1_0\.distcp"
        )
        assert re.search(expected, out.stderr), out.stderr[-3000:]
        assert not (tmp_path / "hf").exists()
    # A finite but corrupted shard of a trainer checkpoint: refused by its manifest, naming the file.
    run = _copy(sft_run, tmp_path)
    shard = sorted((run / "global_step_4" / "actor" / "model").glob("*.distcp"))[0]
    flip_one_byte(shard)
    out = _megatron2hf_in_process(capsys, run / "global_step_4" / "actor" / "model", tmp_path / "hf")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"actor/model/{shard.name} does not hold what was saved" in out.stderr, out.stderr[-3000:]
