"""R3 router replay with the vLLM engine: what runs on CPU (the engine side needs a GPU build, see
tests/models/test_router_replay_r3.py -k device). vLLM 0.32's ``CompletionOutput.routed_experts`` holds
[tokens, MoE layers, K] for every token it ran through the model: prompt and response, not the last
sampled token (never fed back). verl's ``Sample.routed_experts`` covers prompt + response, -1 in that
last row (``router_replay.NOT_ROUTED``), which the trainer replays as any set and leaves out of the
agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.models import router_replay
from verl.rollout.vllm_engine import _engine_routing


def test_the_engines_routing_becomes_the_samples_with_the_last_token_not_routed():
    engine = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2) % 4  # 4 prompt + 3 response tokens - 1
    routed = _engine_routing(engine, prompt_len=4, response_len=3)
    assert routed.dtype == torch.int16 and routed.shape == (7, 2, 2)
    assert torch.equal(routed[:6], torch.from_numpy(engine).short())
    assert torch.equal(routed[6], torch.full((2, 2), router_replay.NOT_ROUTED))


def test_missing_or_misshapen_routing_is_a_clear_error():
    with pytest.raises(RuntimeError, match="returned no routed experts.*enable_return_routed_experts"):
        _engine_routing(None, prompt_len=4, response_len=3)
    with pytest.raises(RuntimeError, match=r"shape \[7, 2, 2\] for 4 prompt \+ 3 response tokens; expected \[6, "):
        _engine_routing(np.zeros((7, 2, 2), dtype=np.int32), prompt_len=4, response_len=3)


def test_the_batch_keeps_the_not_routed_column():
    from verl.rollout.base import Sample, _routed_columns

    # one row: a 2-token prompt left-padded to 3, a 2-token response padded to 3
    sample = Sample(token_ids=[7, 8], logprobs=[-0.1, -0.2], hit_length_limit=False,
                    routed_experts=_engine_routing(np.full((3, 1, 2), 3, dtype=np.int32), 2, 2))
    out = _routed_columns([sample], torch.tensor([[0, 1, 1]]), response_length=3)
    assert out[0, :, 0].tolist() == [[0, 1], [3, 3], [3, 3], [3, 3], [-1, -1], [0, 1]]


class _Router:
    """Stands in for Megatron's router-replay hooks: what set_targets hands each router."""

    def clear_indices(self) -> None:
        self.target = None

    def set_target_indices(self, tokens: torch.Tensor) -> None:
        self.target = tokens


def test_a_not_routed_token_is_replayed_as_a_valid_set_and_not_counted():
    routers = [_Router(), _Router()]
    routed = torch.tensor([[[[2, 3], [1, 0]], [[-1, -1], [-1, -1]], [[3, 1], [2, 0]]]])  # [b=1, S=3, L=2, K=2]
    mask = torch.tensor([[1, 1, 0]])  # the third token is a pad
    router_replay.set_targets(routers, routed, mask)
    assert routers[0].target.tolist() == [[2, 3], [0, 1], [0, 1]]  # S*b order; -1 and the pad replayed as 0..K-1
    assert routers[1].target.tolist() == [[1, 0], [0, 1], [0, 1]]
    assert routers[0].verl_real.tolist() == [True, False, False]  # only the routed real token is counted


def test_the_cpu_build_refuses_to_record_before_starting_vllm(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a GPU build records (tests/models/test_router_replay_r3.py -k device)")
    from verl.config.schema import RolloutConfig
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model
    from verl.rollout.vllm_engine import VLLMRollout

    model = make_tiny_model(str(tmp_path / "moe"), TinyModelSpec(family="qwen3_moe", corpus_lines=200))
    cfg = RolloutConfig(name="vllm", n=1, prompt_length=16, response_length=8)
    with pytest.raises(ValueError, match="needs a GPU build of vLLM: .*Model Runner V2, which needs Triton.*rollout.name=hf"):
        VLLMRollout(cfg, model, record_routing=True)
