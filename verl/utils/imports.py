"""Deferred imports of optional packages that a dependency imports only to see whether they exist.

megatron-core runs ``try: import wandb`` in three modules and ``try: import triton`` in
``megatron.core.utils`` at import time, whatever the run does: about a second of start-up
(more on a loaded machine) for a package the run may never touch. :func:`defer_import` puts a
stand-in module in ``sys.modules`` that carries the package's spec, so ``import wandb`` succeeds
at once (the probe sees the package, as it would); the first attribute read from it (``wandb.init``,
``import wandb.sdk``) imports the real package, which then replaces the stand-in in ``sys.modules``
and fills it, so every holder of either object sees the real package. Nothing is deferred that a
run's config asks for (the trainers call this from :func:`verl.trainer.startup.prepare_run`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

__all__ = ["defer_import", "is_deferred"]

_lock = threading.RLock()


class _DeferredModule(types.ModuleType):
    """The stand-in: its first missing attribute imports the real module."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(_load(self), attr)


def _load(stub: _DeferredModule) -> types.ModuleType:
    name = stub.__name__
    with _lock:
        current = sys.modules.get(name)
        if current is stub or current is None:
            sys.modules.pop(name, None)
            real = importlib.import_module(name)
        else:
            real = current
        if stub.__dict__.get("__verl_deferred__"):
            stub.__dict__.update(real.__dict__)  # the stand-in now answers like the real module
            stub.__dict__["__verl_deferred__"] = False
    return real


def defer_import(name: str) -> bool:
    """Defer the import of top-level package ``name`` until it is used; False when it is already
    imported or not installed (nothing to do)."""
    with _lock:
        if name in sys.modules or "." in name:
            return False
        spec = importlib.util.find_spec(name)
        if spec is None:
            return False
        stub = _DeferredModule(name)
        stub.__spec__ = spec
        stub.__loader__ = spec.loader
        # inspect.getmodule (torch.library calls it at import) walks sys.modules reading __file__:
        # answering it here keeps that walk from importing the real package. No __path__, so
        # ``import name.sub`` still goes through __getattr__ and imports the real package first.
        stub.__file__ = spec.origin
        stub.__verl_deferred__ = True
        sys.modules[name] = stub
    return True


def is_deferred(name: str) -> bool:
    """Whether ``sys.modules[name]`` is still a stand-in that nothing has used."""
    module = sys.modules.get(name)
    return isinstance(module, _DeferredModule) and bool(module.__dict__.get("__verl_deferred__"))
