"""RewardManager: decoding, score placement, failures, timeouts, overlong penalty, the process pool."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

from tests.rewards.conftest import EOS_ID, make_batch
from tests.rewards.test_scorers import ARITHMETIC_CASES, COUNTDOWN_CASES, DAPO_CASES, GSM8K_CASES, MATH_CASES
from verl.protocol import Batch
from verl.rewards import OverlongBuffer, RewardManager, format_reward, load_custom_reward_fn, reward_manager_from_config

# Responses that make the test scorer misbehave (see CUSTOM_SCORER).
CUSTOM_SCORER = """
import math, os, time
from verl.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "RAISE":
        raise RuntimeError("scorer bug")
    if solution_str == "NAN":
        return math.nan
    if solution_str == "NODICT":
        return {"acc": True}
    if solution_str == "TEXT":
        return "high"
    if solution_str == "SLEEP":
        time.sleep(60)
    if solution_str == "EXIT":
        os._exit(3)  # a worker that dies (segfault, OOM kill)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.fixture(scope="module")
def custom_fn(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_fn") / "misbehaving.py"
    path.write_text(textwrap.dedent(CUSTOM_SCORER))
    return load_custom_reward_fn(str(path), "compute_score")


def _mixed_table():
    rows = [("openai/gsm8k", r, gt, e) for r, gt, e in GSM8K_CASES]
    rows += [("lighteval/MATH", r, gt, e) for r, gt, e in MATH_CASES]
    rows += [("math_dapo", r, gt, e) for r, gt, e in DAPO_CASES]
    rows += [("countdown", r, gt, e) for r, gt, e in COUNTDOWN_CASES]
    rows += [("verl/arithmetic", r, gt, e) for r, gt, e in ARITHMETIC_CASES]
    return [(ds, "" if r is None else r, gt, e) for ds, r, gt, e in rows]


def test_scores_sit_on_the_last_valid_token(tokenizer):
    texts = ["#### 72", "Answer: 579", r"so \boxed{\frac12}", "Answer: 7"]
    sources = ["openai/gsm8k", "verl/arithmetic", "lighteval/MATH", "verl/arithmetic"]
    truths = ["72", "579", "0.5", "8"]
    batch = make_batch(texts, sources, truths, length=24)
    out = RewardManager(tokenizer)(batch)

    expected = torch.zeros(4, 24)
    for i, (t, score) in enumerate(zip(texts, [1.0, 1.0, 1.0, 0.0])):
        expected[i, len(t)] = score  # the EOS token after the text is the last valid one
    assert torch.equal(out.token_level_scores, expected)
    assert out.token_level_scores.dtype == torch.float32
    assert torch.equal(out.scores, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert out.num_failed == 0 and out.extra_info == {}


def test_attention_mask_and_left_padded_prompts(tokenizer):
    texts = ["#### 72", "#### 5"]
    batch = make_batch(texts, ["gsm8k", "gsm8k"], ["72", "5"], length=10)
    resp_mask = batch.tensors.pop("response_mask")
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # left-padded prompts [B, P]
    batch["attention_mask"] = torch.cat([prompt_mask, resp_mask], dim=1)  # [B, P + T]
    out = RewardManager(tokenizer)(batch)
    assert out.token_level_scores[0, len(texts[0])] == 1.0
    assert out.token_level_scores[1, len(texts[1])] == 1.0
    assert out.token_level_scores.sum() == 2.0


def test_special_tokens_are_skipped_when_decoding(tokenizer):
    # The EOS id is decoded as "<eos>" only when asked; a format check on the whole text sees it.
    batch = make_batch(["<think>a</think><answer>b</answer>"], ["verl/format"], [""])

    def layout(data_source, solution_str, ground_truth, extra_info=None):
        return format_reward(solution_str)

    assert batch["responses"][0, -1] == EOS_ID
    assert RewardManager(tokenizer, layout)(batch).scores.tolist() == [1.0]
    assert RewardManager(tokenizer, layout, skip_special_tokens=False)(batch).scores.tolist() == [0.0]


def test_extra_fields_are_reported_per_sample(tokenizer):
    batch = make_batch(
        ["Answer: 204", "#### 72", "Answer: 3"],
        ["math_dapo", "openai/gsm8k", "aime24"],
        ["204", "72", "4"],
    )
    out = RewardManager(tokenizer)(batch)
    assert out.scores.tolist() == [1.0, 1.0, -1.0]
    assert out.extra_info == {"acc": [True, None, False], "pred": ["204", None, "3"]}


def test_ground_truth_column_and_reward_fn_key(tokenizer):
    batch = make_batch(["#### 72"], ["ignored"], ["0"])
    batch["task"] = ["openai/gsm8k"]
    batch["ground_truth"] = ["72"]
    out = RewardManager(tokenizer, reward_fn_key="task")(batch)
    assert out.scores.tolist() == [1.0]


def test_configuration_errors_raise_before_scoring(tokenizer, custom_fn):
    with pytest.raises(ValueError, match="no rule-based scorer for data_source='my/set'"):
        RewardManager(tokenizer)(make_batch(["#### 1", "#### 2"], ["gsm8k", "my/set"], ["1", "2"]))
    batch = make_batch(["#### 1"], ["gsm8k"], ["1"])
    batch.non_tensors.pop("data_source")
    with pytest.raises(ValueError, match="no non-tensor column 'data_source'"):
        RewardManager(tokenizer)(batch)
    batch = make_batch(["#### 1"], ["gsm8k"], ["1"])
    batch["reward_model"] = [{"style": "rule"}]
    with pytest.raises(ValueError, match=r"reward_model\[0\] must be a dict with 'ground_truth'"):
        RewardManager(tokenizer)(batch)
    batch = make_batch(["#### 1"], ["gsm8k"], ["1"])
    batch.tensors.pop("response_mask")
    with pytest.raises(ValueError, match="response_mask"):
        RewardManager(tokenizer)(batch)
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(tokenizer, num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(tokenizer, timeout_s=0)
    with pytest.raises(ValueError, match="picklable compute_score"):
        RewardManager(tokenizer, lambda **kw: 1.0, num_workers=2)
    with pytest.raises(ValueError, match="one entry per response"):
        RewardManager(tokenizer).score_texts(["a", "b"], ["1"], ["gsm8k", "gsm8k"])
    with pytest.raises(ValueError, match=r"overlong_buffer\.len=0"):
        OverlongBuffer(len=0, max_response_length=16)
    # A user function sees every data_source itself: no registry check.
    assert RewardManager(tokenizer, custom_fn).score_texts(["RAISE"], ["1"], ["my/set"])[0].score == 0.0


def test_misbehaving_scorers_give_zero_and_a_warning(tokenizer, custom_fn, caplog):
    texts = ["#### 72", "RAISE", "NAN", "NODICT", "TEXT", "SLEEP"]
    batch = make_batch(texts, ["gsm8k"] * 6, ["72"] * 6)
    with caplog.at_level(logging.WARNING, logger="verl.rewards.manager"):
        out = RewardManager(tokenizer, custom_fn, timeout_s=0.3)(batch)
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.num_failed == 5
    assert "5 of 6 responses could not be scored" in caplog.text and "RuntimeError: scorer bug" in caplog.text
    results = RewardManager(tokenizer, custom_fn, timeout_s=0.3).score_texts(texts, ["72"] * 6, ["gsm8k"] * 6)
    assert [r.error is None for r in results] == [True, False, False, False, False, False]
    assert "timed out" in results[5].error and "nan" in results[2].error and "without 'score'" in results[3].error


def test_overlong_penalty_is_added_to_the_score(tokenizer):
    # T = max_response_length = 12, buffer 4: responses longer than 8 tokens lose (L - 8) / 4.
    texts = ["#### 7", "#### 7   ", "#### 7      "]  # 7, 10 and 13 -> 12 tokens with EOS (truncated)
    batch = make_batch(texts, ["gsm8k"] * 3, ["7"] * 3, length=12)
    lengths = batch["response_mask"].sum(-1).tolist()
    assert lengths == [7, 10, 12]
    manager = RewardManager(tokenizer, overlong_buffer=OverlongBuffer(len=4, penalty_factor=1.0, max_response_length=12))
    out = manager(batch)
    expected_penalty = [0.0, -0.5, -1.0]
    assert out.extra_info["overlong_penalty"] == expected_penalty
    # The truncated response lost its EOS, and "#### 7" + spaces still reads 7: raw score 1 for all.
    expected = torch.tensor([1.0, 0.5, 0.0])
    assert torch.equal(out.scores, expected)
    for i, n in enumerate(lengths):
        assert out.token_level_scores[i, n - 1] == expected[i]
    assert torch.equal(out.token_level_scores.sum(-1), expected)


def test_empty_responses_and_empty_batches(tokenizer, caplog):
    batch = make_batch(["", "#### 3"], ["gsm8k", "gsm8k"], ["3", "3"], eos=False, length=8)
    with caplog.at_level(logging.WARNING, logger="verl.rewards.manager"):
        out = RewardManager(tokenizer)(batch)
    assert out.token_level_scores[0].abs().sum() == 0 and out.token_level_scores[1, 5] == 1.0
    assert "1 of 2 responses have no valid token" in caplog.text

    empty = Batch(
        tensors={"responses": torch.zeros(0, 8, dtype=torch.long), "response_mask": torch.zeros(0, 8)},
        non_tensors={"data_source": [], "reward_model": []},
    )
    out = RewardManager(tokenizer, num_workers=2)(empty)
    assert out.token_level_scores.shape == (0, 8) and out.scores.shape == (0,)


@pytest.mark.timeout(120)
def test_process_pool_matches_serial(tokenizer):
    table = _mixed_table()
    texts, truths, sources = [r for _, r, _, _ in table], [gt for _, _, gt, _ in table], [ds for ds, *_ in table]
    serial = RewardManager(tokenizer).score_texts(texts, truths, sources)
    with RewardManager(tokenizer, num_workers=2) as pooled_manager:
        pooled = pooled_manager.score_texts(texts, truths, sources)
        assert pooled == serial
        assert [r.score for r in pooled] == [expected for *_, expected in table]
        # And through a batch, with the pool already warm.
        batch = make_batch(texts, sources, truths)
        assert torch.equal(pooled_manager(batch).token_level_scores, RewardManager(tokenizer)(batch).token_level_scores)


@pytest.mark.timeout(120)
def test_pool_survives_raising_hanging_and_dying_workers(tokenizer, custom_fn):
    manager = RewardManager(tokenizer, custom_fn, num_workers=2, timeout_s=0.5)
    try:
        results = manager.score_texts(["#### 1", "RAISE", "SLEEP", "#### 2"], ["1", "1", "1", "2"], ["gsm8k"] * 4)
        assert [r.score for r in results] == [1.0, 0.0, 0.0, 1.0]
        assert "RuntimeError" in results[1].error and "timed out" in results[2].error

        results = manager.score_texts(["EXIT"], ["1"], ["gsm8k"])
        assert results[0].score == 0.0 and "BrokenProcessPool" in results[0].error

        # The broken pool was replaced: the next batch scores normally.
        results = manager.score_texts(["#### 1", "#### 3"], ["1", "2"], ["gsm8k"] * 2)
        assert [r.score for r in results] == [1.0, 0.0] and all(r.error is None for r in results)
    finally:
        manager.close()


def test_reward_manager_from_config(tokenizer, custom_fn):
    from verl.config import PPOConfig

    config = PPOConfig()
    manager = reward_manager_from_config(config, tokenizer)
    assert manager.num_workers == 0 and manager.overlong_buffer is None and manager.uses_registry

    config.reward_model.reward_manager = "prime"
    config.reward_model.overlong_buffer.enable = True
    config.reward_model.overlong_buffer.len = 64
    config.data.max_response_length = 256
    config.custom_reward_function.path = custom_fn.path
    manager = reward_manager_from_config(config, tokenizer)
    assert manager.num_workers >= 1 and not manager.uses_registry
    assert manager.overlong_buffer == OverlongBuffer(len=64, penalty_factor=1.0, max_response_length=256)

    config.reward_model.reward_manager = "fancy"
    with pytest.raises(ValueError, match="reward_model.reward_manager='fancy' is not one of"):
        reward_manager_from_config(config, tokenizer)
