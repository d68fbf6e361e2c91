"""docs/python_api.md runs as written (the ``verl.RLTrainer`` facade's fit, a ``DataStream`` that
builds its own trainer, the build-time check), and the facade's cheap checks."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "python_api.md")


@pytest.fixture
def restore_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _doc_blocks() -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_every_code_block_of_the_docs_runs(tiny_model_dir, arithmetic_files, tmp_path, restore_env, capsys):
    import torch.distributed as dist

    blocks = _doc_blocks()
    assert len(blocks) == 9
    ns = {"MODEL": tiny_model_dir, "TRAIN_FILE": arithmetic_files["train"], "OUT": str(tmp_path)}
    for block in blocks:
        exec(compile(block, DOC, "exec"), ns)
        assert not dist.is_initialized()  # fit / close tear down the world of one they started

    # The facade: 2 steps, a checkpoint after each, one metrics line per step.
    metrics, out = ns["metrics"], tmp_path / "run"
    assert metrics["global_step"] == 2
    for key in ("reward_mean", "loss", "final_kl"):
        assert math.isfinite(metrics[key]), key
    assert metrics["checkpoint"] == str(out / "global_step_2")
    for step in (1, 2):
        with open(out / f"global_step_{step}" / "trainer_state.json", encoding="utf-8") as f:
            assert json.load(f)["global_step"] == step
        assert (out / f"global_step_{step}" / "actor").is_dir()
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        logged = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in logged] == [1, 2]
    assert metrics["reward_delta"] == logged[1]["critic/score/mean"] - logged[0]["critic/score/mean"]
    # The monitor: one summary per step (report_interval=1) of what metrics.jsonl holds, and the report.
    monitor = ns["monitor"]
    assert [s["step"] for s in monitor.summaries] == [1.0, 2.0]
    assert monitor.summaries[1]["reward_mean"] == logged[1]["critic/score/mean"]
    assert monitor.summaries[1]["kl"] == logged[1]["actor/kl_loss"]
    assert ns["report_html"] == str(out / "logs" / "report.html")
    page = open(ns["report_html"], encoding="utf-8").read()
    assert '<figure id="plot-reward"><figcaption>Reward per step (mean, distribution)</figcaption><svg' in page
    # Resumed from global_step_1, step 2 repeats the uninterrupted run's step 2. The same
    # samples (seeded per step) score the same exactly; the loss runs on the restored weights and
    # optimizer (same arithmetic, so equal within float32 rounding).
    again = ns["again"]
    assert again["global_step"] == 2 and again["checkpoint"] == str(out / "global_step_2")
    assert again["critic/score/mean"] == metrics["critic/score/mean"]
    assert again["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-5)
    assert again["actor/kl_loss"] == pytest.approx(metrics["actor/kl_loss"], abs=1e-6)
    # load_hf_dataset's remapped, streamed rows went to the trainer as one parquet file.
    import pyarrow.parquet as pq

    qa = ns["qa_metrics"]
    assert qa["global_step"] == 1 and qa["rollout_tokens_per_second"] > 0
    written = pq.read_table(tmp_path / "qa" / "data" / "train.parquet").to_pylist()
    assert len(written) == 48 and written[5]["data_source"] == "verl/arithmetic"
    assert ns["qa"].last_config.data.train_files == [str(tmp_path / "qa" / "data" / "train.parquet")]
    # Model objects: the stream wrote the trained weights back into the actor object.
    assert math.isfinite(ns["objects_step"]["reward_mean"]) and ns["objects_step"]["actor/grad_norm"] > 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "objects" / "model_objects" / "global_step_2" / "model.safetensors"))
    actor_state = ns["actor"].state_dict()
    assert all(torch.equal(actor_state[k], v) for k, v in exported.items())
    # A plain nn.Module: the plain PyTorch engine trained the object itself.
    plain = ns["plain_step"]
    assert math.isfinite(plain["reward_mean"]) and plain["actor/grad_norm"] > 0
    assert type(ns["policy"]).__name__ == "TinyGRU"
    assert (tmp_path / "plain" / "logs" / "metrics.jsonl").is_file()
    # DPO through the facade: the first step runs at the reference's weights (margin 0, loss log 2).
    dpo = ns["dpo_metrics"]
    assert dpo["global_step"] == 1 and ns["dpo"].last_config.data.pairs
    assert dpo["loss"] == pytest.approx(math.log(2), abs=1e-6) and dpo["dpo/rewards/margin"] == pytest.approx(0, abs=1e-6)
    assert dpo["actor/grad_norm"] > 0
    cfg = ns["trainer"].last_config
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.data.train_batch_size == 4 and cfg.actor_rollout_ref.actor.use_kl_loss

    # The stream built its own trainer from the keyword arguments and its operators' settings.
    step = ns["step"]
    assert step["step"] == 2 and 0 < step["filter/kept"] < 16
    for key in ("reward_mean", "loss", "kl", "timing_s/op/ResponseLength", "timing_s/op/length_score"):
        assert math.isfinite(step[key]), key
    assert step["kl"] == step["actor/kl_loss"]
    with open(tmp_path / "stream" / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f if line.strip()] == [1, 2]
    # The stream's monitor (report_interval=2): one summary, and report.html with the operators' shares.
    page = open(tmp_path / "stream" / "logs" / "report.html", encoding="utf-8").read()
    assert '<figure id="plot-operators"><figcaption>Time share per operator (verl.DataStream)</figcaption><svg' in page
    # device_map: every role on the one CPU rank, in the config the stream would build its trainer from.
    assert ns["placed"].placement.devices == (0,) and ns["placed"].placement.device == "cpu"
    assert (ns["placed_cfg"].trainer.n_gpus_per_node, ns["placed_cfg"].trainer.nnodes) == (1, 1)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 9  # the blocks' prints: four fit summaries, two stream steps, the placements
    assert printed[-3:] == [
        "every role colocated on cpu:0 (device_map named actor, rollout, reward_model)", "cpu 1",
        "{'actor': [0, 1], 'reward_model': [2]}",  # the tutorials' map on three ranks: the reward model apart
    ]


def test_preference_files_fail_the_trainer_checks_pointing_to_dpo(tiny_model_dir, tmp_path):
    from verl.operator import build_config
    from verl.trainer.ppo_checks import check_ppo_inputs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    cfg = build_config(
        model=tiny_model_dir, train_files=str(pairs),
        overrides=["algorithm.adv_estimator=grpo", "trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.val_files=null",
                   f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"],
    )
    with pytest.raises(ValueError, match=(
        r"data.train_files: .*pairs.jsonl holds preference pairs \(columns 'chosen' and 'rejected'\) and no "
        r"'data_source' column.*algorithm.adv_estimator='grpo' learns from a reward.*algorithm=\"dpo\""
    )):
        check_ppo_inputs(cfg)


@pytest.mark.slow
def test_hybrid_ppo_runs_both_halves_in_the_trainer_loop(tiny_model_dir, arithmetic_files, tmp_path, restore_env):
    import verl

    reward = tmp_path / "length_reward.py"  # a spread of rewards on any response, so DPO gets pairs
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3) / 2.0\n"
    )
    trainer = verl.RLTrainer(
        tiny_model_dir, algorithm="hybrid_ppo", hybrid_condition=lambda s: int(s["uid"].split("/")[-1]) % 2 == 0,
        use_vllm=False, rollout_batch_size=4, n_samples=4, micro_batch_size=16, learning_rate=1e-4,
        max_prompt_length=24, max_response_length=8, device="cpu",
        overrides=[f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score"],
    )
    m = trainer.fit(dataset=arithmetic_files["train"], max_steps=1, output_dir=str(tmp_path / "out"), save_hf=False)
    assert m["global_step"] == 1 and trainer.last_config.algorithm.adv_estimator == "grpo"
    # Prompts 0 and 2 (4 samples each) trained with GRPO, prompts 1 and 3 gave DPO pairs.
    assert m["conditional/true_samples"] == 8 and m["conditional/false_samples"] == 8
    assert 1 <= m["conditional/dpo_pairs"] <= 2
    assert m["actor/grad_norm"] > 0 and m["dpo/actor/grad_norm"] > 0 and math.isfinite(m["dpo/loss"])


def test_ppo_maps_to_gae_with_a_critic(tiny_model_dir, arithmetic_files, tmp_path):
    import verl

    cfg = verl.RLTrainer(tiny_model_dir, algorithm="ppo", use_vllm=False, device="cpu").build_config(
        dataset_path=arithmetic_files["train"], max_steps=1, output_dir=str(tmp_path)
    )
    assert cfg.algorithm.adv_estimator == "gae" and cfg.use_critic


def test_unknown_algorithm_names_the_choices():
    import verl

    with pytest.raises(ValueError, match=r"unknown algorithm='sac'; choose one of \[.*'grpo'.*'ppo'.*'rloo'"):
        verl.RLTrainer("model", algorithm="sac")
    with pytest.raises(ValueError, match=r"'hybrid_ppo': hybrid_condition=1 is not callable; it routes each sample"):
        verl.RLTrainer("model", algorithm="hybrid_ppo", hybrid_condition=1)
    with pytest.raises(ValueError, match="its DPO half needs the reference policy; give kl_coef > 0"):
        verl.RLTrainer("model", algorithm="hybrid_ppo", hybrid_condition=bool, kl_coef=0)
    with pytest.raises(ValueError, match="DPO's beta must be a positive number"):
        verl.RLTrainer("model", algorithm="dpo", beta=0)


def test_import_verl_is_light():
    import subprocess
    import sys

    code = "import sys, verl; print(verl.__version__, 'torch' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [verl_version(), "False"] and proc.stderr == ""


def verl_version() -> str:
    import verl

    return verl.__version__
