"""``tools/bench.py compare-trl --reward``: the words reward scores as documented, both sides call the
same function, and our side's config points its ``custom_reward_function`` at it (fast: no trainer)."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

from tools.benchmarks import compare_trl as bench
from tools.benchmarks.harness import rl_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rewards = _load("verl_tools_bench_rewards", "bench_rewards.py")


@pytest.mark.parametrize(
    ("text", "score"),
    [("", 0.0), ("12", 0.0), (" ", 1.0), ("a b c", 0.4), ("ab cd", 0.2), ("a\tb\nc", 0.0), ("  ab", 0.5)],
)
def test_words_score(text, score):
    assert rewards.words_score(text) == pytest.approx(score)
    assert rewards.compute_score(data_source="verl/arithmetic", solution_str=text, ground_truth="7") == \
        pytest.approx(score)


def _args(**kw):
    base = dict(prompts=4, n=2, response_length=16, engine="vllm", lr=1e-4, steps=2, warmup=1, seed=3,
                reward="arithmetic", rollout_dtype="fp32", micro_batch=16, overrides=[])
    base.update(kw)
    return argparse.Namespace(**base)


HF = {"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 64, "num_attention_heads": 2}


def _keys(overrides):
    return dict(o.split("=", 1) for o in overrides)


def test_our_side_config_per_reward():
    words = _keys(bench._compare_trl_overrides(_args(reward="words"), "/m", "/t.parquet", HF, "fp32"))
    assert words["custom_reward_function.path"] == bench.BENCH_REWARDS
    assert os.path.isfile(words["custom_reward_function.path"])
    assert words["custom_reward_function.name"] == "compute_score"
    plain = _keys(bench._compare_trl_overrides(_args(), "/m", "/t.parquet", HF, "fp32"))
    assert not any(k.startswith("custom_reward_function") for k in plain)  # the data source's scorer
    # The user's overrides come last, so they win.
    mine = bench._compare_trl_overrides(_args(reward="words", overrides=["custom_reward_function.name=x"]),
                                        "/m", "/t.parquet", HF, "fp32")
    assert mine[-1] == "custom_reward_function.name=x"


def test_the_config_loads_with_the_words_reward(tmp_path):
    overrides = bench._compare_trl_overrides(_args(reward="words"), "/m", "/t.parquet", HF, "fp32")
    cfg = rl_config("grpo_tiny_cpu", overrides, str(tmp_path), 1)
    assert cfg.custom_reward_function.path == bench.BENCH_REWARDS
    assert cfg.custom_reward_function.name == "compute_score"
    # What our reward manager then calls is the function TRL's side calls.
    from verl.rewards import load_custom_reward_fn

    ours = load_custom_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    assert ours(data_source="verl/arithmetic", solution_str="a b c", ground_truth="1") == pytest.approx(0.4)


def test_trl_side_scores_like_ours():
    completions = ["a b c", "", "ab cd"]
    conversational = [[{"role": "assistant", "content": c}] for c in completions]
    kw = dict(prompts=["p"] * 3, ground_truth=["7", "12", "3"], data_source=["verl/arithmetic"] * 3)
    words = bench._trl_reward("words")
    assert words.__name__ == "words_reward"
    assert words(completions=completions, **kw) == pytest.approx([0.4, 0.0, 0.2])
    assert words(completions=conversational, **kw) == pytest.approx([0.4, 0.0, 0.2])
    arithmetic = bench._trl_reward("arithmetic")
    from verl.rewards.registry import default_compute_score

    texts = ["Answer: 7", "Answer: 11", "no"]
    got = arithmetic(completions=texts, **kw)
    want = [float(default_compute_score("verl/arithmetic", t, g)) for t, g in zip(texts, kw["ground_truth"])]
    assert got == want
    assert got[0] == 1.0  # a right answer scores, so the arithmetic scorer is the real one


def test_unknown_reward_is_refused():
    with pytest.raises(ValueError, match="unknown reward"):
        bench._reward_overrides("length")


@pytest.mark.parametrize(("choice", "train", "want"),
                         [("fp32", "bf16", "float32"), ("bf16", "fp32", "bfloat16"), ("auto", "bf16", "bfloat16"),
                          ("auto", "fp32", "float32")])
def test_rollout_dtype(choice, train, want):
    got = _keys(bench._compare_trl_overrides(_args(rollout_dtype=choice), "/m", "/t.parquet", HF, train))
    assert got["actor_rollout_ref.rollout.dtype"] == want
    assert got["actor_rollout_ref.actor.megatron.dtype"] == bench._VERL_DTYPES[train]


@pytest.mark.parametrize(("micro_batch", "hidden", "want"),
                         [(16, 64, 8), (0, 64, 8), (4, 64, 4), (3, 64, 3), (None, 64, 8), (None, 512, 8)])
def test_micro_batch(micro_batch, hidden, want):
    # prompts 4 x n 2 = 8 rows: at most the whole batch; 0 is the whole batch; auto (None) is 16 rows from
    # hidden 512 up, the whole batch below.
    hf = dict(HF, hidden_size=hidden, num_attention_heads=hidden // 32)
    args = _args(micro_batch=micro_batch)
    got = _keys(bench._compare_trl_overrides(args, "/m", "/t.parquet", hf, "fp32"))
    assert got["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == str(want)
    assert got["actor_rollout_ref.actor.ppo_mini_batch_size"] == "4"  # one update per step on every prompt


def test_micro_batch_auto_at_the_bench_sizes():
    assert bench._micro_batch(None, 512, 64) == 16  # ~30M: 16 rows
    assert bench._micro_batch(None, 64, 64) == 64  # tiny default: the whole batch, as before
    assert bench._micro_batch(0, 512, 64) == 64


@pytest.mark.parametrize(("flags", "hidden", "want"), [
    (["avx2"], 512, "fp32"), (["avx2"], 64, "fp32"),
    (["avx512_bf16"], 512, "bf16"), (["avx512_bf16"], 64, "fp32"),  # no AMX: bf16 was slower at hidden 64
    (["avx512_bf16", "amx_bf16"], 64, "fp32"), (["amx_bf16"], 512, "bf16"),  # AMX at hidden 64: no faster
])
def test_train_dtype_auto(flags, hidden, want):
    assert bench._verl_train_dtype("auto", hidden, flags) == want
    assert bench._verl_train_dtype("fp32", hidden, flags) == "fp32"


def test_engine_auto():
    assert bench._verl_engine("auto", 64) == "hf"  # tiny default: vLLM's per-step cost dominates
    assert bench._verl_engine("auto", 512) == "vllm"
    assert bench._verl_engine("vllm", 64) == "vllm" and bench._verl_engine("hf", 512) == "hf"
    got = _keys(bench._compare_trl_overrides(_args(engine="auto"), "/m", "/t.parquet", HF, "fp32"))
    assert got["actor_rollout_ref.rollout.name"] == "hf"


def test_trl_side_mfu_counts_its_step_on_its_lengths(tmp_path, monkeypatch):
    """TRL's step's model FLOPs (``_trl_mfu``): generation plus one forward and backward, its head on the
    completion tokens and the one before them, over its step's seconds and the peak of its dtype."""
    import json

    from verl.trainer import perf

    config = dict(model_type="qwen2", vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    peak = perf.DevicePeak("cpu", {"bf16": 1e-3, "fp32": 5e-4}, "test")  # TFLOP/s
    monkeypatch.setattr(perf, "device_peak", lambda device=None: peak)
    trl = [{"step_s": 2.0, "generated_tokens": 8 * 3}]  # 4 prompts x 2 samples, 3 tokens each
    bench._trl_mfu(str(tmp_path), True, trl, [{"prompt_tokens_mean": 5.4}], sequences=8)
    per_token = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 32 + 2 * 64 * 64 + 3 * 2 * 64 * 256)  # 2 layers
    attention = 2 * 2 * 2 * 2 * 32  # per (token, key) pair: 2 matmuls x 2 FLOPs x 2 layers x 2 heads x 32
    gen = 8 * (7 * per_token + attention * 7 * 8 // 2) + 2 * 64 * 1024 * 3 * 8  # prompt 5 + 3 - 1 tokens
    update = 3 * (8 * (8 * per_token + attention * 8 * 9 // 2) + 2 * 64 * 1024 * (3 + 1) * 8)
    assert trl[0]["tflops"] == pytest.approx((gen + update) / 2.0 / 1e12, rel=1e-12)  # float division only
    assert trl[0]["mfu"] == pytest.approx((gen + update) / 2.0 / 1e9, rel=1e-12)  # bf16 peak 1e-3 TFLOP/s
    # --nproc 2: the same step's FLOPs shared by 2 processes, per device as ours; fp32's peak.
    two = [{"step_s": 2.0, "generated_tokens": 8 * 3}]
    bench._trl_mfu(str(tmp_path), False, two, [{"prompt_tokens_mean": 5.4}], sequences=8, devices=2)
    assert two[0]["tflops"] == pytest.approx((gen + update) / 2 / 2.0 / 1e12, rel=1e-12)
    assert two[0]["mfu"] == pytest.approx((gen + update) / 2 / 2.0 / 5e8, rel=1e-12)  # fp32 peak 5e-4 TFLOP/s
