"""``verl.DataStream`` and its operators on the tiny model (a world of one, the transformers engine).

One RLTrainer is built for the module (building the roles is the slow part) and every stream
runs on it (``DataStream(trainer=...)``); the build-time checks need no trainer at all.
"""

from __future__ import annotations

import math
import os

import pytest

from verl.operator import (
    ConditionalUpdateOperator,
    DataStream,
    DPOUpdateOperator,
    FilterOperator,
    GroupFilterOperator,
    MultiRewardScorer,
    PPOUpdateOperator,
    RewardOperator,
    RolloutOperator,
    WeightedFilterOperator,
    build_config,
    build_trainer,
)

FAST = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.name=hf",
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=24",
    "data.max_response_length=8",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "trainer.total_training_steps=20",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.save_hf=false",
    "trainer.resume_mode=disable",
    "trainer.logger=[jsonl]",
    "data.val_files=null",
]


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """A rule any response gets a spread of scores on (the raw tiny model never answers right)."""
    return float(len(solution_str) % 3) / 2.0


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, arithmetic_files, tmp_path_factory):
    saved = dict(os.environ)
    out = tmp_path_factory.mktemp("stream")
    cfg = build_config(
        model=tiny_model_dir,
        train_files=arithmetic_files["train"],
        overrides=[*FAST, f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs"],
    )
    t, started = build_trainer(cfg)
    assert started  # a world of one, started for this module
    yield t
    t.close()
    from verl.parallel.bootstrap import destroy_distributed

    destroy_distributed()
    os.environ.clear()
    os.environ.update(saved)


def _responses(trainer, batch) -> list[str]:
    mask = batch["response_mask"].bool()
    return [
        trainer.tokenizer.decode(batch["responses"][i][mask[i]].tolist(), skip_special_tokens=True)
        for i in range(len(batch))
    ]


@pytest.mark.slow
def test_rollout_reward_update_stream_runs_steps(trainer):
    stream = (
        DataStream(trainer=trainer)
        .add_operator(RolloutOperator())
        .add_operator(RewardOperator(length_score))
        .add_operator(PPOUpdateOperator(estimator="grpo"))
    )
    first = trainer.global_step
    for k in range(2):
        m = stream.step()
        assert trainer.global_step == first + k + 1
        assert m["step"] == trainer.global_step
        for key in ("reward_mean", "loss", "kl", "actor/grad_norm"):
            assert math.isfinite(m[key]), key
        for op in ("RolloutOperator", "length_score", "PPOUpdateOperator"):
            assert m[f"timing_s/op/{op}"] > 0, op
        # The stream's reward is the function's, on the responses this step sampled.
        expected = sum(length_score(None, r, None) for r in _responses(trainer, stream.last_batch)) / 16
        assert m["reward_mean"] == pytest.approx(expected, abs=1e-6)
        assert m["critic/score/mean"] == pytest.approx(expected, abs=1e-6)
        assert m["kl"] == m["actor/kl_loss"]  # the KL loss to the reference is on
        assert m["actor/grad_norm"] > 0
    # step() logged each step to the trainer's metrics.jsonl
    with open(os.path.join(trainer.cfg.trainer.log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        steps = [line for line in f if line.strip()]
    assert len(steps) >= 2


class ResponseLength:
    """A user-written operator: one method, declared inputs and outputs."""

    inputs = ("response_mask",)
    outputs = ("response_length",)

    def process(self, batch):
        batch["response_length"] = batch["response_mask"].sum(-1)  # [B]
        return batch


@pytest.mark.slow
def test_user_operator_and_filter(trainer):
    seen = []

    def keep(sample):
        seen.append(sample)
        return sample["reward"] > 0 and sample["response_length"] >= 1

    stream = (
        DataStream(trainer=trainer)
        .add_operator(RolloutOperator())
        .add_operator(ResponseLength())
        .add_operator(RewardOperator(length_score))
        .add_operator(FilterOperator(predicate=keep))
        .add_operator(PPOUpdateOperator())
    )
    m = stream.step()
    batch = stream.last_batch
    assert len(seen) == 16 and {"reward", "response_length", "uid", "data_source"} <= set(seen[0])
    wanted = sum(1 for s in seen if s["reward"] > 0 and s["response_length"] >= 1)
    assert 0 < wanted < 16, "the fixed seed's samples should be partly kept"
    assert m["filter/kept"] == wanted and m["filter/dropped"] == 16 - wanted
    assert len(batch) == wanted
    assert (batch["token_level_scores"].sum(-1) > 0).all()
    assert "response_length" in batch and "advantages" in batch
    assert m["timing_s/op/ResponseLength"] >= 0 and math.isfinite(m["loss"])

    threshold = DataStream(trainer=trainer).add_operator(RolloutOperator())
    threshold.add_operator(RewardOperator(length_score)).add_operator(FilterOperator(threshold=1.0))
    threshold.add_operator(PPOUpdateOperator())
    m = threshold.step()
    assert (threshold.last_batch["token_level_scores"].sum(-1) >= 1.0).all()
    assert m["filter/kept"] == len(threshold.last_batch)


@pytest.mark.slow
def test_multi_reward_scorer_sums_weighted_scores(trainer):
    multi = MultiRewardScorer([("verl/arithmetic", 1.0), (length_score, 0.5)])
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(multi)
    stream.add_operator(PPOUpdateOperator())
    m = stream.step()
    a, b = m["reward/verl/arithmetic/mean"], m["reward/length_score/mean"]
    assert m["reward/length_score/weight"] == 0.5
    assert m["reward_mean"] == pytest.approx(1.0 * a + 0.5 * b, abs=1e-6)


@pytest.mark.slow
def test_weighted_filter_scales_each_samples_loss(trainer):
    weighted = WeightedFilterOperator(fn=lambda s: 2.0 if s["reward"] > 0 else 0.25)
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator(length_score))
    stream.add_operator(weighted).add_operator(PPOUpdateOperator())
    m = stream.step()
    batch = stream.last_batch
    reward = batch["token_level_scores"].sum(-1)
    assert len(batch) == 16  # weighted, not dropped
    assert batch["sample_weight"].tolist() == [2.0 if r > 0 else 0.25 for r in reward.tolist()]
    assert m["filter/weight_min"] == 0.25 and m["filter/weight_max"] == 2.0
    assert m["actor/pg_loss"] != 0

    # Weight 0 everywhere: no sample contributes, so the policy and KL losses are exactly 0.
    zero = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator(length_score))
    zero.add_operator(WeightedFilterOperator({"verl/arithmetic": 0.0}, field="data_source", default=None))
    m = zero.add_operator(PPOUpdateOperator()).step()
    assert m["actor/pg_loss"] == 0.0 and m["actor/kl_loss"] == 0.0
    with pytest.raises(ValueError, match=r"value 'verl/arithmetic' has no weight.*set default="):
        WeightedFilterOperator({"other": 1.0}, field="data_source", default=None).weight_of({"data_source": "verl/arithmetic"})
    with pytest.raises(ValueError, match=r"no field 'extra_info.tier'"):
        WeightedFilterOperator({"gold": 1.0}, field="extra_info.tier").weight_of({"extra_info": {"split": "train"}})


@pytest.mark.slow
def test_group_filter_drops_groups_whose_rewards_are_all_equal(trainer):
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator(length_score))
    seen = []

    class Record:
        inputs, outputs = ("token_level_scores",), ()

        def process(self, batch):
            seen.append((list(batch.non_tensors["uid"]), batch["token_level_scores"].sum(-1).tolist()))
            return batch

    stream.add_operator(Record()).add_operator(GroupFilterOperator()).add_operator(PPOUpdateOperator())
    m = stream.step()
    uids, rewards = seen[0]
    groups: dict[str, set[float]] = {}
    for uid, r in zip(uids, rewards):
        groups.setdefault(uid, set()).add(r)
    spread = {uid for uid, values in groups.items() if len(values) > 1}
    assert m["filter/kept_groups"] == len(spread) and m["filter/dropped_groups"] == len(groups) - len(spread)
    assert set(stream.last_batch.non_tensors["uid"]) == spread
    assert len(stream.last_batch) == 4 * len(spread)


