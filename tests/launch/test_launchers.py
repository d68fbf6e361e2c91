"""The launchers: valid bash and valid Python; the tiny GRPO as two nodes on localhost, one node
started with `bash launch/...` and the other with `torchrun ... launch/...` on the same file."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from verl.parallel.bootstrap import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHERS = ["launch/ppo_70b.sh", "launch/grpo_7b.sh", "launch/grpo_tiny_cpu.sh", "launch/grpo_smollm2_cpu.sh"]


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_is_bash_and_python(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text)  # Python: the shell half is the module docstring
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    shell = text.split('":"""', 1)[0]
    # Bash: the shell half alone parses (bash reads no further: it exits before the Python half).
    subprocess.run(["bash", "-n"], input=shell, text=True, check=True)
    assert "verl_launch" in shell


@pytest.mark.parametrize("path", LAUNCHERS)
def test_a_multiprocessing_child_does_not_start_another_run(path, monkeypatch):
    """Run by torchrun, the launcher is ``__main__``; a spawned child (Megatron's checkpoint writer)
    imports it as ``__mp_main__``: that must only tie the child to its parent, never start a run."""
    import runpy

    from verl.trainer import launcher
    from verl.utils import process

    watched = []
    monkeypatch.setattr(launcher, "run_recipe", lambda *a, **k: pytest.fail("a child started a run"))
    monkeypatch.setattr(process, "exit_with_parent", lambda **k: watched.append(True))
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(os.path.join(ROOT, path), run_name="__mp_main__")
    assert watched == [True]


def test_two_nodes_on_localhost(tmp_path):
    """NNODES=2 NPROC_PER_NODE=1: c10d rendezvous on 127.0.0.1, two steps of the tiny GRPO (HF rollout)."""
    port = free_port()
    out = tmp_path / "out"
    overrides = [
        "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        # A checkpoint: Megatron's writer is a spawned child, which imports the launcher again.
        "trainer.save_freq=2", "trainer.save_hf=false",
    ]
    env = {
        **os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, "OUT": str(out), "SFT_STEPS": "0", "TRAIN": "200",
        "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    launcher = os.path.join(ROOT, "launch", "grpo_tiny_cpu.sh")
    node0 = subprocess.Popen(["bash", launcher, *overrides], cwd=tmp_path, env={**env, "NODE_RANK": "0"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The second node is the file run by torchrun itself, as users type it on a cluster.
    node1 = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "verl",
         launcher, *overrides],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        logs = [p.communicate(timeout=420)[0] for p in (node0, node1)]
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
    assert node0.returncode == 0 and node1.returncode == 0, "\n\n".join(log[-4000:] for log in logs)
    both = "".join(logs)
    assert "--nnodes 2" in logs[0]  # bash started torchrun for two nodes
    assert "world_size=2" in both  # one world of two ranks, one per node
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1, 2]
    assert "done: step 2" in both


def test_slurm_and_nccl_settings_reach_torchrun(tmp_path):
    """Under srun, bash launch/... builds torchrun's rendezvous from Slurm's variables; NCCL
    defaults are exported and a user's own value wins. (A stand-in Python records what it is given.)"""
    record = tmp_path / "record.json"
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/usr/bin/env bash\n"
        f"printf '%s\\n' \"$@\" > {record}.args\n"
        f"env | grep -E '^(NCCL|TORCH_NCCL|CUDA_DEVICE)' | sort > {record}.env\n"
    )
    fake_python.chmod(0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/usr/bin/env bash\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a01\\ngpu-a02\\n'\n")
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_", "NCCL_"))}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", PYTHON=str(fake_python), SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu-a[01-02]", NCCL_IB_TIMEOUT="20")
    subprocess.run(["bash", os.path.join(ROOT, "launch", "ppo_70b.sh"), "trainer.total_training_steps=3"],
                   env=env, check=True, capture_output=True, text=True)
    args = (tmp_path / "record.json.args").read_text().split("\n")
    assert args[:2] == ["-m", "torch.distributed.run"]
    line = " ".join(args)
    assert "--nnodes 2 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint gpu-a01:29500 --rdzv_id 4242" in line
    assert "--nproc_per_node 8" in line
    assert line.rstrip().endswith("launch/ppo_70b.sh trainer.total_training_steps=3")
    nccl = (tmp_path / "record.json.env").read_text()
    assert "NCCL_IB_TIMEOUT=20" in nccl  # the user's value
    assert "NCCL_DEBUG=WARN" in nccl and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in nccl and "CUDA_DEVICE_MAX_CONNECTIONS=1" in nccl
