"""Interactions: an environment (a simulated user, a checker, a game) that answers the model's turns.

The contract follows the reference verl's ``BaseInteraction`` (its method names, so a reference
interaction ports by making its methods plain functions; coroutines are also accepted):

- ``start_interaction(instance_id, **interaction_kwargs) -> str | None``: reset for one
  conversation (the sample's ``extra_info["interaction_kwargs"]``). The sample's prompt is the
  first user turn; a returned text opens the conversation: it is a user turn (the template's
  user role) after the prompt, in the prompt ids the model reads (out of the loss, on the prompt
  side of the prompt/response split), and the first message :meth:`Interaction.generate_response`
  sees. None (or the instance id itself, which the reference's ``start_interaction`` returns):
  no opening;
- ``generate_response(instance_id, messages, **interaction_kwargs) -> (done, text, reward, extra)``:
  the model's turn (the last message of ``messages``) is judged. ``done``: the conversation ends
  there; else ``text`` becomes the next user turn (rendered in the chat template's user role,
  tokenized like a tool turn, out of the loss). ``reward`` is this turn's score;
- ``finalize_interaction(instance_id)``: the conversation ended.

The agent loop (``verl.rollout.agent.loop``) calls the interaction after every model turn that
calls no tool. The calls of one round run concurrently across conversations (:func:`call_all`):
coroutine methods together on one event loop, plain methods each in its own thread, so an
interaction that waits (a judge model, a web environment) costs one wait per round, not one per
conversation; plain methods must therefore be safe to call from several threads at once.

Each turn's reward is recorded at the last sampled token of the model turn it judges
(``turn_scores`` per sample) and folded into ``token_level_scores`` by the reward step as
``multi_turn.interaction_reward`` says: ``per_turn`` adds each reward at its turn's last token (a
GAE critic sees when it was earned), ``final`` adds their sum at the response's last sampled
token (outcome reward; GRPO and the other sequence-level estimators see the same sum either
way), ``none`` keeps them as metrics only; scaled by ``multi_turn.interaction_reward_weight``.

The YAML file at ``actor_rollout_ref.rollout.multi_turn.interaction_config_path`` lists
interactions in the reference's layout::

    interaction:
      - name: answer_check                  # what extra_info.interaction_kwargs.name selects
        class_name: answer_check            # a registered name, or a dotted path to a class
        config: {max_attempts: 3}           # keyword arguments of the class

A sample picks its interaction with ``extra_info["interaction_kwargs"]["name"]`` (optional when
one interaction is configured); samples without ``interaction_kwargs`` run with tools only.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = [
    "INTERACTIONS",
    "AnswerCheckInteraction",
    "Interaction",
    "call_all",
    "fold_turn_scores",
    "load_interaction_config",
    "register_interaction",
    "turn_score_tensor",
]

INTERACTION_REWARD_MODES = ("per_turn", "final", "none")


def _resolve(value: Any) -> Any:
    """The value of a method that may be a coroutine function (the reference's are async)."""
    if inspect.isawaitable(value):
        return asyncio.run(value)
    return value


class Interaction:
    """One kind of environment (see the module docstring). Subclasses implement :meth:`generate_response`."""

    def __init__(self, name: str = "interaction", **config: Any) -> None:
        self.name = name
        self.config = dict(config)

    def start_interaction(self, instance_id: str, **kwargs: Any) -> str | None:
        """Reset for conversation ``instance_id`` with the sample's ``interaction_kwargs``."""
        return None

    def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Judge the model's last turn: ``(done, next user turn, reward, extra)``."""
        raise NotImplementedError  # abstract: an interaction subclass writes generate_response()

    def finalize_interaction(self, instance_id: str) -> None:
        """Drop the state of conversation ``instance_id``."""


class AnswerCheckInteraction(Interaction):
    """Checks the model's answer against ``interaction_kwargs["ground_truth"]`` with a rule-based
    scorer (``verl.rewards``); a wrong answer gets ``retry_message`` as the next user turn until
    ``max_attempts`` answers were given. Reward per turn: the scorer's score (``correct_reward``
    when it says right, ``wrong_reward`` otherwise).

    Args:
        scorer: a registered data source of ``verl.rewards`` (``verl/arithmetic``, ``openai/gsm8k``...).
        max_attempts: answers the model may give; the last one ends the conversation either way.
        retry_message: the user turn after a wrong answer.
    """

    def __init__(
        self,
        name: str = "answer_check",
        *,
        scorer: str = "verl/arithmetic",
        max_attempts: int = 2,
        retry_message: str = "Your answer is incorrect. Check your work and answer again.",
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
    ) -> None:
        super().__init__(name)
        from verl.rewards import get_scorer

        if int(max_attempts) < 1:
            raise ValueError(f"AnswerCheckInteraction: max_attempts={max_attempts} must be >= 1")
        self.score_fn = get_scorer(scorer)  # ValueError listing the known sources
        self.max_attempts = int(max_attempts)
        self.retry_message = str(retry_message)
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self._attempts: dict[str, int] = {}
        self._truth: dict[str, Any] = {}
        self._lock = threading.Lock()

    def start_interaction(self, instance_id: str, **kwargs: Any) -> str | None:
        if "ground_truth" not in kwargs:
            raise ValueError(
                f"AnswerCheckInteraction: interaction_kwargs has no 'ground_truth' (keys: {sorted(kwargs)}); "
                "write it into each sample's extra_info.interaction_kwargs"
            )
        with self._lock:
            self._attempts[instance_id] = 0
            self._truth[instance_id] = kwargs["ground_truth"]
        return None

    def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        with self._lock:
            self._attempts[instance_id] += 1
            attempt, truth = self._attempts[instance_id], self._truth[instance_id]
        answer = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
        result = self.score_fn(answer, truth)
        score = float(result["score"] if isinstance(result, Mapping) else result)
        correct = score > 0
        reward = self.correct_reward if correct else self.wrong_reward
        if correct or attempt >= self.max_attempts:
            return True, "", reward, {"attempts": attempt, "correct": correct}
        return False, self.retry_message, reward, {"attempts": attempt, "correct": False}

    def finalize_interaction(self, instance_id: str) -> None:
        with self._lock:
            self._attempts.pop(instance_id, None)
            self._truth.pop(instance_id, None)


INTERACTIONS: dict[str, type[Interaction]] = {"answer_check": AnswerCheckInteraction}
"""Built-in interactions by the short name a config's ``class_name`` may use."""


def register_interaction(name: str, cls: type[Interaction]) -> None:
    """Make ``cls`` available as ``class_name: <name>`` in interaction configs."""
    INTERACTIONS[name] = cls


def load_interaction_config(path: str) -> dict[str, Interaction]:
    """The interactions of the YAML file ``path`` by name (see the module docstring)."""
    from verl.tools.base import _import_object, read_yaml_list

    where = f"interaction config {path}"
    entries = read_yaml_list(path, "interaction", where, "actor_rollout_ref.rollout.multi_turn.interaction_config_path")
    if not entries:
        raise ValueError(f"{where}: the 'interaction' list is empty")
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(entries):
        at = f"{where}, interaction[{i}]"
        if not isinstance(entry, Mapping) or "class_name" not in entry:
            raise ValueError(f"{at}: each interaction is a mapping with class_name (and optional name, config)")
        unknown = set(entry) - {"name", "class_name", "config"}
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {sorted(unknown)}; an interaction has name, class_name, config")
        class_name = str(entry["class_name"])
        cls = INTERACTIONS.get(class_name) or _import_object(class_name, at)
        name = str(entry.get("name") or class_name.rpartition(".")[2])
        if name in out:
            raise ValueError(f"{at}: a second interaction named {name!r}; names must be distinct")
        config = dict(entry.get("config") or {})
        try:
            obj = cls(name=name, **config) if _takes_name(cls) else cls(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{at}: {class_name}(**config) failed: {exc}; check its config keys") from exc
        if not all(callable(getattr(obj, m, None)) for m in ("start_interaction", "generate_response")):
            raise ValueError(f"{at}: {class_name} has no start_interaction/generate_response methods")
        obj.name = name
        out[name] = obj
    return out


def _takes_name(cls: Any) -> bool:
    """Our interactions take ``name=`` and keyword config; the reference's take one ``config`` dict."""
    if inspect.isclass(cls) and issubclass(cls, Interaction):
        return True
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return True
    return "name" in params


def pick_interaction(interactions: Mapping[str, Any], kwargs: Mapping[str, Any] | None) -> Any | None:
    """The interaction a sample's ``interaction_kwargs`` selects (None: the sample has none)."""
    if kwargs is None:
        return None
    if not interactions:
        raise ValueError(
            "a sample has extra_info.interaction_kwargs but no interaction is configured; set "
            "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
        )
    name = kwargs.get("name")
    if name is None:
        if len(interactions) == 1:
            return next(iter(interactions.values()))
        raise ValueError(
            f"extra_info.interaction_kwargs has no 'name' and {len(interactions)} interactions are configured "
            f"({sorted(interactions)}); name one"
        )
    if name not in interactions:
        raise ValueError(f"extra_info.interaction_kwargs.name={name!r} is not configured (known: {sorted(interactions)})")
    return interactions[name]


def turn_score_tensor(
    turn_scores: Sequence[Sequence[tuple[int, float]]],
    last_sampled: Sequence[int],
    *,
    response_length: int,
    mode: str,
    weight: float,
) -> torch.Tensor:
    """``interaction_scores`` [B, R]: each sample's ``(position, reward)`` pairs placed as ``mode``
    says (see the module docstring), times ``weight``; ``last_sampled[i]``: the response position
    of sample i's last sampled token (-1: none)."""
    if mode not in INTERACTION_REWARD_MODES:
        raise ValueError(f"interaction_reward={mode!r}; one of {INTERACTION_REWARD_MODES}")
    out = torch.zeros((len(turn_scores), response_length), dtype=torch.float32)
    if mode == "none":
        return out
    for i, pairs in enumerate(turn_scores):
        for pos, reward in pairs:
            where = pos if mode == "per_turn" else last_sampled[i]
            if where >= 0:
                out[i, where] += float(reward) * float(weight)
    return out


def fold_turn_scores(batch: Any, scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """``scores`` (the reward step's ``token_level_scores``) plus the batch's ``interaction_scores``
    when it has them (an agent rollout with interactions); metrics ``reward/interaction/mean``.
    Then the rows of one split agent-program episode (``agent_episode``) get the episode's reward:
    each earlier trajectory's row has its last row's total at its own last sampled token, and nothing
    else (:func:`share_episode_rewards`)."""
    more: dict[str, float] = {}
    if "interaction_scores" in batch:
        extra = batch["interaction_scores"].to(device=scores.device, dtype=scores.dtype)
        if extra.shape != scores.shape:
            raise ValueError(f"interaction_scores {tuple(extra.shape)} and token_level_scores {tuple(scores.shape)} differ")
        scores = scores + extra
        more["reward/interaction/mean"] = float(extra.sum(-1).mean())
    if "agent_episode" in batch and "agent_trajectory" in batch:
        scores = share_episode_rewards(scores, batch["response_mask"], batch["agent_episode"], batch["agent_trajectory"])
    return scores, more


def share_episode_rewards(scores: torch.Tensor, response_mask: torch.Tensor, episode: Any, within: Any) -> torch.Tensor:
    """``scores`` [B, R] with every row of an episode of several rows (same ``episode`` id) scored
    as the episode: its last trajectory's row (highest ``within``) keeps its scores; each other row
    gets that row's total at its own last sampled token (``response_mask`` [B, R]) and 0 elsewhere.
    Rows alone in their episode are unchanged. (A scorer reads one row's response: an earlier
    trajectory of a program that edited its history holds no answer of the episode.)"""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(episode):
        groups.setdefault(key, []).append(i)
    out = None
    for members in groups.values():
        if len(members) < 2:
            continue
        if out is None:
            out = scores.clone()
        final = max(members, key=lambda i: int(within[i]))
        total = scores[final].sum()
        for i in members:
            if i == final:
                continue
            out[i] = 0
            sampled = response_mask[i].nonzero()
            if len(sampled):
                out[i, int(sampled[-1])] = total
    return scores if out is None else out


def call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an interaction method, running it to completion when it is a coroutine function."""
    return _resolve(method(*args, **kwargs))


MAX_THREADS = 64
"""Plain (not coroutine) interaction methods of one round run in at most this many threads."""


def call_all(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...], Mapping[str, Any]]], *, return_exceptions: bool = False
) -> list[Any]:
    """``[method(*args, **kwargs) for method, args, kwargs in calls]``, concurrently: coroutine
    methods are awaited together on one event loop, plain ones run in threads (at most
    :data:`MAX_THREADS`). Results in order. After every call has finished, the first exception (in
    call order) is raised, or with ``return_exceptions`` each is returned in its call's place."""
    if not calls:
        return []

    async def gather() -> list[Any]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=min(MAX_THREADS, len(calls)), thread_name_prefix="verl-interaction") as pool:

            async def one(method: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
                if inspect.iscoroutinefunction(method):
                    return await method(*args, **kwargs)
                value = await loop.run_in_executor(pool, lambda: method(*args, **kwargs))
                return await value if inspect.isawaitable(value) else value

            return await asyncio.gather(*(one(m, a, k) for m, a, k in calls), return_exceptions=True)

    results = asyncio.run(gather())
    for value in results:
        if isinstance(value, BaseException) and not (return_exceptions and isinstance(value, Exception)):
            raise value
    return results
