"""Micro-batched forward (and backward) of verl's Megatron models through Megatron's pipeline schedule.

Input is a padded batch: ``input_ids`` [B, T] and ``attention_mask`` [B, T] (1 = real token),
with prompts left-padded and responses right-padded as rollouts produce them. Transformers
treats such a row with ``position_ids = cumsum(mask) - 1`` (clipped at 0) and masks the pads
out of attention. Megatron's rotary embedding, however, always uses positions 0..S-1. So each
row is *packed* first: its real tokens move to the front in order (pads to the back) — then the
k-th real token sits at position k, which is exactly ``cumsum(mask) - 1``, and plain causal
attention never lets a real token see a pad. Outputs are scattered back to the original
layout; values at pad positions are 0.

No compute on padding: with one pipeline stage, each micro-batch
runs at the length of its longest real row, rounded up to a multiple of 8 (and of the TP size
under sequence parallelism, and of 2 x CP under context parallelism), not at the batch's padded width ``T``: after packing, the cut
columns hold only pads, which causal attention never lets a real token see, so the real tokens'
outputs are those of the full width (float rounding of the shorter matmuls apart). With
pipeline stages every micro-batch keeps the width ``T`` (the stages exchange fixed shapes).

Context parallelism (``pg.cp`` of size > 1; ``verl.models.cp_attention``): each rank runs the model
on its two chunks of every row (Megatron's load-balanced layout), attention sees the whole row
through the CP group, and every per-token output is gathered over CP once, in the head, before
the layout is undone: ``outputs`` and the loss function see the whole micro-batch on every CP rank.

Packed sequences (``pack_sequences``, the config's ``use_remove_padding``) go further: each
micro-batch's rows become one row of their real tokens, run as Megatron's THD packed sequences
(``verl.models.packing``), so no layer but attention computes on any pad; with pipeline stages
every packed micro-batch is padded to the largest one's width.

Outputs (all [B, T], float32, aligned with ``input_ids``):

- ``logprobs[:, t]`` = log p(input_ids[:, t] | real tokens before t), computed from
  vocabulary-parallel logits without gathering the vocabulary; ``entropy[:, t]`` is the entropy
  of that same predictive distribution. Both are 0 at pads and at each row's first real token
  (nothing predicts it).
- ``values[:, t]`` = the scalar head on the hidden state of token t (critic / reward model;
  :func:`last_token_values` turns it into one reward per sequence).
- ``logits`` [B, T, V/TP]: this rank's vocabulary slice (checks and tests only).
- with ``topk=k`` (``output='logprobs'``): ``topk_ids`` [B, T, k] (int64) and ``topk_logprobs``
  [B, T, k], the k most probable tokens of the distribution that predicts token t and their
  log-probabilities (on-policy distillation's teacher; no gradient).
- with ``score_ids=<key>`` (``output='logprobs'``): ``score_logprobs`` [B, T, k], the
  log-probabilities, under the distribution that predicts token t, of the ids the batch tensor
  ``<key>`` holds at column t (differentiable: the student's side of a top-k distillation loss).
  ``<key>`` is [B, C, k] for the last C <= T columns (the responses, as ``head_columns``).
  Both over the full vocabulary from vocabulary-parallel logits (``verl.models.vocab_parallel``),
  0 where ``logprobs`` is 0.

- with ``routing='record'`` (a Mixture-of-Experts model built with ``moe_enable_routing_replay``):
  ``routed_experts`` [B, T, L, K] (int16), the experts each MoE layer sent each token to; with
  ``routing='replay'`` the batch's ``routed_experts`` decide the experts instead of the routers
  (``verl.models.router_replay``).

Results exist on the last pipeline stage; ``broadcast=True`` sends them to every stage.

The loss contract (the only one in verl). A loss function is a :data:`LossShareFn`:
``loss_fn(outputs, micro_batch) -> LossShare``, where ``LossShare.loss`` is this micro-batch's
*share of the global-batch loss*: its per-token (or per-sequence) losses summed and divided by
the denominator of the whole optimizer step — tokens or sequences over every micro-batch on
every data-parallel rank — times the data-parallel size. ``verl.algos.agg_loss(...,
global_batch_info=GlobalBatchInfo.from_masks(...))`` computes exactly that. The shares of all
micro-batches then add up, on every rank, to the step's loss times the DP size, so after
Megatron's DDP averages gradients over DP they are those of the step's loss whatever the
micro-batch size or DP size. :func:`forward_backward` multiplies each share by the number of
micro-batches before handing it to Megatron's schedule, which divides by that number; that
one rescaling is the whole adapter. A function returning anything but a ``LossShare`` (for
instance a bare micro-batch mean) is refused at the first micro-batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.models import router_replay
from verl.models.micro_batches import MicroBatchSplit, fixed_split
from verl.models.packing import PackedMicroBatch, pack_like, pack_micro_batch, packed_width, unpack_to_rows
from verl.models.vocab_parallel import (
    SamplingTruncation,
    vocab_parallel_gather_logprobs,
    vocab_parallel_logprobs_entropy,
    vocab_parallel_topk,
)
from verl.protocol.images import model_image_inputs

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.models.router_replay import RoutingMode

OutputKind = Literal["logprobs", "values", "logits"]


@dataclass(frozen=True)
class LossShare:
    """A micro-batch's share of the global-batch loss (the module docstring's loss contract)."""

    loss: torch.Tensor
    """Scalar, differentiable: this micro-batch's losses over the whole step's denominator, x DP size."""
    metrics: Mapping[str, torch.Tensor | float] = field(default_factory=dict)
    """Scalars to report (the engine averages them over micro-batches and DP ranks)."""


LossShareFn = Callable[[dict[str, torch.Tensor], Mapping[str, torch.Tensor]], LossShare]
"""``loss_fn(outputs, micro_batch) -> LossShare``: ``outputs`` are this micro-batch's model
outputs ([b, T], differentiable), ``micro_batch`` its slice of every batch tensor."""


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Transformers' positions for a padded batch: cumsum(mask) - 1, clipped at 0. [B, T] -> [B, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_left(input_ids: torch.Tensor, attention_mask: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the front, keeping their order.

    Returns (packed_ids [B, seq_len] with trailing pads, order [B, T]) where
    ``packed[:, j] = input_ids[:, order[:, j]]`` for j < min(T, seq_len). ``seq_len > T`` adds
    trailing pads; ``seq_len < T`` cuts trailing columns (the caller keeps every real token:
    ``seq_len`` >= each row's real length).
    """
    b, t = input_ids.shape
    # Stable sort on "is pad" keeps real tokens (0) before pads (1), each in original order.
    order = torch.sort((attention_mask == 0).to(torch.int8), dim=1, stable=True).indices  # [B, T]
    packed = input_ids.gather(1, order)
    if seq_len > t:
        packed = F.pad(packed, (0, seq_len - t), value=0)
    elif seq_len < t:
        packed = packed[:, :seq_len]
    return packed, order


