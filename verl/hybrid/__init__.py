"""The 3D-HybridEngine: resharding the actor's weights into the rollout layout, in place, and the
memory handoff between the training state and the rollout KV cache.

- :mod:`verl.hybrid.layout`: where every Hugging Face element lives on a training rank (Megatron)
  and on a rollout rank (vLLM, transformers, Hugging Face shards);
- :mod:`verl.hybrid.plan`: the reshard plan (ranges per source/destination rank pair), pure data;
- :mod:`verl.hybrid.transfer`: executing it: local copies, then buckets with every peer in turn;
- :mod:`verl.hybrid.delta`: delta pushes to a rollout apart (only changed blocks, each bucket
  checksummed against the engine's own values);
- :mod:`verl.hybrid.memory`: moving the actor's training state to host memory and back, and the
  per-phase memory ledger;
- :mod:`verl.hybrid.weight_sync`: ``WeightSync``, the trainer's entry point, ``DisaggregatedSync``
  (the same plan across ranks, for a rollout engine placed apart from the actor), and the naive
  baseline;
- ``copy_ranges_`` (many tensors to many tensors, one call) and ``copy_shards_`` (one pair): the
  bounds-checked range copies of ``verl._C`` the transfer and the offload are built on.
"""

from verl.hybrid.copy_ranges import copy_ranges_, copy_ranges_reference_
from verl.hybrid.copy_shards import copy_shards_, copy_shards_reference_
from verl.hybrid.memory import MemoryLedger, PhaseMemory, TrainingStateOffload
from verl.hybrid.weight_sync import DisaggregatedSync, HFShards, WeightSync, naive_push

__all__ = [
    "DisaggregatedSync",
    "HFShards",
    "MemoryLedger",
    "PhaseMemory",
    "TrainingStateOffload",
    "WeightSync",
    "copy_ranges_",
    "copy_ranges_reference_",
    "copy_shards_",
    "copy_shards_reference_",
    "naive_push",
]
