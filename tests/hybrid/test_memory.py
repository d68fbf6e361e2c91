"""verl.hybrid.memory: the training-state offload around rollout, and its memory ledger.

Offload moves storages, not tensors: after a round trip every parameter, ``main_grad`` view,
gradient buffer and Adam moment is the same object with the same bytes, and a training step
after it is the step without it, bit for bit. On CPU the "device" is host memory, so the tests
check that offloading really frees it (RSS) and that the CPU vLLM build's KV cache is counted
and released. Engines are built in the persistent gloo pool (``run_distributed``): TP=2 on two
ranks, TP=1 on one.
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

ROWS, SEQ = 4, 16
FLAGS = {
    "params": dict(params=True, grads=False, optimizer=False),
    "grads": dict(params=False, grads=True, optimizer=False),
    "optimizer": dict(params=False, grads=False, optimizer=True),
    "all": dict(params=True, grads=True, optimizer=True),
}


# ---------------------------------------------------------------------------------------------
# bodies (run on every rank)


def _engine(model_dir: str, tp: int, *, trainable: bool = True):
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state as ms

    if ms.is_initialized():  # a second engine in the same body
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg = ProcessGroupCollection.use_mpu_process_groups()
    else:
        pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, seed=7)
    return MegatronEngine(
        model=ModelConfig(path=model_dir),
        megatron=MegatronConfig(tensor_model_parallel_size=tp),
        pg=pg,
        # Adam, so the optimizer holds state (two moments per parameter); clipping active.
        optim=OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0) if trainable else None,
        total_training_steps=10,
    )


def _step(engine, seed: int = 0):
    """One train step on the same [ROWS, SEQ] random tokens on every rank (DP=1)."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.engine import LossShare

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.spec.vocab_size, (ROWS, SEQ), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    info = GlobalBatchInfo.from_masks([batch["loss_mask"].float()], group=engine.pg.dp)

    def loss_fn(outputs, micro_batch):
        mask = micro_batch["loss_mask"].float()
        return LossShare(agg_loss(-outputs["logprobs"], mask, "token-mean", global_batch_info=info))

    result = engine.train_step(batch, micro_batch_size=2, loss_fn=loss_fn)
    assert result.update_successful
    return result


def _state_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    """Every tensor object of the training state: parameters, their main_grad views, DDP's flat
    grad buffers, the optimizer's state tensors."""
    out: list[tuple[str, torch.Tensor]] = []
    for c, chunk in enumerate(engine.chunks):
        for name, p in chunk.named_parameters():
            out.append((f"{c}.{name}", p))
            if getattr(p, "main_grad", None) is not None:
                out.append((f"{c}.{name}.main_grad", p.main_grad))
        for b, buffer in enumerate(getattr(chunk, "buffers", [])):
            out.append((f"{c}.buffer{b}.grad_data", buffer.grad_data))
    if engine.optimizer is not None:
        for o, wrapper in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
            for i, state in enumerate(wrapper.optimizer.state.values()):
                for key, value in state.items():
                    if torch.is_tensor(value):
                        out.append((f"optimizer{o}.{i}.{key}", value))
    return out


def _views_intact(engine) -> bool:
    """Every main_grad still views its DDP buffer's grad_data."""
    for chunk in engine.chunks:
        buffer_ptrs = {b.grad_data.untyped_storage().data_ptr() for b in chunk.buffers}
        for p in chunk.parameters():
            if p.main_grad.untyped_storage().data_ptr() not in buffer_ptrs:
                return False
    return True


