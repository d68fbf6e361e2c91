"""Ulysses sequence parallelism on the FSDP2 engine (``fsdp_config.ulysses_sequence_parallel_size``).

Two gloo ranks, each with its own rows (as dispatch gives them): SP1 is the plain FSDP2 engine (DP2,
padded rows, transformers' own sdpa mask); SP2 runs every micro-batch of both ranks over both, packed,
each rank computing half of each turn's tokens and half of the heads in attention. Log-probs, entropy,
values, one clipped Adam step's gradients and the weights after it must agree within 1e-5 (fp32): the
two run the same math in other shapes -- packed rows instead of padded ones, attention over the
whole packed row with a block mask, each layer's matmuls over half the tokens, and each gradient
summed over the two ranks' halves by FSDP2's reduce-scatter -- so float32 rounding differs
(measured <= 4.8e-7 here; docs/fsdp2.md). Models: tiny Qwen2 (4 heads, 2 KV heads) and
Llama (4 heads, 1 KV head: repeated to split over 2 ranks), random init, made here.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from verl.testing.distributed import run_distributed

VOCAB, PROMPT, RESPONSE = 64, 7, 6


def _model(kind: str, head: str = "lm") -> torch.nn.Module:
    from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, attn_implementation="sdpa")
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **common))
    cfg = Qwen2Config(num_key_value_heads=2, **common)
    if head == "value":
        cfg.num_labels, cfg.pad_token_id = 1, 0
        return Qwen2ForSequenceClassification(cfg)
    return Qwen2ForCausalLM(cfg)


def _batch(rank: int) -> dict[str, torch.Tensor]:
    """Four rollout-layout rows of uneven lengths (prompts left-padded, responses right-padded); the
    ranks' rows differ, and so do their token counts."""
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(3, VOCAB, (4, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(4):
        mask[i, : (i + rank) % PROMPT] = 0  # left padding of the prompt
        right = (2 * i + rank) % RESPONSE
        if right:
            mask[i, -right:] = 0  # right padding of the response
    return {"input_ids": ids * mask, "attention_mask": mask, "response_mask": mask[:, PROMPT:].float(),
            "returns": torch.randn(4, RESPONSE, generator=gen)}


def _split(rank: int):
    """Uneven micro-batches: three rows then one on rank 0, one then three on rank 1."""
    from verl.models.micro_batches import MicroBatchSplit

    parts = ([0, 1, 2], [3]) if rank == 0 else ([0], [1, 2, 3])
    return MicroBatchSplit(parts=tuple(np.array(p) for p in parts), rows=3, pad=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().float()


def _run(sp: int, kind: str, head: str = "lm", drop_all_to_all: bool = False) -> dict:
    """Forward (log-probs and entropy, or values), one clipped Adam step, forward again."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import OptimConfig
    from verl.config.schema import FSDPConfig
    from verl.engine import LossShare
    from verl.engine.fsdp import FSDPEngine
    from verl.models import ulysses
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    patched = contextlib.nullcontext()
    if drop_all_to_all:  # each rank keeps its own chunks: attention sees only its own half of the tokens
        patched = pytest.MonkeyPatch.context()
    try:
        with patched as mp:
            if drop_all_to_all:
                mp.setattr(ulysses, "_all_to_all", lambda chunks, group: chunks.clone())
            # eps 1e-4: as tests/trainer/test_engine_fsdp.py, so Adam's division by tiny moments does not
            # magnify rounding differences into the weights.
            optim = OptimConfig(optimizer="adam", lr=1e-2, clip_grad=0.5, weight_decay=0.0, eps=1e-4)
            engine = FSDPEngine(_model(kind, head), pg=pg, fsdp=FSDPConfig(ulysses_sequence_parallel_size=sp),
                                optim=optim, total_training_steps=4, hf_dir=".", name="actor", head=head)
            rank = pg.dp.rank()
            local = _batch(rank)
            info = GlobalBatchInfo.from_masks([local["response_mask"]], group=pg.dp)
            output = "values" if head == "value" else "logprobs"

            def loss_fn(outputs, mb):
                if head == "value":
                    err = (outputs["values"][:, -RESPONSE:] - mb["returns"]) ** 2
                    return LossShare(agg_loss(err, mb["response_mask"], "token-mean", global_batch_info=info))
                lp, ent = outputs["logprobs"][:, -RESPONSE:], outputs["entropy"][:, -RESPONSE:]
                loss = agg_loss(-lp - 0.01 * ent, mb["response_mask"], "token-mean", global_batch_info=info)
                return LossShare(loss, {"tokens": mb["response_mask"].sum()})

            out = {"before": engine.forward(local, split=_split(rank), output=output, with_entropy=head == "lm").outputs}
            step = engine.train_step(local, split=_split(rank), loss_fn=loss_fn, output=output, with_entropy=head == "lm")
            out["loss"], out["norm"] = step.loss, step.grad_norm
            out["grads"] = {n: _full(p.grad) for n, p in engine.module.named_parameters()}
            out["weights"] = {n: _full(p) for n, p in engine.module.named_parameters()}
            out["after"] = engine.forward(local, micro_batch_size=2, output=output).outputs
            out["mask"] = local["attention_mask"]
            return out
    finally:
        ms.destroy_model_parallel()


def _diff(expected: dict, actual: dict) -> float:
    """The largest absolute difference over every output, the loss, the norm, gradients and weights."""
    worst = max(abs(expected["loss"] - actual["loss"]), abs(expected["norm"] - actual["norm"]))
    for phase in ("before", "after"):
        assert expected[phase].keys() == actual[phase].keys()
        for k, v in expected[phase].items():
            worst = max(worst, float((v - actual[phase][k]).abs().max()))
    for key in ("grads", "weights"):
        for name, v in expected[key].items():
            worst = max(worst, float((v - actual[key][name]).abs().max()))
    return worst


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,head", [("qwen2", "lm"), ("llama", "lm"), ("qwen2", "value")])
def test_sp2_equals_sp1(kind, head):
    """SP2 against SP1 on the same two ranks and rows: every output, the step's loss and gradient norm,
    every gradient and weight within 1e-5 (fp32 rounding of other shapes: module docstring)."""
    expected = run_distributed(_run, 2, 1, kind, head)
    actual = run_distributed(_run, 2, 2, kind, head)
    for rank, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert _diff(e, a) <= 1e-5, (rank, _diff(e, a))
        real = e["mask"].bool()
        key = "values" if head == "value" else "logprobs"
        assert bool((e["before"][key][real] != 0).any())  # real numbers were compared, not zeros
        assert bool((a["before"][key][~real] == 0).all())  # pads stay 0 as in the padded layout
    assert expected[0]["norm"] > 0.5  # the clip acted


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dropping_the_all_to_all_breaks_it():
    """Without the all-to-all (each rank's attention over its own half of a turn only) SP2 is far from SP1:
    the equality above tests the exchange, not two ranks that each compute alone."""
    expected = run_distributed(_run, 2, 1, "qwen2")
    actual = run_distributed(_run, 2, 2, "qwen2", drop_all_to_all=True)
    assert min(_diff(e, a) for e, a in zip(expected, actual, strict=True)) > 1e-3


def _refuse(sp: int, kind: str, fsdp_size: int = -1) -> str:
    from verl.config import OptimConfig
    from verl.config.schema import FSDPConfig
    from verl.engine.fsdp import FSDPEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=7)
    try:
        module = _model(kind) if kind != "plain" else torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8))
        FSDPEngine(module, pg=pg, fsdp=FSDPConfig(ulysses_sequence_parallel_size=sp), optim=OptimConfig(),
                   hf_dir=".", name="actor")
    except ValueError as e:
        return str(e)
    finally:
        ms.destroy_model_parallel()
    return ""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_engine_refuses_in_one_line():
    """The engine's own checks (the Python API builds engines without the config's validation)."""
    three, plain = run_distributed(_refuse, 2, 3, "qwen2")[0], run_distributed(_refuse, 2, 2, "plain")[0]
    assert "ulysses_sequence_parallel_size=3 does not divide the model's 4 attention heads" in three
    assert "runs transformers models, not Sequential" in plain
    for message in (three, plain):
        assert "\n" not in message and "set it to" in message


def test_config_refuses_before_any_model(tmp_path):
    """Validation names the key, the sizes and the fix, for the world, the heads and the strategy; the
    reference's keys are aliases."""
    import json

    from verl.config import load_config
    from verl.config.core import ConfigError
    from verl.config.schema import PPOConfig

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2}))
    base = ["trainer.n_gpus_per_node=4", f"actor_rollout_ref.model.path={tmp_path}", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "critic.ppo_micro_batch_size_per_gpu=1"]
    fsdp = ["actor_rollout_ref.actor.strategy=fsdp2"]

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            load_config(PPOConfig, overrides=[*base, *overrides], world_size=4)
        return str(info.value)

    key = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
    assert f"{key}=3 does not divide the actor's ranks, 4" in error(*fsdp, f"{key}=3")
    assert f"{key}=4 does not divide the model's 6 attention heads" in error(*fsdp, f"{key}=4")
    assert "set actor_rollout_ref.actor.strategy=fsdp2" in error("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    cfg = load_config(PPOConfig, overrides=[*base, *fsdp, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                            "critic.strategy=fsdp2", "critic.ulysses_sequence_parallel_size=2"],
                      world_size=4)
    assert cfg.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size == 2  # follows the actor
    assert cfg.critic.fsdp_config.ulysses_sequence_parallel_size == 2
