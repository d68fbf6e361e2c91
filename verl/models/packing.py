"""Packed sequences (``model.use_remove_padding``): Megatron's THD layout, on either layer spec.

A micro-batch of ``b`` padded rows becomes one row of its real tokens only: the rows' real
tokens one after another (``[1, S]``), their boundaries in ``cu_seqlens`` (int32, ``[k + 1]``),
handed to the model as Megatron's ``PackedSeqParams(qkv_format="thd")``. Every linear layer,
norm and the vocabulary head then run on the real tokens, not on ``b x`` the longest row;
Megatron's attention restarts the rotary positions at each boundary (``apply_rotary_pos_emb``
with ``cu_seqlens``) and the core attention keeps each sequence to itself.

The core attention is the only part that depends on the spec:

- Transformer Engine's ``TEDotProductAttention`` takes THD natively (its variable-length kernels).
- Megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params`` (it asserts it is
  None; megatron-core 0.16.1). ``verl.models.varlen_attention.VarlenDotProductAttention`` is the local spec's core
  attention in verl's builder: without ``packed_seq_params`` it *is* Megatron's (the same call);
  with them it lays the packed queries, keys and values out as ``[max_seqlen, k, heads, dim]``
  (sequence ``i``'s tokens in column ``i``, zeros after its end), runs Megatron's own causal
  attention on that, and gathers each real token's output back into the packed order. Causal
  attention never lets a token see a later position, so the zeros after a sequence never reach
  its tokens: the outputs are those of each sequence alone. Attention is the one part computed at
  the longest sequence's length, as on the padded path; everything else is on real tokens.

So one code path (:func:`pack_micro_batch` in, ``PackedSeqParams`` through Megatron, the
outputs scattered back) serves CPU and GPU; only the attention kernel differs.

Layout rules (:func:`pack_micro_batch`): rows with no real token take no segment; the packed
row is padded at its end to ``width`` (a multiple of 8, and of TP under sequence parallelism;
with pipeline stages every micro-batch's common width) and the padding makes segments of its own,
none longer than the longest row (they attend to themselves only; their outputs are dropped), so
every segment has at least one token.

Context parallelism (``segment_multiple`` = 2 x CP): every segment is padded at its end to a multiple
of 2 x CP (pads inside a segment sit after its real tokens, so causal attention never lets a real
token see them), so each CP rank can take chunks ``i`` and ``2 * cp - 1 - i`` of every segment
(``verl.models.cp_attention.thd_cp_index``). The real tokens then sit at ``slots`` of the packed row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verl.models.varlen_attention import PackedRows


@dataclass
class PackedMicroBatch:
    """One micro-batch packed (:func:`pack_micro_batch`)."""

    input_ids: torch.Tensor
    """[1, width]: the rows' real tokens in row order, then padding (id 0)."""
    position_ids: torch.Tensor
    """[1, width]: each token's position in its own row (0 at every row's first real token)."""
    real: torch.Tensor
    """[n] (int64): the flat indices (into the micro-batch's ``[b * T]``) of its real tokens, in
    packed order: packed token ``slots[j]`` is ``input_ids.view(-1)[real[j]]`` of the padded rows."""
    slots: torch.Tensor
    """[n] (int64): where each real token sits in the packed row (``arange(n)`` unless segments are padded)."""
    starts: torch.Tensor
    """[width] bool: True at each row's first real token (nothing in the packed row predicts it)."""
    cu_seqlens: torch.Tensor
    """[k + 1] int32: the segments' boundaries (the rows with real tokens, then the padding if any)."""
    max_seqlen: int
    """The longest segment."""
    token_segment: torch.Tensor
    """[width] int64: the segment of each packed token."""
    token_offset: torch.Tensor
    """[width] int64: each packed token's position in its segment."""

    def seq_params(self) -> PackedRows:
        """What the model is called with (``packed_seq_params=``): Megatron's THD ``PackedSeqParams``."""
        from verl.models.varlen_attention import PackedRows

        return PackedRows(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            token_segment=self.token_segment,
            token_offset=self.token_offset,
            segments=self.cu_seqlens.numel() - 1,
        )


