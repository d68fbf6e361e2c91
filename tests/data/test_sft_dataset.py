"""SFT and preference datasets: the loss mask covers response / assistant tokens only."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.data import PreferenceDataset, SFTDataset


def to_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def masked_text(tokenizer, item) -> str:
    ids = item["input_ids"][item["loss_mask"].bool()].tolist()
    return tokenizer.decode(ids)


def test_prompt_response_mask_only_on_response(tmp_path, tokenizer):
    path = to_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 37+45?", "response": "Answer: 82"}])
    item = SFTDataset(path, tokenizer, max_length=64)[0]
    # The learnt tokens are exactly the assistant content and the end-of-turn token (= eos);
    # the template's trailing newline after it is part of the rendered turn.
    assert masked_text(tokenizer, item) == "Answer: 82<|im_end|>\n"
    n = int(item["attention_mask"].sum())
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 37+45?"}], add_generation_prompt=True, tokenize=False
    )
    n_prompt = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    assert item["loss_mask"][:n_prompt].sum() == 0 and item["loss_mask"][n_prompt:n].all()
    assert item["loss_mask"][n:].sum() == 0 and (item["input_ids"][n:] == tokenizer.pad_token_id).all()
    assert item["position_ids"].tolist() == list(range(64))


def test_plain_text_response_ends_with_eos(tmp_path, tokenizer):
    path = to_jsonl(tmp_path / "d.jsonl", [{"q": "2+2=", "meta": {"a": "4"}}])
    item = SFTDataset(
        path, tokenizer, max_length=16, prompt_key="q", response_key="meta.a", apply_chat_template=False
    )[0]
    expected = (
        tokenizer("2+2=")["input_ids"]
        + tokenizer("4", add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
    )
    n = len(expected)
    assert item["input_ids"][:n].tolist() == expected
    assert item["loss_mask"][:n].tolist() == [0] * (n - 2) + [1, 1]


def test_multi_turn_learns_assistant_turns_only(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "Answer: 2"},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "Answer: 4"},
    ]
    path = str(tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), path)
    item = SFTDataset(path, tokenizer, max_length=96, messages_key="messages")[0]
    n = int(item["attention_mask"].sum())
    expected_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert item["input_ids"][:n].tolist() == expected_ids
    assert masked_text(tokenizer, item) == "Answer: 2<|im_end|>\nAnswer: 4<|im_end|>\n"
    with pytest.raises(ValueError, match=r"u.jsonl: row 0: field 'messages': the conversation has no assistant turn"):
        SFTDataset(to_jsonl(tmp_path / "u.jsonl", [{"messages": messages[:2]}]), tokenizer, messages_key="messages")


@pytest.mark.parametrize("mode", ["left", "right", "error"])
def test_sft_truncation(tmp_path, tokenizer, mode):
    path = to_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "one two three four five six", "response": "Answer: 12345"}]
    )
    full = SFTDataset(path, tokenizer, max_length=128)[0]
    n = int(full["attention_mask"].sum())
    ds = SFTDataset(path, tokenizer, max_length=n - 4, truncation=mode)
    if mode == "error":
        with pytest.raises(ValueError, match=rf"d.jsonl: row 0: {n} tokens exceed max_length={n - 4}"):
            ds[0]
        return
    item = ds[0]
    keep = slice(4, n) if mode == "left" else slice(0, n - 4)
    assert item["input_ids"].tolist() == full["input_ids"][keep].tolist()
    assert item["loss_mask"].tolist() == full["loss_mask"][keep].tolist()


def test_preference_pairs(tmp_path, tokenizer):
    rows = [
        {"prompt": "What is 3+4?", "chosen": "Answer: 7", "rejected": "Answer: 8"},
        {
            "prompt": [{"role": "user", "content": "What is 5+5?"}],
            "chosen": [
                {"role": "user", "content": "What is 5+5?"},
                {"role": "assistant", "content": "Answer: 10"},
            ],
            "rejected": [
                {"role": "user", "content": "What is 5+5?"},
                {"role": "assistant", "content": "Answer: 11"},
            ],
        },
    ]
    ds = PreferenceDataset(to_jsonl(tmp_path / "p.jsonl", rows), tokenizer, max_length=48)
    for i, (good, bad) in enumerate([("7", "8"), ("10", "11")]):
        item = ds[i]
        assert (
            masked_text(
                tokenizer, {"input_ids": item["chosen_input_ids"], "loss_mask": item["chosen_loss_mask"]}
            )
            == f"Answer: {good}<|im_end|>\n"
        )
        assert (
            masked_text(
                tokenizer, {"input_ids": item["rejected_input_ids"], "loss_mask": item["rejected_loss_mask"]}
            )
            == f"Answer: {bad}<|im_end|>\n"
        )
        # Both sides share the prompt tokens exactly.
        first = int(item["chosen_loss_mask"].nonzero()[0])
        assert item["chosen_input_ids"][:first].tolist() == item["rejected_input_ids"][:first].tolist()
    bad = to_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "chosen": "y"}])
    with pytest.raises(ValueError, match="b.jsonl: every row lacks the field 'rejected'"):
        PreferenceDataset(bad, tokenizer)


def test_sft_reads_the_arithmetic_rl_files(tmp_path, tokenizer):
    """The demo's SFT warm-up reads the RL-format task files: response from extra_info.answer."""
    from verl.data.io import write_parquet
    from verl.data.tasks.arithmetic import generate_splits

    train, _ = generate_splits(train=4, val=0, digits=2, seed=0)
    path = str(tmp_path / "train.parquet")
    write_parquet(train, path)
    ds = SFTDataset(path, tokenizer, max_length=40, prompt_key="prompt", response_key="extra_info.answer")
    for i, rec in enumerate(train):
        assert masked_text(tokenizer, ds[i]) == f"Answer: {rec['reward_model']['ground_truth']}<|im_end|>\n"
