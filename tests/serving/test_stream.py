"""In a real ``DataStream`` (an RLTrainer on the tiny model, a world of one, the transformers
engine): ``HumanReviewOperator`` between the reward and the update, and ``stream.export_as_api()``
serving the actor it trains."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="fastapi is the serve extra")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from verl.operator import (  # noqa: E402
    DataStream,
    HumanReviewOperator,
    PPOUpdateOperator,
    RewardOperator,
    RolloutOperator,
    build_config,
    build_trainer,
)
from verl.api.review import REVIEW_DB_FILE  # noqa: E402

FAST = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.name=hf",
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=24",
    "data.max_response_length=6",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "trainer.total_training_steps=5",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.save_hf=false",
    "trainer.resume_mode=disable",
    "trainer.logger=[jsonl]",
    "data.val_files=null",
]


def half_score(data_source, solution_str, ground_truth, extra_info=None):
    """Every response scores 0.5: all of them fall in the review band."""
    return 0.5


@pytest.fixture(scope="module")
def arithmetic_file(tmp_path_factory) -> str:
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic

    out = tmp_path_factory.mktemp("arith-serving")
    train, _ = arithmetic.generate_splits(train=64, val=0, digits=1, seed=0)
    write_parquet(train, str(out / "train.parquet"))
    return str(out / "train.parquet")


@pytest.mark.slow
def test_review_in_a_stream_then_serve_the_trained_actor(tiny_model_dir, arithmetic_file, tmp_path):
    saved = dict(os.environ)
    cfg = build_config(
        model=tiny_model_dir,
        train_files=arithmetic_file,
        overrides=[
            *FAST,
            f"trainer.default_local_dir={tmp_path}/run",
            f"trainer.log_dir={tmp_path}/run/logs",
        ],
    )
    trainer, started = build_trainer(cfg)
    app = None
    try:
        review = HumanReviewOperator(lambda s: 0.2 < s["reward"] < 0.8, timeout_s=120)
        stream = (
            DataStream(trainer=trainer)
            .add_operator(RolloutOperator())
            .add_operator(RewardOperator(half_score))
            .add_operator(review)
            .add_operator(PPOUpdateOperator())
        )
        # A reviewer rejects the first sample and scores the rest 1.0, while the step waits.
        decided: list[int] = []

        def reviewer() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(decided) < 4:
                if review._server is not None:
                    for item in httpx.get(review.url + "/api/pending", timeout=10).json()["items"]:
                        body = (
                            {"decision": "reject"}
                            if item["sample_index"] == 0
                            else {"decision": "score", "score": 1.0}
                        )
                        httpx.post(f"{review.url}/api/items/{item['id']}/review", json=body, timeout=10)
                        decided.append(item["sample_index"])
                time.sleep(0.1)

        thread = threading.Thread(target=reviewer, daemon=True)
        thread.start()
        metrics = stream.step()
        thread.join(30)
        assert sorted(decided) == [0, 1, 2, 3]
        # The update trained on the human rewards: 0 for the rejected sample, 1.0 for the others.
        assert (
            metrics["review/reviewed"] == 4
            and metrics["review/rejected"] == 1
            and metrics["review/scored"] == 3
        )
        assert stream.last_batch["token_level_scores"].sum(-1).tolist() == [0.0, 1.0, 1.0, 1.0]
        assert metrics["critic/score/mean"] == pytest.approx(0.75)
        assert metrics["reward_mean"] == pytest.approx(0.5)  # the reward operator's own scores
        assert os.path.isfile(os.path.join(tmp_path, "run", REVIEW_DB_FILE))  # in the run directory
        assert trainer.global_step == 1

        app = stream.export_as_api(str(tmp_path / "export"), engine="hf", name="policy", device="cpu")
        with TestClient(app) as client:
            info = client.get("/model").json()
            assert info["name"] == "policy" and info["step"] == 1
            body = client.post(
                "/generate", json={"prompts": ["1 + 2 ="], "sampling": {"temperature": 0, "max_tokens": 6}}
            ).json()
        assert len(body["outputs"][0]["responses"][0]["token_ids"]) >= 1
        # The served model is the trained actor: the exported weights moved away from the start
        # (one update at lr 1e-3), and the engine serves exactly the exported tensors.
        from safetensors.torch import load_file

        def weights(d: str) -> dict:
            out = {}
            for name in sorted(os.listdir(d)):
                if name.endswith(".safetensors"):
                    out.update(load_file(os.path.join(d, name)))
            return out

        start, exported = weights(tiny_model_dir), weights(str(tmp_path / "export"))
        assert sorted(start) == sorted(exported)
        assert any(not torch.equal(start[k], exported[k]) for k in start)
        served = dict(app.state.model.engine.named_parameters())
        for name, tensor in exported.items():
            if name in served:
                assert torch.equal(served[name].detach().cpu(), tensor.to(served[name].dtype)), name
        stream.close()
    finally:
        if app is not None:
            app.state.model.close()
        trainer.close()
        if started:
            from verl.parallel.bootstrap import destroy_distributed

            destroy_distributed()
        os.environ.clear()
        os.environ.update(saved)
