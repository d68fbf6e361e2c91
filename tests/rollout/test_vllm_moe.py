"""Mixture-of-Experts weights into the vLLM engine (the CPU build's fused experts).

The CPU build prepacks the fused experts (w13/w2) for its kernel; verl keeps them plain beside a
packed copy that ``weights_updated`` renews (``verl.rollout.vllm_internals.plain_cpu_moe``). Per
family: an engine started from a checkpoint, given another checkpoint's weights with
``update_weights``, samples exactly what an engine started from that other checkpoint samples,
token for token and logprob for logprob (same kernels, same weights); and verl's map of the engine's
parameters (``verl.hybrid.layout.vllm_layout``, what the hybrid push writes by) puts every checkpoint
element where vLLM's own loader put it, bit-exactly, and covers every engine parameter. The push
from a Megatron actor (EP, TP) is tests/hybrid/test_weight_sync_engines.py::test_push_moe_into_vllm.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]  # qwen2_moe: a shared expert and its gate
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 30, 40, 50]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{family: (checkpoint, the same model with every weight perturbed)}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("vllm-moe")
    out = {}
    for seed, family in enumerate(FAMILIES, start=21):
        base = make_tiny_model(str(root / family), TinyModelSpec(family=family, corpus_lines=600, seed=seed))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        moved = str(root / f"{family}-moved")
        model.save_pretrained(moved)
        AutoTokenizer.from_pretrained(base).save_pretrained(moved)
        out[family] = (base, moved)
    return out


def _checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by their stored (Hugging Face hub) names: per-expert for the experts."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [item for f in files for item in load_file(os.path.join(path, f)).items()]


def _layout_problems(path: str, params: dict[str, torch.Tensor]) -> list[str]:
    """Where verl's vLLM layout of ``path`` (TP' 1) differs from the engine's loaded ``params``."""
    from verl.hybrid.layout import box_view, fill_from_hf, vllm_layout
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config(path)
    layout = vllm_layout(spec, tp=1, tp_rank=0)
    problems = [f"{k}: not in the layout" for k in params if k not in layout.shapes]
    problems += [f"{k}: not in the engine" for k in layout.shapes if k not in params]
    problems += [f"{k}: shape {tuple(params[k].shape)} != {s}" for k, s in layout.shapes.items()
                 if k in params and tuple(params[k].shape) != s]
    if problems:
        return problems
    tensors = {k: torch.zeros(s) for k, s in layout.shapes.items()}
    fill_from_hf(spec, layout, tensors, _checkpoint_tensors(path))
    return [f"{b.tensor} <- {b.hf_name}" for b in layout.boxes
            if not torch.equal(box_view(b, tensors[b.tensor]), box_view(b, params[b.tensor].detach()))]


def _greedy(engine) -> tuple[list[list[int]], list[list[float]]]:
    from verl.rollout.base import SamplingSpec

    samples = engine.sample(PROMPTS, SamplingSpec(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8,
                                                  ignore_eos=True))
    return [s.token_ids for s in samples], [s.logprobs for s in samples]


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_experts_equal_an_engine_started_with_them(checkpoints, family):
    from verl.config.schema import RolloutConfig
    from verl.rollout.vllm_engine import VLLMRollout

    base, moved = checkpoints[family]
    names = [name for name, _ in _checkpoint_tensors(moved)]
    assert any(".experts.0." in n for n in names)  # per-expert tensors, as on the hub
    cfg = RolloutConfig(name="vllm", n=1, prompt_length=16, response_length=8, seed=3)
    with VLLMRollout(cfg, base) as engine:
        layout_problems = _layout_problems(base, dict(engine.named_parameters()))
        before = _greedy(engine)
        experts = {k: p.detach().clone() for k, p in engine.named_parameters() if "routed_experts" in k}
        assert experts and all(k.endswith(("w13_weight", "w2_weight")) for k in experts)
        engine.update_weights(_checkpoint_tensors(moved))
        after = _greedy(engine)
        changed = {k for k, p in engine.named_parameters() if k in experts and not torch.equal(p, experts[k])}
    with VLLMRollout(cfg, moved) as reference:
        expected = _greedy(reference)
    assert layout_problems == []
    assert changed == set(experts)  # the plain expert weights took the new values ...
    assert after[0] == expected[0]  # ... and the kernel computes with them: the same tokens
    # The same weights through the same kernels: bit-identical logprobs.
    assert after[1] == expected[1], (after[1], expected[1])
    assert before[1] != after[1]  # the perturbation shows in the output
