"""The 3D-HybridEngine: resharding the actor's weights into the rollout layout, in place."""

from verl.hybrid.copy_shards import copy_shards_, copy_shards_reference_

__all__ = ["copy_shards_", "copy_shards_reference_"]