def unpack(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_left` for per-token outputs: [B, S, ...] -> [B, T, ...]."""
    b, t = order.shape
    packed = packed[:, :t]
    if packed.shape[1] < t:  # a trimmed micro-batch: the cut columns were pads
        packed = F.pad(packed, (0, 0) * (packed.dim() - 2) + (0, t - packed.shape[1]))
    index = order.reshape(b, t, *([1] * (packed.dim() - 2))).expand_as(packed)
    out = torch.empty_like(packed)
    out.scatter_(1, index, packed)
    return out


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score per row: the scalar head at the row's last real token. [B, T] -> [B].

    Rows without any real token score 0.
    """
    t = attention_mask.shape[1]
    index = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    last = (index * (attention_mask != 0)).argmax(dim=1)  # [B]
    return values.gather(1, last.unsqueeze(1)).squeeze(1) * (attention_mask.sum(1) > 0)


@dataclass
class _MicroBatch:
    tensors: dict[str, torch.Tensor]  # this micro-batch's slice of every batch tensor, [b, ...]
    input_ids: torch.Tensor  # what the model reads: [b, S] (rows packed left) or [1, S] (sequences packed)
    position_ids: torch.Tensor  # the same shape
    order: torch.Tensor | None  # [b, T]: rows packed left (pack_left)
    mask: torch.Tensor  # [b, T] float
    packed: PackedMicroBatch | None = None  # sequences packed into one row (verl.models.packing)
    cp: "_CPSplit | None" = None  # a packed row's split over context parallel (per micro-batch)
    # (layers, [b, T, L_chunk, K]) per model chunk: the experts this micro-batch's pass recorded
    routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token model outputs ([rows, S, ...]) -> the micro-batch's layout ([b, T, ...])."""
        if self.packed is None:
            return unpack(x, self.order)
        b, t = self.mask.shape
        return unpack_to_rows(x, self.packed.real, b, t, self.packed.slots)

    def to_model(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the micro-batch ([b, T]) in the model's layout ([rows, S])."""
        s_len = self.input_ids.shape[1]
        if self.packed is not None:
            return pack_like(x, self.packed.real, s_len, self.packed.slots)
        tail = x.shape[2:]
        x = x.gather(1, self.order.reshape(*self.order.shape, *([1] * len(tail))).expand_as(x))
        return x[:, :s_len] if x.shape[1] >= s_len else F.pad(x, (0, 0) * len(tail) + (0, s_len - x.shape[1]))


@dataclass(frozen=True)
class _CPSplit:
    """One micro-batch's width split over the context-parallel group (``verl.models.cp_attention``):
    this rank runs the model on ``positions`` of every row and gathers per-token results once."""

    group: dist.ProcessGroup
    positions: torch.Tensor  # [S/cp] int64: this rank's columns of the model's rows (chunks i, 2cp-1-i)
    order: torch.Tensor  # [S]: the column of each gathered (rank-major) position

    @classmethod
    def of(cls, group: dist.ProcessGroup, width: int, device: torch.device) -> "_CPSplit":
        from verl.models.cp_attention import cp_positions

        cp, rank = group.size(), group.rank()
        order = torch.cat([cp_positions(width, cp, r, device) for r in range(cp)])
        return cls(group=group, positions=cp_positions(width, cp, rank, device), order=order)

    @classmethod
    def of_packed(cls, group: dist.ProcessGroup, cu_seqlens: torch.Tensor) -> "_CPSplit":
        from verl.models.cp_attention import thd_cp_index

        cp, rank = group.size(), group.rank()
        order = torch.cat([thd_cp_index(cu_seqlens, cp, r) for r in range(cp)])
        return cls(group=group, positions=thd_cp_index(cu_seqlens, cp, rank), order=order)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, S/cp, ...] of this rank -> [rows, S, ...] of the whole row. Differentiable: each rank's
        outputs take their own tokens' gradient of the loss (which every CP rank computes whole, with the
        whole micro-batch's token counts). That is Megatron's convention for a CP rank's loss: its schedule
        multiplies each loss by the CP size and DDP averages gradients over data x context parallel, so
        the CP ranks' partial gradients add up to the loss's."""
        from verl.models.cp_attention import gather_over_cp

        return gather_over_cp(x, self.group, self.order, dim=1, sum_grads=False)


@dataclass
class ForwardResult:
    """What :func:`forward_backward` returns."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token outputs over the whole batch ([B, T] / [B, T, V/TP]); empty off the last stage
    unless broadcast."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's ``LossShare.loss`` (last stage only, detached, float32)."""
    metrics: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Each micro-batch's ``LossShare.metrics`` as float32 tensors (last stage only); a forward-only replay:
    one dict, the pass's ``router_replay.AGREEMENT_COUNTS``."""


def _head_outputs(
    output: torch.Tensor,
    mb: _MicroBatch,
    *,
    kind: OutputKind,
    vocab_size: int,
    tp_group: dist.ProcessGroup,
    temperature: float,
    with_entropy: bool,
    head_columns: int | None = None,
    topk: int | None = None,
    score_ids: str | None = None,
    cp: "_CPSplit | None" = None,
    truncation: SamplingTruncation | None = None,
) -> dict[str, torch.Tensor]:
    """Last-stage model output (packed) -> per-token outputs in the original layout. ``head_columns``:
    log-probabilities (and entropy) of the last that many columns only; ``topk``, ``score_ids``: the
    top-k and scored-ids outputs (module docstring). ``cp``: the output holds this context-parallel
    rank's tokens only; each per-token result is gathered over CP once, before the layout is undone."""
    mask = mb.mask
    if kind == "values":
        values = output.squeeze(-1).float()  # [rows, S] ([rows, S/cp] under CP)
        values = cp.gather(values) if cp is not None else values
        return {"values": mb.to_rows(values) * mask}
    if kind == "logits":
        logits = cp.gather(output) if cp is not None else output
        logits = mb.to_rows(logits)  # [b, T, V_local]
        return {"logits": logits * mask.unsqueeze(-1).to(logits.dtype)}
    s_len = mb.input_ids.shape[1]
    if cp is None:
        logits = output[:, :-1]  # [rows, S-1, V_local] predicts the model's tokens 1..S-1
        after = slice(1, None)  # the columns of the tokens the logits predict
        last = None
    else:  # [rows, S/cp, V_local]: this rank's positions, each predicting the token after it
        logits = output
        after = (cp.positions + 1).clamp(max=s_len - 1)
        last = cp.positions == s_len - 1  # predicts nothing (dropped after the gather)
    targets = mb.input_ids[:, after]  # [rows, S-1] ([rows, S/cp] under CP)
    scored = None
    if score_ids is not None:  # [b, C, k] for the last C columns -> [rows, S-1, k] beside targets
        scored = mb.to_model(full_width(mb.tensors[score_ids], mask.shape[1]))[:, after]
    chosen = None
    if head_columns is not None:
        # Only the tokens of the last head_columns columns (the responses): where the model reads them.
        t = mask.shape[1]
        wanted = mask.bool() & (torch.arange(t, device=mask.device) >= t - head_columns)  # [b, T]
        chosen = mb.to_model(wanted)[:, after]  # [rows, S-1]: the targets whose log-probability is computed
        if mb.packed is not None:  # a row's first token follows the previous row's last: not predicted
            chosen = chosen & ~mb.packed.starts[after]
        if last is not None:
            chosen = chosen & ~last
        logits, targets = logits[chosen], targets[chosen]  # [N, V_local], [N]
        scored = scored[chosen] if scored is not None else None  # [N, k]
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    vocab = dict(vocab_start=dist.get_rank(tp_group) * v_local, vocab_size=vocab_size, group=tp_group)
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets, with_entropy=with_entropy, truncation=truncation, **vocab
    )
    extra: dict[str, torch.Tensor] = {}  # [rows, S-1, k] (or [N, k] with chosen)
    if topk is not None:
        extra["topk_ids"], extra["topk_logprobs"] = vocab_parallel_topk(logits, topk, **vocab)
    if scored is not None:
        extra["score_logprobs"] = vocab_parallel_gather_logprobs(logits, scored, **vocab)
    if chosen is not None:  # back to [b, S-1], 0 at the tokens not asked for
        logprobs = logprobs.new_zeros(chosen.shape).index_put((chosen,), logprobs)
        entropy = entropy.new_zeros(chosen.shape).index_put((chosen,), entropy)
        extra = {k: v.new_zeros(*chosen.shape, v.shape[-1]).index_put((chosen,), v) for k, v in extra.items()}
    if cp is not None:  # every CP rank's positions, in order; the last position predicts nothing
        logprobs = cp.gather(logprobs)[:, :-1]
        entropy = cp.gather(entropy)[:, :-1] if with_entropy else entropy.new_zeros(logprobs.shape)
        extra = {k: cp.gather(v)[:, :-1] for k, v in extra.items()}
    logprobs, entropy = F.pad(logprobs, (1, 0)), F.pad(entropy, (1, 0))  # [rows, S], 0: nothing predicts token 0
    if mb.packed is not None:  # nor each row's first token (it follows the previous row in the packed row)
        logprobs = logprobs.masked_fill(mb.packed.starts, 0.0)
        entropy = entropy.masked_fill(mb.packed.starts, 0.0)
    out = {"logprobs": mb.to_rows(logprobs) * mask}
    if with_entropy:
        out["entropy"] = mb.to_rows(entropy) * mask
    for key, value in extra.items():
        value = F.pad(value, (0, 0, 1, 0))  # [rows, S, k]
        if mb.packed is not None:
            value = value.masked_fill(mb.packed.starts.unsqueeze(-1), 0)
        out[key] = mb.to_rows(value) * mask.unsqueeze(-1).to(value.dtype)
    return out


def full_width(columns: torch.Tensor, width: int) -> torch.Tensor:
    """A per-token tensor of the last C columns ([b, C, ...]) at the row's full width ([b, width, ...],
    zeros on the left)."""
    missing = width - columns.shape[1]
    if missing < 0:
        raise ValueError(f"a tensor of {columns.shape[1]} columns does not fit rows of {width}")
    return F.pad(columns, (0, 0) * (columns.dim() - 2) + (missing, 0)) if missing else columns


def _trimmed_width(longest: int, seq_len: int, multiple: int) -> int:
    return min(seq_len, max(multiple, -(-longest // multiple) * multiple))


def trimmed_length(attention_mask: torch.Tensor, seq_len: int, multiple: int) -> int:
    """A micro-batch's width without padding: its longest real row rounded up to ``multiple``,
    at most ``seq_len`` (the full width)."""
    longest = int(attention_mask.sum(-1).max()) if attention_mask.numel() else 0
    return _trimmed_width(longest, seq_len, multiple)


def packed_widths(
    lengths: list[int], split: MicroBatchSplit, multiple: int, *, common: bool, segment_multiple: int = 1
) -> list[int]:
    """Each micro-batch's packed width (``use_remove_padding``) from the rows' real ``lengths``: its real
    tokens (each row's rounded up to ``segment_multiple``: 2 x CP) rounded up to ``multiple``; ``common``:
    every micro-batch at the largest (pipeline stages exchange fixed shapes)."""
    def seg(length: int) -> int:
        return -(-int(length) // segment_multiple) * segment_multiple

    widths = [packed_width(sum(seg(lengths[i]) for i in index), multiple) for index in split.parts]
    return [max(widths)] * len(widths) if common and widths else widths


def _micro_batches(
    batch: Mapping[str, torch.Tensor],
    split: MicroBatchSplit,
    seq_len: int,
    trim_multiple: int | None = None,
    pack_widths: list[int] | None = None,
    lengths: list[int] | None = None,
    segment_multiple: int = 1,
) -> list[_MicroBatch]:
    """``lengths``: every row's real tokens (to trim or pack), read once per batch (None: read here);
    ``segment_multiple``: each packed sequence padded to a multiple of it (2 x CP)."""
    device = batch["input_ids"].device
    if lengths is None and (trim_multiple is not None or pack_widths is not None):
        lengths = batch["attention_mask"].sum(-1).tolist()
    positions_by_width: dict[int, torch.Tensor] = {}  # [S] per width, shared read-only by micro-batches
    out = []
    for number, index in enumerate(split.parts):
        idx = torch.as_tensor(index, dtype=torch.long, device=device)
        mb = {k: v.index_select(0, idx) for k, v in batch.items()}
        pad_rows = split.rows - len(index) if split.pad else 0
        if pad_rows > 0:
            # Rows with an all-zero mask keep the shapes fixed for the pipeline; dropped at the end.
            mb = {k: torch.cat([v, v.new_zeros(pad_rows, *v.shape[1:])]) for k, v in mb.items()}
        if pack_widths is not None:  # sequences packed into one row (verl.models.packing)
            row_lengths = [lengths[i] for i in index] + [0] * max(pad_rows, 0)
            packed = pack_micro_batch(
                mb["input_ids"], mb["attention_mask"], pack_widths[number], row_lengths, segment_multiple=segment_multiple
            )
            out.append(
                _MicroBatch(
                    tensors=mb,
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    order=None,
                    mask=mb["attention_mask"].to(torch.float32),
                    packed=packed,
                )
            )
            continue
        if trim_multiple is None:
            width = seq_len
        else:
            width = _trimmed_width(int(max((lengths[i] for i in index), default=0)), seq_len, trim_multiple)
        packed, order = pack_left(mb["input_ids"], mb["attention_mask"], width)
        if width not in positions_by_width:
            positions_by_width[width] = torch.arange(width, device=device)
        positions = positions_by_width[width].expand_as(packed)
        out.append(
            _MicroBatch(
                tensors=mb,
                input_ids=packed,
                position_ids=positions,
                order=order,
                mask=mb["attention_mask"].to(torch.float32),
            )
        )
    return out


def _in_batch_order(pieces: list[torch.Tensor], split: MicroBatchSplit) -> torch.Tensor:
    """Each micro-batch's outputs ([b_i + padding, ...]) -> the batch's rows in its own order."""
    real = [piece[: len(index)] for piece, index in zip(pieces, split.parts)]
    stacked = torch.cat(real)
    index = torch.as_tensor(np.concatenate(split.parts), dtype=torch.long, device=stacked.device)
    out = torch.empty_like(stacked)
    out[index] = stacked
    return out


def forward_backward(
    model: torch.nn.Module | list[torch.nn.Module],
    batch: Mapping[str, torch.Tensor],
    *,
    pg: "ProcessGroupCollection",
    micro_batch_size: int | None = None,
    split: MicroBatchSplit | None = None,
    output: OutputKind = "logprobs",
    loss_fn: LossShareFn | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    broadcast: bool = True,
    trim_padding: bool = True,
    head_columns: int | None = None,
    pack_sequences: bool = False,
    topk: int | None = None,
    score_ids: str | None = None,
    routing: "RoutingMode | None" = None,
    truncation: SamplingTruncation | None = None,
) -> ForwardResult:
    """Run the batch through the model in micro-batches with Megatron's pipeline schedule.

    Args:
        model: the rank's model chunk(s) from ``build_model_chunks`` (optionally DDP-wrapped).
        batch: ``input_ids`` [B, T] and ``attention_mask`` [B, T], plus anything ``loss_fn`` reads.
        pg: the process groups the model was built with.
        micro_batch_size: rows per micro-batch (B is padded up to a multiple; extra rows dropped).
        split: the micro-batches instead (``verl.models.micro_batches``: a token budget); give
            exactly one of ``micro_batch_size`` and ``split``. Outputs come back in batch order.
        output: ``logprobs`` (+ ``entropy``), ``values`` or ``logits`` (see module docstring).
        loss_fn: with a loss (the module docstring's contract), gradients are accumulated into
            ``.grad``/``.main_grad`` (no optimizer step); without, forward only under ``torch.no_grad``.
        temperature: logits are divided by it before logprobs/entropy.
        with_entropy: also compute entropy (``output='logprobs'``).
        broadcast: send ``outputs`` from the last pipeline stage to every stage.
        trim_padding: run each micro-batch at its longest real row (one pipeline stage only; the
            module docstring); False: every one at the full width.
        head_columns: with ``output='logprobs'``, compute log-probabilities (and entropy) for the
            tokens of the last ``head_columns`` columns only (the responses, which is all an RL loss
            reads); the other columns are 0. The log-softmax over the vocabulary then skips the
            prompts' tokens (measured: the vocabulary head was 28% of the tiny model's update).
            The computed columns are the same numbers as without it. None: every column.
        pack_sequences: each micro-batch's rows packed into one row of their real tokens, run as
            Megatron's THD packed sequences (``verl.models.packing``; ``model.use_remove_padding``):
            no compute on padding in any layer but attention. Not with context parallelism.
        topk: with ``output='logprobs'``, also ``topk_ids``/``topk_logprobs`` [B, T, topk] (module docstring).
        score_ids: with ``output='logprobs'``, the batch key of [B, C, k] token ids whose log-probabilities
            come back as ``score_logprobs`` [B, T, k] (module docstring).
        routing: ``record`` the experts every token goes to (output ``routed_experts``), or ``replay``
            the batch's ``routed_experts`` (``verl.models.router_replay``); None: the routers decide.
        truncation: the rollout sampler's top-k / top-p, applied to ``logprobs``/``entropy``
            (``verl.models.vocab_parallel``); None: the full vocabulary. Top-k outputs and scored ids
            stay full-vocabulary.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl.models.builder import unwrap_model
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    chunks = model if isinstance(model, list) else [model]
    inner = unwrap_model(chunks[0])
    spec, build = inner.verl_spec, inner.verl_build
    if output == "logprobs" and build.head != "lm" or output == "values" and build.head == "lm":
        raise ValueError(f"output={output!r} does not fit a model built with head={build.head!r}")
    if (micro_batch_size is None) == (split is None):
        raise ValueError(
            f"forward_backward takes exactly one of micro_batch_size and split (got micro_batch_size="
            f"{micro_batch_size}, split={'given' if split is not None else None})"
        )
    for key in ("input_ids", "attention_mask", *([score_ids] if score_ids is not None else [])):
        if key not in batch:
            raise ValueError(f"batch has no '{key}' tensor (keys: {sorted(batch)})")
    if (topk is not None or score_ids is not None) and output != "logprobs":
        raise ValueError(f"topk and score_ids go with output='logprobs' (got output={output!r})")
    if split is None:
        split = fixed_split(batch["input_ids"].shape[0], micro_batch_size)
    elif sum(len(p) for p in split.parts) != batch["input_ids"].shape[0]:
        raise ValueError(
            f"split covers {sum(len(p) for p in split.parts)} rows but the batch has {batch['input_ids'].shape[0]}"
        )
    tp_size = pg.tp.size()
    pp_size = pg.pp.size()
    cp_size = pg.cp.size()
    config = inner.config
    t = batch["input_ids"].shape[1]
    # The model's width divides over sequence parallel (TP) and, under context parallelism, into 2 x CP
    # chunks of which each rank's pair divides over TP again.
    width_multiple = tp_size if config.sequence_parallel else 1
    if cp_size > 1:
        width_multiple = math.lcm(2 * cp_size, cp_size * width_multiple)
    seq_len = -(-t // width_multiple) * width_multiple
    trim_multiple = None
    if trim_padding and pp_size == 1:
        trim_multiple = math.lcm(8, width_multiple)
    # Every row's real length in one device-to-host copy for the whole batch, not one sync per
    # micro-batch (on a GPU each ``int(tensor)`` waits for the stream).
    lengths = None
    if trim_multiple is not None or pack_sequences:
        lengths = batch["attention_mask"].sum(-1).tolist()
    widths = None
    rows = split.rows
    segment_multiple = 2 * cp_size if cp_size > 1 else 1
    if pack_sequences:  # every sequence a multiple of 2 x CP, split per sequence over CP
        widths = packed_widths(
            lengths, split, math.lcm(8, width_multiple), common=pp_size > 1, segment_multiple=segment_multiple
        )
        seq_len, rows = max(widths), 1  # the pipeline's fixed shape: one packed row per micro-batch
    vlm = hasattr(inner, "verl_vlm_spec")  # verl.models.megatron_vlm: each micro-batch's images go with its rows
    if vlm and cp_size > 1:
        raise ValueError("a vision-language model runs without context parallelism: set context_parallel_size=1")
    replay_chunks = _routing_setup(chunks, batch, pg, routing)  # per chunk: (its layers of L, its routers)
    replay_routers = [router for _, routers in replay_chunks for router in routers]
    chunk_of = {id(chunk): i for i, chunk in enumerate(chunks)}
    micro_batches = _micro_batches(batch, split, seq_len, trim_multiple, widths, lengths, segment_multiple)
    num_micro = len(micro_batches)
    forward_only = loss_fn is None
    head = functools.partial(
        _head_outputs,
        kind=output,
        vocab_size=spec.vocab_size,
        tp_group=pg.tp,
        temperature=temperature,
        with_entropy=with_entropy,
        head_columns=head_columns,
        topk=topk,
        score_ids=score_ids,
        truncation=truncation,
    )
    cp_splits: dict[int, _CPSplit] = {}  # per model width, shared by the micro-batches

    def cp_split(mb: _MicroBatch) -> _CPSplit | None:
        if cp_size == 1:
            return None
        if mb.packed is not None:  # each sequence's chunks (verl.models.cp_attention.thd_cp_index)
            if mb.cp is None:
                mb.cp = _CPSplit.of_packed(pg.cp, mb.packed.cu_seqlens)
            return mb.cp
        width = mb.input_ids.shape[1]
        if width not in cp_splits:
            cp_splits[width] = _CPSplit.of(pg.cp, width, mb.input_ids.device)
        return cp_splits[width]

    def collect(mb: _MicroBatch, output_tensor: torch.Tensor):
        outputs = head(output_tensor, mb, cp=cp_split(mb))
        record = {"outputs": {k: v.detach() for k, v in outputs.items()}}
        if loss_fn is None:
            return output_tensor.new_zeros((), dtype=torch.float32), record
        share = loss_fn(outputs, mb.tensors)
        if not isinstance(share, LossShare):
            raise TypeError(
                f"loss_fn returned {type(share).__name__}, not a LossShare: verl loss functions return "
                "LossShare(loss=..., metrics=...), the micro-batch's share of the global-batch loss "
                "(verl.models.forward's module docstring). A micro-batch mean is not a share: use "
                "verl.algos.agg_loss(..., global_batch_info=GlobalBatchInfo.from_masks(...))"
            )
        record["loss"] = share.loss.detach().float()
        f32 = torch.float32  # python-float metrics go on the outputs' device, so the step reduces them there
        record["metrics"] = {
            k: v.detach().float() if torch.is_tensor(v) else output_tensor.new_tensor(float(v), dtype=f32)
            for k, v in share.metrics.items()
        }
        if routing == "replay" and pp_size == 1:  # the share of this micro-batch's sets free routing would keep
            agree, total = router_replay.agreement(replay_routers, sp_group)
            record["metrics"][router_replay.AGREEMENT] = output_tensor.new_tensor(agree / max(total, 1.0), dtype=f32)
        # Megatron's schedule divides every micro-batch loss by the number of micro-batches; the
        # share is already a share of the global loss, so that division is undone here.
        return share.loss * num_micro, record

    sp_group = pg.tp if config.sequence_parallel and tp_size > 1 else None  # routers see a slice of S

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        if routing is not None:
            layers, routers_ = replay_chunks[chunk_of[id(chunk)]]
        if routing == "replay":
            model_mask = mb.to_model(mb.tensors["attention_mask"])
            routed = mb.to_model(mb.tensors[router_replay.ROUTED_EXPERTS])
            router_replay.set_targets(routers_, routed[:, :, layers.to(routed.device)], model_mask, sp_group)
        ids, positions = mb.input_ids, mb.position_ids
        if cp_size > 1:  # this rank's chunks of every row or sequence (verl.models.cp_attention)
            mine = cp_split(mb).positions
            ids, positions = ids[:, mine], positions[:, mine]
        if vlm:  # the rows' mask in the model's layout and their images (verl.protocol.images)
            packed = {} if mb.packed is None else {"packed_seq_params": mb.packed.seq_params()}
            out = chunk(ids, positions, None, rows_mask=mb.to_model(mb.tensors["attention_mask"]),
                        **model_image_inputs(mb.tensors), **packed)
        elif mb.packed is None:
            out = chunk(ids, positions, None)
        else:
            out = chunk(ids, positions, None, packed_seq_params=mb.packed.seq_params())
        if routing == "record":
            rows = router_replay.recorded(routers_, mb.input_ids.shape[0], sp_group)  # [b, S, L_chunk, K]
            mb.routing.append((layers, router_replay.pad_positions(mb.to_rows(rows), mb.mask)))
        return out, functools.partial(collect, mb)

    schedule = get_forward_backward_func(pp_size=pp_size, vp_size=len(chunks) if len(chunks) > 1 else None)
    kwargs = dict(
        forward_step_func=step,
        data_iterator=[iter(micro_batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_micro,
        seq_length=seq_len,
        micro_batch_size=rows,
        forward_only=forward_only,
        pg_collection=pg,
    )
    if pp_size > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pg.pp, config=config)
    if not forward_only and spec.is_moe:
        _reset_moe_aux_loss_tracker()
    replay_counts = None
    recorded = None
    pp_group = pg.pp if pp_size > 1 else None
    try:
        with torch.no_grad() if forward_only else torch.enable_grad():
            records = schedule(**kwargs)
        if routing == "replay" and (forward_only or pp_size > 1):  # the whole pass's counts, every stage's layers
            replay_counts = router_replay.agreement(replay_routers, sp_group, pp_group)
        if routing == "record":
            recorded = _recorded_routing(micro_batches, split, pg.pp, inner.config.num_layers)
    finally:
        if routing is not None:
            router_replay.end(replay_routers)

    result = ForwardResult()
    last_stage = pg.pp.rank() == pp_size - 1
    if last_stage:
        keys = records[0]["outputs"].keys()
        result.outputs = {k: _in_batch_order([r["outputs"][k] for r in records], split) for k in keys}
        if not forward_only:
            result.losses = [r["loss"] for r in records]
            result.metrics = [r["metrics"] for r in records]
            if replay_counts is not None:  # pipeline stages: the pass's share on every micro-batch
                share = replay_counts[0] / max(replay_counts[1], 1.0)
                for m in result.metrics:
                    device = next(iter(m.values())).device if m else None  # beside the loss's metrics
                    m[router_replay.AGREEMENT] = torch.tensor(share, dtype=torch.float32, device=device)
        elif replay_counts is not None:
            result.metrics = [{k: torch.tensor(v, dtype=torch.float32) for k, v in zip(router_replay.AGREEMENT_COUNTS, replay_counts)}]
    if broadcast and pp_size > 1:
        extra = {}  # the top-k and scored-ids outputs: (shape's last dim, dtype)
        if topk is not None:
            extra.update(topk_ids=(topk, torch.long), topk_logprobs=(topk, torch.float32))
        if score_ids is not None:
            extra["score_logprobs"] = (batch[score_ids].shape[-1], torch.float32)
        result.outputs = _broadcast_from_last_stage(result.outputs, batch, output, with_entropy, pg, inner, extra)
    if recorded is not None and (last_stage or broadcast):
        result.outputs[router_replay.ROUTED_EXPERTS] = recorded
    return result


def _reset_moe_aux_loss_tracker() -> None:
    """Empty megatron-core's process-wide tracker of the load-balancing loss per layer (``moe_utils``,
    0.16.1). Its first training pass sizes each entry by that model's layer count and never resizes it, so
    a deeper MoE model trained later in the same process (a critic beside an actor, a test worker) indexed
    past it (IndexError in ``save_to_aux_losses_tracker``). verl does not read the tracker; emptied before
    each training pass, it is sized by the model being trained."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def _recorded_routing(micro_batches: list[_MicroBatch], split: MicroBatchSplit, pp_group, num_layers: int) -> torch.Tensor:
    """The pass's recording, [B, T, L, K] in batch order, on every pipeline stage: each stage's chunks hold
    their own layers of L; the stages' parts are gathered over ``pp_group`` (a collective when it has
    several ranks). As bytes: gloo has no int16 collectives."""
    parts = []
    for mb in micro_batches:
        pieces = sorted(mb.routing, key=lambda piece: int(piece[0][0]))
        parts.append((torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces], dim=2)))
    layers = parts[0][0]
    local = _in_batch_order([routed for _, routed in parts], split)  # [B, T, L_stage, K]
    if pp_group.size() == 1:
        return local
    from verl.protocol.collectives import comm_device

    device = comm_device(pp_group)
    b, t, _, k = local.shape
    most = torch.tensor([len(layers)], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pp_group)
    most = int(most)
    index = torch.full((most,), -1, dtype=torch.long, device=device)
    index[: len(layers)] = layers.to(device)
    padded = torch.zeros((b, t, most, k), dtype=local.dtype, device=device)
    padded[:, :, : len(layers)] = local.to(device)
    indices = [torch.empty_like(index) for _ in range(pp_group.size())]
    dist.all_gather(indices, index, group=pp_group)
    stages = [torch.empty_like(padded).view(torch.uint8) for _ in range(pp_group.size())]
    dist.all_gather(stages, padded.view(torch.uint8), group=pp_group)
    out = torch.empty((b, t, num_layers, k), dtype=local.dtype, device=local.device)
    seen = torch.zeros(num_layers, dtype=torch.bool)
    for index, stage in zip(indices, stages):
        mine = index[index >= 0].cpu()
        out[:, :, mine] = stage.view(local.dtype)[:, :, : len(mine)].to(local.device)
        seen[mine] = True
    if not bool(seen.all()):
        raise RuntimeError(f"router replay: the pipeline stages recorded layers {seen.nonzero().flatten().tolist()} of {num_layers}")
    return out


def _routing_setup(chunks, batch, pg, routing) -> list[tuple[torch.Tensor, list]]:
    """Per chunk, its MoE layers' indices in ``routed_experts``' L and their routers, to record or replay
    (``routing``), their action set; [] without routing."""
    if routing is None:
        return []
    if routing not in ("record", "replay"):
        raise ValueError(f"routing={routing!r}; use 'record', 'replay' or None")
    problems = router_replay.routing_problems(chunks, pg)
    if problems:
        raise ValueError(f"routing={routing!r} is not supported here: " + "; ".join(problems))
    key = router_replay.ROUTED_EXPERTS
    if routing == "replay" and (key not in batch or batch[key].shape[:2] != batch["input_ids"].shape):
        shape = tuple(batch[key].shape) if key in batch else None
        raise ValueError(
            f"routing='replay' needs the batch's '{key}' [B, T, layers, k] from a recording pass (got {shape} "
            f"for input_ids {tuple(batch['input_ids'].shape)})"
        )
    from verl.models.builder import unwrap_model

    num_layers = unwrap_model(chunks[0]).config.num_layers
    if routing == "replay" and batch[key].shape[2] != num_layers:
        raise ValueError(f"batch '{key}' has {batch[key].shape[2]} layers of routing, the model {num_layers} MoE layers")
    per_chunk = []
    for chunk in chunks:
        found = router_replay.routers([chunk])
        router_replay.begin(found, routing)
        per_chunk.append((torch.tensor(router_replay.chunk_layers(chunk), dtype=torch.long), found))
    return per_chunk


def _broadcast_from_last_stage(
    outputs: dict[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    kind: OutputKind,
    with_entropy: bool,
    pg: "ProcessGroupCollection",
    inner: torch.nn.Module,
    extra: Mapping[str, tuple[int, torch.dtype]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every pipeline stage gets the last stage's outputs (same keys and shapes on all stages);
    ``extra``: outputs [B, T, k] of the given k and dtype besides."""
    b, t = batch["input_ids"].shape
    device = batch["input_ids"].device
    if kind == "logprobs":
        shapes = {"logprobs": (b, t), **({"entropy": (b, t)} if with_entropy else {})}
    elif kind == "values":
        shapes = {"values": (b, t)}
    else:
        shapes = {"logits": (b, t, inner.verl_padded_vocab // pg.tp.size())}
    dtypes = {}
    for key, (k, dtype) in (extra or {}).items():
        shapes[key], dtypes[key] = (b, t, k), dtype
    src = dist.get_global_rank(pg.pp, pg.pp.size() - 1)
    is_src = pg.pp.rank() == pg.pp.size() - 1
    result = {}
    for key, shape in shapes.items():
        if is_src:
            tensor = outputs[key].contiguous()
        else:
            dtype = inner.config.params_dtype if key == "logits" else dtypes.get(key, torch.float32)
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=pg.pp)
        result[key] = tensor
    return result