def _round_trip(model_dir: str, tp: int) -> dict:
    from verl.hybrid.memory import TrainingStateOffload

    engine = _engine(model_dir, tp)
    _step(engine)
    offload = TrainingStateOffload(engine, params=True, grads=True, optimizer=True)
    tensors = _state_tensors(engine)
    expected = {name: t.detach().clone() for name, t in tensors}
    resident = offload.held_bytes()
    offload.reload()  # not offloaded: a no-op
    out: dict = {"resident": resident, "after_noop_reload": offload.held_bytes()}
    out["has_grads"] = bool(any(b.grad_data.abs().sum() > 0 for c in engine.chunks for b in c.buffers))
    out["has_adam"] = sum(1 for name, _ in tensors if name.endswith("exp_avg_sq"))

    offload.offload()
    out["offloaded"] = offload.held_bytes()
    out["storage_sizes"] = sorted({t.untyped_storage().nbytes() for _, t in tensors})
    offload.offload()  # already offloaded: a no-op
    host = offload._host.data_ptr()
    offload.reload()
    out["reloaded"] = offload.held_bytes()
    again = _state_tensors(engine)
    out["same_objects"] = [n for n, _ in again] == [n for n, _ in tensors] and all(
        a is b for (_, a), (_, b) in zip(again, tensors)
    )
    out["mismatch"] = [name for name, t in tensors if not torch.equal(t.detach(), expected[name])]
    out["views_intact"] = _views_intact(engine)
    # A second cycle reuses the host buffer.
    offload.offload()
    offload.reload()
    out["host_reused"] = offload._host.data_ptr() == host
    out["mismatch_2"] = [name for name, t in tensors if not torch.equal(t.detach(), expected[name])]
    out["host_bytes"] = offload.host_capacity_bytes
    out["storages"] = sum(len(v) for v in offload._resident().values())
    return out


def _step_after_handoff(model_dir: str, tp: int, flags: dict) -> dict:
    from verl.hybrid.memory import TrainingStateOffload

    expected_engine, actual_engine = _engine(model_dir, tp), _engine(model_dir, tp)
    first = (_step(expected_engine), _step(actual_engine))
    offload = TrainingStateOffload(actual_engine, **flags)
    offload.offload()
    moved = {c: n == 0 for c, n in offload.held_bytes().items()}
    offload.reload()
    expected, actual = _step(expected_engine, seed=1), _step(actual_engine, seed=1)
    weights = zip(expected_engine.chunks[0].parameters(), actual_engine.chunks[0].parameters(), strict=True)
    return {
        "first_equal": (first[0].loss, first[0].grad_norm) == (first[1].loss, first[1].grad_norm),
        "moved": moved,
        "expected": (expected.loss, expected.grad_norm),
        "actual": (actual.loss, actual.grad_norm),
        "weights_equal": all(torch.equal(e, a) for e, a in weights),
    }


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_drop(model_dir: str) -> dict:
    import gc

    from verl.hybrid.memory import TrainingStateOffload

    engine = _engine(model_dir, 1)
    _step(engine)
    offload = TrainingStateOffload(engine, params=True, grads=True, optimizer=True)
    state = sum(offload.held_bytes().values())
    gc.collect()
    rss = [_rss_bytes()]
    for _ in range(2):
        offload.offload()
        rss.append(_rss_bytes())
        offload.reload()
        rss.append(_rss_bytes())
    loss = _step(engine, seed=1).loss  # the engine trains on after the cycles
    return {"state": state, "host": offload.host_capacity_bytes, "rss": rss, "loss": loss}


def _frozen_engine(model_dir: str) -> dict:
    from verl.hybrid.memory import TrainingStateOffload

    engine = _engine(model_dir, 1, trainable=False)
    errors = {}
    for flag in ("grads", "optimizer"):
        try:
            TrainingStateOffload(engine, params=False, **{"grads": False, "optimizer": False, flag: True})
        except ValueError as exc:
            errors[flag] = str(exc)
    # A frozen engine (a reference policy) can still move its weights.
    offload = TrainingStateOffload(engine, params=True, grads=False, optimizer=False)
    expected = [p.detach().clone() for p in engine.chunks[0].parameters()]
    resident = offload.held_bytes()
    offload.offload()
    offloaded = offload.held_bytes()
    offload.reload()
    same = all(torch.equal(p, e) for p, e in zip(engine.chunks[0].parameters(), expected, strict=True))
    return {"errors": errors, "resident": resident, "offloaded": offloaded, "same": same}


