"""The one module that touches ``megatron.core.parallel_state``.

Everything else in verl receives Megatron's process groups explicitly, as a
``ProcessGroupCollection`` (``pg_collection``), and asks the accessors here for ranks and
sizes. ``initialize_model_parallel`` applies the CPU shim when CUDA is absent, builds
Megatron's global groups for the whole world, seeds Megatron's RNG streams and returns the
collection; ``destroy_model_parallel`` undoes it (called between distributed tests too).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl.parallel.cpu_shim import apply_cpu_shim, shim_needed
from verl.utils.logging import log_rank0

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

_PG_COLLECTION: ProcessGroupCollection | None = None
_VIRTUAL_PP_SIZE: int | None = None


def validate_parallel_degrees(
    *,
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    context_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    where: str = "megatron",
) -> int:
    """Check the degrees against ``world_size``; returns the data-parallel size.

    Raises one ``ValueError`` that prints every degree and the world size.
    """
    degrees = (
        f"tensor_model_parallel_size={tensor_model_parallel_size}, "
        f"pipeline_model_parallel_size={pipeline_model_parallel_size}, "
        f"context_parallel_size={context_parallel_size}, "
        f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}, "
        f"world_size={world_size}"
    )
    problems = []
    for name, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("world_size", world_size),
    ):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be an integer >= 1")
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            problems.append("virtual_pipeline_model_parallel_size must be None or >= 1")
        elif pipeline_model_parallel_size < 2:
            problems.append(
                "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2 "
                "(set it to None without pipeline parallelism)"
            )
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if not problems and world_size % model_parallel != 0:
        problems.append(
            f"world_size must be a multiple of tensor x pipeline x context = {model_parallel}; "
            "change the degrees or the number of ranks"
        )
    if problems:
        raise ValueError(f"{where}: invalid parallel layout ({degrees}): " + "; ".join(problems))
    return world_size // model_parallel


def initialize_model_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    seed: int = 1234,
) -> ProcessGroupCollection:
    """Build Megatron's model-parallel groups over the whole world and seed its RNG streams.

    torch.distributed must already be initialised. Data parallel is derived:
    ``world_size // (tp * pp * cp)``. Returns the ``ProcessGroupCollection`` to pass to
    Megatron models, DDP and ``finalize_model_grads``; it is also what the accessors in this
    module read when called without a collection.
    """
    global _PG_COLLECTION, _VIRTUAL_PP_SIZE
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (torchrun, or verl.testing.run_distributed)"
        )
    world_size = dist.get_world_size()
    validate_parallel_degrees(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        where="initialize_model_parallel",
    )
    if shim_needed():
        apply_cpu_shim()

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "initialize_model_parallel: Megatron's model parallel state is already initialised; "
            "call verl.parallel.megatron_state.destroy_model_parallel() first"
        )
    backend = dist.get_backend()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        # The extra gloo groups serve the distributed optimizer on NCCL; on gloo they would
        # only duplicate every group.
        create_gloo_process_groups=backend != "gloo",
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    _PG_COLLECTION = ProcessGroupCollection.use_mpu_process_groups()
    _VIRTUAL_PP_SIZE = virtual_pipeline_model_parallel_size
    log_rank0(
        logger,
        logging.INFO,
        "Megatron model parallel: tp=%d pp=%d cp=%d vpp=%s dp=%d (world %d, %s)",
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        virtual_pipeline_model_parallel_size,
        world_size // (tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size),
        world_size,
        backend,
    )
    return _PG_COLLECTION


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run (and not been destroyed) in this process."""
    return _PG_COLLECTION is not None


def destroy_model_parallel() -> None:
    """Tear down Megatron's global parallel state; safe to call when nothing was initialised."""
    global _PG_COLLECTION, _VIRTUAL_PP_SIZE
    _PG_COLLECTION = None
    _VIRTUAL_PP_SIZE = None
    if "megatron.core.parallel_state" not in sys.modules:
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.destroy_model_parallel()
    # Names destroy_model_parallel leaves set (initialize_role binds them too).
    for name in ("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS"):
        setattr(parallel_state, name, None)
    initialize_rng_tracker(force_reset=True)


