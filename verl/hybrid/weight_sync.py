"""``WeightSync``: the trainer's one entry point to the 3D-HybridEngine's weight transfer.

    sync = WeightSync(actor, rollout, bucket_bytes=rollout_cfg.update_weights_bucket_megabytes * 2**20)
    with sync.rollout_phase():     # collective: training state out, KV cache in, weights pushed
        batch = rollout.generate(prompts)
    # here the KV cache is released again and the training state is back

At construction (collective over the world, where actor and rollout are colocated) it checks
the layouts (the rollout TP' must divide the actor's ranks and the model's heads; every engine
parameter must be one the plan fills, and the other way round; every rank raises the same
error), computes the :class:`~verl.hybrid.plan.ReshardPlan` from the actor's layout (TP, PP,
VPP, DP) and the destination's, and keeps it. ``push`` executes the plan
(:func:`verl.hybrid.transfer.execute_plan`): each rank copies what it holds and needs locally,
exchanges buckets with its peers, and writes straight into the destination's tensors; no rank
gathers a whole tensor it does not serve. Destinations: the vLLM engine's parameters (vLLM
layout, in place), the transformers fallback engine (whole Hugging Face tensors, TP' = 1), or
:class:`HFShards` (Hugging Face tensors split for a rollout rank; tests and tools).

:func:`naive_push` is the path the reference verl takes (every TP rank gathers each whole
tensor, pipeline stages broadcast theirs, the engine slices): kept as the baseline that
``tools/bench.py reshard`` measures side by side.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from verl.hybrid.layout import Layout, check_megatron_layout, check_rollout_degrees, fill_from_hf, hf_layout, hf_shape
from verl.hybrid.layout import megatron_layout, vllm_layout
from verl.hybrid.memory import MemoryLedger, TrainingStateOffload, memory_handoff
from verl.hybrid.plan import ReshardPlan, build_plan
from verl.hybrid.transfer import execute_plan
from verl.models.builder import unwrap_model
from verl.models.hf_config import HFModelSpec
from verl.models.lora import named_weights

if TYPE_CHECKING:
    from verl.engine import MegatronEngine

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = ["DisaggregatedSync", "HFShards", "WeightSync", "destination_layout", "naive_push", "push_totals", "write_into"]

# Push metrics that count what each rank moved: a push's total is their sum over the ranks.
_SUMMED = ("update_weights/bytes_", "update_weights/blocks_", "update_weights/checksum_failures")

class HFShards:
    """A destination that is a dict of Hugging Face tensors as rollout rank ``tp_rank`` of ``tp``
    would hold them (split like vLLM, unstacked, unpadded; whole tensors at ``tp = 1``)."""

    weights_layout = "hf-shards"

    def __init__(self, spec: HFModelSpec, *, tp: int, tp_rank: int, dtype: torch.dtype, device: torch.device | str):
        self.spec, self.tp, self.tp_rank = spec, tp, tp_rank
        self.layout = hf_layout(spec, tp=tp, tp_rank=tp_rank)
        self.tensors = {k: torch.zeros(s, dtype=dtype, device=device) for k, s in self.layout.shapes.items()}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, by Hugging Face name."""
        return iter(self.tensors.items())

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Slice whole Hugging Face tensors into this rank's shards (what an engine's loader does)."""
        fill_from_hf(self.spec, self.layout, self.tensors, weights)

    def weights_updated(self) -> None:
        """Nothing is cached."""

    def resume(self) -> None:
        """No KV cache to take back."""

    def release(self) -> None:
        """No KV cache to give back."""

    def kv_cache_bytes(self) -> int:
        """No KV cache."""
        return 0


def write_into(destination: Any, keys: list[str], write: Callable[[list[torch.Tensor]], _T]) -> _T:
    """Run ``write`` (a push: it writes the destination's tensors ``keys``, flattened, in place) on the
    destination, then let it drop what it cached; returns what ``write`` returns.

    An engine with ``transfer_weights`` (vLLM: verl's push registered as vLLM's weight-transfer engine,
    driven by vLLM's public update session) runs it itself; other destinations hand their
    ``named_parameters``.
    """
    def run(params: dict[str, torch.Tensor]) -> _T:
        return write([params[k].view(-1) for k in keys])

    transfer = getattr(destination, "transfer_weights", None)
    if transfer is not None:
        return transfer(run)
    result = run({k: p.data for k, p in destination.named_parameters()})
    destination.weights_updated()
    return result


def _rollout_tp(destination: Any) -> int:
    layout = getattr(destination, "weights_layout", None)
    if layout == "vllm":
        return int(destination.cfg.tensor_model_parallel_size)
    if layout == "hf":
        return 1
    if layout == "hf-shards":
        return destination.tp
    raise ValueError(f"WeightSync: {type(destination).__name__} is not a rollout engine or HFShards destination")


def destination_layout(destination: Any, spec: HFModelSpec, *, rank: int, rollout_tp: int) -> Layout:
    """The tensors rollout rank ``rank`` holds in ``destination``'s layout (TP' rank = rank % TP')."""
    kind = destination.weights_layout
    if kind == "vllm":
        return vllm_layout(spec, tp=rollout_tp, tp_rank=rank % rollout_tp)
    if kind == "hf":
        return hf_layout(spec, fused_experts=spec.is_moe)
    return hf_layout(spec, tp=rollout_tp, tp_rank=rank % rollout_tp)


def _tensor_problems(layout: Layout, tensors: dict[str, torch.Tensor], what: str) -> list[str]:
    problems = []
    missing = sorted(set(layout.shapes) - set(tensors))
    extra = sorted(set(tensors) - set(layout.shapes))
    if missing:
        problems.append(f"{what} lacks {len(missing)} parameter(s) the plan fills, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{what} has {len(extra)} parameter(s) the plan does not know, e.g. {extra[:3]}")
    for key in sorted(set(layout.shapes) & set(tensors)):
        if tuple(tensors[key].shape) != tuple(layout.shapes[key]):
            problems.append(f"{what} parameter {key} has shape {list(tensors[key].shape)}, the plan {list(layout.shapes[key])}")
        elif not tensors[key].is_contiguous():
            problems.append(f"{what} parameter {key} is not contiguous")
    return problems


class WeightSync:
    """Pushes the actor's weights into a colocated rollout destination (see the module docstring).

    Args:
        actor: the actor's ``MegatronEngine`` (any TP x PP x VPP x DP over the whole world).
        rollout: the rollout engine (vLLM: TP' from its config, replicas of consecutive ranks;
            transformers: TP' = 1) or an :class:`HFShards`.
        bucket_bytes: the transfer's bucket size (from
            ``actor_rollout_ref.rollout.update_weights_bucket_megabytes``); peak extra memory is
            at most two buckets.
    """

    def __init__(self, actor: "MegatronEngine", rollout: Any, *, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"WeightSync: bucket_bytes={bucket_bytes}; it must be >= 1")
        self.actor, self.rollout = actor, rollout
        spec = actor.spec
        world, rank = dist.get_world_size(), dist.get_rank()
        pg = actor.pg
        tp, pp, dp, cp = pg.tp.size(), pg.pp.size(), pg.dp.size(), pg.cp.size()
        vpp = actor.megatron_config.virtual_pipeline_model_parallel_size
        rollout_tp = _rollout_tp(rollout)
        degrees = (
            f"actor tp={tp} pp={pp} vpp={vpp} cp={cp} dp={dp}, rollout TP'={rollout_tp} "
            f"x DP'={world // rollout_tp if rollout_tp and world % rollout_tp == 0 else '?'}, world_size={world}"
        )
        problems = []
        if tp * pp * cp * dp != world:
            problems.append("the actor must span the whole world (the rollout is colocated with it)")
        if world % rollout_tp:
            problems.append(f"rollout TP'={rollout_tp} does not divide the actor's {world} ranks")
        problems += check_rollout_degrees(spec, rollout_tp)
        local: list[str] = []
        ep_rank, ep = unwrap_model(actor.chunks[0]).verl_ep  # expert parallel (1 for a dense model)
        split = unwrap_model(actor.chunks[0]).verl_split  # the same on every rank (one config)
        if not problems:
            source = megatron_layout(
                spec, tp=tp, tp_rank=pg.tp.rank(), pp=pp, pp_rank=pg.pp.rank(), vpp=vpp,
                vocab_pad_multiple=actor.build_config.vocab_pad_multiple, ep=ep, ep_rank=ep_rank, split=split,
            )
            try:
                check_megatron_layout(source, actor.chunks, where=f"rank {rank}")
            except ValueError as exc:
                local.append(str(exc))
            dest = destination_layout(rollout, spec, rank=rank, rollout_tp=rollout_tp)
            local += [f"rank {rank}: {p}" for p in _tensor_problems(dest, dict(rollout.named_parameters()), "the rollout engine")]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ((pg.tp.rank(), pg.pp.rank(), ep_rank), local))
        problems += [p for _, errs in gathered for p in errs]
        if problems:  # the same list on every rank: every rank raises
            raise ValueError(f"WeightSync: cannot reshard ({degrees}): " + "; ".join(dict.fromkeys(problems)))
        sources = [
            megatron_layout(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, vpp=vpp,
                            vocab_pad_multiple=actor.build_config.vocab_pad_multiple, ep=ep, ep_rank=e, split=split)
            for (t, p, e), _ in gathered
        ]
        destinations = [destination_layout(rollout, spec, rank=r, rollout_tp=rollout_tp) for r in range(world)]
        self.plan: ReshardPlan = build_plan(sources, destinations)
        self.destination: Layout = destinations[rank]
        """This rank's destination layout (the boxes the plan writes)."""
        self.rollout_tp = rollout_tp
        self.degrees = degrees
        dtype = next(unwrap_model(actor.chunks[0]).parameters()).dtype
        self.bucket_elements = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        self.last_metrics: dict[str, float] = {}
        flags = actor.megatron_config
        # Two offloads: the parameters leave only after the push has read them.
        self._state_offload = TrainingStateOffload(
            actor, params=False, grads=flags.grad_offload, optimizer=flags.optimizer_offload
        )
        self._param_offload = TrainingStateOffload(actor, params=flags.param_offload, grads=False, optimizer=False)
        self.ledger = MemoryLedger(actor.device)
        stats = self.plan.rank_stats(rank)
        logger.info(
            "weight sync planned (%s): rank %d copies %d elements locally, receives %d from %d peers",
            degrees, rank, stats.local_elements, stats.received_elements, len(stats.received),
        )

    def _sources(self) -> list[torch.Tensor]:
        params = {}
        for v, chunk in enumerate(self.actor.chunks):
            for name, param in named_weights(unwrap_model(chunk)):  # LoRA: merged W + s B A
                params[f"{v}/{name}"] = param
        return [params[k].view(-1) for k in self.plan.src_keys[dist.get_rank()]]

    def _destinations(self) -> list[torch.Tensor]:
        params = {k: p.data for k, p in self.rollout.named_parameters()}
        return [params[k].view(-1) for k in self.plan.dst_keys[dist.get_rank()]]

    def push(self) -> dict[str, float]:
        """Write the actor's current weights into the destination (collective); returns step metrics."""
        rank = dist.get_rank()
        stats = write_into(self.rollout, self.plan.dst_keys[rank], lambda destinations: execute_plan(
            self.plan, rank, self._sources(), destinations, bucket_elements=self.bucket_elements
        ))
        self.last_metrics = {
            "timing_s/update_weights": stats.seconds,
            "timing_s/update_weights_local": stats.local_seconds,
            "update_weights/bytes_local": float(stats.local_bytes),
            "update_weights/bytes_sent": float(stats.sent_bytes),
            "update_weights/bytes_received": float(stats.received_bytes),
            "update_weights/buffer_bytes": float(stats.buffer_bytes),
        }
        return dict(self.last_metrics)

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[dict[str, float]]:
        """The rollout half of a step (collective), with the memory handoff around it.

        On entry: the actor's gradients and optimizer state go to host memory (``grad_offload``,
        ``optimizer_offload`` of ``actor_rollout_ref.actor.megatron``), the engine takes its KV cache
        (and, on GPU, its weights) back, the actor's weights are pushed, then the actor's
        parameters go to host memory too (``param_offload``; after the push, which reads them).
        The body generates. On exit: the KV cache is released and the training state restored.
        Yields the push's metrics; afterwards :attr:`last_metrics` also holds the per-phase memory
        (``memory/{train,offloaded,rollout,reloaded}/*_bytes``, ``memory/peak_vs_sum``).
        """
        with memory_handoff(self, self._state_offload, self._param_offload) as metrics:
            yield metrics


def _layout_of(kind: str, spec: HFModelSpec, *, tp: int, tp_rank: int) -> Layout:
    """The tensors a rollout rank holds in a destination of ``kind`` ("vllm", "hf", "hf-shards")."""
    if kind == "vllm":
        return vllm_layout(spec, tp=tp, tp_rank=tp_rank)
    if kind == "hf":
        return hf_layout(spec, fused_experts=spec.is_moe)
    return hf_layout(spec, tp=tp, tp_rank=tp_rank)


class DisaggregatedSync:
    """Sends the actor's weights from its ranks to a rollout engine on ranks of its own.

    The rollout engine placed apart from the actor (``trainer.placement.rollout``: generation
    disaggregated) keeps its memory; there is no handoff. :meth:`push` (collective over the whole
    world: every rank calls it, those of neither role with nothing to move) executes the same
    kind of reshard plan as :class:`WeightSync`, across ranks: each actor rank sends the pieces of
    its shards that each rollout rank's tensors need, straight into those tensors, in buckets.

    Args:
        actor: the actor's ``MegatronEngine`` on the actor's ranks, None elsewhere.
        rollout: the rollout engine (or :class:`HFShards`) on the rollout's ranks, None elsewhere.
        rollout_rank: this rank's place among the rollout's ranks (0 .. size - 1; its TP' rank is
            ``rollout_rank % TP'``), None off them.
        bucket_bytes: as :class:`WeightSync`.
        rollout_world: the group of the rollout's ranks, the engine's world
            (``verl.parallel.role_world``): the engine's own calls run inside it.
        mode: ``"full"`` (every push sends everything) or ``"delta"`` (``"delta_sharded"``, the
            reference verl's name, is the same): only the blocks changed since the last push
            cross the wire, each bucket checksummed (:mod:`verl.hybrid.delta`).
        full_every: with ``mode="delta"``, pushes 1, 1 + full_every, 1 + 2 full_every, ... are full.
        block_bytes: with ``mode="delta"``, the unit of change in bytes of the actor's weights (0: one
            element, so the changed elements alone are sent, found by a bitmask of one bit each).
    """

    def __init__(self, actor: "MegatronEngine | None", rollout: Any, *, rollout_rank: int | None,
                 bucket_bytes: int, rollout_world: dist.ProcessGroup | None = None, mode: str = "full",
                 full_every: int = 10, block_bytes: int = 0) -> None:
        from verl.parallel.role_world import role_world

        self._engine_world = lambda: role_world(rollout_world)
        # The whole world, named explicitly: the push runs inside the engine's world block (vLLM's
        # update session), where the default group is the rollout's ranks only.
        self._world_group = dist.group.WORLD
        if bucket_bytes < 1:
            raise ValueError(f"DisaggregatedSync: bucket_bytes={bucket_bytes}; it must be >= 1")
        if mode not in ("full", "delta", "delta_sharded"):
            raise ValueError(f"DisaggregatedSync: mode={mode!r}; use 'full' or 'delta' ('delta_sharded')")
        if full_every < 1 or block_bytes < 0:
            raise ValueError(f"DisaggregatedSync: full_every={full_every} (>= 1), block_bytes={block_bytes} (>= 0)")
        self.mode = "full" if mode == "full" else "delta"
        if (rollout is None) != (rollout_rank is None):
            raise ValueError("DisaggregatedSync: give rollout_rank with the rollout engine, and only there")
        self.actor, self.rollout = actor, rollout
        world, rank = dist.get_world_size(), dist.get_rank()
        mine: dict[str, Any] = {}
        if actor is not None:
            pg = actor.pg
            mine["actor"] = {
                "coords": (pg.tp.rank(), pg.pp.rank()),
                "degrees": (pg.tp.size(), pg.pp.size(), pg.dp.size(), pg.cp.size()),
                "vpp": actor.megatron_config.virtual_pipeline_model_parallel_size,
                "pad": actor.build_config.vocab_pad_multiple,
                "dtype": str(next(unwrap_model(actor.chunks[0]).parameters()).dtype).removeprefix("torch."),
                "spec": actor.spec,
                "ep": unwrap_model(actor.chunks[0]).verl_ep[1],
                "split": unwrap_model(actor.chunks[0]).verl_split,
            }
        if rollout is not None:
            with self._engine_world():
                first_param = next(iter(rollout.named_parameters()), (None, None))[1]
            mine["rollout"] = {"kind": rollout.weights_layout, "tp": _rollout_tp(rollout), "rank": rollout_rank,
                               "dtype": str(getattr(first_param, "dtype", "torch.float32")).removeprefix("torch.")}
        infos: list[Any] = [None] * world
        dist.all_gather_object(infos, mine)
        actor_ranks = [r for r, i in enumerate(infos) if "actor" in i]
        rollout_ranks = [r for r, i in enumerate(infos) if "rollout" in i]
        if not actor_ranks or not rollout_ranks:
            raise ValueError(
                f"DisaggregatedSync: the actor is built on ranks {actor_ranks} and the rollout on {rollout_ranks}; "
                "both must exist"
            )
        first = infos[actor_ranks[0]]["actor"]
        spec, vpp, pad, split = first["spec"], first["vpp"], first["pad"], first["split"]
        tp, pp, dp, cp = first["degrees"]
        rollout_tp = infos[rollout_ranks[0]]["rollout"]["tp"]
        self.degrees = (
            f"actor tp={tp} pp={pp} vpp={vpp} cp={cp} dp={dp} on ranks {actor_ranks}, rollout TP'={rollout_tp} "
            f"x DP'={len(rollout_ranks) // rollout_tp if len(rollout_ranks) % rollout_tp == 0 else '?'} on ranks "
            f"{rollout_ranks}, world_size={world}"
        )
        problems = []
        if first["ep"] != 1:
            problems.append("expert-parallel actors are not resharded into a rollout on other ranks yet (EP must be 1)")
        if len(rollout_ranks) % rollout_tp:
            problems.append(f"rollout TP'={rollout_tp} does not divide the rollout's {len(rollout_ranks)} ranks")
        problems += check_rollout_degrees(spec, rollout_tp)

        def source(info: dict[str, Any] | None) -> Layout:
            if info is None:
                return Layout(shapes={}, boxes=())
            t, p = info["coords"]
            return megatron_layout(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, vpp=vpp, vocab_pad_multiple=pad,
                                   split=split)

        def destination(info: dict[str, Any] | None) -> Layout:
            if info is None:
                return Layout(shapes={}, boxes=())
            return _layout_of(info["kind"], spec, tp=rollout_tp, tp_rank=info["rank"] % rollout_tp)

        local: list[str] = []
        if not problems:
            if actor is not None:
                try:
                    check_megatron_layout(source(mine["actor"]), actor.chunks, where=f"rank {rank}")
                except ValueError as exc:
                    local.append(str(exc))
            if rollout is not None:
                dest = destination(mine["rollout"])
                with self._engine_world():
                    held = dict(rollout.named_parameters())
                local += [f"rank {rank}: {p}" for p in _tensor_problems(dest, held, "the rollout engine")]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        problems += [p for errs in gathered for p in errs]
        if problems:  # the same list on every rank: every rank raises
            raise ValueError(f"DisaggregatedSync: cannot send ({self.degrees}): " + "; ".join(dict.fromkeys(problems)))
        self.plan: ReshardPlan = build_plan(
            [source(i.get("actor")) for i in infos], [destination(i.get("rollout")) for i in infos]
        )
        self.source_dtype = getattr(torch, first["dtype"])
        self.bucket_elements = max(1, bucket_bytes // torch.empty((), dtype=self.source_dtype).element_size())
        if actor is not None:
            self.device = actor.device
        elif rollout is not None:
            self.device = next((t.device for _, t in held.items()), torch.device("cpu"))
        else:  # a rank of neither role: nothing to move, a device for its (empty) buffers
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.last_metrics: dict[str, float] = {}
        self._delta = None
        if self.mode == "delta":
            from verl.hybrid.delta import DeltaTransfer

            elem = torch.empty((), dtype=self.source_dtype).element_size()
            self._delta = DeltaTransfer(
                self.plan, rank, bucket_elements=self.bucket_elements, block_elements=max(1, block_bytes // elem),
                full_every=full_every, source_dtype=self.source_dtype, device=self.device,
                dest_dtype=getattr(torch, infos[rollout_ranks[0]]["rollout"]["dtype"]), group=self._world_group,
            )
        stats = self.plan.rank_stats(rank)
        logger.info(
            "disaggregated weight sync planned (%s): rank %d sends %d elements to %d peers, receives %d from %d",
            self.degrees, rank, sum(stats.sent.values()), len(stats.sent), stats.received_elements, len(stats.received),
        )

    def push(self) -> dict[str, float]:
        """Send the actor's current weights into the rollout engine (collective over the world)."""
        rank = dist.get_rank()
        sources: list[torch.Tensor] = []
        if self.actor is not None:
            params = {}
            for v, chunk in enumerate(self.actor.chunks):
                for name, param in named_weights(unwrap_model(chunk)):  # LoRA: merged W + s B A
                    params[f"{v}/{name}"] = param
            sources = [params[k].view(-1) for k in self.plan.src_keys[rank]]
        if self._delta is not None:
            return self._push_delta(sources)
        stats = self._into_engine(lambda destinations: execute_plan(
            self.plan, rank, sources, destinations, bucket_elements=self.bucket_elements,
            source_dtype=self.source_dtype, device=self.device, group=self._world_group,
        ))
        self.last_metrics = {
            "timing_s/update_weights": stats.seconds,
            "update_weights/bytes_sent": float(stats.sent_bytes),
            "update_weights/bytes_received": float(stats.received_bytes),
            "update_weights/buffer_bytes": float(stats.buffer_bytes),
        }
        return dict(self.last_metrics)

    def _into_engine(self, write: Callable[[list[torch.Tensor]], _T]) -> _T:
        """``write`` into the engine's tensors on the rollout's ranks (:func:`write_into`, in the engine's
        world); elsewhere with no destinations."""
        if self.rollout is None:
            return write([])
        keys = self.plan.dst_keys[dist.get_rank()]  # a rank of the whole world, taken outside the block
        with self._engine_world():
            return write_into(self.rollout, keys, write)

    def _push_delta(self, sources: list[torch.Tensor]) -> dict[str, float]:
        delta = self._delta
        assert delta is not None
        stats = self._into_engine(lambda destinations: delta.push(sources, destinations))
        self.last_metrics = {
            "timing_s/update_weights": stats.seconds,
            "update_weights/seconds": stats.seconds,
            "update_weights/bytes_sent": float(stats.sent_bytes),
            "update_weights/bytes_received": float(stats.received_bytes),
            "update_weights/bytes_full": float(stats.full_bytes),
            "update_weights/sent_share": stats.sent_bytes / stats.full_bytes if stats.full_bytes else 0.0,
            "update_weights/full": float(stats.full),
            "update_weights/blocks_sent": float(stats.blocks_sent),
            "update_weights/blocks_total": float(stats.blocks_total),
            "update_weights/checksum_failures": float(stats.checksum_failures),
            "update_weights/buffer_bytes": float(stats.buffer_bytes),
        }
        return dict(self.last_metrics)


def push_totals(metrics: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """A push's metrics over every rank of ``group`` (collective; the same dict on every rank), from each
    rank's own (:meth:`DisaggregatedSync.push`, ``GatheredSend.push``: the actor's ranks count what they
    sent, the rollout's what they received). Bytes, blocks and checksum failures are summed,
    ``update_weights/sent_share`` is recomputed from the sums (sent over a full push's bytes), and every
    other figure (times, buffer bytes, buckets, whether the push was full) is the largest of the ranks'."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, metrics, group=group)
    totals: dict[str, float] = {}
    for key in dict.fromkeys(k for m in every for k in m):
        values = [float(m[key]) for m in every if key in m]
        totals[key] = sum(values) if key.startswith(_SUMMED) else max(values)
    if "update_weights/sent_share" in totals:
        full = totals.get("update_weights/bytes_full", 0.0)
        totals["update_weights/sent_share"] = totals.get("update_weights/bytes_sent", 0.0) / full if full else 0.0
    return totals


def _hf_order(actor: "MegatronEngine") -> list[str]:
    """The Hugging Face tensors of this rank's stage in the order ``iter_hf_weights`` yields them."""
    from verl.models.checkpoint import chunk_param_mapping

    names: list[str] = []
    for chunk in actor.chunks:
        inner = unwrap_model(chunk)
        for param_name, _ in named_weights(inner):
            mapping = chunk_param_mapping(inner, param_name, actor.pg.tp.rank(), actor.pg.tp.size())
            if not mapping.duplicate:
                names += [piece.name for piece in mapping.pieces if piece.name not in names]
    return names


@torch.no_grad()
def naive_push(actor: "MegatronEngine", rollout: Any) -> int:
    """The baseline: whole Hugging Face tensors on every rank, sliced by the destination (collective).

    Every TP rank of a stage gathers each whole tensor of its stage (``iter_hf_weights``); with
    PP > 1 each stage broadcasts its tensors over the pipeline groups, so every rank sees the
    whole model; the destination's ``update_weights`` slices its share. Returns the bytes this
    rank received.
    """
    from verl.models.checkpoint import iter_hf_weights

    pg = actor.pg
    spec = actor.spec
    pp, pp_rank = pg.pp.size(), pg.pp.rank()
    received = 0
    dtype = next(unwrap_model(actor.chunks[0]).parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    tp = pg.tp.size()
    for stage in range(pp):
        # The order iter_hf_weights yields in (the model's parameter order), told to the other stages.
        box: list[Any] = [_hf_order(actor) if stage == pp_rank else None]
        if pp > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(pg.pp, stage), group=pg.pp)
        stream = iter_hf_weights(actor.chunks, pg=pg) if stage == pp_rank else None
        for name in box[0]:
            if stream is not None:
                got, tensor = next(stream)
                assert got == name, f"naive_push: iter_hf_weights yielded {got}, expected {name}"
                tensor = tensor.contiguous()
                received += tensor.numel() * elem * (tp - 1) // tp  # the all-gather over TP
            else:
                shape = hf_shape(spec, name)
                tensor = torch.empty(shape if shape[1] > 1 else shape[:1], dtype=dtype, device=actor.device)
                received += tensor.numel() * elem
            if pp > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(pg.pp, stage), group=pg.pp)
            rollout.update_weights([(name, tensor)])
            del tensor
    rollout.weights_updated()
    return received
