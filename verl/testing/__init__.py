"""Test utilities shipped with verl: the persistent multi-rank runner for distributed tests."""

from verl.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    rank_device,
    run_distributed,
    shutdown_pools,
)

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "rank_device",
    "run_distributed",
    "shutdown_pools",
]