@pytest.mark.slow
def test_conditional_update_routes_each_sample_and_both_branches_train(trainer, monkeypatch):
    import torch

    def params():
        return torch.cat([p.detach().flatten().clone() for p in trainer.actor.engine.chunks[0].parameters()])

    calls = []

    def recorded(name, fn):
        def call(batch, *args, **kwargs):
            before = params()
            out = fn(batch, *args, **kwargs)
            calls.append((name, list(batch.non_tensors["uid"]), batch["responses"].clone(), before, params()))
            return out

        return call

    monkeypatch.setattr(trainer.pieces, "update_step", recorded("ppo", trainer.pieces.update_step))
    monkeypatch.setattr(trainer.pieces, "update_preference", recorded("dpo", trainer.pieces.update_preference))
    even_prompt = lambda s: int(s["uid"].split("/")[-1]) % 2 == 0  # noqa: E731 (uid: step/draw/prompt)
    cond = ConditionalUpdateOperator(
        condition=even_prompt, true_branch=PPOUpdateOperator(), false_branch=DPOUpdateOperator(beta=0.1)
    )
    seen = []

    class Record:
        inputs, outputs = ("token_level_scores",), ()

        def process(self, batch):
            seen.append(batch)
            return batch

    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator(length_score))
    stream.add_operator(Record()).add_operator(cond)
    start = trainer.global_step
    m = stream.step()
    assert trainer.global_step == start + 1  # one step, two updates
    batch = seen[0]
    uids = list(batch.non_tensors["uid"])
    reward = batch["token_level_scores"].sum(-1).tolist()
    true_rows = [i for i, u in enumerate(uids) if int(u.split("/")[-1]) % 2 == 0]
    false_rows = [i for i in range(len(uids)) if i not in true_rows]
    assert cond.last_routes["true"] == true_rows and cond.last_routes["false"] == false_rows
    expected_pairs = []
    for uid in dict.fromkeys(uids[i] for i in false_rows):
        rows = [i for i in false_rows if uids[i] == uid]
        best = max(rows, key=lambda i: (reward[i], -i))
        worst = min(rows, key=lambda i: (reward[i], i))
        if reward[best] > reward[worst]:
            expected_pairs.append((best, worst))
    assert cond.last_routes["pairs"] == expected_pairs and expected_pairs, "the seed's odd groups should give pairs"
    (ppo_name, ppo_uids, ppo_resp, b0, a0), (dpo_name, dpo_uids, dpo_resp, b1, a1) = calls
    assert ppo_name == "ppo" and ppo_uids == [uids[i] for i in true_rows]
    assert torch.equal(ppo_resp, batch["responses"][true_rows])
    rows = [i for pair in expected_pairs for i in pair]
    assert dpo_name == "dpo" and torch.equal(dpo_resp, batch["responses"][rows])
    assert (a0 != b0).any() and (a1 != b1).any()  # both branches changed the actor's weights
    assert torch.equal(b1, a0)  # the DPO update starts from the PPO update's weights
    assert m["conditional/dpo_pairs"] == len(expected_pairs) and math.isfinite(m["dpo/loss"])
    assert m["dpo/actor/grad_norm"] > 0 and m["actor/grad_norm"] > 0


