"""A Hugging Face checkpoint (config, tokenizer, safetensors) of an engine's weights, written collectively.

Each pipeline stage's first TP/DP/CP rank writes its stage's tensors (gathered over TP one
parameter at a time, so no rank ever holds the whole model) into a hidden stage directory;
global rank 0 then moves every file into place under the Hugging Face names and writes the
index (``verl.models.safetensors_io.commit_shards``), the config and the side files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl.models.builder import HF_DTYPE_NAMES
from verl.models.checkpoint import iter_hf_weights
from verl.models.hf_config import HFModelSpec
from verl.models.safetensors_io import SafetensorsWriter, commit_shards, copy_side_files
from verl.utils.logging import log_rank0

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["export_hf_checkpoint"]

_STAGE_FILES = "files.json"


def _stage_dir(out_dir: str, stage: int) -> str:
    return os.path.join(out_dir, f".stage{stage:03d}")


def export_hf_checkpoint(
    chunks: list[torch.nn.Module],
    pg: "ProcessGroupCollection",
    *,
    spec: HFModelSpec,
    dtype: str,
    hf_dir: str,
    out_dir: str,
) -> None:
    """Write the weights of ``chunks`` as a Hugging Face checkpoint in ``out_dir`` (collective).

    ``dtype`` is verl's short name of the weights' dtype (the config's ``torch_dtype``);
    ``hf_dir`` is the model the engine started from (tokenizer and generation files come from it).
    """
    world_rank = dist.get_rank()
    pp_rank, pp_size = pg.pp.rank(), pg.pp.size()
    stage_dir = _stage_dir(out_dir, pp_rank)
    if world_rank == 0:
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir)
    dist.barrier()
    if pg.dp.rank() == 0 and pg.cp.rank() == 0:
        writer = None
        if pg.tp.rank() == 0:
            os.makedirs(stage_dir, exist_ok=True)
            writer = SafetensorsWriter(stage_dir)
        for name, tensor in iter_hf_weights(chunks, pg=pg):  # every TP rank takes part in the gathers
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            shards = [(os.path.basename(path), names, nbytes) for path, names, nbytes in writer.close()]
            with open(os.path.join(stage_dir, _STAGE_FILES), "w", encoding="utf-8") as f:
                json.dump(shards, f)
    dist.barrier()
    if world_rank == 0:
        shards = []
        for stage in range(pp_size):
            with open(os.path.join(_stage_dir(out_dir, stage), _STAGE_FILES), encoding="utf-8") as f:
                shards += [
                    (os.path.join(_stage_dir(out_dir, stage), name), names, nbytes)
                    for name, names, nbytes in json.load(f)
                ]
        commit_shards(out_dir, shards)
        for stage in range(pp_size):
            shutil.rmtree(_stage_dir(out_dir, stage))
        copy_side_files(hf_dir, out_dir, include_config=False)
        config = dict(spec.raw)
        config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
        with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    dist.barrier()
    log_rank0(logger, logging.INFO, "exported Hugging Face checkpoint to %s", out_dir)
