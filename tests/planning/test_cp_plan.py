"""The planner and the dry run with context parallelism: activations per CP rank, and CP suggested where a
sequence does not fit.

The case: GRPO on Llama-3-70B in launch/ppo_70b.sh's layout (8 nodes x 8 GPUs, TP8 x PP4, SP, the
distributed optimizer, grad/optimizer offload), no critic, 2k-token prompts with 32k-token responses,
and activation recomputation off (``enable_gradient_checkpointing=false``: full recompute costs a
third more compute, 8 FLOPs per parameter and token instead of 6). At CP1 stage 0 holds four
micro-batches of 34,816 tokens in flight: 89 GiB of activations, over 80 GiB GPUs; at CP2 each GPU
holds half of every sequence. (With full recompute the recipe fits 34k tokens at CP1: 40 GiB.)
"""

from __future__ import annotations

import dataclasses
import io

import pytest

from tests.planning.test_memory_plan import _cfg, _formula_plan
from verl.planning.cli import config_inputs, write_report
from verl.planning.dry_run import dry_run_plan
from verl.planning.hardware import gpu_preset
from verl.planning.search import context_parallel_suggestion, search_layouts, suggestion_overrides

GIB = 2**30
GRPO_32K = [
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "critic.enable=false",
    "actor_rollout_ref.rollout.n=8", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "data.max_prompt_length=2048", "data.max_response_length=32768", "actor_rollout_ref.rollout.prompt_length=2048",
    "actor_rollout_ref.rollout.response_length=32768", "actor_rollout_ref.rollout.max_num_batched_tokens=34816",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
]
CP2 = "actor_rollout_ref.actor.megatron.context_parallel_size=2"


def _inputs(*overrides: str):
    return config_inputs(_cfg("ppo_70b", *GRPO_32K, *overrides), model_config="llama3_70b", gpu_memory_gib=80.0)


@pytest.fixture(scope="module")
def cp1_dry_run():
    return dry_run_plan(_inputs())


def test_70b_grpo_with_32k_responses_needs_cp_and_the_dry_run_says_so(cp1_dry_run):
    plan = cp1_dry_run
    assert not plan.fits and plan.worst.peak_phase == "actor_update" and plan.worst.rank == 0
    out = io.StringIO()
    assert write_report(plan, gpu_preset("H100"), out) == 1
    text = out.getvalue()
    suggestion = context_parallel_suggestion(plan)
    assert suggestion is not None and suggestion.cp == 2 and suggestion.overrides() == [CP2]
    assert suggestion.describe() in text
    assert f"context parallelism: {CP2} splits each 34816-token sequence over 2 GPUs" in text
    freed = plan.peak - suggestion.plan.peak
    assert suggestion.freed == freed and f"(frees {freed / GIB:.1f} GiB): fits in 80 GiB" in text
    # What it frees is the activations, halved per GPU (tokens per rank: 34816 / 2 exactly); the state
    # (parameters, gradients, optimizer sharded over DP x CP = 2 as before) is unchanged.
    for before, after in zip(plan.ranks, suggestion.plan.ranks):
        a, b = before.roles["actor"], after.roles["actor"]
        assert (b.params, b.grads, b.optimizer) == (a.params, a.grads, a.optimizer)
        assert b.activations == pytest.approx(a.activations / 2, rel=1e-6)  # int rounding of the byte counts
        assert b.forward_activations == pytest.approx(a.forward_activations / 2, rel=1e-6)
    assert freed == pytest.approx(plan.ranks[0].roles["actor"].activations / 2, rel=1e-6)
    # The suggestion applied: the dry run (meta-device models at CP2, the real topology) fits, with
    # the formulas' figures.
    at_cp2 = dry_run_plan(_inputs(CP2))
    assert at_cp2.fits and at_cp2.peak == suggestion.plan.peak
    assert at_cp2.peak < 80 * GIB < plan.peak


def test_the_layout_search_picks_cp_over_recompute_for_long_sequences(cp1_dry_run):
    inputs = cp1_dry_run.inputs
    found = search_layouts(inputs, gpu_preset("H100"))
    best = found[0].inputs.role("actor")
    # CP2 without recompute is estimated faster than CP1 with full recompute (6 vs 8 FLOPs per parameter and token;
    # the K/V exchange over the CP group is seconds against minutes of compute).
    assert best.cp > 1 and not best.recompute, found[0].describe()
    overrides = suggestion_overrides(found[0])
    assert f"actor_rollout_ref.actor.megatron.context_parallel_size={best.cp}" in overrides
    assert _formula_plan(_inputs(*overrides)).fits


def test_cp_is_not_suggested_where_the_sequences_fit():
    # The same GRPO with 2k-token responses fits without recompute at CP1: no CP line, and the fastest
    # layout keeps CP1 (CP would add its K/V exchange and save nothing that matters).
    inputs = _inputs("data.max_response_length=2048", "actor_rollout_ref.rollout.response_length=2048")
    plan = _formula_plan(inputs)
    out = io.StringIO()
    assert write_report(plan, gpu_preset("H100"), out) == 0
    assert "context parallelism:" not in out.getvalue()
    best = search_layouts(inputs, gpu_preset("H100"), limit=1)[0]
    assert best.inputs.role("actor").cp == 1 and not best.inputs.role("actor").recompute, best.describe()
    # On 40 GiB GPUs no CP of this layout fits (CP4 x TP8 x PP4 would need 128 GPUs): nothing suggested.
    assert context_parallel_suggestion(_formula_plan(dataclasses.replace(_inputs(), gpu_memory_gib=40.0))) is None
