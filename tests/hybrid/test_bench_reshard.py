"""``tools/bench.py reshard``: the plan-only figures of a 70B cluster match a hand calculation, and a
measured 2-rank run prints one JSON object whose traffic and memory beat the naive path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.processes import run_tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "tools", "bench.py")
LLAMA3_70B = os.path.join(REPO, "configs", "models", "llama3_70b.json")


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def test_plan_only_llama3_70b_matches_the_hand_calculation():
    proc = subprocess.run(
        [sys.executable, BENCH, "reshard", "--config", LLAMA3_70B, "--plan-only", "--train-tp", "8", "--train-pp", "4",
         "--rollout-tp", "8", "--world", "32", "--dtype", "bf16"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    result = _json(proc)
    h, f, v, heads, kv, d = 8192, 28672, 128256, 64, 8, 128
    layer = (heads * d * h + 2 * kv * d * h + h * heads * d + 3 * f * h) // 8 + 2 * h  # a TP shard + two norms
    vocab_rows = v // 8  # 128256 is a multiple of 64 x 8: no padding, 16032 rows per rank
    per_rank = {  # elements a rollout rank receives: the 60 layers of the other stages, plus
        "first": 60 * layer + vocab_rows * h + h,  # the LM head (stage 3) and the final norm
        "middle": 60 * layer + 2 * vocab_rows * h + h,  # the embedding and the LM head
        "last": 60 * layer + vocab_rows * h,  # the embedding
    }
    for r in result["ranks"]:
        stage = r["rank"] // 8  # TP varies fastest
        kind = "first" if stage == 0 else "last" if stage == 3 else "middle"
        assert r["bytes_received"] == 2 * per_rank[kind], (r["rank"], r["bytes_received"], 2 * per_rank[kind])
        assert r["peers"] == 3  # the same TP rank of the three other stages
        # Naive: all of the other stages whole, plus 7/8 of its own stage, per rank: ~10x more.
        assert r["naive_bytes_received"] > 9 * r["bytes_received"]
    # Two buffers of half the largest piece moved (an embedding / LM-head shard: 16032 x 8192 bf16, whose
    # half is below the 512 MiB bucket), against the naive path's gathered and merged embedding.
    assert result["peak_extra_bytes_bound_max"] == vocab_rows * h * 2
    assert result["naive_peak_extra_bytes_max"] == 2 * 2 * v * h  # the whole embedding, gathered and merged


@pytest.mark.parametrize(("train_tp", "train_pp", "rollout_tp"), [(1, 2, 2), (2, 1, 1), (2, 1, 2)])
def test_buckets_are_sized_to_the_transfer_of_a_small_model(tmp_path, train_tp, train_pp, rollout_tp):
    """With the default 512 MiB bucket, a small model's two transfer buffers together are no larger than the
    largest piece it moves, so the push's peak extra memory stays at or below the naive path's on every rank."""
    import argparse

    from transformers import LlamaConfig

    from tools.benchmarks.reshard import _reshard_layouts, _reshard_plan_only
    from verl.hybrid.plan import build_plan
    from verl.models.hf_config import parse_hf_config

    LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000).save_pretrained(tmp_path)
    args = argparse.Namespace(config=str(tmp_path / "config.json"), model=None, train_tp=train_tp, train_pp=train_pp,
                              train_vpp=None, rollout_tp=rollout_tp, bucket_mb=512.0, destination="hf-shards",
                              dtype="bf16", world=None)
    result = _reshard_plan_only(args)
    for r in result["ranks"]:
        assert r["peak_extra_bytes_bound"] <= r["naive_peak_extra_bytes"], r
    # The buffers execute_plan allocates: two of half the largest piece, where the earlier sizing took two of
    # a peer's whole traffic.
    plan = build_plan(*_reshard_layouts(parse_hf_config(args.config), args, train_tp * train_pp))
    for rank in range(plan.world_size):
        st = plan.rank_stats(rank)
        traffic = max([*st.received.values(), *st.sent.values(), 0])
        assert plan.bucket_elements(rank, 2**40) == plan.largest_piece(rank) // 2
        assert plan.largest_piece(rank) < traffic or traffic == 0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(360)  # the run's guard (280 s) and the tree's kill after it
def test_measured_run_beats_the_naive_path(tmp_path):
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(str(tmp_path / "llama"), TinyModelSpec(family="llama", hidden=128, heads=4, kv_heads=2,
                                                                   layers=2, corpus_lines=600))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = run_tree(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", BENCH, "reshard",
         "--model", model, "--train-tp", "1", "--train-pp", "2", "--rollout-tp", "2", "--bucket-mb", "0.0625",
         "--repeats", "2"],
        280, cwd=REPO, env=env,
    )
    result = _json(proc)
    assert result["same_weights_as_naive"]
    assert 0 < result["network_bytes"] < result["naive_network_bytes"]
    assert 0 < result["peak_extra_bytes_max"] < result["naive_peak_extra_bytes_max"]
    assert result["peak_extra_bytes_max"] <= 2 * 0.0625 * 2**20  # two buckets, measured
    assert result["memcpy_gbps_median"] > 0 and result["local_gbps_min"] > 0
    # OMP_NUM_THREADS=1 on two ranks: two copy threads, one per rank, every ratio measured.
    assert (result["threads_per_rank"], result["copy_threads"]) == (1, 2)
    for unit in ("", "_cpu"):
        assert result[f"local_fraction_of_memcpy{unit}"] > 0 and result[f"local_fraction_of_torch_copy{unit}"] > 0
    assert [r["rank"] for r in result["ranks"]] == [0, 1]


@pytest.mark.parametrize(("train_tp", "train_pp", "rollout_tp"), [(1, 2, 2), (2, 1, 1), (2, 1, 2)])
def test_the_torch_copy_ceiling_moves_the_plans_bytes(tmp_path, train_tp, train_pp, rollout_tp):
    """The like-with-like ceiling (plain torch copies of the same bytes, one strided copy_ per run of rows)
    writes exactly what the plan's local copy writes, in far fewer calls than the plan has rows."""
    import argparse

    import torch
    from transformers import LlamaConfig

    from tools.benchmarks.reshard import _reshard_layouts, _strided_runs
    from verl.hybrid import copy_ranges_
    from verl.hybrid.plan import build_plan
    from verl.models.hf_config import parse_hf_config

    LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000).save_pretrained(tmp_path)
    args = argparse.Namespace(train_tp=train_tp, train_pp=train_pp, train_vpp=None, rollout_tp=rollout_tp,
                              destination="hf-shards")
    sources, dests = _reshard_layouts(parse_hf_config(str(tmp_path / "config.json")), args, train_tp * train_pp)
    plan = build_plan(sources, dests)
    gen = torch.Generator().manual_seed(0)
    for rank in range(plan.world_size):
        srcs = [torch.randn(sources[rank].shapes[k], generator=gen).view(-1) for k in plan.src_keys[rank]]
        expected = [torch.full(dests[rank].shapes[k], float("nan")).view(-1) for k in plan.dst_keys[rank]]
        actual = [t.clone() for t in expected]
        local = plan.ranges(rank, rank)
        copy_ranges_(expected, srcs, local)
        runs = _strided_runs(local)
        for st, so, ss, dt, do, ds, rows, n in runs:
            actual[dt].as_strided((rows, n), (ds, 1), do).copy_(srcs[st].as_strided((rows, n), (ss, 1), so))
        for e, a in zip(expected, actual):
            assert torch.equal(e.nan_to_num(7.0), a.nan_to_num(7.0))
        assert len(runs) <= len(plan.src_keys[rank]) + len(plan.dst_keys[rank]), (len(runs), len(local))
