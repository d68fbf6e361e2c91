"""Router replay: record which experts every token was routed to in one pass, and send the same tokens
to the same experts in a later pass, so that two passes over the same batch (the old-policy log-probs
and the actor's update) route alike even where float rounding would flip a near tie.

Two modes (``actor.megatron.router_replay.mode``): R2, the actor's old-policy pass records (this
module's ``record``) and the update replays; R3, the rollout engine records while it generates (the
transformers engine's ``verl.rollout.hf_engine.RoutingRecorder``: each router's top-k ids of the prefill
and every KV-cached decode step, in the same layout) and the old-policy pass and the update both replay,
so the trainer routes as the engine did.

The batch carries the routing as ``routed_experts`` [B, T, L, K] (int16, :data:`ROUTING_DTYPE`): for row b, column t, the k
experts MoE layer l chose, in the router's top-k order; ``L`` counts every MoE layer of the model, so
the tensor is independent of the pipeline split. Pad positions hold ``0..K-1`` (any valid set; their
outputs are masked). A real token the rollout engine never ran through the model holds ``-1``
(:data:`NOT_ROUTED`: vLLM never feeds the last sampled token back): it is replayed as ``0..K-1``
and left out of the agreement; its output would predict the token after the response, which no
loss reads.

Megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``; megatron-core 0.16.1, the only version
checked) does the routing: every router of a model built with it owns one instance; with the action
``RECORD`` the router keeps its last call's top-k indices ([tokens, K], tokens in the model's
``[S, b]`` order), with ``REPLAY_FORWARD`` it takes given indices and gathers their scores (the
probabilities are the current router's, only the choice is replayed). The class also keeps every
instance ever built in a process-wide list; verl never uses that list and reaches each model's own
instances through its routers, so another model (the reference, a critic) is left alone. Every call
into it lives in this module.

The batch's [B, T] layout is the only one the routing is kept in: each micro-batch maps it into the
model's layout and back with the same maps as its per-token outputs (``verl.models.forward``'s
``_MicroBatch.to_model`` / ``to_rows``: rows packed left, or every row's real tokens packed into one
THD row), and micro-batches are cut from the batch's rows by index, so a recording made with one
packing and micro-batching (fixed rows or a token budget) replays under any other.

With tensor parallelism and sequence parallelism the routers of TP rank ``r`` see only the ``r``-th of
``tp`` equal slices of the model's sequence dimension (the ``[S, b]`` tokens ``r*S/tp .. (r+1)*S/tp``,
every row): a replay hands each rank its slice, a recording gathers the slices over the TP group so
every TP rank returns the whole [B, T, L, K]. Expert parallelism does not change what a router sees.

A replay also counts, for :data:`AGREEMENT`, the real tokens whose free top-k from the pass's own
router scores is the replayed set: each replaying instance gets an instance-level ``get_replay_topk``
that calls the class's and compares (removed by :func:`end`); Megatron reaches it through the
instance (if it stopped, the replay tests, which expect 1.0 at the recording's weights, would read 0).

Pipeline parallelism (and virtual chunks): each chunk's routers take and give their own layers' slice
of L (:func:`chunk_layers`); a recording is gathered over the pipeline stages so every stage returns the
whole [B, T, L, K], and the agreement is summed over the stages.

Covered: no context parallelism, tensor (with or without sequence), pipeline and expert parallel any,
padded or packed sequences, without activation recomputation (Megatron's backward replay is not wired);
anything else is refused by :func:`routing_problems` before the pass.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

ROUTED_EXPERTS = "routed_experts"
"""Batch key of the recorded routing, [B, T, L, K] :data:`ROUTING_DTYPE` (module docstring)."""
ROUTING_DTYPE = torch.int16
"""dtype of ``routed_experts``: a quarter of int64's memory (a 1,024 x 8k-token batch of a 48-layer top-8
model holds 3.2e9 ids: 6.4 GB instead of 25.8 GB), ids up to 32,767 and -1 (:func:`as_routing` checks);
each micro-batch widens its slice to int64 for Megatron's replay."""
AGREEMENT = "router_replay/agreement"
"""Metric of a replayed training pass: the share of (real token, MoE layer) top-k sets that the routers'
free choice, from the same pass's logits, would have taken too (1.0: the replay changed nothing)."""
AGREEMENT_COUNTS = ("router_replay/agreeing", "router_replay/routed")
"""A forward-only replay's ``ForwardResult.metrics`` (one dict for the pass): the agreeing and all (real token,
MoE layer) pairs of the whole pass, as :data:`AGREEMENT` counts them, for a caller to sum over data parallel."""
NOT_ROUTED = -1
"""``routed_experts`` entry of a real token the engine did not route (module docstring)."""
RoutingMode = Literal["record", "replay"]


