"""``record_collectives()``: which process group each collective of a block ran on.

Two roles on disjoint ranks that build or step at different moments deadlock as soon as one of
them runs a collective on the whole world (the other role's ranks never join it), however rarely
the interleaving shows it. A test runs a role's build and step inside this block and asserts that
no call reached the world's group: that holds under any timing, so it fails on the first run
where a stress test would hang once in tens.

Every collective of ``torch.distributed`` ends in a method of the group's ``ProcessGroup``
(``allreduce``, ``allgather``, ``broadcast``, ``barrier``, ...), whatever module or alias called
it (``all_gather_object`` and Megatron's functions bound at import time included); the block
wraps those methods on the class, so it sees each call with the group it really ran on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

__all__ = ["CollectiveCall", "record_collectives"]

# ProcessGroup methods that communicate (torch 2.11-2.13); the names missing in a torch are skipped.
_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "recv_anysource",
)


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective: the ``ProcessGroup`` method, the group it ran on and that group's size."""

    op: str
    group: object
    size: int


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveCall]]:
    """Record every collective this process runs inside the block, in order (see the module
    docstring); the yielded list fills as the block runs. The methods are restored on exit."""
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[CollectiveCall] = []
    names = [name for name in _METHODS if hasattr(ProcessGroup, name)]
    # Restored from the class's own dict: getattr gives pybind's plain function, which set back on
    # the class no longer binds ``self`` (every later call fails with "incompatible arguments").
    own = {name: vars(ProcessGroup)[name] for name in names if name in vars(ProcessGroup)}

    def wrap(name: str, function):
        def recorded(self, *args, **kwargs):
            calls.append(CollectiveCall(name, self, self.size()))
            return function(self, *args, **kwargs)

        return recorded

    for name in names:
        setattr(ProcessGroup, name, wrap(name, getattr(ProcessGroup, name)))
    try:
        yield calls
    finally:
        for name in names:
            if name in own:
                setattr(ProcessGroup, name, own[name])
            else:  # inherited: the wrapper goes, the base class's method shows again
                delattr(ProcessGroup, name)
