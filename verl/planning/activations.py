"""Activation memory measured, not modelled: the bytes autograd holds for backward during a training step.

:class:`SavedTensorMeter` counts what ``torch.autograd.graph.saved_tensors_hooks`` sees: every tensor
saved for backward (``ctx.save_for_backward`` and autograd's own saves), each storage once (views of
one storage share it), parameters' storages left out (weights saved by a linear layer are the model,
not activations). A saved storage is live from its first save until autograd drops the last packed
reference to it (after the backward that used it); the meter keeps the live total and its peak. It is
the machine-independent part of activation memory (the allocator would add the transient buffers of
each op, and on a CPU there is no allocator to ask); tensors a custom ``autograd.Function`` keeps as
plain ``ctx`` attributes are not seen (Megatron's linear layers, attention and cross entropy use
``save_for_backward``).

:func:`measure_step_activations` is a body for ``verl.testing.distributed.run_distributed``: it builds
a Megatron actor with verl's builder (``MegatronEngine``) at the given context-parallel degree and runs
one training step of one micro-batch under the meter, so the peak is the activations of that
micro-batch on this rank (``tools/bench.py cp-memory``, ``tests/planning/test_cp_activations.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["SavedTensorMeter", "measure_step_activations"]


class _Packed:
    """One save of a storage; dropping it (autograd frees the saved variable) releases the storage's share."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "SavedTensorMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of the storages saved for backward inside the ``with`` block (module docstring).

    ``exclude``: tensors whose storages are not counted (the model's parameters and their gradient buffers).
    """

    def __init__(self, exclude: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._lock = threading.Lock()  # autograd may run backward on another thread
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return tensor
        with self._lock:
            if key not in self._refs:
                self._refs[key] = 0
                self._bytes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._refs[key] += 1
        return _Packed(tensor, key, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= self._bytes.pop(key)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def measure_step_activations(
    model_dir: str, *, cp: int, seq_len: int, rows: int = 1, seed: int = 0, pack: bool = False
) -> dict[str, Any]:
    """One Megatron training step of ``rows`` sequences of ``seq_len`` tokens (one micro-batch) at context
    parallel ``cp`` over this world (data parallel over the rest, each DP rank given the same rows); returns
    this rank's peak bytes saved for backward and the step's loss. A ``run_distributed`` body."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import MegatronConfig, ModelConfig, OptimConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(context_parallel_size=cp, seed=seed)
    engine = MegatronEngine(
        model=ModelConfig(path=model_dir, use_remove_padding=pack),
        megatron=MegatronConfig(context_parallel_size=cp),
        pg=pg,
        optim=OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, weight_decay=0.0),
        total_training_steps=1,
    )
    ids = torch.randint(0, engine.spec.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    info = GlobalBatchInfo.from_masks([batch["loss_mask"].float()], group=pg.dp)

    def loss_fn(outputs, micro):
        return LossShare(agg_loss(-outputs["logprobs"], micro["loss_mask"].float(), "token-mean", global_batch_info=info))

    held = []
    for chunk in engine.chunks:
        for p in chunk.parameters():
            held.append(p)
            if getattr(p, "main_grad", None) is not None:
                held.append(p.main_grad)
    with SavedTensorMeter(exclude=held) as meter:
        step = engine.train_step(batch, micro_batch_size=rows, loss_fn=loss_fn)
    return {"cp": pg.cp.size(), "cp_rank": pg.cp.rank(), "dp": pg.dp.size(), "peak_bytes": meter.peak,
            "left_bytes": meter.live, "loss": float(step.loss), "tokens_on_rank": rows * seq_len // cp}
