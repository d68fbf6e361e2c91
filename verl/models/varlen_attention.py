"""The local spec's core attention, extended to packed (THD) sequences: ``verl.models.packing``
says what and why. Kept apart from it because this module imports Megatron-core."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


@dataclass
class PackedRows(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (THD) plus where each packed token sits in its sequence.

    ``token_segment[j]`` and ``token_offset[j]`` (int64, ``[S]``): packed token ``j`` is token
    ``token_offset[j]`` of segment ``token_segment[j]`` (the padding at the end is the last
    segment). :class:`VarlenDotProductAttention` reads them; Transformer Engine ignores them.
    """

    token_segment: torch.Tensor | None = None
    token_offset: torch.Tensor | None = None
    segments: int = 0


class VarlenDotProductAttention(DotProductAttention):
    """Megatron's local core attention that also takes THD packed sequences (``verl.models.packing``)."""

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
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed sequences in qkv_format={packed_seq_params.qkv_format!r}; verl packs 'thd'"
            )
        if not isinstance(packed_seq_params, PackedRows) or packed_seq_params.token_segment is None:
            raise ValueError(
                "VarlenDotProductAttention needs verl's PackedRows (verl.models.packing.pack_micro_batch), "
                "which say where each packed token sits in its sequence"
            )
        if attention_mask is not None:
            raise ValueError(
                "packed sequences take no attention_mask: each sequence's causal mask is implied"
            )
        segment, offset = packed_seq_params.token_segment, packed_seq_params.token_offset
        length, count = packed_seq_params.max_seqlen_q, packed_seq_params.segments

        def by_sequence(x: torch.Tensor) -> torch.Tensor:  # [t, heads, dim] -> [max_len, k, heads, dim]
            out = x.new_zeros(length, count, *x.shape[1:])
            return out.index_put((offset, segment), x)

        context = super().forward(
            by_sequence(query), by_sequence(key), by_sequence(value), None, attn_mask_type, attention_bias
        )  # [max_len, k, heads * dim]
        return context[offset, segment]  # [t, heads * dim]