def _handoff_with_vllm(model_dir: str) -> dict:
    """One step's phases with the real CPU vLLM engine: train, offloaded, rollout, reloaded."""
    from verl.config.schema import MegatronConfig, RolloutConfig
    from verl.hybrid.memory import MemoryLedger, TrainingStateOffload
    from verl.protocol import Batch
    from verl.rollout import build_rollout_engine
    from verl.rollout.vllm_engine import _kv_cache_bytes_from_config

    cfg = RolloutConfig(name="vllm", n=2, prompt_length=8, response_length=8, seed=3)
    rollout = build_rollout_engine(cfg, model_dir)
    out: dict = {}
    try:
        out["kv_start"] = rollout.kv_cache_bytes()
        out["kv_public"] = _kv_cache_bytes_from_config(rollout._llm)
        rollout.release()
        out["kv_released"] = rollout.kv_cache_bytes()

        engine = _engine(model_dir, 1)
        megatron = MegatronConfig(param_offload=True, grad_offload=True, optimizer_offload=True)
        offload = TrainingStateOffload.from_config(engine, megatron)
        ledger = MemoryLedger(engine.device)
        _step(engine)
        ledger.record("train", held=offload.held_bytes(), kv_cache_bytes=rollout.kv_cache_bytes())
        offload.offload()
        ledger.record("offloaded", held=offload.held_bytes(), kv_cache_bytes=rollout.kv_cache_bytes())
        rollout.resume()
        ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        generated = rollout.generate(Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
        out["generated"] = len(generated)
        ledger.record("rollout", held=offload.held_bytes(), kv_cache_bytes=rollout.kv_cache_bytes())
        rollout.release()
        offload.reload()
        ledger.record("reloaded", held=offload.held_bytes(), kv_cache_bytes=rollout.kv_cache_bytes())
        rollout.resume()
        out["kv_resumed"] = rollout.kv_cache_bytes()
        out["loss_after"] = _step(engine, seed=1).loss
        out["metrics"] = ledger.metrics()
    finally:
        rollout.shutdown()
    return out


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "tp"),
    [pytest.param(1, 1, id="tp1"), pytest.param(2, 2, id="tp2", marks=pytest.mark.distributed)],
)
def test_offload_round_trips_training_state_bit_exactly(tiny_model_dir, world, tp):
    ranks = run_distributed(_round_trip, world, tiny_model_dir, tp)
    for rank, r in enumerate(ranks):
        assert r["has_grads"] and r["has_adam"] > 0, f"rank {rank}: the step left no gradients or Adam state"
        assert all(n > 0 for n in r["resident"].values()), r["resident"]
        assert r["after_noop_reload"] == r["resident"]
        assert r["offloaded"] == {"params": 0, "grads": 0, "optimizer": 0}
        assert r["storage_sizes"] == [0], f"rank {rank}: storages left allocated: {r['storage_sizes']}"
        assert r["reloaded"] == r["resident"]
        assert r["same_objects"] and r["views_intact"]
        assert r["mismatch"] == [] and r["mismatch_2"] == []
        assert r["host_reused"]
        # Every distinct storage once (main_grad views and grad_data are one buffer), each at a
        # 512-byte aligned offset.
        total = sum(r["resident"].values())
        assert total <= r["host_bytes"] < total + 512 * r["storages"]
    if tp == 2:
        assert ranks[0]["resident"] == ranks[1]["resident"]  # the TP ranks hold equal shares


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "tp", "flags"),
    [pytest.param(2, 2, name, id=f"tp2-{name}", marks=pytest.mark.distributed) for name in FLAGS]
    + [pytest.param(1, 1, "all", id="tp1-all")],
)
def test_step_after_handoff_equals_step_without(tiny_model_dir, world, tp, flags):
    ranks = run_distributed(_step_after_handoff, world, tiny_model_dir, tp, FLAGS[flags])
    for r in ranks:
        assert r["first_equal"]  # two engines built alike step alike (the comparison is meaningful)
        assert r["moved"] == {c: FLAGS[flags][c] for c in ("params", "grads", "optimizer")}
        # Bit-exact: the same bytes go through the same kernels; nothing rounds.
        assert r["actual"] == r["expected"]
        assert r["weights_equal"]


@pytest.mark.timeout(300)
def test_offload_frees_host_memory_on_cpu(large_model_dir):
    [r] = run_distributed(_rss_drop, 1, large_model_dir)
    state, rss = r["state"], r["rss"]
    assert state > 120 * 2**20  # weights + grads + 2 Adam moments of 8.9M float32 parameters
    assert r["host"] >= state
    mib = [round(x / 2**20) for x in rss]
    # First offload: the host buffer takes the room the freed storages give back. Were they not
    # freed, RSS would grow by the whole state; allow 10% of it for allocator slack.
    assert rss[1] - rss[0] < 0.1 * state, mib
    # Later offloads reuse the host buffer: RSS drops by the state (90% of it: heap pages the
    # allocator keeps, and RSS noise of a few MB).
    assert rss[2] - rss[3] > 0.9 * state, mib
    # Reload takes the memory back.
    assert rss[4] - rss[3] > 0.9 * state, mib
    assert r["loss"] == r["loss"]  # finite: the engine trained after the cycles


