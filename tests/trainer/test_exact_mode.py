"""Exact mode (``trainer.deterministic=true``, ``verl.trainer.exact``): the same config and seed give
the same run bit for bit: every metric but the wall-clock ones (``exact.comparable``) equal (``==``).

On 2 ranks, GRPO on the main job's config (``grpo_tiny_cpu``, shortened):

- sync, colocated, the vLLM engine (the main job's layout): two runs;
- async on 2 ranks, the rollout on rank 1 (the transformers engine), ``free_running`` with partial
  rollout asked for: exact mode runs it step-paced, so it equals the plain (step-paced) async run
  step for step, keys included (a free-running thread would add ``async/free_segments`` and sample
  with versions that depend on timing); a run stopped after step 2 and resumed from its checkpoint
  (which holds the batches in flight) equals the uninterrupted one.

tests/trainer/test_reliability.py kills runs at random moments; here the stop is the loop's own.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl.testing.distributed import run_distributed
from verl.trainer.exact import ExactMode, comparable, pinned_async

from .test_partial_rollout_trainer import PARTIAL
from .test_rollout_modes import APART, _metrics, config

EXACT = ["trainer.deterministic=true"]
VLLM = ["actor_rollout_ref.rollout.name=vllm"]  # FAST picks the transformers engine; the main job runs vLLM
FREE = ["trainer.async_training.free_running=true"]
STEPS = ["trainer.total_training_steps=3"]


def _run(model_dir: str, files: dict[str, str], root: str, name: str, *extra: str,
         stop_after: int | None = None, resume: str = "disable") -> tuple[int, int]:
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = config(model_dir, files, f"{root}/{name}", *extra, resume=resume)
    with PPOTrainer(cfg) as trainer:
        start = trainer.resume()
        trainer.fit(stop_after=stop_after)
        return start, trainer.global_step


def _body(model_dir: str, files: dict[str, str], root: str) -> dict:
    runs = {
        "sync_a": _run(model_dir, files, root, "sync_a", *EXACT, *VLLM, "trainer.total_training_steps=2"),
        "sync_b": _run(model_dir, files, root, "sync_b", *EXACT, *VLLM, "trainer.total_training_steps=2"),
        "free": _run(model_dir, files, root, "free", *EXACT, *APART, *PARTIAL, *FREE, *STEPS),
        "paced": _run(model_dir, files, root, "paced", *EXACT, *APART, *PARTIAL, *STEPS),
        "killed": _run(model_dir, files, root, "killed", *EXACT, *APART, *PARTIAL, *FREE, *STEPS,
                       "trainer.save_freq=1", stop_after=2),
        "resumed": _run(model_dir, files, root, "killed", *EXACT, *APART, *PARTIAL, *FREE, *STEPS,
                        "trainer.save_freq=1", resume="auto"),
        "settings_after": (torch.are_deterministic_algorithms_enabled(),),
    }
    if torch.distributed.get_rank() == 0:
        for name in ("sync_a", "sync_b", "free", "paced", "killed"):
            runs[f"{name}_metrics"] = {step: comparable(m) for step, m in _metrics(f"{root}/{name}/logs", keep_all=True).items()}
    return runs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_exact_runs_are_equal_sync_async_and_resumed(tiny_model_dir, arithmetic_files, tmp_path):
    out, _ = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=840)
    assert out["sync_a"] == out["sync_b"] == (0, 2)
    assert (out["free"], out["paced"], out["killed"], out["resumed"]) == ((0, 3), (0, 3), (0, 2), (2, 3))
    assert out["settings_after"] == (False,)  # the run's process-wide settings are put back at close
    sync_a, sync_b = out["sync_a_metrics"], out["sync_b_metrics"]
    assert sorted(sync_a) == [1, 2]
    assert sync_a == sync_b
    free, paced, resumed = out["free_metrics"], out["paced_metrics"], out["killed_metrics"]
    assert sorted(free) == [1, 2, 3]
    differ = {step: sorted(k for k in free[step].keys() | paced[step].keys() if free[step].get(k) != paced[step].get(k))
              for step in free}
    assert differ == {1: [], 2: [], 3: []}  # keys included: no free-running thread (async/free_segments)
    assert free == paced
    assert resumed == free  # steps 1-2 of the stopped run, step 3 of the resumed one


def test_exact_mode_pins_only_the_timing_paced_schedules():
    assert pinned_async(True, False, deterministic=True) == (False, False)
    assert pinned_async(False, True, deterministic=True) == (False, False)
    assert pinned_async(False, True, deterministic=False) == (False, True)
    assert pinned_async(True, False, deterministic=False) == (True, False)


def test_exact_mode_key_alias_and_pipeline(tiny_model_dir, arithmetic_files, tmp_path):
    from verl.trainer.step import build_step

    free = config(tiny_model_dir, arithmetic_files, str(tmp_path), *APART, *PARTIAL, *FREE)
    assert build_step(free).operators[0].free_running is True and free.trainer.deterministic is False
    exact = config(tiny_model_dir, arithmetic_files, str(tmp_path), *APART, *PARTIAL, *FREE,
                   "actor_rollout_ref.rollout.full_determinism=true")  # the reference's key
    assert exact.trainer.deterministic is True
    head = build_step(exact).operators[0]
    assert (head.free_running, head.fill_window, head.partial_tokens, head.depth) == (False, False, 5, 2)


def test_exact_mode_turns_torch_settings_on_and_puts_them_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    with ExactMode(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with ExactMode(False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_comparable_drops_wall_clock_metrics_only():
    metrics = {"timing_s/gen": 1.0, "perf/cpu_memory_used_gb": 2.0, "rollout/tokens_per_s": 3.0, "rollout/time_s": 4.0,
               "memory/peak_gb": 5.0, "update_weights/time_s": 6.0,
               "critic/score/mean": 0.5, "async/free_segments": 0, "training/skipped_steps": 0, "update_weights/bytes_sent": 7}
    assert comparable(metrics) == {"critic/score/mean": 0.5, "async/free_segments": 0, "training/skipped_steps": 0,
                                   "update_weights/bytes_sent": 7}
