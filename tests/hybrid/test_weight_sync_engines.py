"""WeightSync into real rollout engines (the CPU vLLM build, transformers) colocated with a Megatron actor.

Per case, in one call on the 2-rank pool (engine start-up dominates):

1. the engine's own loader fills its parameters from the checkpoint (the ground truth of its
   layout); they are overwritten with a marker value, WeightSync pushes the actor's (equal)
   weights, and every element the plan owns must equal the loader's bit-exactly while
   everything else (vLLM's vocabulary padding rows) keeps the marker;
2. the engine samples; the actor recomputes the samples' logprobs: they agree (the rollout tests'
   tolerance);
3. one real Adam step on the actor, ``rollout_phase`` (resume, push, release), sample again: the
   engine's logprobs agree with the updated actor and clearly not with the old weights.
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(500)]

PROMPT_LEN, RESPONSE_LEN, N = 8, 8, 2
# float32 on both sides, different kernels (vLLM CPU attention/GEMM vs Megatron): rounding only,
# measured ~1e-6; the rollout tests use 1e-4 for the same comparison. A stale weight is off by >1e-2.
LOGPROB_ATOL = 1e-4
MARKER = 7.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("sync-engines")
    specs = {
        # A vocabulary of 1001: vLLM pads it to 1024 rows the push must leave alone.
        "qwen2": TinyModelSpec(family="qwen2", kv_heads=2, tie_embeddings=True, vocab=1001, corpus_lines=600, seed=11),
        # q/k norms, and 4 heads of 32 on a hidden size of 64 (head_dim apart from hidden/heads).
        "qwen3": TinyModelSpec(family="qwen3", heads=4, kv_heads=2, head_dim=32, vocab=1001, corpus_lines=600, seed=12),
        # Mixture-of-Experts (4 experts, top 2): vLLM's fused experts (w13/w2) and its router.
        "qwen3_moe": TinyModelSpec(family="qwen3_moe", kv_heads=2, vocab=1001, corpus_lines=600, seed=13),
        "mixtral": TinyModelSpec(family="mixtral", kv_heads=2, vocab=1001, corpus_lines=600, seed=14),
    }
    return {family: make_tiny_model(str(root / family), spec) for family, spec in specs.items()}


def _response_logprobs(actor, out, temperature: float) -> torch.Tensor:
    """The actor's logprobs of this rank's samples. Every rank of the actor's TP/PP groups must see
    the same batch, and rollout replicas sample different ones: gather all, then take ours."""
    import torch.distributed as dist

    from verl.protocol import all_gather

    every = all_gather(out.select(["input_ids", "attention_mask"]))
    rows = len(out)
    lp = actor.forward(
        {"input_ids": every["input_ids"], "attention_mask": every["attention_mask"]},
        micro_batch_size=4, output="logprobs", temperature=temperature,
    ).outputs["logprobs"]
    mine = lp[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]
    return mine[:, -RESPONSE_LEN:].float().cpu()  # [B, R]


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def _engine_body(model_dir: str, tp: int, pp: int, rollout_tp: int, engine_name: str, offload: bool, ep: int = 1,
                 sp: bool = False) -> dict:
    import torch.distributed as dist

    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.config.schema import RolloutConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.hybrid import WeightSync
    from verl.hybrid.layout import box_view
    from verl.parallel import megatron_state as ms
    from verl.protocol import Batch
    from verl.rollout import build_rollout_engine

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep, seed=3)
    actor = MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                expert_model_parallel_size=ep, sequence_parallel=sp, param_offload=offload, grad_offload=offload, optimizer_offload=offload),
        pg=pg, optim=OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0), total_training_steps=10,
    )
    cfg = RolloutConfig(name=engine_name, n=N, temperature=1.0, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
                        tensor_model_parallel_size=rollout_tp, free_cache_engine=True)
    rollout = build_rollout_engine(cfg, model_dir)
    result: dict = {"rank": dist.get_rank()}
    try:
        sync = WeightSync(actor, rollout, bucket_bytes=16 * 1024)
        dst_boxes = sync.destination.boxes
        truth = {k: p.detach().clone() for k, p in rollout.named_parameters()}
        with torch.no_grad():
            for _, p in rollout.named_parameters():
                p.data.fill_(MARKER)
        metrics = sync.push()
        params = dict(rollout.named_parameters())
        owned = {k: torch.zeros(p.shape, dtype=torch.bool) for k, p in params.items()}
        wrong = []
        for box in dst_boxes:
            if not torch.equal(box_view(box, params[box.tensor]), box_view(box, truth[box.tensor])):
                wrong.append((box.tensor, box.hf_name))
            box_view(box, owned[box.tensor]).fill_(True)
        result["wrong"] = wrong
        result["untouched_ok"] = all(bool((params[k][~owned[k]] == MARKER).all()) for k in params)
        result["padding_elements"] = sum(int((~owned[k]).sum()) for k in params)
        result["push"] = metrics

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 500, (4, PROMPT_LEN), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        prompts = Batch.from_dict({"input_ids": ids * mask, "attention_mask": mask})
        out = rollout.generate(prompts, seed=5)
        resp_mask = out["response_mask"].float()
        result["before"] = _max_diff(out["rollout_log_probs"], _response_logprobs(actor, out, 1.0), resp_mask)

        from verl.protocol import all_gather

        every = all_gather(out.select(["input_ids", "attention_mask"]))
        # One DP rank here when tp * pp = 2: every rank steps on the whole gathered batch.
        info = GlobalBatchInfo.from_masks([every["attention_mask"].float()], group=pg.dp)

        def loss_fn(outputs, mb):
            return LossShare(agg_loss(-outputs["logprobs"], mb["attention_mask"].float(), "token-mean",
                                      global_batch_info=info))

        old = _response_logprobs(actor, out, 1.0)
        step = actor.train_step({"input_ids": every["input_ids"], "attention_mask": every["attention_mask"]},
                                micro_batch_size=4, loss_fn=loss_fn)
        result["step_ok"] = step.update_successful
        result["actor_moved"] = _max_diff(_response_logprobs(actor, out, 1.0), old, resp_mask)
        rollout.release()  # as after the previous rollout: rollout_phase resumes it
        with sync.rollout_phase() as push_metrics:
            after = rollout.generate(prompts, seed=6)
            result["held_during_rollout"] = sync._state_offload.held_bytes()
        result["phase_metrics"] = sorted(push_metrics)
        result["memory"] = {k: v for k, v in sync.last_metrics.items() if k.startswith("memory/")}
        after_mask = after["response_mask"].float()
        result["after"] = _max_diff(after["rollout_log_probs"], _response_logprobs(actor, after, 1.0), after_mask)
        # The same samples under the weights before the step: what a stale engine would report.
        result["stale_gap"] = _max_diff(after["rollout_log_probs"], _stale_logprobs(model_dir, after), after_mask)
    finally:
        rollout.shutdown()
    return result


def _stale_logprobs(model_dir: str, out) -> torch.Tensor:
    """The checkpoint's (pre-step) logprobs of a batch, with transformers."""
    from transformers import AutoModelForCausalLM

    from verl.rollout.hf_engine import hf_response_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_response_logprobs(
        model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=RESPONSE_LEN
    ).float()