def routers(chunks: list[torch.nn.Module]) -> list:
    """The ``RouterReplay`` instance of every MoE layer of ``chunks``, in layer order; ValueError when the
    model was built without ``moe_enable_routing_replay``."""
    from verl.models.builder import unwrap_model

    out = []
    for chunk in chunks:
        for layer in unwrap_model(chunk).decoder.layers:
            router = getattr(getattr(layer.mlp, "router", None), "router_replay", None)
            if router is None:
                raise ValueError(
                    "router replay needs a Mixture-of-Experts model built with moe_enable_routing_replay "
                    "(megatron.override_transformer_config.moe_enable_routing_replay=true)"
                )
            out.append(router)
    return out


def chunk_layers(chunk: torch.nn.Module) -> list[int]:
    """The model-wide MoE layer index (``routed_experts``' L dimension) of each router of ``chunk``, in the
    order :func:`routers` gives them: Megatron's global ``layer_number`` - 1 (every layer is MoE), so a
    pipeline stage or virtual chunk reads and writes its own layers' slice."""
    from verl.models.builder import unwrap_model

    return [int(layer.layer_number) - 1 for layer in unwrap_model(chunk).decoder.layers]


def routing_problems(chunks: list[torch.nn.Module], pg: "ProcessGroupCollection") -> list[str]:
    """Why this pass cannot record or replay routing ([] when it can)."""
    from verl.models.builder import unwrap_model

    config = unwrap_model(chunks[0]).config
    problems = []
    if pg.cp.size() > 1:
        problems.append(f"context parallel {pg.cp.size()}")
    if config.recompute_granularity is not None:
        problems.append("activation recomputation: Megatron's backward replay is not wired (turn gradient checkpointing off)")
    return problems


def begin(routers_: list, mode: RoutingMode) -> None:
    """Set every router's action for the pass; a replay also counts agreement (:func:`agreement`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    action = RouterReplayAction.RECORD if mode == "record" else RouterReplayAction.REPLAY_FORWARD
    for router in routers_:
        router.clear_indices()
        router.set_router_replay_action(action)
        if mode == "replay":
            # An instance attribute over the class's method: Megatron's top-k calls
            # ``router_replay.get_replay_topk(...)``, so the count sees each call's own scores.
            router.get_replay_topk = functools.partial(_counted_replay_topk, router, type(router).get_replay_topk)
            router.verl_counts = torch.zeros(2, dtype=torch.float64)  # [agreeing sets, real tokens]
            router.verl_real = None


def end(routers_: list) -> None:
    """Back to ordinary routing; recorded and target indices dropped, agreement counting removed."""
    for router in routers_:
        router.clear_router_replay_action()
        router.clear_indices()
        for name in ("get_replay_topk", "verl_counts", "verl_real"):
            router.__dict__.pop(name, None)


def as_routing(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids (any integer dtype) as ``routed_experts`` entries (:data:`ROUTING_DTYPE`); ValueError for an id
    the dtype cannot hold."""
    if ids.numel() and int(ids.max()) > torch.iinfo(ROUTING_DTYPE).max:
        raise ValueError(f"expert id {int(ids.max())} does not fit router replay's {ROUTING_DTYPE} routing")
    return ids.to(ROUTING_DTYPE)


