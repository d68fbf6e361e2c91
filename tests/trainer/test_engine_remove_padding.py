"""``model.use_remove_padding``: the reference's key loads, and the engine runs packed sequences with it.

True packs each micro-batch's rows into one row of their real tokens (Megatron's THD layout,
``verl.models.packing``; the model-level checks against transformers are in
``tests/models/test_packed_sequences.py``). Here: the engine with it gives the outputs and the
training step of the engine without (float rounding apart: the same math on other shapes), on
an SFT batch with real padding, and says which attention runs the packed rows; context
parallelism is accepted (each sequence split over CP: ``tests/models/test_context_parallel.py``).
"""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS = 6


def test_key_loads_from_yaml_and_override(tmp_path):
    from verl.config import PPOConfig, load_config

    assert PPOConfig().actor_rollout_ref.model.use_remove_padding is False  # the reference's default
    assert PPOConfig().critic.model.use_remove_padding is False
    f = tmp_path / "rmpad.yaml"
    f.write_text(textwrap.dedent("""
        actor_rollout_ref:
          model:
            use_remove_padding: true
        """))
    cfg = load_config(PPOConfig, config_file=f, overrides=["critic.model.use_remove_padding=true"])
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert cfg.critic.model.use_remove_padding is True
    off = ["actor_rollout_ref.model.use_remove_padding=false"]
    cfg = load_config(PPOConfig, config_file=f, overrides=off)
    assert cfg.actor_rollout_ref.model.use_remove_padding is False


def test_context_parallel_is_accepted():
    from verl.engine.build import check_remove_padding

    for impl in ("local", "transformer_engine"):
        check_remove_padding(True, impl, cp_size=2, log=False)
        check_remove_padding(False, impl, cp_size=2)


def test_the_log_names_the_attention_that_runs_packed_rows(caplog):
    from verl.engine.build import check_remove_padding

    with caplog.at_level(logging.INFO, logger="verl.engine.build"):
        check_remove_padding(False, "local")
        assert not caplog.records
        check_remove_padding(True, "local")
        check_remove_padding(True, "transformer_engine")
        check_remove_padding(True, "local", log=False)  # not the group's first rank: silent
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("packed row" in m and "THD" in m for m in said), said
    assert "verl.models.varlen_attention" in said[0] and "Transformer Engine" in said[1]


def _on_and_off(model_dir: str, data_file: str) -> dict:
    from verl.algos import agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.data.sft_dataset import SFTDataset
    from verl.data.tokenizer import load_tokenizer
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    build_logger = logging.getLogger("verl.engine.build")
    build_logger.setLevel(logging.INFO)
    build_logger.addHandler(Keep(level=logging.INFO))
    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    dataset = SFTDataset(
        data_file, load_tokenizer(model_dir), max_length=32, response_key="extra_info.answer"
    )
    rows = [dataset[i] for i in range(ROWS)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def loss_fn(outputs, micro_batch):
        return LossShare(agg_loss(-outputs["logprobs"], micro_batch["loss_mask"].float(), "token-mean"))

    out = {}
    for flag in (False, True):
        engine = MegatronEngine(
            model=ModelConfig(path=model_dir, use_remove_padding=flag),
            megatron=MegatronConfig(),
            pg=pg,
            optim=OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0),
            total_training_steps=10,
        )
        logprobs = engine.forward(batch, micro_batch_size=2, with_entropy=True).outputs
        step = engine.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
        after = engine.forward(batch, micro_batch_size=3).outputs["logprobs"]
        out[flag] = {"forward": logprobs, "step": (step.loss, step.grad_norm), "after": after}
    out["messages"] = messages
    out["real_tokens"] = int(batch["attention_mask"].sum())
    out["width"] = batch["attention_mask"].shape[1]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_on_gives_the_outputs_and_step_of_off(tiny_model_dir, arithmetic_files):
    out = run_distributed(_on_and_off, 1, tiny_model_dir, arithmetic_files["train"])[0]
    assert out["real_tokens"] < 0.8 * ROWS * out["width"]  # the batch has padding to remove
    expected, actual = out[False], out[True]
    # float32; the same math on packed shapes: rounding only (a token seeing another row, or a
    # rotary position not restarted at a row's start, is off by > 1e-2). Measured on a model of this
    # fixture's kind: forward and loss equal, gradient norm 1e-7 relative, weights after the SGD step
    # (lr 1: log-probabilities of ~-10 move by whole units) 9.5e-7 apart.
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(
            actual["forward"][key], expected["forward"][key], rtol=0, atol=2e-6, msg=key
        )
    assert actual["step"][0] == pytest.approx(expected["step"][0], rel=1e-6)  # loss
    assert actual["step"][1] == pytest.approx(expected["step"][1], rel=1e-6)  # gradient norm
    torch.testing.assert_close(actual["after"], expected["after"], rtol=0, atol=1e-5)
    said = [m for m in out["messages"] if "use_remove_padding" in m]
    assert len(said) == 1 and "packed row" in said[0] and "varlen_attention" in said[0], said
