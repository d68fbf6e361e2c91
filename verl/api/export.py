"""``DataStream.export_as_api``: the stream's actor as a Hugging Face checkpoint, served.

The actor's weights are written by the trainer's own export (``MegatronEngine.export_hf``,
collective), with ``verl_export.json`` (the trainer step) beside them; the app is
:func:`verl.serving.create_app` on that directory.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Protocol

from verl.serving.engine import EXPORT_INFO_FILE

if TYPE_CHECKING:
    from verl.trainer.ppo_trainer import PPOTrainer

__all__ = ["export_as_api", "export_policy"]


class HoldsTrainer(Protocol):
    """What the export reads of a :class:`~verl.api.stream.DataStream`: its trainer, nothing else
    (so this module, which the stream's ``export_as_api`` calls, does not import the stream)."""

    @property
    def trainer(self) -> "PPOTrainer": ...


def export_policy(stream: HoldsTrainer, out_dir: str | None = None) -> str:
    """Write the stream's current actor as a Hugging Face checkpoint; returns the directory
    (default ``<trainer.default_local_dir>/serving/global_step_<N>``). Collective: every rank calls it."""
    import torch.distributed as dist

    trainer = stream.trainer
    step = int(trainer.global_step)
    if out_dir is None:
        out_dir = os.path.join(trainer.cfg.trainer.default_local_dir, "serving", f"global_step_{step}")
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    trainer.export_actor_hf(out_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(out_dir, EXPORT_INFO_FILE), "w", encoding="utf-8") as f:
            json.dump({"step": step, "source": "verl.DataStream.export_as_api"}, f, indent=2)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def export_as_api(stream: HoldsTrainer, out_dir: str | None = None, **app_kwargs: Any) -> Any:
    """:func:`export_policy`, then :func:`verl.serving.create_app` on the export (``app_kwargs``:
    ``engine``, ``limits``, ``api_key``, ``name``, ``device``, ``seed``). Returns the FastAPI app;
    serve it with ``verl.serving.run(app)`` or ``BackgroundServer(app)``."""
    from verl.serving.app import create_app

    actor = stream.trainer.actor  # None on ranks the actor is not placed on (trainer.placement)
    if actor is not None and not actor.engine.capabilities.hf_checkpoint:
        raise ValueError(
            f"export_as_api: the actor is a plain nn.Module ({type(actor.engine.module).__name__}) on the plain PyTorch "
            "engine; the serving app runs Hugging Face checkpoints (vLLM or transformers), not arbitrary modules. "
            "Its weights are exported with export_policy(stream) (model.safetensors, the module's state_dict)"
        )
    path = export_policy(stream, out_dir)
    return create_app(path, **app_kwargs)