def test_missing_input_fails_at_build_naming_the_field():
    # No trainer is built: DataStream(model=...) builds its own only on the first step.
    stream = DataStream(model="unused").add_operator(RolloutOperator())
    with pytest.raises(ValueError, match="PPOUpdateOperator needs field 'token_level_scores'"):
        stream.add_operator(PPOUpdateOperator())
    with pytest.raises(ValueError, match="ResponseLength needs field 'response_mask'"):
        DataStream(model="unused").add_operator(ResponseLength())
    with pytest.raises(TypeError, match="needs a process"):
        stream.add_operator(object())
    with pytest.raises(ValueError, match="unknown estimator"):
        PPOUpdateOperator(estimator="nope")


@pytest.mark.slow
def test_operator_settings_must_match_a_given_trainer(trainer):
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator())
    with pytest.raises(ValueError, match="algorithm.adv_estimator='gae' but the trainer was built with"):
        stream.add_operator(PPOUpdateOperator(estimator="gae"))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.n=8"):
        DataStream(trainer=trainer).add_operator(RolloutOperator(n=8))


class CountCalls:
    inputs = ("responses",)
    outputs = ()

    def __init__(self):
        self.calls = 0

    def process(self, batch):
        self.calls += 1
        return batch


@pytest.mark.slow
def test_stream_fit_runs_its_step_in_the_trainer_loop(trainer):
    counter = CountCalls()
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(counter)
    stream.add_operator(RewardOperator()).add_operator(PPOUpdateOperator())
    start = trainer.global_step
    m = stream.fit(stop_after=start + 1)
    assert counter.calls == 1 and trainer.global_step == start + 1
    assert m["training/global_step"] == start + 1 and "timing_s/op/CountCalls" in m
    assert m["reward/config/mean"] == m["critic/score/mean"]  # the config's verl/arithmetic scorer


@pytest.mark.slow
def test_device_map_must_agree_with_a_given_trainer(trainer):
    stream = DataStream(trainer=trainer, device_map={"actor": [0], "rollout_sampler": "cpu", "reference": "cpu:0"})
    assert (stream.placement.device, stream.placement.devices) == ("cpu", (0,))
    with pytest.raises(ValueError, match=r"names cpu device\(s\) \[1\] that do not exist: the launched world has 1"):
        DataStream(trainer=trainer, device_map={"actor": [0, 1]})
    with pytest.raises(ValueError, match=r"names cuda devices .* but trainer.device=cpu"):
        DataStream(trainer=trainer, device_map={"actor": "cuda:0"})


