"""Which decoder layers each pipeline stage (and each virtual chunk) holds.

Megatron-core splits layers uniformly unless ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` are set (the reference verl passes them through
``megatron.override_transformer_config``); the middle stages then share the rest evenly. A model
whose layer count does not divide the pipeline (Qwen2.5-7B's 28 layers or Qwen3-8B's 36 on PP 8, a
3-layer model on PP 2) gets first/last counts chosen here automatically. Megatron's explicit
``pipeline_model_parallel_layout`` (same place, the same key as Megatron's ``TransformerConfig``)
sets every chunk's layers by hand, e.g. 5 layers on PP 2 x VPP 2, which no first/last split can.

This module is the one place that knows the split: the builder hands its counts to Megatron, and
the reshard plan, the converters and the dry-run planner read stage ranges from it, so every part
agrees on which layer lives where. Pure Python (no Megatron import); ``tests/models/
test_uneven_pipeline.py`` checks it against Megatron's own offset and count functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FIRST_KEY = "num_layers_in_first_pipeline_stage"
LAST_KEY = "num_layers_in_last_pipeline_stage"
LAYOUT_KEY = "pipeline_model_parallel_layout"
_LAYOUT_NAMES = {"embedding": "E", "decoder": "t", "loss": "L", "mtp": "m", "encoder": "?"}
"""Megatron's layer-type names (the list form of a layout) -> the characters of its string form."""