def get_process_group_collection() -> ProcessGroupCollection:
    """The collection built by ``initialize_model_parallel``."""
    if _PG_COLLECTION is None:
        raise RuntimeError(
            "Megatron model parallel is not initialised; call "
            "verl.parallel.megatron_state.initialize_model_parallel(...) first"
        )
    return _PG_COLLECTION


def _pgs(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    return pg_collection if pg_collection is not None else get_process_group_collection()


def tp_rank(pg_collection: ProcessGroupCollection | None = None) -> int:
    """This rank's index in its tensor-parallel group."""
    return dist.get_rank(group=_pgs(pg_collection).tp)


def tp_size(pg_collection: ProcessGroupCollection | None = None) -> int:
    """Tensor-parallel degree."""
    return dist.get_world_size(group=_pgs(pg_collection).tp)


def pp_rank(pg_collection: ProcessGroupCollection | None = None) -> int:
    """This rank's pipeline stage."""
    return dist.get_rank(group=_pgs(pg_collection).pp)


def pp_size(pg_collection: ProcessGroupCollection | None = None) -> int:
    """Pipeline-parallel degree (number of stages)."""
    return dist.get_world_size(group=_pgs(pg_collection).pp)


def cp_rank(pg_collection: ProcessGroupCollection | None = None) -> int:
    """This rank's index in its context-parallel group."""
    return dist.get_rank(group=_pgs(pg_collection).cp)


def cp_size(pg_collection: ProcessGroupCollection | None = None) -> int:
    """Context-parallel degree."""
    return dist.get_world_size(group=_pgs(pg_collection).cp)


def dp_group(pg_collection: ProcessGroupCollection | None = None) -> dist.ProcessGroup:
    """The data-parallel group (without context parallel ranks)."""
    return _pgs(pg_collection).dp


def dp_rank(pg_collection: ProcessGroupCollection | None = None) -> int:
    """This rank's index in its data-parallel group."""
    return dist.get_rank(group=_pgs(pg_collection).dp)


def dp_size(pg_collection: ProcessGroupCollection | None = None) -> int:
    """Data-parallel degree."""
    return dist.get_world_size(group=_pgs(pg_collection).dp)


def virtual_pp_size() -> int | None:
    """The virtual pipeline size given to ``initialize_model_parallel`` (None without interleaving)."""
    return _VIRTUAL_PP_SIZE


def is_pipeline_first_stage(
    pg_collection: ProcessGroupCollection | None = None, *, vp_stage: int | None = None
) -> bool:
    """True on the first pipeline stage (and, with interleaving, for its first model chunk)."""
    if vp_stage is not None and vp_stage != 0:
        return False
    return pp_rank(pg_collection) == 0


def is_pipeline_last_stage(
    pg_collection: ProcessGroupCollection | None = None, *, vp_stage: int | None = None
) -> bool:
    """True on the last pipeline stage (and, with interleaving, for its last model chunk)."""
    if vp_stage is not None and _VIRTUAL_PP_SIZE is not None and vp_stage != _VIRTUAL_PP_SIZE - 1:
        return False
    return pp_rank(pg_collection) == pp_size(pg_collection) - 1


def process_group_collection(groups: Mapping[str, dist.ProcessGroup | None]) -> ProcessGroupCollection:
    """A Megatron ``ProcessGroupCollection`` from explicit groups (no global parallel state).

    ``groups`` holds this rank's "tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp",
    "ep" groups, and "embd"/"pos_embd" where this rank is on an embedding stage (missing ones
    become None, as in Megatron). Expert groups are derived for dense models (expert parallel
    1, expert TP = TP): expert DP is DP x CP. Used by ``Topology.build_groups`` so roles on
    different rank sets each get their own collection.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    required = ("tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "ep")
    missing = [kind for kind in required if groups.get(kind) is None]
    if missing:
        raise ValueError(f"process_group_collection: groups {missing} are missing; build them with Topology")
    pgs = ProcessGroupCollection(
        tp=groups["tp"],
        cp=groups["cp"],
        dp=groups["dp"],
        pp=groups["pp"],
        mp=groups["mp"],
        tp_cp=groups["tp_cp"],
        dp_cp=groups["dp_cp"],
        tp_dp_cp=groups["tp_dp_cp"],
        ep=groups["ep"],
        embd=groups.get("embd"),
        pos_embd=groups.get("pos_embd"),
        # Dense model: expert parallel 1 and expert TP = TP, so the expert groups are these.
        expt_tp=groups["tp"],
        tp_ep=groups["tp"],
        tp_ep_pp=groups["mp"],
        expt_dp=groups["dp_cp"],
        intra_dp_cp=groups["dp_cp"],
        intra_expt_dp=groups["dp_cp"],
    )
    return pgs


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _parallel_state_bindings(pgs: ProcessGroupCollection) -> dict[str, object]:
    """Megatron's global group names -> this rank's groups in ``pgs`` (dense model: ep = 1)."""
    embd = getattr(pgs, "embd", None)
    pos_embd = getattr(pgs, "pos_embd", None)
    return {
        "_TENSOR_MODEL_PARALLEL_GROUP": pgs.tp,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": _ranks(pgs.tp),
        "_PIPELINE_MODEL_PARALLEL_GROUP": pgs.pp,
        "_PIPELINE_GLOBAL_RANKS": _ranks(pgs.pp),
        "_MODEL_PARALLEL_GROUP": pgs.mp,
        "_MODEL_PARALLEL_GLOBAL_RANKS": _ranks(pgs.mp),
        "_CONTEXT_PARALLEL_GROUP": pgs.cp,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": _ranks(pgs.cp),
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": pgs.tp_cp,
        "_DATA_PARALLEL_GROUP": pgs.dp,
        "_DATA_PARALLEL_GLOBAL_RANKS": _ranks(pgs.dp),
        "_DATA_PARALLEL_GROUP_WITH_CP": pgs.dp_cp,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": _ranks(pgs.dp_cp),
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": pgs.dp_cp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": pgs.tp_dp_cp,
        "_EMBEDDING_GROUP": embd,
        "_EMBEDDING_GLOBAL_RANKS": _ranks(embd),
        "_POSITION_EMBEDDING_GROUP": pos_embd,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": _ranks(pos_embd),
        "_EXPERT_MODEL_PARALLEL_GROUP": pgs.ep,
        "_EXPERT_TENSOR_PARALLEL_GROUP": pgs.tp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": pgs.tp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": pgs.mp,
        "_EXPERT_DATA_PARALLEL_GROUP": pgs.dp_cp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": pgs.dp_cp,
    }


def _bind(pgs: ProcessGroupCollection) -> dict[str, object]:
    """Point Megatron's global groups at ``pgs``; returns the previous values."""
    from megatron.core import parallel_state

    bindings = _parallel_state_bindings(pgs)
    previous = {name: getattr(parallel_state, name) for name in bindings}
    for name, value in bindings.items():
        setattr(parallel_state, name, value)
    return previous


@contextlib.contextmanager
def activate_role(pg_collection: ProcessGroupCollection) -> Iterator[None]:
    """Run a block with Megatron's global groups pointing at one role's groups.

    Megatron-core 0.16 still reads its global groups in a few places even when a
    ``pg_collection`` is passed (vocab-parallel cross entropy, some schedule fallbacks), so
    colocated roles with different layouts (actor TP2, reference TP1 on the same ranks) each
    run inside their own ``activate_role``. The previous binding is restored on exit.
    """
    previous = _bind(pg_collection)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        for name, value in previous.items():
            setattr(parallel_state, name, value)


def initialize_role(pg_collection: ProcessGroupCollection, *, seed: int = 1234) -> None:
    """Prepare this process for a role's explicit groups (from ``Topology``), without global groups.

    The counterpart of ``initialize_model_parallel`` for roles on part of the world: applies
    the CPU shim when CUDA is absent, creates Megatron's process-local scratch buffer (its
    local attention takes buffers from ``parallel_state``'s global memory buffer, whatever
    groups are passed in), points Megatron's global groups at this role's groups (see
    ``activate_role`` for switching between colocated roles), and seeds the default stream
    and the TP/DP RNG streams (the TP stream differs per TP rank). Undone by
    ``destroy_model_parallel``.
    """
    global _PG_COLLECTION
    if shim_needed():
        apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    _bind(pg_collection)
    tp = dist.get_rank(group=pg_collection.tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp, ep_rank=0, etp_rank=tp, force_reset_rng=True)
    if _PG_COLLECTION is None:
        _PG_COLLECTION = pg_collection
