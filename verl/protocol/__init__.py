"""The batch that flows between roles (:class:`Batch`) and its collectives.

``verl.protocol.batch`` holds the container, ``verl.protocol.collectives`` the functions that move
it over a process group (``scatter``, ``gather``, ``all_gather``, ``broadcast``).
"""

from verl.protocol.batch import Batch
from verl.protocol.collectives import all_gather, broadcast, gather, scatter

__all__ = ["Batch", "all_gather", "broadcast", "gather", "scatter"]
