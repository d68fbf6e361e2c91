"""The rules a Megatron parallel layout must satisfy, stated once (no torch import).

:func:`layout_problems` checks one role's degrees (TP, PP, CP, virtual PP, sequence parallel)
against the number of ranks it runs on and returns every problem, worded with the caller's
names for the degrees. Its callers only add where the layout comes from:

- ``verl.config.validation`` (dotted config keys, the launched or declared world size),
- ``verl.parallel.topology.Topology`` (a role's ``RoleLayout`` fields and its rank count),
- ``verl.parallel.megatron_state.initialize_model_parallel`` (Megatron's argument names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LayoutNames", "LayoutProblem", "layout_problems"]

ProblemKind = Literal["degree", "virtual_pipeline", "sequence_parallel", "divide"]


@dataclass(frozen=True, kw_only=True)
class LayoutNames:
    """How a caller names the degrees in messages; ``prefix`` goes before the first name of each."""

    tensor: str = "tensor_model_parallel_size"
    pipeline: str = "pipeline_model_parallel_size"
    context: str = "context_parallel_size"
    virtual_pipeline: str = "virtual_pipeline_model_parallel_size"
    sequence_parallel: str = "sequence_parallel"
    prefix: str = ""
    """E.g. ``actor_rollout_ref.actor.megatron.`` for the config's dotted keys."""


@dataclass(frozen=True)
class LayoutProblem:
    """One broken rule: its kind and the message naming every degree involved."""

    kind: ProblemKind
    text: str


def _is_degree(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def layout_problems(
    *,
    ranks: int,
    ranks_text: str,
    tensor: int,
    pipeline: int,
    context: int = 1,
    virtual_pipeline: int | None = None,
    sequence_parallel: bool = False,
    names: LayoutNames = LayoutNames(),
) -> list[LayoutProblem]:
    """Every rule the degrees break on ``ranks`` ranks (``ranks_text`` says what they are).

    Rules: each degree is an integer >= 1; virtual pipeline stages need pipeline parallel > 1;
    sequence parallel needs tensor parallel > 1; TP x PP x CP divides the ranks (the rest is
    data parallel). An empty list means the layout is valid.
    """
    p = names.prefix
    problems = [
        LayoutProblem("degree", f"{p}{name}={value!r} must be an integer >= 1")
        for name, value in (
            (names.tensor, tensor), (names.pipeline, pipeline), (names.context, context)
        )
        if not _is_degree(value)
    ]
    if problems:
        return problems
    if virtual_pipeline is not None:
        if not _is_degree(virtual_pipeline):
            problems.append(LayoutProblem(
                "virtual_pipeline",
                f"{p}{names.virtual_pipeline}={virtual_pipeline!r} must be null or an integer >= 1",
            ))
        elif pipeline < 2:
            problems.append(LayoutProblem(
                "virtual_pipeline",
                f"{p}{names.virtual_pipeline}={virtual_pipeline} needs {names.pipeline} > 1 (got {pipeline}); "
                "set it to null or raise the pipeline degree",
            ))
    if sequence_parallel and tensor == 1:
        problems.append(LayoutProblem(
            "sequence_parallel",
            f"{p}{names.sequence_parallel}=true needs {names.tensor} > 1 (got 1); "
            f"set {p}{names.sequence_parallel}=false or raise the tensor degree",
        ))
    model_parallel = tensor * pipeline * context
    if ranks % model_parallel:
        problems.append(LayoutProblem(
            "divide",
            f"{p}{names.tensor}={tensor} x {names.pipeline}={pipeline} x {names.context}={context} = "
            f"{model_parallel} does not divide {ranks_text}; choose degrees whose product divides {ranks}",
        ))
    return problems
