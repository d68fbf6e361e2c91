"""``verl.monitor``: the tutorials' import path of ``VerlMonitor`` (``verl.api.monitor``)."""

from verl.api.monitor import VerlMonitor

__all__ = ["VerlMonitor"]
