"""Context parallelism (CP) for the local layer spec: the sequence split and attention across it.

Megatron's load-balanced layout: a sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks and
CP rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (:func:`cp_positions`), so under a causal
mask every rank does the same attention work. Everything but attention is per token and runs on the
rank's ``S / cp`` tokens as it is; Megatron's rotary embedding already takes each rank's slice of the
global positions (``get_pos_emb_on_this_cp_rank``).

Attention is the one part that sees across the split. Transformer Engine's ``TEDotProductAttention``
does it natively (ring attention); Megatron-core's local ``DotProductAttention`` refuses CP (it
asserts ``context_parallel_size == 1``; megatron-core 0.16.1). :class:`ContextParallelAttention` is
the local spec's core attention in verl's builder: at CP 1 it *is* verl's
:class:`~verl.models.varlen_attention.VarlenDotProductAttention`; at CP > 1 it all-gathers the keys
and values of the CP group (Megatron's ``gather_from_sequence_parallel_region`` on the CP group:
all-gather forward, reduce-scatter of their gradients backward), puts them in global order and
attends from the rank's queries with the causal (and sliding-window) mask built from the chunks'
global positions (:func:`attention_by_positions`). Per rank that is ``S / cp`` queries against ``S``
keys: the same math as the full sequence, with K/V memory of the whole sequence per rank (ring
attention would hold one chunk at a time; this is the simple, exact form for machines without TE).

Packed (THD) sequences are split per sequence in the same way (:func:`thd_cp_index`): each sequence,
padded to a multiple of ``2 * cp`` (``verl.models.packing``, ``segment_multiple``), gives chunk ``i``
and ``2 * cp - 1 - i`` of itself to rank ``i`` (Transformer Engine's ``thd_get_partitioned_indices``
layout); Megatron's rotary embedding takes each sequence's slice itself (``cu_seqlens // cp``). The
attention then masks by segment and position within it over the whole packed row's keys (memory
``t / cp x t`` per head, not per sequence: the simple form).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from verl.models.varlen_attention import VarlenDotProductAttention

__all__ = [
    "ContextParallelAttention",
    "attention_by_positions",
    "cp_positions",
    "gather_over_cp",
    "thd_cp_index",
]


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions CP rank ``cp_rank`` holds of a sequence of ``seq_len``: chunks ``cp_rank``
    and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``. [seq_len / cp_size] int64, ascending."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split over context parallel {cp_size}: the length must be "
            f"a multiple of 2 x CP = {2 * cp_size}"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def thd_cp_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The packed tokens CP rank ``cp_rank`` holds of a THD row whose sequences end at ``cu_seqlens``
    ([k + 1], every sequence a multiple of ``2 * cp_size``): each sequence's :func:`cp_positions`, offset
    to where it starts. [total / cp_size] int64."""
    bounds = cu_seqlens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        parts.append(start + cp_positions(end - start, cp_size, cp_rank, device=cu_seqlens.device))
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=cu_seqlens.device)
    return torch.cat(parts)


