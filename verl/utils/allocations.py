"""Measuring the peak memory a block of code allocates (allocation tracking, not an estimate).

:func:`track_allocations` reports the peak, above the level at entry, of the bytes torch had
allocated while the block ran: on CUDA from the caching allocator's statistics
(``max_memory_allocated`` after a reset), on CPU by replaying the allocation and free events
torch's profiler records (``profile_memory=True``) in time order. The CPU path slows the block
down (the profiler hooks every allocation), so time a block in a separate run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["AllocationPeak", "track_allocations"]


@dataclass
class AllocationPeak:
    """Filled in when the ``track_allocations`` block exits."""

    peak_bytes: int = 0
    """Largest amount allocated above the level at entry, at any moment inside the block."""
    net_bytes: int = 0
    """Allocated at exit minus at entry (what the block kept)."""


@contextlib.contextmanager
def track_allocations(device: torch.device | str = "cpu") -> Iterator[AllocationPeak]:
    """Track torch's allocations on ``device`` inside the block (see the module docstring)."""
    device = torch.device(device)
    result = AllocationPeak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = torch.cuda.max_memory_allocated(device) - start
        result.net_bytes = torch.cuda.memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = []
    for event in prof.events():
        # Allocations are charged to the op that made them (its own share, not its children's);
        # frees come as separate "[memory]" events with negative sizes.
        nbytes = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if nbytes:
            events.append((event.time_range.start, nbytes))
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    result.peak_bytes, result.net_bytes = peak, live
