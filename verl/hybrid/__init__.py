"""The 3D-HybridEngine: resharding the actor's weights into the rollout layout, in place."""

from verl.hybrid.copy_ranges import copy_ranges_, copy_ranges_reference_
from verl.hybrid.copy_shards import copy_shards_, copy_shards_reference_

__all__ = ["copy_ranges_", "copy_ranges_reference_", "copy_shards_", "copy_shards_reference_"]