@dataclass(frozen=True)
class PipelineSplit:
    """Layer counts of a pipeline: ``first``/``last`` None means the stage is a middle one."""

    num_layers: int
    pp: int
    vpp: int | None = None
    first: int | None = None
    last: int | None = None
    chunks: tuple[int, ...] | None = None
    """From an explicit ``pipeline_model_parallel_layout``: the decoder layers of every model chunk in
    Megatron's order (chunk ``v`` of stage ``p`` at ``v * pp + p``); None: first/last/middle counts."""

    @property
    def uneven(self) -> bool:
        """Whether Megatron needs the first/last counts or a layout (the split is not uniform)."""
        return self.first is not None or self.last is not None or self.chunks is not None

    @property
    def layout(self) -> str | None:
        """The explicit layout as Megatron's string (``E`` embedding, ``t`` a layer, ``L`` the loss,
        ``|`` between chunks); None without one."""
        if self.chunks is None:
            return None
        stages = ["t" * n for n in self.chunks]
        stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
        return "|".join(stages)

    @property
    def middle(self) -> int:
        """Layers on each stage that is neither an explicit first nor an explicit last one."""
        stages = self.pp - (self.first is not None) - (self.last is not None)
        rest = self.num_layers - (self.first or 0) - (self.last or 0)
        return rest // stages if stages else 0

    def stage_layers(self) -> list[int]:
        """Layers per pipeline stage (all its virtual chunks together)."""
        if self.chunks is not None:
            return [sum(self.chunks[p :: self.pp]) for p in range(self.pp)]
        counts = [self.middle] * self.pp
        if self.first is not None:
            counts[0] = self.first
        if self.last is not None:
            counts[-1] = self.last
        return counts

    def chunk_range(self, pp_rank: int, vp_stage: int | None = None) -> tuple[int, int]:
        """(global index of the first layer, layer count) of one model chunk, as Megatron places them:
        with interleaving, virtual chunk ``v`` of every stage comes before chunk ``v + 1`` of any."""
        if self.chunks is not None:
            index = (vp_stage or 0) * self.pp + pp_rank
            return sum(self.chunks[:index]), self.chunks[index]
        v = self.vpp or 1
        per_chunk = [n // v for n in self.stage_layers()]  # every stage's count divides by vpp
        offset = (vp_stage or 0) * sum(per_chunk) + sum(per_chunk[:pp_rank])
        return offset, per_chunk[pp_rank]

    def megatron_kwargs(self) -> dict[str, int]:
        """The ``TransformerConfig`` fields of this split ({} when uniform).

        On two stages with both counts given, only the first is passed and the last stage is
        Megatron's one "middle" stage (the same layers): megatron-core 0.16.1's interleaved offset
        divides by the number of middle stages, zero there (ZeroDivisionError on the last stage).
        """
        if self.chunks is not None:
            return {LAYOUT_KEY: self.layout}
        out = {}
        if self.first is not None:
            out[FIRST_KEY] = self.first
        if self.last is not None and not (self.pp == 2 and self.first is not None):
            out[LAST_KEY] = self.last
        return out

    def describe(self) -> str:
        """e.g. ``3 layers on PP 2: [2, 1]``."""
        vpp = f" x VPP {self.vpp}" if self.vpp else ""
        chunks = f", chunks {list(self.chunks)} ({self.layout})" if self.chunks is not None else ""
        return f"{self.num_layers} layers on PP {self.pp}{vpp}: {self.stage_layers()}{chunks}"


def stage_layer_overrides(override_transformer_config: dict) -> dict[str, Any]:
    """``first_stage_layers``/``last_stage_layers``/``pipeline_layout`` keyword arguments from a role's
    ``megatron.override_transformer_config`` (the reference verl's and Megatron's keys; absent: None)."""
    return {"first_stage_layers": override_transformer_config.get(FIRST_KEY),
            "last_stage_layers": override_transformer_config.get(LAST_KEY),
            "pipeline_layout": normalize_layout(override_transformer_config.get(LAYOUT_KEY))}


def normalize_layout(layout: Any) -> str | None:
    """A layout as Megatron's string form: a string is kept, Megatron's list form (one list of layer
    type names per chunk, e.g. ``[["embedding", "decoder"], ["decoder", "loss"]]``) becomes one;
    ValueError naming the key for anything else."""
    if layout is None or isinstance(layout, str):
        return layout
    if isinstance(layout, (list, tuple)) and all(isinstance(stage, (list, tuple)) for stage in layout):
        names = [str(n).strip().lower() for stage in layout for n in stage]
        unknown = sorted(set(names) - set(_LAYOUT_NAMES))
        if not unknown:
            return "|".join("".join(_LAYOUT_NAMES[str(n).strip().lower()] for n in stage) for stage in layout)
        raise ValueError(f"{LAYOUT_KEY}: unknown layer types {unknown}; use embedding, decoder and loss")
    raise ValueError(
        f"{LAYOUT_KEY}={layout!r}: give a string such as 'Et|tt|t|tL' or a list of lists of layer types"
    )


def _expand(text: str) -> str:
    """Unroll ``x*n`` and ``(...)*n`` (nesting allowed) in a layout string."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "(":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ValueError(f"{LAYOUT_KEY}: unbalanced '(' in {text!r}")
            piece, i = _expand(text[i + 1 : j - 1]), j
        elif text[i] == ")":
            raise ValueError(f"{LAYOUT_KEY}: unbalanced ')' in {text!r}")
        else:
            piece, i = text[i], i + 1
        repeat = re.match(r"\*(\d+)", text[i:])
        if repeat:
            piece, i = piece * int(repeat.group(1)), i + repeat.end()
        out.append(piece)
    return "".join(out)


def layout_problem(layout: str, num_layers: int, pp: int, vpp: int | None) -> tuple[str | None, tuple[int, ...]]:
    """(why ``layout`` cannot place ``num_layers`` on ``pp`` x ``vpp`` chunks, or None; the chunks' layer counts).

    Megatron-core 0.16.1's string form: one ``|``-separated stage per model chunk in the order chunk 0
    of every stage, then chunk 1, ...; ``E`` the embedding, ``t`` a decoder layer, ``L`` the loss;
    ``x*n`` and ``(...)*n`` repeat, commas are cosmetic. verl's builder puts the embedding on the first
    chunk and the LM head on the last, and builds no empty chunk or multi-token-prediction layer."""
    fix = f"(one '|'-separated stage per chunk: PP {pp} x virtual {vpp or 1}, e.g. 'Et|tt|t|tL')"
    try:
        stages = _expand(layout.replace(",", "").replace(" ", "")).split("|")
    except ValueError as exc:
        return str(exc), ()
    bad = sorted({c for stage in stages for c in stage} - set("EtL"))
    if bad:
        return f"{LAYOUT_KEY}={layout!r} has {bad}; verl builds only E (embedding), t (decoder layer), L (loss)", ()
    if len(stages) != pp * (vpp or 1):
        return f"{LAYOUT_KEY}={layout!r} has {len(stages)} stages, not {pp * (vpp or 1)} {fix}", ()
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        return f"{LAYOUT_KEY}={layout!r}: the embedding E must open the first stage, once {fix}", ()
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        return f"{LAYOUT_KEY}={layout!r}: the loss L must close the last stage, once {fix}", ()
    chunks = tuple(stage.count("t") for stage in stages)
    if sum(chunks) != num_layers:
        return f"{LAYOUT_KEY}={layout!r} places {sum(chunks)} decoder layers (t); num_hidden_layers={num_layers}", chunks
    if 0 in chunks:
        return f"{LAYOUT_KEY}={layout!r}: chunk {chunks.index(0)} holds no decoder layer (give every stage a t)", chunks
    return None, chunks


def split_problem(
    num_layers: int, pp: int, vpp: int | None = None, first: int | None = None, last: int | None = None,
    layout: str | None = None,
) -> str | None:
    """Why these counts cannot split ``num_layers`` over ``pp`` stages (``vpp`` chunks each); None if they can.

    Megatron-core's rules: counts > 0; with interleaving each stage's count divides by ``vpp``; the
    layers left for the middle stages divide evenly among them (none left when there are none).
    """
    if layout is not None:
        if first is not None or last is not None:
            return f"{LAYOUT_KEY} and {FIRST_KEY}/{LAST_KEY} are both set; keep one of them"
        return layout_problem(layout, num_layers, pp, vpp)[0]
    where = f"num_hidden_layers={num_layers} on pipeline {pp} x virtual {vpp or 1}"
    if pp == 1 and (first is not None or last is not None):
        return f"{FIRST_KEY}/{LAST_KEY} need pipeline_model_parallel_size > 1 (remove them or raise PP)"
    for key, n in ((FIRST_KEY, first), (LAST_KEY, last)):
        if n is None:
            continue
        if n < 1:
            return f"{key}={n} must be >= 1"
        if vpp and n % vpp:
            return f"{key}={n} is not divisible by virtual pipeline {vpp} ({where})"
    stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (stages == 0 and rest) or (stages and rest < stages):
        return (f"{FIRST_KEY}={first}, {LAST_KEY}={last} leave {rest} layers for {stages} middle stages "
                f"({where})")
    if stages and rest % (stages * (vpp or 1)):
        return (f"{FIRST_KEY}={first}, {LAST_KEY}={last} leave {rest} layers, not divisible by {stages} middle "
                f"stages x virtual {vpp or 1} ({where})")
    return None


def auto_split(num_layers: int, pp: int, vpp: int | None = None) -> tuple[int | None, int | None] | None:
    """First/last counts for a layer count that does not divide ``pp * vpp``; (None, None) if it does;
    None when no first/last split exists (e.g. 5 layers on PP 2 x VPP 2).

    The choice minimises the largest stage; among equals it gives the middle stages more (the first
    stage carries the embedding, the last the LM head and loss), then keeps first and last close,
    then gives the first stage the extra layer (the last one computes the LM head and loss).
    E.g. 3 layers on PP 2: [2, 1]; 28 on PP 8: [2, 4, 4, 4, 4, 4, 4, 2]; 36 on PP 8: [3, 5, 5, 5, 5, 5, 5, 3].
    """
    v = vpp or 1
    if num_layers % (pp * v) == 0:
        return None, None
    if pp == 1:
        return None
    best, best_key = None, None
    for first in range(v, num_layers + 1, v):
        for last in range(v, num_layers - first + 1, v):
            if split_problem(num_layers, pp, vpp, first, last) is not None:
                continue
            middle = PipelineSplit(num_layers=num_layers, pp=pp, vpp=vpp, first=first, last=last).middle
            key = (max(first, last, middle), -middle, abs(first - last), -first)
            if best_key is None or key < best_key:
                best, best_key = (first, last), key
    return best


def resolve_split(
    num_layers: int, pp: int, vpp: int | None = None, first: int | None = None, last: int | None = None,
    layout: str | None = None,
) -> PipelineSplit:
    """The split of ``num_layers``: an explicit ``layout`` or the given first/last counts (checked), or
    automatic ones when the layers do not divide ``pp * vpp``. ValueError naming the keys and the fix."""
    if layout is not None:
        problem = split_problem(num_layers, pp, vpp, first, last, layout)
        if problem:
            raise ValueError(f"pipeline layout refused: {problem}")
        chunks = layout_problem(layout, num_layers, pp, vpp)[1]
        return PipelineSplit(num_layers=num_layers, pp=pp, vpp=vpp, chunks=chunks)
    if first is None and last is None:
        chosen = auto_split(num_layers, pp, vpp)
        if chosen is None:
            raise ValueError(
                f"num_hidden_layers={num_layers} is not divisible by pipeline {pp} x virtual {vpp or 1}, and no "
                f"{FIRST_KEY}/{LAST_KEY} split exists for it (each stage's count must divide by the virtual "
                "size); change pipeline_model_parallel_size or virtual_pipeline_model_parallel_size"
            )
        first, last = chosen
    problem = split_problem(num_layers, pp, vpp, first, last)
    if problem:
        raise ValueError(f"uneven pipeline split refused: {problem}")
    return PipelineSplit(num_layers=num_layers, pp=pp, vpp=vpp, first=first, last=last)