def packed_width(real_tokens: int, multiple: int) -> int:
    """The packed row's width for ``real_tokens``: rounded up to ``multiple`` (at least one ``multiple``)."""
    return max(multiple, -(-real_tokens // multiple) * multiple)


def pack_micro_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    width: int,
    lengths: Sequence[int] | None = None,
    *,
    segment_multiple: int = 1,
) -> PackedMicroBatch:
    """Pack ``input_ids`` [b, T] (``attention_mask`` 1 = real token) into one row of ``width`` tokens.

    ``width`` must hold every real token (``>= attention_mask.sum()``). The real tokens keep their
    order within each row (left- and right-padding alike), so token ``k`` of a row is at position ``k``.
    ``lengths``: each row's real tokens, read on the host once per batch by the caller (None: read
    here); the layout is then built without waiting on the device. ``segment_multiple``: every segment's
    length a multiple of it (context parallelism: 2 x CP; ``width`` must be one too), padded at its end.
    """
    device = input_ids.device
    if lengths is None:
        lengths = attention_mask.sum(-1).tolist()
    n = int(sum(lengths))
    rows = [int(length) for length in lengths if length > 0]
    segments = [-(-length // segment_multiple) * segment_multiple for length in rows]
    used = sum(segments)
    if used > width or width % segment_multiple:
        segments_text = f" ({used} in segments of a multiple of {segment_multiple})" if segment_multiple > 1 else ""
        raise ValueError(f"pack_micro_batch: {n} real tokens{segments_text} do not fit a packed width of {width}")
    # The padding after the real tokens: segments of their own, none longer than the longest row
    # (the local attention lays every segment out at the longest one's length).
    cap, pad = max(segments, default=width), width - used
    while pad > 0:
        segments.append(min(pad, cap))
        pad -= segments[-1]
    cu = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32, device=device)
    segment = torch.repeat_interleave(
        torch.arange(len(segments), device=device),
        torch.tensor(segments, device=device),
        output_size=width,
    )  # [width]
    positions = torch.arange(width, device=device)
    offset = positions - cu[:-1].long()[segment]  # [width]
    # [n], row-major = packed order; the size known on the host, so no wait on the device
    real = torch.nonzero_static(attention_mask.reshape(-1), size=n).squeeze(-1)
    if segment_multiple == 1 or not rows:
        slots = positions[:n]
    else:  # each row's tokens at the start of its (padded) segment, the segment's pads after them
        real_in_segment = offset[:used] < torch.tensor(rows, device=device)[segment[:used]]
        slots = torch.nonzero_static(real_in_segment, size=n).squeeze(-1)
    packed = input_ids.new_zeros(1, width)
    packed[0, slots] = input_ids.reshape(-1)[real]
    return PackedMicroBatch(
        input_ids=packed,
        position_ids=offset.unsqueeze(0),
        real=real,
        slots=slots,
        starts=(offset == 0) & (segment < len(rows)),  # the padding is no row's first token
        cu_seqlens=cu,
        max_seqlen=max(segments),
        token_segment=segment,
        token_offset=offset,
    )


def unpack_to_rows(
    packed: torch.Tensor, real: torch.Tensor, rows: int, width: int, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token outputs of a packed row ([1, S, ...]) back to the padded rows ([rows, width, ...]); 0 at pads.
    ``slots``: where the real tokens sit in the packed row (None: the first ``real.numel()``).

    Differentiable (an ``index_put`` into zeros)."""
    tail = packed.shape[2:]
    out = packed.new_zeros(rows * width, *tail)
    mine = packed[0, : real.numel()] if slots is None else packed[0, slots]
    out = out.index_put((real,), mine)
    return out.view(rows, width, *tail)


def pack_like(values: torch.Tensor, real: torch.Tensor, width: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """A per-token tensor of the padded rows ([b, T, ...]) in packed order ([1, width, ...]; 0 at the
    packed row's pads); ``slots`` as :func:`unpack_to_rows`."""
    tail = values.shape[2:]
    out = values.new_zeros(1, width, *tail)
    if slots is None:
        out[0, : real.numel()] = values.reshape(-1, *tail)[real]
    else:
        out[0, slots] = values.reshape(-1, *tail)[real]
    return out