def _counted_replay_topk(router, replay_topk, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """``RouterReplay.get_replay_topk`` plus a count of the real tokens whose free top-k (from these
    scores, the router's own) is the replayed set."""
    probs, indices = replay_topk(router, scores, topk, num_groups, group_topk, default_compute_topk)
    with torch.no_grad():
        _, free = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        same = (free.sort(-1).values == indices.sort(-1).values).all(-1)  # [tokens]
        real = router.verl_real if router.verl_real is not None else torch.ones_like(same)
        router.verl_counts += torch.stack([(same & real).sum(), real.sum()]).to(router.verl_counts)
    return probs, indices


def agreement(routers_: list, sp_group=None, pp_group=None) -> tuple[float, float]:
    """(agreeing, all) (real token, MoE layer) pairs of the replay since the last call, summed over the
    layers (and the TP ranks' slices of S with ``sp_group``, the pipeline stages' layers with ``pp_group``;
    collectives over those groups): a pair agrees when the router's free top-k would have chosen the
    replayed experts. Counters reset."""
    import torch.distributed as dist

    from verl.protocol.collectives import comm_device

    counts = torch.stack([router.verl_counts for router in routers_]).sum(0)
    for router in routers_:
        router.verl_counts.zero_()
    for group in (sp_group, pp_group):
        if group is not None and group.size() > 1:
            on_device = counts.to(comm_device(group))  # NCCL reduces CUDA tensors only
            dist.all_reduce(on_device, group=group)
            counts = on_device.cpu()
    return float(counts[0]), float(counts[1])


def set_targets(routers_: list, routed: torch.Tensor, model_mask: torch.Tensor, sp_group=None) -> None:
    """Give each router the experts of one micro-batch: ``routed`` [b, S, L, K] in the model's row layout,
    ``model_mask`` [b, S] (1 = real token; pads and :data:`NOT_ROUTED` tokens get ``0..K-1`` and are
    left out of the agreement); ``sp_group``: the TP group when the model runs sequence parallel (each
    rank routes its slice of S), else None."""
    b, s, layers, k = routed.shape
    if layers != len(routers_):
        raise ValueError(f"batch '{ROUTED_EXPERTS}' has {layers} layers of routing, the model {len(routers_)} MoE layers")
    routed = routed.long()  # Megatron gathers by int64 indices
    counted = model_mask.bool() & (routed != NOT_ROUTED).all(-1).all(-1)  # [b, S]
    routed = torch.where(counted[..., None, None], routed, torch.arange(k, device=routed.device))
    tokens = routed.transpose(0, 1).reshape(s * b, layers, k)  # the router's [S, b] token order
    real = counted.transpose(0, 1).reshape(s * b)
    if sp_group is not None and sp_group.size() > 1:
        share = s * b // sp_group.size()  # S is a multiple of TP under sequence parallel
        tokens = tokens[sp_group.rank() * share : (sp_group.rank() + 1) * share]
        real = real[sp_group.rank() * share : (sp_group.rank() + 1) * share]
    for layer, router in enumerate(routers_):
        router.clear_indices()
        router.set_target_indices(tokens[:, layer].contiguous())
        router.verl_real = real


def recorded(routers_: list, rows: int, sp_group=None) -> torch.Tensor:
    """The routing the last micro-batch recorded: [b, S, L, K] in the model's row layout (``sp_group``:
    as :func:`set_targets`; the TP ranks' slices are gathered, a collective over the group)."""
    import torch.distributed as dist

    per_layer = [router.get_recorded_indices() for router in routers_]
    if any(t is None for t in per_layer):
        raise RuntimeError("a router recorded nothing in this micro-batch (was the action set?)")
    tokens = torch.stack(per_layer, dim=1).to(torch.long)  # [S/tp * b, L, K]
    if sp_group is not None and sp_group.size() > 1:
        slices = [torch.empty_like(tokens) for _ in range(sp_group.size())]
        dist.all_gather(slices, tokens.contiguous(), group=sp_group)
        tokens = torch.cat(slices)  # [S * b, L, K]: the slices are consecutive runs of S
    return as_routing(tokens.reshape(-1, rows, *tokens.shape[1:]).transpose(0, 1))


def pad_positions(routed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``routed`` [B, T, L, K] with ``0..K-1`` where ``mask`` [B, T] is 0."""
    k = routed.shape[-1]
    return torch.where(mask.bool()[..., None, None], routed, torch.arange(k, dtype=routed.dtype, device=routed.device))
