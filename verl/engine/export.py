"""A Hugging Face checkpoint (config, tokenizer, safetensors) of an engine's weights, written collectively.

Each pipeline stage's first TP/DP/CP rank writes its stage's tensors (gathered over TP one
parameter at a time, so no rank ever holds the whole model) into a stage directory inside a
hidden staging sibling of the target; global rank 0 then gives every file its Hugging Face
name and writes the index (``verl.models.safetensors_io.commit_shards``), the config and the
side files, and renames the staging directory into place (``verl.utils.outputs``). A target
that is, holds or lies inside the model being trained, or that holds files verl did not
write, is refused before anything is written, on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl.models.builder import HF_DTYPE_NAMES
from verl.models.checkpoint import iter_hf_weights
from verl.models.hf_config import HFModelSpec
from verl.models.safetensors_io import SafetensorsWriter, commit_shards, copy_side_files
from verl.utils.logging import log_rank0
from verl.utils.outputs import OutputPathError, check_output_dir, commit_output, staging_dir

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["export_hf_checkpoint"]

_STAGE_FILES = "files.json"


def _stage_dir(root: str, stage: int) -> str:
    return os.path.join(root, f".stage{stage:03d}")


def _shared_staging_dir(out_dir: str, hf_dir: str) -> str:
    """Rank 0 checks the target and makes the staging directory; every rank gets its path, or the
    same OutputPathError (no rank is left waiting)."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            check_output_dir(out_dir, key="Hugging Face export dir", inputs={"model.path": hf_dir},
                             replace_verl_outputs=True)
            box[0] = staging_dir(out_dir)
        except OutputPathError as exc:
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], OutputPathError):
        raise box[0]
    return str(box[0])


def export_hf_checkpoint(
    chunks: list[torch.nn.Module],
    pg: "ProcessGroupCollection",
    *,
    spec: HFModelSpec,
    dtype: str,
    hf_dir: str,
    out_dir: str,
    config: dict[str, Any] | None = None,
    extra: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    more_side_files: tuple[str, ...] = (),
) -> None:
    """Write the weights of ``chunks`` as a Hugging Face checkpoint in ``out_dir`` (collective).

    ``dtype`` is verl's short name of the weights' dtype (the config's ``torch_dtype``);
    ``hf_dir`` is the model the engine started from (tokenizer and generation files come from it).
    ``config``: the config.json to write (None: ``spec.raw``); ``extra``: more (name, whole tensor)
    pairs, replicated on every rank, written by the first stage's writer (a VLM's vision tower);
    ``more_side_files``: files of ``hf_dir`` copied too when present (a VLM's image processor).
    Raises ``verl.utils.outputs.OutputPathError`` on every rank when ``out_dir`` may not be written.
    """
    world_rank = dist.get_rank()
    pp_rank, pp_size = pg.pp.rank(), pg.pp.size()
    tmp = _shared_staging_dir(out_dir, hf_dir)
    stage_dir = _stage_dir(tmp, pp_rank)
    if pg.dp.rank() == 0 and pg.cp.rank() == 0:
        writer = None
        if pg.tp.rank() == 0:
            os.makedirs(stage_dir, exist_ok=True)
            writer = SafetensorsWriter(stage_dir)
        for name, tensor in iter_hf_weights(chunks, pg=pg):  # every TP rank takes part in the gathers
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None and extra is not None and pp_rank == 0:
            for name, tensor in extra():
                writer.add(name, tensor)
        if writer is not None:
            shards = [(os.path.basename(path), names, nbytes) for path, names, nbytes in writer.close()]
            with open(os.path.join(stage_dir, _STAGE_FILES), "w", encoding="utf-8") as f:
                json.dump(shards, f)
    dist.barrier()
    if world_rank == 0:
        shards = []
        for stage in range(pp_size):
            with open(os.path.join(_stage_dir(tmp, stage), _STAGE_FILES), encoding="utf-8") as f:
                shards += [
                    (os.path.join(_stage_dir(tmp, stage), name), names, nbytes)
                    for name, names, nbytes in json.load(f)
                ]
        commit_shards(tmp, shards)
        for stage in range(pp_size):
            shutil.rmtree(_stage_dir(tmp, stage))
        copy_side_files(hf_dir, tmp, include_config=False)
        for name in more_side_files:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(hf_dir, name), os.path.join(tmp, name))
        config = dict(spec.raw if config is None else config)
        config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        commit_output(tmp, out_dir, what="Hugging Face export (MegatronEngine.export_hf)")
    dist.barrier()
    log_rank0(logger, logging.INFO, "exported Hugging Face checkpoint to %s", out_dir)
