"""Ulysses sequence parallelism for Hugging Face transformers models on the FSDP2 engine.

``fsdp_config.ulysses_sequence_parallel_size=N`` (the reference verl's
``actor_rollout_ref.actor.ulysses_sequence_parallel_size``, ``critic.ulysses_sequence_parallel_size``)
cuts the role's data-parallel ranks into groups of ``N`` consecutive ranks (the SP groups). Each rank
keeps the rows it was dispatched, as without SP; every micro-batch of every member of a group runs
over the whole group, one member's micro-batch after the other (a *turn*):

1. the member's rows become one packed row of their real tokens (no padding anywhere), each
   sequence numbered from 0 (``position_ids`` per sequence), padded at its end to a multiple of
   ``N``; rank ``r`` of the group runs the model on the ``r``-th ``1/N`` of that row;
2. around each attention (an attention function registered with transformers'
   ``AttentionInterface`` under :data:`ATTENTION_NAME`, no model code touched) an all-to-all turns
   ``[tokens/N, all heads]`` into ``[all tokens, heads/N]``; attention runs over the whole row with a
   causal mask that keeps each sequence to itself; a second all-to-all turns the result back.
   Key/value heads that do not split over ``N`` (grouped-query attention with fewer KV heads than
   ``N``) are repeated first, as few times as makes them split;
3. the per-token outputs (log-probs and entropy, or values) of the ``1/N`` are gathered over the group
   once, and the member whose rows they are keeps them; its loss runs back through the same
   collectives (their backward: the reverse all-to-all, a sum of the gathered outputs' gradients).

Every rank thus holds ``1/N`` of each turn's tokens in every layer but attention, and the whole row
of ``1/N`` of the heads inside attention. The gradients each rank accumulates are the share of its
tokens in every member's loss: summed over the group they are the members' whole gradients, so the
engine's gradient average over all its DP ranks is unchanged (SP2 equals SP1).

What it does not do: sliding-window or soft-capped attention (refused), flash-attention's varlen
kernels (the mask is a boolean ``[S, S]`` per turn for ``torch.nn.functional.scaled_dot_product_attention``),
plain ``nn.Module`` s (the Python API's), ``output='logits'``, ``topk`` and ``score_ids``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "ATTENTION_NAME",
    "TurnLayout",
    "check_ulysses_model",
    "enable_ulysses",
    "gather_seq",
    "head_to_seq",
    "seq_to_head",
    "ulysses_group",
    "ulysses_turns",
]

ATTENTION_NAME = "verl_ulysses"
"""The name the attention function is registered under (``config._attn_implementation``)."""


# -- collectives with their backward ------------------------------------------------------------


def _all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``chunks`` [N, ...]: chunk ``j`` goes to rank ``j``; returns [N, ...] with rank ``j``'s chunk at ``j``."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)  # after .contiguous(): empty_like keeps a permuted view's strides
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = group.size()
    b, h, s, d = x.shape
    chunks = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # [N (head group), b, h/N, s, d]
    got = _all_to_all(chunks, group)  # [N (sequence chunk), b, h/N, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = group.size()
    b, hn, seq, d = x.shape
    chunks = x.reshape(b, hn, n, seq // n, d).permute(2, 0, 1, 3, 4)  # [N (sequence chunk), b, h/N, s, d]
    got = _all_to_all(chunks, group)  # [N (head group), b, h/N, s, d]
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hn, seq // n, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's loss reads the gathered tensor: its chunk's gradient is the sum over the group.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=-1)[ctx.group.rank()].contiguous(), None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, heads, tokens/N, d] (this rank's tokens, every head) -> [b, heads/N, tokens, d] (every token,
    this rank's heads); differentiable (backward: :func:`head_to_seq`)."""
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`seq_to_head`: [b, heads/N, tokens, d] -> [b, heads, tokens/N, d]."""
    return _HeadToSeq.apply(x, group)


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[..., tokens/N] of every rank -> [..., tokens] (rank order); backward sums the gradient over the
    group and keeps this rank's chunk."""
    return _GatherSeq.apply(x, group)


# -- the group and the model ------------------------------------------------------------------


