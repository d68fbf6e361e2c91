"""``GatheredHFPush``: a Megatron engine's weights, whole Hugging Face tensors, into a colocated
transformers rollout engine, the vision tower of a vision-language model included.

The 3D-HybridEngine's reshard plan (``verl.hybrid.WeightSync``) covers the language model's tensors;
a Qwen2.5-VL actor (``verl.models.megatron_vlm``) also holds a vision tower, whole on every TP rank,
which the plan does not know. This push takes the simple route the transformers engine allows
(it holds every tensor whole, TP' = 1): :meth:`MegatronEngine.hf_weights` gathers each decoder tensor
over TP, one at a time, and yields the tower's tensors as they are; with pipeline stages, each stage's
tensors (the tower's from the first) are broadcast over the PP group one at a time, so every rank gets
the whole model; every rank hands a bucket of at most ``bucket_bytes`` to its engine
(``update_weights``) and drops it before the next.

Names: the actor yields the hub's checkpoint names (``model.layers.*``, ``lm_head.weight``,
``visual.*``); transformers 5 keeps the same tensors under ``model.language_model.*`` and
``model.visual.*``. The mapping is found once, at construction, by matching each name (as is, or so
moved) against the engine's parameters; every name and shape is checked there, on every rank.

The memory handoff is :class:`~verl.hybrid.WeightSync`'s: the actor's gradients and optimizer state
(``grad_offload``, ``optimizer_offload``) leave before the push, its parameters (``param_offload``)
after it, and come back when the rollout is over; a :class:`~verl.hybrid.memory.MemoryLedger`
records each phase.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl.hybrid.layout import hf_layout
from verl.hybrid.memory import MemoryLedger, TrainingStateOffload, memory_handoff
from verl.models.builder import unwrap_model

if TYPE_CHECKING:
    from verl.engine.engine import MegatronEngine

__all__ = ["GatheredHFPush", "engine_names"]

# Where transformers 5 keeps a Qwen2.5-VL's tensors that the hub's checkpoints name otherwise.
_MOVED = (("model.", "model.language_model."), ("visual.", "model.visual."))


def engine_names(hub_names: dict[str, tuple[int, ...]], engine: dict[str, tuple[int, ...]]) -> tuple[dict[str, str], list[str]]:
    """({hub name: the engine's name}, problems) for ``hub_names`` (name -> shape) against the engine's
    parameters (name -> shape): each name as it is, else moved as transformers 5 keeps it."""
    found: dict[str, str] = {}
    problems: list[str] = []
    for name, shape in hub_names.items():
        candidates = [name] + [new + name[len(old):] for old, new in _MOVED if name.startswith(old)]
        target = next((c for c in candidates if c in engine), None)
        if target is None:
            problems.append(f"the rollout engine's model has no {name!r} (nor {candidates[1:]})")
        elif tuple(engine[target]) != tuple(shape):
            problems.append(f"{name}: actor {list(shape)}, engine {target} {list(engine[target])}")
        else:
            found[name] = target
    return found, problems


class GatheredHFPush:
    """Pushes a Megatron actor's weights into a colocated transformers rollout engine (module docstring).

    Args:
        actor: the actor's ``MegatronEngine`` (one pipeline stage, or a vision-language model's stages),
            on the ranks the engine runs on.
        rollout: the transformers rollout engine on this rank (``weights_layout == "hf"``).
        bucket_bytes: the largest bucket of whole tensors handed over at once
            (``actor_rollout_ref.rollout.update_weights_bucket_megabytes``).
    """

    def __init__(self, actor: "MegatronEngine", rollout: Any, *, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"GatheredHFPush: bucket_bytes={bucket_bytes}; it must be >= 1")
        if getattr(rollout, "weights_layout", None) != "hf":
            raise ValueError(
                f"GatheredHFPush: {type(rollout).__name__} is not the transformers rollout engine; a vision-language "
                "actor on Megatron pushes into actor_rollout_ref.rollout.name=hf"
            )
        if actor.pg.pp.size() > 1 and not actor.is_vlm:
            raise ValueError("GatheredHFPush: the actor has pipeline stages; the push gathers one stage's tensors")
        self.actor, self.rollout, self.bucket_bytes = actor, rollout, bucket_bytes
        ours = dict(hf_layout(actor.spec).shapes)
        if actor.spec.tie_word_embeddings:
            ours.pop("lm_head.weight", None)  # the embedding's tensor (iter_hf_weights yields it once)
        if actor.is_vlm:
            from verl.models.megatron_vlm import VISION_PREFIX

            vision = unwrap_model(actor.chunks[0]).vision  # on the first pipeline stage only
            shapes = [None if vision is None else {VISION_PREFIX + n: tuple(p.shape) for n, p in vision.named_parameters()}]
            if actor.pg.pp.size() > 1:  # every stage pushes the whole model (MegatronEngine.hf_weights)
                dist.broadcast_object_list(shapes, src=dist.get_global_rank(actor.pg.pp, 0), group=actor.pg.pp,
                                           device=actor.device)
            ours.update(shapes[0])
        theirs = {n: tuple(p.shape) for n, p in rollout.named_parameters()}
        self.names, problems = engine_names(ours, theirs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, problems[:5])
            problems = list(dict.fromkeys(p for ps in gathered for p in ps))
        if problems:
            raise ValueError(
                "GatheredHFPush: the actor's weights do not fit the rollout engine's model (the actor and the "
                "rollout must load the same actor_rollout_ref.model.path): " + "; ".join(problems[:5])
            )
        flags = actor.megatron_config
        # Two offloads: the parameters leave only after the push has read them.
        self._state_offload = TrainingStateOffload(
            actor, params=False, grads=flags.grad_offload, optimizer=flags.optimizer_offload
        )
        self._param_offload = TrainingStateOffload(actor, params=flags.param_offload, grads=False, optimizer=False)
        self.ledger = MemoryLedger(actor.device)
        self.last_metrics: dict[str, float] = {}

    def push(self) -> dict[str, float]:
        """Write the actor's current weights into the engine, bucket by bucket (collective over the actor's
        TP group, and its PP group with stages); returns ``timing_s/update_weights``, the bytes handed over and the largest bucket."""
        start = time.perf_counter()
        total = largest = buckets = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0

        def hand_over() -> None:
            nonlocal total, largest, buckets, bucket, size
            self.rollout.update_weights(bucket)
            total += size
            largest = max(largest, size)
            buckets += 1
            bucket, size = [], 0

        for name, tensor in self.actor.hf_weights():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                hand_over()
            bucket.append((self.names[name], tensor))
            size += nbytes
        if bucket:
            hand_over()
        self.rollout.weights_updated()
        self.last_metrics = {
            "timing_s/update_weights": time.perf_counter() - start,
            "update_weights/bytes_gathered": float(total),
            "update_weights/buffer_bytes": float(largest),
            "update_weights/buckets": float(buckets),
        }
        return dict(self.last_metrics)

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[dict[str, float]]:
        """The rollout half of a step (collective), with :class:`~verl.hybrid.WeightSync`'s memory handoff;
        yields the push's metrics; afterwards :attr:`last_metrics` also holds the per-phase memory."""
        with memory_handoff(self, self._state_offload, self._param_offload) as metrics:
            yield metrics
