"""One conversation of the agent loop as data: :class:`Trajectory` (the prompt, the response built
turn by turn, its loss mask and log-probs) and :class:`CallRecord` (one tool call as run).

The loop (:mod:`verl.rollout.agent.loop`) writes them and a custom agent loop's
:class:`~verl.rollout.agent.agents.Conversation` extends them; both import them from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallRecord", "Trajectory"]


@dataclass(kw_only=True)
class CallRecord:
    """One tool call as run (or refused)."""

    name: str
    """The tool's name; ``unknown_tool`` or ``bad_format`` when no tool could be chosen."""
    error: bool
    """Whether the model got an error message."""
    seconds: float = 0.0
    """Wall time of the call (0 for calls refused before running)."""


@dataclass(kw_only=True)
class Trajectory:
    """One conversation: the prompt and the response built turn by turn (the token-in, token-out
    layout is :mod:`verl.rollout.agent.loop`'s module docstring)."""

    prompt_ids: list[int]
    """The prompt's token ids (unpadded): the dataset's prompt, and after it the opening user turn
    of the conversation's interaction when ``start_interaction`` returned one (:attr:`opening`)."""
    instance_id: str
    """Names this conversation to stateful tools."""
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Per-tool settings of this sample (``{tool: {"create_kwargs": {...}}}``, from ``extra_info``)."""
    response_ids: list[int] = field(default_factory=list)
    """Sampled ids and tool-turn ids, in order."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on sampled ids, 0 on tool-turn ids."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each sampled id; 0.0 on tool-turn ids."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """``{"role": "assistant" | "tool", "start": i, "end": j}``: response positions [i, j) of each turn
    (tool turns also list the ``calls`` they answer, by tool name)."""
    calls: list[CallRecord] = field(default_factory=list)
    """Every tool call of the conversation."""
    assistant_turns: int = 0
    """Model turns so far."""
    user_turns: int = 0
    """Tool turns so far."""
    stop_reason: str = ""
    """Why the conversation ended (``verl.rollout.agent.loop.STOP_REASONS``, or a custom loop's own
    reason); empty while it runs."""
    agent_name: str = "tool_agent"
    """``tool_agent``, ``single_turn_agent`` (:data:`~verl.rollout.agent.loop.AGENT_NAMES`) or a custom agent loop's name, from ``extra_info["agent_name"]``."""
    interaction: Any = None
    """The interaction that answers this conversation's model turns (``verl.rollout.agent.interaction``), or None."""
    interaction_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The sample's ``extra_info["interaction_kwargs"]``."""
    opening: str | None = None
    """The interaction's opening text (``start_interaction``'s return), a user turn at the end of
    :attr:`prompt_ids`; None: the dataset's prompt opens the conversation alone."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The turns after the prompt as text (what an interaction reads; never re-tokenized)."""
    own_prompt: bool = False
    """The prompt ids are this trajectory's own, not its batch row's (an agent program's episode
    that did not start from the dataset's prompt ids, ``verl.rollout.agent.endpoint``)."""
    turn_scores: list[tuple[int, float]] = field(default_factory=list)
    """``(position, reward)`` of every interaction reward: the response position of the last
    sampled token of the model turn it judges."""
    images: list[tuple[Any, Any]] = field(default_factory=list)
    """The conversation's images in context order, each ``(pixel_values [p, D], image_grid_thw [k, 3])``:
    the prompt's, then each tool turn's (``verl.rollout.agent.images``); empty for a text conversation."""
    earlier: list[Trajectory] = field(default_factory=list)
    """The trajectories of this one's episode before it (an agent program's episode split where a
    request did not extend the conversation, ``verl.rollout.agent.endpoint``), in order; a training
    rollout makes each a row of its own (:func:`~verl.rollout.agent.loop.assemble_agent_rollout`)."""

    @property
    def num_turns(self) -> int:
        """Turns of the conversation, the prompt counted as one (the reference verl's ``num_turns``)."""
        return self.assistant_turns + self.user_turns + 1

    def _append(self, ids: Sequence[int], logprobs: Sequence[float] | None, role: str) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if logprobs is not None else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.turns.append({"role": role, "start": start, "end": len(self.response_ids)})