def ulysses_group(dp: dist.ProcessGroup, size: int, name: str) -> dist.ProcessGroup:
    """This rank's SP group: the ``size`` consecutive ranks of the role's DP group ``dp`` it is among.
    Only the group's own ranks take part in making it (``use_local_synchronization``), so a role placed
    on part of the world makes its groups alone."""
    ranks = dist.get_process_group_ranks(dp)
    if size < 1 or len(ranks) % size:
        raise ValueError(
            f"{name}: fsdp_config.ulysses_sequence_parallel_size={size} does not divide the role's {len(ranks)} "
            f"data-parallel ranks; set it to a divisor of {len(ranks)}"
        )
    start = (dp.rank() // size) * size
    return dist.new_group(ranks[start : start + size], use_local_synchronization=True)


def check_ulysses_model(config: Any, size: int, name: str) -> None:
    """ValueError (one line, naming the key) when a transformers model with ``config`` cannot run with
    ``size`` ranks per sequence."""
    key = f"{name}: fsdp_config.ulysses_sequence_parallel_size={size}"
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(f"{key} needs a transformers model config with num_attention_heads; set it to 1")
    if heads % size:
        raise ValueError(
            f"{key} does not divide the model's {heads} attention heads (num_attention_heads); set it to a divisor "
            f"of {heads}"
        )
    kinds = set(getattr(config, "layer_types", None) or [])
    if (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)) or kinds - {
        "full_attention"
    }:
        raise ValueError(f"{key}: the model has sliding-window attention layers, which Ulysses does not run; set it to 1")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{key}: the model soft-caps attention logits, which Ulysses does not run; set it to 1")


def enable_ulysses(module: torch.nn.Module, size: int, name: str) -> None:
    """Route ``module``'s attention through :func:`ulysses_attention` (registered once with transformers'
    ``AttentionInterface``); checks the model first (:func:`check_ulysses_model`)."""
    from transformers import AttentionInterface

    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "set_attn_implementation"):
        raise ValueError(
            f"{name}: fsdp_config.ulysses_sequence_parallel_size={size} runs transformers models, not "
            f"{type(module).__name__}; set it to 1"
        )
    check_ulysses_model(config, size, name)
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    module.set_attn_implementation(ATTENTION_NAME)


@dataclass(frozen=True)
class TurnLayout:
    """One turn's packed row as the attention sees it (the whole row, every rank alike)."""

    group: dist.ProcessGroup
    mask: torch.Tensor
    """[1, 1, S, S] bool: query i may see key j (causal, same sequence; the end padding sees itself)."""


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    verl_ulysses: TurnLayout | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [b, H, s, d], ``key``/``value`` [b, K, s, d]
    of this rank's ``s`` tokens -> ([b, s, H, d], None). The model's own mask is unused (none is built
    for a custom attention function): :class:`TurnLayout` carries the whole row's."""
    if verl_ulysses is None:
        raise ValueError(
            f"{type(module).__name__} runs Ulysses attention ({ATTENTION_NAME}) only inside the FSDP2 engine's "
            "turns (verl.models.ulysses.ulysses_turns)"
        )
    group = verl_ulysses.group
    n = group.size()
    kv_heads = key.shape[1]
    if kv_heads % n:  # fewer (or unevenly many) KV heads: repeat each, keeping the query-to-KV grouping
        repeat = n // math.gcd(kv_heads, n)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = seq_to_head(query, group), seq_to_head(key, group), seq_to_head(value, group)  # [b, heads/N, S, d]
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=verl_ulysses.mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return head_to_seq(out, group).transpose(1, 2).contiguous(), None


# -- the turns of one micro-batch -------------------------------------------------------------


def _share_rows(ids: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every member's (lengths [b_j], real token ids [n_j]) of this micro-batch (a header first, so
    rows and tokens may differ in number between members)."""
    real = mask.bool()
    lengths = real.sum(dim=1).to(torch.long)
    flat = ids[real].to(torch.long)
    n = group.size()
    header = torch.tensor([lengths.numel(), flat.numel()], dtype=torch.long, device=ids.device)
    headers = [torch.empty_like(header) for _ in range(n)]
    dist.all_gather(headers, header, group=group)
    rows, tokens = (max(int(h[i]) for h in headers) for i in (0, 1))
    got_lengths = [torch.empty(max(rows, 1), dtype=torch.long, device=ids.device) for _ in range(n)]
    got_ids = [torch.empty(max(tokens, 1), dtype=torch.long, device=ids.device) for _ in range(n)]
    dist.all_gather(got_lengths, F.pad(lengths, (0, max(rows, 1) - lengths.numel())), group=group)
    dist.all_gather(got_ids, F.pad(flat, (0, max(tokens, 1) - flat.numel())), group=group)
    return [(got_lengths[j][: int(h[0])], got_ids[j][: int(h[1])]) for j, h in enumerate(headers)]


def _packed_row(lengths: torch.Tensor, flat: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [S], positions [S], sequence index [S], -1 on the end padding) of one member's rows, S the
    real tokens rounded up to a multiple of ``n`` (at least ``n``)."""
    total = int(flat.numel())
    width = max(math.ceil(total / n), 1) * n
    device = flat.device
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)  # [total]
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(total, device=device) - starts[seq]
    pad = width - total
    return (
        F.pad(flat, (0, pad)),
        F.pad(positions, (0, pad)),
        F.pad(seq, (0, pad), value=-1),
    )