CASES = [  # (family, tp, pp, rollout TP', engine, offload the training state during the rollout)
    ("qwen2", 2, 1, 2, "vllm", True),  # TP == TP': nothing crosses the network; params/grads/Adam state to host
    ("qwen2", 2, 1, 1, "vllm", False),  # two replicas of TP' = 1, each gathers from both TP ranks
    ("qwen2", 1, 2, 2, "vllm", False),  # layers from two pipeline stages into one TP' = 2 engine
    ("qwen2", 2, 1, 1, "hf", False),  # the transformers fallback: whole Hugging Face tensors
    ("qwen3", 2, 1, 1, "vllm", False),  # Qwen3 (q/k norms, explicit head_dim): vLLM's Qwen3ForCausalLM
    ("qwen3", 1, 2, 1, "hf", False),  # ... and transformers'
]


@pytest.mark.parametrize(
    ("family", "tp", "pp", "rollout_tp", "engine", "offload"), CASES,
    ids=[f"{f}-tp{a}-pp{b}-to-{e}{c}{'-offload' if o else ''}" for f, a, b, c, e, o in CASES],
)
def test_push_into_a_real_engine(model_dirs, family, tp, pp, rollout_tp, engine, offload):
    model_dir = model_dirs[family]
    results = run_distributed(_engine_body, 2, model_dir, tp, pp, rollout_tp, engine, offload, timeout=480)
    _check_push(results, tp, pp, rollout_tp, engine, offload)