@pytest.mark.slow
def test_dynamic_batch_size_splits_generation_and_keeps_greedy_samples(trainer, monkeypatch):
    import dataclasses

    import torch

    engine = trainer.rollout.engine
    # The transformers engine's report: free host memory over K+V bytes per token (2 layers x
    # 2 KV heads x 32 x float32 x K and V = 1024 bytes); none while released for training.
    assert engine.kv_bytes_per_token() == 1024 and engine.kv_token_budget() == 0
    with trainer.rollout.phase():
        assert engine.kv_token_budget() > 0
    prompts = trainer.pieces.prompt_batch(0)
    seed = trainer.pieces.sampling_seed(0)
    fields = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids")

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in fields) and list(a.non_tensors["uid"]) == list(b.non_tensors["uid"])

    # Room for everything: one call of the 16 sequences, the samples of an unsplit call (sampled).
    whole, _ = trainer.pieces.generate(prompts, seed=seed)
    one, m = trainer.pieces.generate(prompts, seed=seed, call_sizes=(4, 32))
    assert same(one, whole) and (m["rollout/num_calls"], m["rollout/batch_size"]) == (1.0, 16.0)

    # Greedy, with the engine reporting room for 8 sequences of 24 + 8 tokens: 2 calls of 2 prompts,
    # the same samples as one call; a budget below min_batch_size: calls of min_batch_size = 1 prompt.
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, do_sample=False))
    greedy, _ = trainer.pieces.generate(prompts, seed=seed)
    for budget, sizes, calls, size in ((8 * 32, (4, 32), 2.0, 8.0), (10, (4, 32), 4.0, 4.0), (10**9, (4, 8), 2.0, 8.0)):
        monkeypatch.setattr(engine, "kv_token_budget", lambda b=budget: b)
        split, m = trainer.pieces.generate(prompts, seed=seed, call_sizes=sizes)
        assert same(split, greedy), budget
        assert (m["rollout/num_calls"], m["rollout/batch_size"], m["rollout/kv_token_budget"]) == (calls, size, budget)
        assert m["rollout/num_sequences"] == 16.0 and m["rollout/num_tokens"] == split["response_mask"].sum().item()
    monkeypatch.setattr(engine, "kv_token_budget", lambda: None)
    with pytest.raises(ValueError, match=r"the 'hf' rollout engine reports no memory"):
        trainer.pieces.generate(prompts, seed=seed, call_sizes=(4, 32))
    monkeypatch.undo()

    # Through the operator, in a step; and its misuse.
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator(dynamic_batch_size=True, min_batch_size=4, max_batch_size=8))
    stream.add_operator(RewardOperator(length_score)).add_operator(PPOUpdateOperator())
    m = stream.step()
    assert (m["rollout/num_calls"], m["rollout/batch_size"]) == (2.0, 8.0) and len(stream.last_batch) == 16
    with pytest.raises(ValueError, match=r"max_batch_size=2\) is below actor_rollout_ref.rollout.n=4"):
        DataStream(trainer=trainer).add_operator(RolloutOperator(dynamic_batch_size=True, max_batch_size=2)).run_operators()
    with pytest.raises(ValueError, match=r"min_batch_size=8, max_batch_size=4\): min is above max"):
        RolloutOperator(dynamic_batch_size=True, min_batch_size=8, max_batch_size=4)
    with pytest.raises(ValueError, match=r"add dynamic_batch_size=True or drop them"):
        RolloutOperator(min_batch_size=4)
    with pytest.raises(ValueError, match=r"min_batch_size=0\): a number of sequences"):
        RolloutOperator(dynamic_batch_size=True, min_batch_size=0)


def test_a_stream_given_a_trainer_replaces_its_pipeline(trainer):
    """One pipeline per run (issue #52): the stream's step is the trainer's step from then on, so the
    trainer's own loop, checkpoints and holds run the stream's operators, not a second pipeline beside them."""
    stream = DataStream(trainer=trainer).add_operator(RolloutOperator()).add_operator(RewardOperator(length_score))
    assert trainer.pipeline is stream._pipeline
    assert [type(op).__name__ for op in trainer.pipeline.operators] == ["RolloutOperator", "RewardOperator"]
    again = DataStream(trainer=trainer)
    assert trainer.pipeline is again._pipeline and trainer.stream is None