def gather_over_cp(
    x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor, dim: int = 0, *, sum_grads: bool = True
) -> torch.Tensor:
    """Every CP rank's ``x`` (its tokens along ``dim``) gathered and put in global order: the result's
    index ``order[j]`` along ``dim`` is the gathered (rank-major) token ``j``.

    Differentiable (Megatron's sequence-parallel gather on the CP group): all-gather forward; backward,
    with ``sum_grads``, reduce-scatter (each rank used the gathered tensor in its own computation, as
    attention uses the keys and values: the gradients of every rank's use are summed into the rank that
    holds the tokens), without, each rank keeps its own tokens' gradient (the computation after the
    gather is the same on every rank, as a loss over gathered log-probabilities).
    ``order`` [cp * n]: the global position of each gathered token (the ranks' :func:`cp_positions` or
    :func:`thd_cp_index`, concatenated in rank order)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    moved = x.movedim(dim, 0).contiguous()
    gathered = gather_from_sequence_parallel_region(moved, tensor_parallel_output_grad=sum_grads, group=group)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return gathered.index_select(0, inverse.to(gathered.device)).movedim(0, dim)


def attention_by_positions(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    softmax_scale: float,
    window: tuple[int, int] | None = None,
    q_seg: torch.Tensor | None = None,
    k_seg: torch.Tensor | None = None,
    dropout: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` [sq, b, np, hn] over ``key``/``value`` [sk, b, ng, hn] (ng divides np:
    grouped-query attention) where query ``i`` sits at ``q_pos[i]`` and key ``j`` at ``k_pos[j]`` ([sq], [sk]):
    key ``j`` is seen iff ``k_pos[j] <= q_pos[i]`` (and, with ``window`` ``(left, right)``, Megatron's sliding
    window ``q_pos - left <= k_pos <= q_pos + right``; and, with segments ``q_seg``/``k_seg``, only in the
    query's own segment). Returns [sq, b, np * hn].

    The math of Megatron's local ``DotProductAttention`` (scale inside the matmul, scores masked to -10000,
    softmax in float32), so CP > 1 gives CP 1's numbers up to the order of float sums."""
    sq, b, heads, dim = query.shape
    groups = key.shape[2]
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    q = query.permute(1, 2, 0, 3).reshape(b * heads, sq, dim)  # [b * np, sq, hn]
    k = key.permute(1, 2, 0, 3).reshape(b * heads, -1, dim)  # [b * np, sk, hn]
    v = value.permute(1, 2, 0, 3).reshape(b * heads, -1, dim)
    scores = torch.bmm(q, k.transpose(1, 2)) * softmax_scale  # [b * np, sq, sk]
    hidden = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [sq, sk] True: masked
    if window is not None:
        left, right = window
        hidden = hidden | (k_pos.unsqueeze(0) < q_pos.unsqueeze(1) - left) | (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) + right)
    if q_seg is not None:
        hidden = hidden | (k_seg.unsqueeze(0) != q_seg.unsqueeze(1))
    probs = scores.float().masked_fill(hidden, -10000.0).softmax(dim=-1).to(value.dtype)
    if dropout is not None:
        probs = dropout(probs)
    context = torch.bmm(probs, v)  # [b * np, sq, hn]
    return context.view(b, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


def _thd_layout(params: PackedSeqParams, cp: int, rank: int):
    """(query positions, key positions, query segments, key segments, gathered order) of a packed row
    split over CP: positions within each sequence, keys in the row's order. Needs verl's ``PackedRows``."""
    segment, offset = getattr(params, "token_segment", None), getattr(params, "token_offset", None)
    if segment is None:
        raise ValueError(
            "context-parallel attention on packed sequences needs verl's PackedRows "
            "(verl.models.packing.pack_micro_batch), which say where each packed token sits in its sequence"
        )
    cached = getattr(params, "_verl_cp_layout", None)  # every layer of one forward gets the same params
    if cached is not None and cached[0] == (cp, rank):
        return cached[1]
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    mine = thd_cp_index(cu, cp, rank).to(segment.device)
    order = torch.cat([thd_cp_index(cu, cp, r) for r in range(cp)]).to(segment.device)
    layout = (offset[mine], offset, segment[mine], segment, order)
    params._verl_cp_layout = ((cp, rank), layout)
    return layout


class ContextParallelAttention(VarlenDotProductAttention):
    """The local spec's core attention across a context-parallel split (the module docstring).

    At CP 1 it is :class:`VarlenDotProductAttention` (Megatron's own attention, plus packed sequences).
    Megatron's constructor refuses CP > 1; it is given a copy of the config at CP 1 for the parts that
    do not depend on it (heads per TP rank, scale, window, dropout), and the model's config is kept.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, pg_collection=None, **kwargs):
        base = config
        if config.context_parallel_size > 1:
            base = copy.copy(config)
            base.context_parallel_size = 1
        super().__init__(base, layer_number, attn_mask_type, attention_type, *args, pg_collection=pg_collection, **kwargs)
        self.config = config
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        if config.context_parallel_size > 1 and (self.cp_group is None or self.cp_group.size() != config.context_parallel_size):
            raise ValueError(
                f"ContextParallelAttention: context_parallel_size={config.context_parallel_size} needs the model's "
                "ProcessGroupCollection with a CP group of that size (pg_collection=)"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if self.cp_group is None or self.cp_group.size() == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("context-parallel attention takes no attention_mask/bias: the causal mask is implied")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        window = self.scale_mask_softmax.window_size
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        device = query.device
        if packed_seq_params is None:  # [S/cp, b, heads, dim]: this rank's two chunks of every row
            total = query.shape[0] * cp
            order = torch.cat([cp_positions(total, cp, r, device) for r in range(cp)])
            q_pos, k_pos = cp_positions(total, cp, rank, device), torch.arange(total, device=device)
            q_seg = k_seg = None
        else:  # THD [t/cp, heads, dim]: this rank's two chunks of every packed sequence
            q_pos, k_pos, q_seg, k_seg, order = _thd_layout(packed_seq_params, cp, rank)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key = gather_over_cp(key, self.cp_group, order)
        value = gather_over_cp(value, self.cp_group, order)
        context = attention_by_positions(
            query, key, value, q_pos, k_pos, softmax_scale=scale, window=window, q_seg=q_seg, k_seg=k_seg,
            dropout=self.attention_dropout if self.attention_dropout.p > 0 and self.training else None,
        )
        return context if packed_seq_params is None else context.squeeze(1)