MOE_CASES = [  # (family, tp, ep, rollout TP'): the CPU build's fused experts stay plain (vllm_internals.plain_cpu_moe)
    ("qwen3_moe", 1, 2, 2),  # experts over two EP ranks into TP' = 2 (one replica: vLLM couples MoE replicas)
    ("mixtral", 1, 1, 2),  # whole experts on both (data parallel) ranks into TP' = 2: each rank's share of every F
]


@pytest.mark.parametrize(("family", "tp", "ep", "rollout_tp"), MOE_CASES,
                         ids=[f"{f}-tp{t}-ep{e}-to-vllm{r}" for f, t, e, r in MOE_CASES])
def test_push_moe_into_vllm(model_dirs, family, tp, ep, rollout_tp):
    """The same checks for a Mixture-of-Experts actor (Megatron's experts over EP or TP) and vLLM's fused
    experts; the logprob checks run through the CPU kernel's packed copy, renewed after each push."""
    results = run_distributed(_engine_body, 2, model_dirs[family], tp, 1, rollout_tp, "vllm", False, ep, tp > 1,
                              timeout=480)
    _check_push(results, tp, 1, rollout_tp, "vllm", False)


def _check_push(results: list[dict], tp: int, pp: int, rollout_tp: int, engine: str, offload: bool) -> None:
    for r in results:
        assert r["wrong"] == [], r["wrong"][:5]
        assert r["untouched_ok"], "the push wrote outside the plan's boxes (vLLM's padding rows)"
        assert r["before"] < LOGPROB_ATOL, r
        assert r["step_ok"] and r["actor_moved"] > 1e-2, r  # the step changed the policy
        assert r["after"] < LOGPROB_ATOL, r  # the engine has the new weights ...
        assert r["stale_gap"] > 1e-2, r  # ... and not the old ones
        assert "timing_s/update_weights" in r["phase_metrics"]
        if tp == rollout_tp and pp == 1:
            assert r["push"]["update_weights/bytes_sent"] == 0 and r["push"]["update_weights/bytes_received"] == 0
        memory = r["memory"]
        assert memory["memory/train/params_bytes"] > 0 and memory["memory/train/optimizer_bytes"] > 0
        assert memory["memory/reloaded/params_bytes"] == memory["memory/train/params_bytes"]
        if offload:  # all of the training state was on the host while the engine generated
            assert r["held_during_rollout"] == {"params": 0, "grads": 0, "optimizer": 0}
            assert memory["memory/offloaded/grads_bytes"] == 0 and memory["memory/offloaded/optimizer_bytes"] == 0
        if engine == "vllm":
            assert memory["memory/rollout/kv_cache_bytes"] > 0 and memory["memory/reloaded/kv_cache_bytes"] == 0
    if engine == "vllm":
        assert sum(r["padding_elements"] for r in results) > 0  # vLLM's padding rows exist and were left alone
