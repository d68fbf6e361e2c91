"""The 3D-HybridEngine: resharding the actor's weights into the rollout layout, in place, and the
memory handoff between the training state and the rollout KV cache (:mod:`verl.hybrid.memory`)."""

from verl.hybrid.copy_shards import copy_shards_, copy_shards_reference_
from verl.hybrid.memory import MemoryLedger, PhaseMemory, TrainingStateOffload

__all__ = ["MemoryLedger", "PhaseMemory", "TrainingStateOffload", "copy_shards_", "copy_shards_reference_"]