@pytest.mark.timeout(300)
def test_bad_use_is_refused_or_harmless(tiny_model_dir):
    [r] = run_distributed(_frozen_engine, 1, tiny_model_dir)
    assert "optimizer=True (megatron.optimizer_offload)" in r["errors"]["optimizer"]
    assert "without an optimizer" in r["errors"]["optimizer"]
    assert "grads=True (megatron.grad_offload)" in r["errors"]["grads"]
    assert r["resident"]["params"] > 0 and r["resident"]["grads"] == r["resident"]["optimizer"] == 0
    assert r["offloaded"]["params"] == 0
    assert r["same"]


def test_ledger_phases_and_metrics():
    from verl.hybrid.memory import MemoryLedger

    ledger = MemoryLedger(torch.device("cpu"))
    state = {"params": 100, "grads": 100, "optimizer": 200}
    none = {"params": 0, "grads": 0, "optimizer": 0}
    ledger.record("train", held=state, kv_cache_bytes=0)
    ledger.record("offloaded", held=none, kv_cache_bytes=0)
    ledger.record("rollout", held=none, kv_cache_bytes=1000)
    ledger.record("reloaded", held=state, kv_cache_bytes=0)
    m = ledger.metrics()
    assert m["memory/train/params_bytes"] == 100 and m["memory/rollout/kv_cache_bytes"] == 1000
    assert m["memory/train/peak_bytes"] == 400 and m["memory/rollout/peak_bytes"] == 1000
    assert m["memory/peak_bytes"] == 1000 and m["memory/sum_bytes"] == 1400
    assert m["memory/peak_vs_sum"] == pytest.approx(1000 / 1400)
    with pytest.raises(ValueError, match="phase 'warmup' is not one of"):
        ledger.record("warmup", held=state, kv_cache_bytes=0)
    with pytest.raises(ValueError, match="held_bytes"):
        ledger.record("train", held={"params": 1}, kv_cache_bytes=0)
    ledger.reset()
    assert ledger.metrics() == {"memory/peak_bytes": 0.0, "memory/sum_bytes": 0.0, "memory/peak_vs_sum": 0.0}


@pytest.mark.timeout(120)
def test_hf_engine_holds_no_kv_cache_between_calls(tiny_model_dir):
    from verl.config.schema import RolloutConfig
    from verl.rollout.hf_engine import HFRollout

    engine = HFRollout(RolloutConfig(name="hf", prompt_length=8, response_length=4), tiny_model_dir, device="cpu")
    try:
        assert engine.kv_cache_bytes() == 0
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_vllm_kv_cache_bytes_follow_release_and_resume(tiny_model_dir):
    """The CPU vLLM build's KV cache, counted from its tensors, through a whole handoff step."""
    pytest.importorskip("vllm")
    [r] = run_distributed(_handoff_with_vllm, 1, tiny_model_dir, timeout=360.0)
    kv = r["kv_start"]
    assert kv > 0
    assert r["kv_public"] == kv  # the public-config fallback counts the same bytes (dense attention)
    assert r["kv_released"] == 0 and r["kv_resumed"] == kv
    assert r["generated"] == 4 and r["loss_after"] == r["loss_after"]
    m = r["metrics"]
    state = m["memory/train/params_bytes"] + m["memory/train/grads_bytes"] + m["memory/train/optimizer_bytes"]
    assert state > 0 and m["memory/train/kv_cache_bytes"] == 0
    for phase in ("offloaded", "rollout"):
        assert m[f"memory/{phase}/params_bytes"] == m[f"memory/{phase}/grads_bytes"] == 0
        assert m[f"memory/{phase}/optimizer_bytes"] == 0
    assert m["memory/rollout/kv_cache_bytes"] == kv and m["memory/offloaded/kv_cache_bytes"] == 0
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "kv_cache_bytes"):
        assert m[f"memory/reloaded/{key}"] == m[f"memory/train/{key}"]
    for phase in ("train", "offloaded", "rollout", "reloaded"):  # CPU: the peak is the tracked sum
        parts = sum(m[f"memory/{phase}/{k}"] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                        "kv_cache_bytes"))
        assert m[f"memory/{phase}/peak_bytes"] == parts
    assert m["memory/peak_bytes"] == max(state, kv) and m["memory/sum_bytes"] == state + kv
    assert m["memory/peak_vs_sum"] == pytest.approx(max(state, kv) / (state + kv))