def _turn_outputs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    seq: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    output: str,
    temperature: float,
    with_entropy: bool,
    truncation: Any,
    score: torch.nn.Module | None,
) -> torch.Tensor:
    """One turn's gathered per-token outputs [k, S] over the packed row (k: log-probs, and entropy; or
    values). Log-probs and entropy at packed index p are of the distribution at p (predicting p + 1)."""
    from verl.models.vocab_parallel import vocab_parallel_logprobs_entropy

    n, rank = group.size(), group.rank()
    width = ids.numel() // n
    mine = slice(rank * width, (rank + 1) * width)
    idx = torch.arange(ids.numel(), device=ids.device)
    mask = (idx[None, :] <= idx[:, None]) & (seq[None, :] == seq[:, None])  # [S, S]
    layout = TurnLayout(group=group, mask=mask[None, None])
    kwargs = {"position_ids": positions[mine][None], "use_cache": False, "verl_ulysses": layout}
    if output == "values":
        scores: list[torch.Tensor] = []
        handle = score.register_forward_hook(lambda _m, _i, out: scores.append(out))
        try:
            pooled = model(ids[mine][None], **kwargs).logits
        finally:
            handle.remove()
        # The root's output in the graph: FSDP2 gathers the root's parameters for backward from a hook on it.
        local = (scores[-1].squeeze(-1) + 0.0 * pooled.sum()).float()  # [1, S/N]
    else:
        logits = model(ids[mine][None], **kwargs).logits  # [1, S/N, V]
        if temperature != 1.0:
            logits = logits / temperature
        targets = F.pad(ids[1:], (0, 1))[mine][None]  # the next token of each position
        sampler = {"truncation": truncation} if truncation is not None else {}  # the rollout's top-k / top-p
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            logits, targets, vocab_start=0, vocab_size=logits.shape[-1], group=None, with_entropy=with_entropy,
            **sampler,
        )
        local = torch.cat([logprobs, entropy]) if with_entropy else logprobs  # [k, S/N]
    return gather_seq(local, group)


def ulysses_turns(
    model: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    *,
    output: str,
    temperature: float,
    with_entropy: bool,
    truncation: Any = None,
    score: torch.nn.Module | None = None,
):
    """Run one micro-batch of every member of ``group`` (module docstring), a turn each in rank order.

    ``truncation``: the rollout's top-k / top-p, as the plain engine's log-probs take it (logits
    divided by ``temperature`` first). A generator: it yields ``(outputs, gathered)`` once per turn. ``outputs`` is this rank's
    per-token outputs [b, T] of its own rows (the plain engine's layout: ``logprobs`` [and
    ``entropy``], 0 at pads and at each row's first token; or ``values``) on its own turn, else
    None; ``gathered`` [k, S] is the turn's gathered tensor, whose backward every member must run
    (``torch.autograd.backward(gathered, zeros)`` on the turns that are not its own) before the next
    turn's forward when training.
    """
    ids, mask = mb["input_ids"], mb["attention_mask"]
    members = _share_rows(ids, mask, group)
    n = group.size()
    for j, (lengths, flat) in enumerate(members):
        row_ids, positions, seq = _packed_row(lengths, flat, n)
        gathered = _turn_outputs(model, row_ids, positions, seq, group, output=output, temperature=temperature,
                                 with_entropy=with_entropy, truncation=truncation, score=score)
        if j != group.rank():
            yield None, gathered
            continue
        real = mask.bool()
        src = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
        src[real] = torch.arange(int(real.sum()), device=ids.device)
        if output != "values":  # token t is scored by the distribution at the packed index before it
            first = positions[src.clamp(min=0)] == 0
            src = torch.where(real & ~first, src - 1, torch.full_like(src, -1))
        picked = gathered[:, src.clamp(min=0)] * (src >= 0)  # [k, b, T]
        names = ["values"] if output == "values" else ["logprobs"] + (["entropy"] if with_entropy else [])
        yield {name: picked[i] for i, name in enumerate(names)}, gathered
