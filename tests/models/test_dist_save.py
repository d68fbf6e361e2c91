"""``verl.models.dist_save``: a Megatron checkpoint save from a script without a main guard runs the
script's body once (Megatron's own writer spawns a process that imports the script again).

Each test runs a small script, written the way users write them (no ``if __name__ ==
"__main__":``), in a fresh interpreter: a world of one on gloo saves a sharded tensor and loads it
back; every import of the script appends its ``__name__`` to a file.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import os, sys
with open(os.environ["BODY_LOG"], "a", encoding="utf-8") as f:
    f.write(__name__ + "\\n")
if __name__ == "__mp_main__":
    # A second run of this body inside Megatron's spawned process (the behaviour under test):
    # stop here rather than start a second world beside the first.
    raise SystemExit(0)
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from verl.models.dist_save import save_sharded
from verl.parallel.cpu_shim import apply_cpu_shim, shim_needed

if shim_needed():
    apply_cpu_shim()  # as verl's engines do without CUDA (Megatron's writer synchronises the device)
out = os.environ["CKPT_DIR"]
dist.init_process_group("gloo", init_method="file://" + out + ".store", rank=0, world_size=1)
weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
sharded = {"w": ShardedTensor.from_rank_offsets("w", weight)}
if os.environ["SAVE"] == "verl":
    save_sharded(sharded, out)
else:
    dist_checkpointing.save(sharded, out)
loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, out)
assert torch.equal(loaded["w"], weight), loaded["w"]
dist.destroy_process_group()
print("SAVED")
"""


def _run_script(tmp_path, save: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    log = tmp_path / "body.log"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "BODY_LOG": str(log), "CKPT_DIR": str(ckpt), "SAVE": save,
           "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    runs = log.read_text(encoding="utf-8").split() if log.exists() else []
    return proc, runs


def test_save_sharded_from_a_guardless_script_runs_its_body_once(tmp_path):
    proc, runs = _run_script(tmp_path, "verl")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SAVED" in proc.stdout
    assert runs == ["__main__"], runs


def test_megatrons_own_save_imports_the_script_again(tmp_path):
    """The behaviour ``save_sharded`` works around. When this fails, Megatron's writer no longer
    spawns a process that imports ``__main__``: ``verl.models.dist_save`` can go."""
    from verl.models.dist_save import in_process_queue_applies

    if not in_process_queue_applies():
        pytest.skip("megatron-core is not a version verl.models.dist_save was checked on")
    _, runs = _run_script(tmp_path, "megatron")
    assert runs[0] == "__main__" and "__mp_main__" in runs[1:], runs
