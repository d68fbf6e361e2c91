"""``trainer.async_training.free_running``: async GRPO with partial rollout, the rollout on rank 1
of 2 (and on ranks 1 and 2 of 3, data parallel), ``max_staleness=2``, responses of 12 tokens in
segments of 5 (and on 2 ranks in whole batches, without partial rollout), and the reward slowed by
a sleep on every rank (the main thread's work outside the update window). A generator thread on
the rollout's ranks generates without stopping at step boundaries.

Which version samples which token depends on timing, so the test asserts what does not:

- the thread generated while the main thread was scoring the reward (outside any update window:
  the fixed schedule and ``fill_update_window`` generate only inside it), and only the thread did
  after the first batch; the actor's rank generated nothing;
- every segment (every batch, without partial rollout) ran on the weights of the version it records (the engine's weights, summed, at each
  segment: one sum per version, a different one for each), so no segment ran while the weights were
  being pushed in place;
- per sample, the bound; per token, versions non-decreasing, the first the sample's
  ``rollout_version``, each at most the version its update starts from;
- with the reference on the rollout's rank, the log-probs the thread computed for each trained batch
  equal, bit for bit, those the reference computes for it again after the step;
- with two rollout ranks, both ran the same segments with the same weights (each segment is a
  collective of theirs: a rank that paused alone would hang the other);
- a run stopped after step 2 and resumed from its checkpoint loses nothing: each batch the
  checkpoint holds in flight is continued, its samples' saved tokens (and their versions) the
  start of what step 3 and 4 train.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from verl.testing.distributed import run_distributed

from .test_partial_rollout_trainer import PARTIAL
from .test_rollout_modes import APART, _metrics, config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DEPTH = 2
SLOW_REWARD_S = 1.5
FREE = ["trainer.async_training.free_running=true"]
GENERATOR = "verl-free-running-generator"  # verl.trainer.step.generator's thread


def _body(model_dir: str, files: dict[str, str], root: str, world: int, name: str, *extra: str,
          stop_after: int | None = None, resume: str = "disable", partial: bool = True) -> dict:
    """One run (``extra`` overrides); what it trained and generated, on this rank."""
    import threading
    import time

    import torch

    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.trainer.step import ops
    from verl.trainer.step.partial import PartialBatch

    cfg = config(
        model_dir, files, f"{root}/{name}", *(PARTIAL if partial else [p for p in PARTIAL if "partial_rollout" not in p]),
        *FREE, *extra,
        *(APART if world == 2 else ["trainer.placement.rollout=[1,2]", "trainer.n_gpus_per_node=3"]),
        resume=resume, world_size=world,
    )
    seen: dict[int, dict[str, list]] = {}
    main = ["start"]  # what the main thread does now
    segments: list[tuple[str, str, str, int, float]] = []  # (thread, main's doing, batch uid, version, weights)
    with PPOTrainer(cfg) as trainer:
        update_step, advance, reward = trainer.pieces.update_step, PartialBatch.advance, ops.RewardOperator.process

        def recording(batch, metrics=None):
            step = trainer.pieces.step_in_progress()
            seen[step] = {key: batch[key].tolist() for key in ("rollout_token_versions", "rollout_version", "response_mask", "responses")
                          if key in batch}
            if trainer.world.ref_ahead and trainer.reference is not None:  # computed on the thread: again here
                again = batch.select([k for k in batch.tensors if k != "ref_log_prob"])
                seen[step]["ref_equal"] = torch.equal(trainer.pieces.compute_ref_log_prob(again)["ref_log_prob"], batch["ref_log_prob"])
            main[0] = "update"
            try:
                return update_step(batch, metrics)
            finally:
                main[0] = "between"

        def slow_reward(self, batch):
            main[0] = "reward"
            time.sleep(SLOW_REWARD_S)
            try:
                return reward(self, batch)
            finally:
                main[0] = "between"

        def counting(self, segment, version):  # the rollout's ranks
            weights = sum(float(p.detach().double().sum()) for p in trainer.rollout.engine.model.parameters())
            uid = self.prompts.non_tensors["uid"][0]
            segments.append((threading.current_thread().name, main[0], uid, int(version), weights))
            return advance(self, segment, version)

        if trainer.rollout is not None and not partial:  # whole batches: each engine call, its version read after
            generate = trainer.rollout.generate

            def calling(prompts, **kwargs):
                weights = sum(float(p.detach().double().sum()) for p in trainer.rollout.engine.model.parameters())
                segments.append((threading.current_thread().name, main[0], prompts.non_tensors["uid"][0], -1, weights))
                return generate(prompts, **kwargs)

            trainer.rollout.generate = calling
        trainer.pieces.update_step = recording
        ops.RewardOperator.process = slow_reward
        PartialBatch.advance = counting
        try:
            start = trainer.resume()
            trainer.fit(stop_after=stop_after)
        finally:
            PartialBatch.advance, ops.RewardOperator.process = advance, reward
        if not partial:  # each batch's version: every sample of it has the one that generated it
            began = {step: batch["rollout_version"] for step, batch in seen.items()}
            assert all(len(set(v)) == 1 for v in began.values()), began
            segments = [(*s[:3], began[int(s[2].split("/")[0]) + 1][0], s[4]) for s in segments]
        out = {"start": start, "steps": trainer.global_step, "seen": seen, "segments": segments,
               "rank": torch.distributed.get_rank(), "threads": [t.name for t in threading.enumerate()]}
    out["after_close"] = [t.name for t in threading.enumerate()]
    out["metrics"] = _metrics(f"{root}/{name}/logs", keep_all=True) if out["rank"] == 0 else None
    return out


def _check_batches(seen: dict[int, dict[str, list]]) -> None:
    for step, batch in seen.items():
        assert all(0 <= (step - 1) - began <= DEPTH for began in batch["rollout_version"]), (step, batch["rollout_version"])
        if "rollout_token_versions" not in batch:  # whole batches: one version each
            continue
        for versions, mask, began in zip(batch["rollout_token_versions"], batch["response_mask"], batch["rollout_version"]):
            length = int(sum(mask))
            sampled, pads = versions[:length], versions[length:]
            assert length > 0 and sampled[0] == began and pads == [-1] * len(pads), (step, versions)
            assert all(a <= b for a, b in zip(sampled, sampled[1:])), (step, versions)
            assert max(sampled) <= step - 1, (step, versions)


def _check_weights(segments: list) -> None:
    weights: dict[int, set[float]] = {}
    for *_, version, total in segments:
        weights.setdefault(version, set()).add(total)
    assert all(len(sums) == 1 for sums in weights.values()), weights
    assert len({next(iter(sums)) for sums in weights.values()}) == len(weights), weights


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world", "partial", "extra"), [
    (2, True, ()), (3, True, ()), (2, False, ()),
    (2, True, ("trainer.placement.ref=[1]",)),  # the reference on the rollout's rank: the thread computes its log-probs
])
def test_free_running_generator_keeps_generating_across_steps(tiny_model_dir, arithmetic_files, tmp_path, world, partial, extra):
    [actor, rollout, *more] = run_distributed(_body, world, tiny_model_dir, arithmetic_files, str(tmp_path), world, "free",
                                              *extra, partial=partial, timeout=840)
    assert actor["steps"] == rollout["steps"] == 4
    assert actor["segments"] == [] and GENERATOR not in actor["threads"]  # the actor's rank generates nothing
    assert GENERATOR in rollout["threads"] and GENERATOR not in rollout["after_close"]  # stopped by close()
    segments = rollout["segments"]
    # The first batch is generated at step 1 by the main thread; the thread generated while the
    # main thread scored the reward, outside any update window.
    assert {s[0] for s in segments if s[2].startswith("0/")} == {"MainThread"}
    assert any(s[0] == GENERATOR and s[1] == "reward" for s in segments), [s[:4] for s in segments]
    _check_weights(segments)
    for other in more:  # the second rollout rank: the same segments on the same weights
        assert other["steps"] == 4 and other["seen"] == rollout["seen"]
        assert [s[2:] for s in other["segments"]] == [s[2:] for s in segments]
    ref_equal = [batch.pop("ref_equal", None) for batch in rollout["seen"].values()]
    assert ref_equal == ([True] * 4 if "trainer.placement.ref=[1]" in extra else [None] * 4), ref_equal
    assert actor["seen"] == rollout["seen"]  # every rank trains the same batch
    _check_batches(actor["seen"])
    metrics = actor["metrics"]
    assert metrics[4]["staleness/max"] <= DEPTH
    assert sum(metrics[s]["async/free_segments"] for s in (2, 3, 4)) > 0
    if not partial:  # a batch per unit: the thread generated steps 2-4's
        assert [s[2] for s in segments if s[0] == GENERATOR] == ["1/0/0", "2/0/0", "3/0/0"]
    assert all(metrics[s]["timing_s/gen_free"] >= 0 for s in (2, 3, 4))


@pytest.mark.timeout(900)
def test_free_running_resumes_the_batches_in_flight(tiny_model_dir, arithmetic_files, tmp_path):
    root = str(tmp_path)
    killed = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, root, 2, "run", "trainer.save_freq=1",
                             stop_after=2, timeout=840)
    assert [k["steps"] for k in killed] == [2, 2]
    queue = os.path.join(root, "run", "global_step_2", "rollout_queue")
    with open(os.path.join(queue, "index.json"), encoding="utf-8") as f:
        saved = json.load(f)["batches"]
    assert [entry["step"] for entry in saved] == [3, 4]
    resumed = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, root, 2, "run", "trainer.save_freq=1",
                              resume="auto", timeout=840)
    assert [(r["start"], r["steps"]) for r in resumed] == [(2, 4), (2, 4)]
    seen = resumed[0]["seen"]
    assert sorted(seen) == [3, 4] and resumed[1]["seen"] == seen
    _check_batches(seen)
    _check_weights(resumed[1]["segments"])
    continued = 0
    for i, entry in enumerate(saved):  # nothing the checkpoint held is lost: each sample goes on from it
        batch = seen[entry["step"]]
        if entry["partial"]:
            state = torch.load(os.path.join(queue, f"{i}.partial", "state.pt"), weights_only=True)
            tokens, versions = state["tokens"], state["versions"]
        elif entry["begun"]:
            from verl.protocol import Batch

            done = Batch.load(os.path.join(queue, f"{i}.batch"))
            lengths = done["response_mask"].long().sum(-1).tolist()
            tokens = [row[:k] for row, k in zip(done["responses"].tolist(), lengths)]
            versions = [row[:k] for row, k in zip(done["rollout_token_versions"].tolist(), lengths)]
        else:
            continue  # drawn, not begun: nothing generated yet
        for j, (kept, kept_versions) in enumerate(zip(tokens, versions)):
            assert batch["responses"][j][: len(kept)] == kept, (entry["step"], j)
            assert batch["rollout_token_versions"][j][: len(kept)] == kept_versions, (entry["step"], j)
            continued += len(kept)
    assert continued > 0  # the checkpoint held generated tokens (the thread ran between steps 2's push and its save)
