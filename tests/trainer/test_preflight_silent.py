"""``main_ppo``'s pre-flight (#58): settings and inputs that were accepted and did nothing, or failed
later with an unclear message, are refused before any model is built, in one line naming the key or
the file and the fix (``run``: main_ppo with the world's start replaced by a failure)."""

from __future__ import annotations

import glob
import json
import os

from tests.trainer.test_main_ppo_errors import inputs, run  # noqa: F401 (fixtures)


def _one_line(err: str, start: str) -> str:
    lines = [line for line in err.splitlines() if start in line]
    assert len(lines) == 1, err
    return lines[0]


def test_a_lora_rank_larger_than_the_model_is_refused(run, inputs, tiny_model_dir):  # noqa: F811
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    err = run([*inputs, f"actor_rollout_ref.model.lora_rank={hidden * 4}"])
    line = _one_line(err, "lora_rank=")
    assert f"actor_rollout_ref.model.lora_rank={hidden * 4} is larger than the model's hidden size ({hidden}, " in line
    assert f"set actor_rollout_ref.model.lora_rank <= {hidden} (usually 8 to 64)" in line


def test_lora_settings_without_a_rank_are_refused(run, inputs):  # noqa: F811
    err = run([*inputs, "actor_rollout_ref.model.lora_alpha=32"])
    assert "actor_rollout_ref.model.lora_alpha=32 set, but actor_rollout_ref.model.lora_rank=0 builds no adapters" in err


def test_multi_turn_with_nothing_to_do_is_refused(run, inputs):  # noqa: F811
    err = run([*inputs, "actor_rollout_ref.rollout.multi_turn.enable=true"])
    line = _one_line(err, "multi_turn.enable=true")
    assert "no tool, interaction or agent loop is configured: the agent loop would sample one plain response" in line
    assert "Set actor_rollout_ref.rollout.multi_turn.tool_config_path" in line


def test_tools_kwargs_naming_a_tool_not_configured_is_refused(run, tiny_model_dir, tmp_path):  # noqa: F811
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic

    rows, _ = arithmetic.generate_splits(train=8, val=0, digits=1, seed=0)
    rows = [dict(r, extra_info={"tools_kwargs": {"search": {"create_kwargs": {"k": 1}}}}) for r in rows]
    write_parquet(rows, str(tmp_path / "train.parquet"))
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    err = run([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path}/train.parquet",
               "data.val_files=null", "actor_rollout_ref.rollout.multi_turn.enable=true",
               f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"])
    line = _one_line(err, "tools_kwargs")
    assert f"data.train_files: {tmp_path}/train.parquet row 0: extra_info.tools_kwargs names the tool 'search', " in line
    assert "which is not configured (tools: ['calculator']; " in line and "add it to the tool config" in line


def test_a_glob_in_data_files_is_named_with_its_matches(run, tiny_model_dir, arithmetic_files):  # noqa: F811
    pattern = os.path.join(os.path.dirname(arithmetic_files["train"]), "*.parquet")
    err = run([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={pattern}", "data.val_files=null"])
    line = _one_line(err, "is a pattern")
    found = sorted(glob.glob(pattern))
    assert line.endswith(
        f"data.train_files: {pattern} is a pattern, and verl reads the files named, not patterns; it matches "
        f"{len(found)} file(s): list them, e.g. data.train_files=[{','.join(found[:2])}]"
    ), line


def test_a_jsonl_that_is_not_utf8_is_named_with_its_line(run, tiny_model_dir, tmp_path):  # noqa: F811
    from verl.data.tasks import arithmetic

    rows, _ = arithmetic.generate_splits(train=4, val=0, digits=1, seed=0)
    path = tmp_path / "train.jsonl"
    with open(path, "wb") as f:
        for i, row in enumerate(rows):
            line = json.dumps(row, ensure_ascii=False)
            f.write((line.replace('"prompt"', '"prompt_caf\u00e9"') if i == 2 else line).encode("latin-1") + b"\n")
    err = run([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={path}", "data.val_files=null"])
    line = _one_line(err, "is not UTF-8 text")
    assert f"{path}: record 2 (line 3) is not UTF-8 text (byte 0xe9 at column " in line
    assert "convert the file (e.g. iconv -f latin1 -t utf-8" in line
