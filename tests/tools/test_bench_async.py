"""``tools/bench.py async`` under torchrun on 2 ranks (rollout on rank 1, actor on rank 0): the
modes run in one process and report their throughput, staleness and phases.

One torchrun runs all five modes (the three ``trainer.rollout_mode`` modes and the two partial-
rollout ones asked for with ``--modes``); each test checks its modes of that one report (a
second torchrun cost a process start per rank and an async mode run twice)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.processes import run_tree
from tests.tools.bench_run import BENCH, REPO

pytestmark = pytest.mark.slow

SMALL = [
    "actor_rollout_ref.rollout.name=hf",
    "data.train_batch_size=8",
    "data.max_prompt_length=32",
    "data.max_response_length=12",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
]
MODES = ["sync", "one_step_off", "async", "async_partial", "async_fill"]


@pytest.fixture(scope="module")
def bench_async(tmp_path_factory) -> dict:
    """The report of ``bench.py async --modes sync one_step_off async async_partial async_fill
    --partial-tokens 4`` (partial rollout in segments of 4 of the 12 tokens: a batch begun 2
    windows ahead gets 2 segments there, the rest at its step; async_fill fills each update
    window with segments until the update ends, fill_update_window)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = run_tree(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", BENCH, "async",
         "--inputs", str(tmp_path_factory.mktemp("bench-async")), "--prompts", "64", "--steps", "2", "--warmup", "1",
         "--modes", *MODES, "--partial-tokens", "4", *SMALL],
        1000, cwd=REPO, env=env,  # a hang guard: 40 s quiet, 190 s beside two busy loops
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    return json.loads(line)


@pytest.mark.timeout(1060)
def test_bench_async_reports_every_mode(bench_async):
    result = bench_async
    assert result["bench"] == "async" and result["world_size"] == 2
    modes = result["modes"]
    assert list(modes) == MODES
    assert modes["sync"]["speedup"] == 1.0
    # the bounds: sync trains fresh samples, one_step_off one version stale, async (bound 2) at most 2
    assert modes["sync"]["staleness_max"] == 0.0 and modes["one_step_off"]["staleness_max"] == 1.0
    assert 1.0 <= modes["async"]["staleness_max"] <= 2.0
    for name in ("sync", "one_step_off", "async"):
        mode = modes[name]
        assert mode["generated_tokens_per_s"] > 0, name
        actor, rollout = mode["phases_by_rank"]
        # the actor on rank 0 only (rank 1 enters the phase and leaves it: microseconds)
        assert actor["update_actor"] > 0 and rollout["update_actor"] < 0.05 * actor["update_actor"], name
        # the streaming modes generate on rank 1 inside the update window, sync never does
        assert (rollout["gen_ahead"] > 0) == (name != "sync"), name
        assert [samples for samples, _ in mode["reward_curve"]] == [64, 96], name  # steps 2-3 of 8 x 4
    assert 0 < result["first_mode_generation_share"] < 1


@pytest.mark.timeout(1060)
def test_bench_async_partial_mode(bench_async):
    """async against async_partial and async_fill: the same async run with partial rollout, and with
    it filling each update window."""
    modes = bench_async["modes"]
    assert list(modes)[2:] == ["async", "async_partial", "async_fill"]
    for name in ("async", "async_partial", "async_fill"):
        mode = modes[name]
        assert mode["generated_tokens_per_s"] > 0 and 1.0 <= mode["staleness_max"] <= 2.0, name
        assert mode["phases_by_rank"][1]["gen_ahead"] > 0, name  # segments inside the update window
