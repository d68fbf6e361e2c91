"""The launchers: valid bash and valid Python; the tiny GRPO as two nodes on localhost, one node
started with `bash launch/...` and the other with `torchrun ... launch/...` on the same file."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time

import pytest

from tests.processes import kill_tree
from verl.parallel.bootstrap import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHERS = ["launch/ppo_70b.sh", "launch/grpo_7b.sh", "launch/grpo_tiny_cpu.sh", "launch/grpo_smollm2_cpu.sh",
             "launch/grpo_tools_tiny_cpu.sh", "launch/distill_tiny_cpu.sh", "launch/grpo_qwen3_30b_a3b.sh",
             "launch/grpo_code_tiny_cpu.sh", "launch/agent_program_tiny_cpu.sh", "launch/grpo_vlm_tiny_cpu.sh"]


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
    """Run by torchrun, the launcher is ``__main__``; a spawned child (a reward worker of
    ``reward_model.reward_manager=prime``) imports it as ``__mp_main__``: that must only tie the child to its parent, never start a run."""
    import runpy

    from verl.trainer import launcher
    from verl.utils import process

    watched = []
    monkeypatch.setattr(launcher, "run_recipe", lambda *a, **k: pytest.fail("a child started a run"))
    monkeypatch.setattr(process, "exit_with_parent", lambda **k: watched.append(True))
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(os.path.join(ROOT, path), run_name="__mp_main__")
    assert watched == [True]


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """One run of `launch/grpo_tiny_cpu.sh` as two nodes on localhost (NNODES=2 NPROC_PER_NODE=1: c10d
    rendezvous on 127.0.0.1), one node started with `bash launch/...` and the other with `torchrun ...
    launch/...`: two steps of the tiny GRPO (HF rollout) with a checkpoint and two validations, its
    logs and checkpoints in folders of the user's (``trainer.log_dir``, ``default_local_dir``), after
    an earlier run's figures in the launcher's default log folder. Checked by
    test_two_nodes_on_localhost and test_the_launchers_summary_is_this_runs_with_folder_overrides
    (one launch for both: each is a minute of CPU)."""
    tmp_path = tmp_path_factory.mktemp("two-nodes")
    port = free_port()
    out = tmp_path / "out"
    stale = out / "logs"
    stale.mkdir(parents=True)
    # An earlier run's figures in the launcher's default log folder.
    (stale / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "val-core/arith/acc/mean@4": 0.552}) + "\n"
        + json.dumps({"step": 60, "val-core/arith/acc/mean@4": 0.606}) + "\n"
    )
    mine = tmp_path / "elsewhere"
    overrides = [
        "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.val_kwargs.n=1", "data.val_batch_size=16",
        "trainer.test_freq=2",
        # A checkpoint: Megatron's writer forks workers (verl.models.dist_save: nothing imports the launcher again).
        "trainer.save_freq=2", "trainer.save_hf=false",
        f"trainer.log_dir={mine}/logs", f"trainer.default_local_dir={mine}/ckpt",
    ]
    env = {
        **os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, "OUT": str(out), "SFT_STEPS": "0", "TRAIN": "200",
        "VAL": "16", "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    launcher = os.path.join(ROOT, "launch", "grpo_tiny_cpu.sh")
    # Each node's stdout (the closing lines) apart from its stderr (the logs), in files: a pipe that
    # nobody reads while the test waits for the other node could fill and stall that node's rank.
    files = {name: open(tmp_path / name, "w+", encoding="utf-8") for name in ("out0", "err0", "out1", "err1")}
    try:
        node0 = subprocess.Popen(["bash", launcher, *overrides], cwd=tmp_path, env={**env, "NODE_RANK": "0"},
                                 stdout=files["out0"], stderr=files["err0"], text=True, start_new_session=True)
        # The second node is the file run by torchrun itself, as users type it on a cluster.
        node1 = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "verl",
             launcher, *overrides],
            cwd=tmp_path, env=env, stdout=files["out1"], stderr=files["err1"], text=True, start_new_session=True,
        )
        nodes = (node0, node1)
        try:
            # A hang guard (tests/processes.py): 44 s quiet, 226-420+ s beside two busy loops (suites 15-17).
            # A node that failed ends the wait: the other would wait for it until the guard.
            deadline = time.monotonic() + 1200
            while any(p.poll() is None for p in nodes) and not any(p.poll() for p in nodes):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(["bash", launcher, *overrides], 1200)
                time.sleep(0.5)
        finally:
            for p in nodes:
                kill_tree(p)  # torchrun's ranks too
                p.wait(timeout=60)
        outputs = []
        for i in (0, 1):
            for name in (f"out{i}", f"err{i}"):
                files[name].seek(0)
            outputs.append((files[f"out{i}"].read(), files[f"err{i}"].read()))
    finally:
        for f in files.values():
            f.close()
    return {"nodes": nodes, "outputs": outputs, "mine": mine}


@pytest.mark.timeout(1260)
def test_two_nodes_on_localhost(two_node_run):
    """NNODES=2 NPROC_PER_NODE=1: c10d rendezvous on 127.0.0.1, two steps of the tiny GRPO (HF rollout)."""
    node0, node1 = two_node_run["nodes"]
    logs = [stdout + stderr for stdout, stderr in two_node_run["outputs"]]
    assert node0.returncode == 0 and node1.returncode == 0, "\n\n".join(log[-4000:] for log in logs)
    both = "".join(logs)
    assert "--nnodes 2" in logs[0]  # bash started torchrun for two nodes
    assert "world_size=2" in both  # one world of two ranks, one per node
    with open(two_node_run["mine"] / "logs" / "metrics.jsonl", encoding="utf-8") as f:
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
    assert args[:2] == ["-m", "verl.trainer.torchrun"]
    line = " ".join(args)
    assert "--nnodes 2 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint gpu-a01:29500 --rdzv_id 4242" in line
    assert "--nproc_per_node 8" in line
    assert line.rstrip().endswith("launch/ppo_70b.sh trainer.total_training_steps=3")
    nccl = (tmp_path / "record.json.env").read_text()
    assert "NCCL_IB_TIMEOUT=20" in nccl  # the user's value
    assert "NCCL_DEBUG=WARN" in nccl and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in nccl and "CUDA_DEVICE_MAX_CONNECTIONS=1" in nccl


def _recipe_config(*overrides: str):
    from verl.config import PPOConfig, load_config

    return load_config(PPOConfig, config_file="grpo_tiny_cpu", overrides=list(overrides))


def _write_run(log_dir, ckpt_dir, export_dir, values: list[tuple[int, float]], newest_step: int) -> None:
    """What a run leaves: metrics.jsonl with validation points, a checkpoint tracker, a marked HF export."""
    from verl.utils.checkpoint import TRACKER_FILE
    from verl.utils.outputs import MARKER_FILE

    for folder in (log_dir, ckpt_dir, export_dir):
        folder.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, value in values:
            f.write(json.dumps({"step": step, "val-core/arith/acc/mean@4": value, "timing_s/step": 1.0}) + "\n")
    (ckpt_dir / TRACKER_FILE).write_text(str(newest_step))
    (export_dir / MARKER_FILE).write_text("{}")


def test_recipe_summary_reads_the_folders_of_this_run_not_the_defaults(tmp_path):
    """A run with trainer.log_dir/default_local_dir/hf_export_dir overrides: the summary names its own
    folders and figures; an earlier run's outputs in the launcher's default folders are not shown."""
    import time

    from verl.trainer.launcher import recipe_summary

    old = tmp_path / "default"
    _write_run(old / "logs", old / "checkpoints", old / "grpo_model", [(0, 0.552), (60, 0.606)], 60)
    past = time.time() - 3600
    for path in (old / "logs" / "metrics.jsonl", old / "checkpoints" / "latest_checkpointed_iteration.txt",
                 old / "grpo_model" / ".verl_output.json"):
        os.utime(path, (past, past))  # an hour ago: an earlier run
    started = time.time()
    new = tmp_path / "mine"
    _write_run(new / "logs", new / "ckpt", new / "hf", [(0, 0.55), (20, 0.61), (40, 0.824)], 40)
    # The launcher's defaults first, then the user's overrides (last wins), as run_recipe orders them.
    cfg = _recipe_config(f"trainer.log_dir={old}/logs", f"trainer.default_local_dir={old}/checkpoints",
                         f"trainer.hf_export_dir={old}/grpo_model", f"trainer.log_dir={new}/logs",
                         f"trainer.default_local_dir={new}/ckpt", f"trainer.hf_export_dir={new}/hf")
    lines = recipe_summary(cfg, started, label="validation reward")
    text = "\n".join(lines)
    assert lines[0] == "== validation reward (val-core/arith/acc/mean@4): 0.550 before GRPO (step 0) -> 0.824 after (step 40)"
    assert lines[1] == "== every validation: 0.550 (step 0), 0.610 (step 20), 0.824 (step 40)"
    assert f"== metrics:      {new / 'logs' / 'metrics.jsonl'}" in lines
    assert f"== checkpoints:  {new / 'ckpt'} (newest: {new / 'ckpt' / 'global_step_40'})" in lines
    assert f"== HF export:    {new / 'hf'}" in lines
    assert "0.606" not in text and str(old) not in text

    # The same folders, but this run wrote none of it (an earlier run's files, its own settings off):
    # no line claims them.
    cfg = _recipe_config(f"trainer.log_dir={old}/logs", f"trainer.default_local_dir={old}/checkpoints",
                         f"trainer.hf_export_dir={old}/grpo_model")
    assert recipe_summary(cfg, started, label="validation reward") == []
    cfg = _recipe_config(f"trainer.log_dir={new}/logs", f"trainer.default_local_dir={new}/ckpt",
                         f"trainer.hf_export_dir={new}/hf", "trainer.logger=[console]", "trainer.save_freq=-1",
                         "trainer.save_hf=false")
    assert recipe_summary(cfg, started, label="validation reward") == []


def test_recipe_summary_without_validation_before_training(tmp_path):
    """The first validation point after step 0 is not called "before GRPO"; step times when asked."""
    import time

    from verl.trainer.launcher import recipe_summary

    started = time.time()
    _write_run(tmp_path / "logs", tmp_path / "ckpt", tmp_path / "hf", [(15, 0.6), (30, 0.7)], 30)
    cfg = _recipe_config(f"trainer.log_dir={tmp_path}/logs", f"trainer.default_local_dir={tmp_path}/ckpt",
                         f"trainer.hf_export_dir={tmp_path}/hf")
    lines = recipe_summary(cfg, started, label="held-out accuracy", key_note=", greedy", step_times=True)
    assert lines[0] == "== held-out accuracy (val-core/arith/acc/mean@4, greedy): 0.600 at step 15 -> 0.700 after (step 30)"
    assert "== time per step: 1.0 s mean over 2 steps (min 1.0, max 1.0)" in lines


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_the_launchers_summary_is_this_runs_with_folder_overrides(two_node_run):
    """`bash launch/grpo_tiny_cpu.sh trainer.log_dir=... trainer.default_local_dir=...` after an
    earlier run in $OUT: the closing lines (printed by global rank 0, on whichever node it is) name
    the overridden folders and this run's figures."""
    node0, node1 = two_node_run["nodes"]
    assert node0.returncode == 0 and node1.returncode == 0, "\n\n".join(
        (stdout + stderr)[-4000:] for stdout, stderr in two_node_run["outputs"])
    mine = two_node_run["mine"]
    with open(mine / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        val = [v for r in map(json.loads, f) for k, v in r.items() if k.startswith("val-core/")]
    assert len(val) == 2  # before training and at step 2
    printed = [stdout for stdout, _ in two_node_run["outputs"] if "== validation reward" in stdout]
    assert len(printed) == 1, [stdout[-2000:] for stdout, _ in two_node_run["outputs"]]  # rank 0's node alone
    closing = printed[0].splitlines()
    closing = closing[next(i for i, line in enumerate(closing) if line.startswith("== validation reward")):]
    assert f"{val[0]:.3f} before GRPO (step 0) -> {val[1]:.3f} after (step 2)" in closing[0], closing
    assert f"== metrics:      {mine / 'logs' / 'metrics.jsonl'}" in closing
    assert f"== checkpoints:  {mine / 'ckpt'} (newest: {mine / 'ckpt' / 'global_step_2'})" in closing
    assert not any("0.606" in line or "HF export" in line for line in closing), closing


def test_the_distillation_launchers_summary_says_distillation_not_grpo(tmp_path):
    """launch/distill_tiny_cpu.sh trains by distillation: its closing line reads "before distillation"."""
    import runpy
    import time

    started = time.time()
    _write_run(tmp_path / "logs", tmp_path / "ckpt", tmp_path / "hf", [(0, 0.64), (60, 0.72)], 60)
    cfg = _recipe_config(f"trainer.log_dir={tmp_path}/logs", f"trainer.default_local_dir={tmp_path}/ckpt",
                         f"trainer.hf_export_dir={tmp_path}/none")
    launcher = runpy.run_path(os.path.join(ROOT, "launch", "distill_tiny_cpu.sh"), run_name="distill_recipe")
    lines = launcher["_summary"](str(tmp_path), cfg, started)
    assert lines[0] == ("== student's validation reward (val-core/arith/acc/mean@4): "
                        "0.640 before distillation (step 0) -> 0.720 after (step 60)"), lines
    assert not any("GRPO" in line for line in lines), lines
