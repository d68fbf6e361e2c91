"""``model.use_remove_padding``: the reference's key loads, and what it does where verl has no THD path.

verl builds no packed (THD) path. On the local spec (no Transformer Engine: every CPU run) True
runs the trimmed padded micro-batches, so an engine with it gives exactly the outputs and the
step of one without, and says so once; on the Transformer Engine spec True is refused rather
than silently ignored (``verl.engine.build.check_remove_padding``).
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


def test_transformer_engine_spec_refuses_it():
    from verl.engine.build import check_remove_padding

    refused = r"use_remove_padding=true.*Transformer Engine.*set use_remove_padding=false"
    with pytest.raises(ValueError, match=refused):
        check_remove_padding(True, "transformer_engine")
    check_remove_padding(False, "transformer_engine")  # off: nothing to refuse


def test_local_spec_logs_once(caplog):
    from verl.engine.build import check_remove_padding

    with caplog.at_level(logging.WARNING, logger="verl.engine.build"):
        check_remove_padding(False, "local")
        assert not caplog.records
        for _ in range(3):
            check_remove_padding(True, "local")
    # warn_once: at most one per process (an earlier test in this process may have taken it).
    assert len([r for r in caplog.records if "use_remove_padding" in r.getMessage()]) <= 1


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

    logging.getLogger("verl.engine.build").addHandler(Keep(level=logging.WARNING))
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
def test_on_gives_the_outputs_of_off_on_the_local_spec(tiny_model_dir, arithmetic_files):
    out = run_distributed(_on_and_off, 1, tiny_model_dir, arithmetic_files["train"])[0]
    assert out["real_tokens"] < ROWS * out["width"]  # the batch has padding to remove
    expected, actual = out[False], out[True]
    # Exact: with True the engine runs the same trimmed padded path as with False.
    for key in ("logprobs", "entropy"):
        assert torch.equal(actual["forward"][key], expected["forward"][key]), key
    assert actual["step"] == expected["step"]
    assert torch.equal(actual["after"], expected["after"])
    said = [m for m in out["messages"] if "use_remove_padding" in m]
    assert len(said) == 1 and "local spec" in said[0] and "trimmed" in said[0]
