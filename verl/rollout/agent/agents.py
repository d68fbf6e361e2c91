"""Custom agent loops: a conversation driver of your own, selected per sample by ``agent_name``.

The reference verl's names: a class is registered under a name with the ``register("name")``
decorator on an :class:`AgentLoopBase` subclass, or listed in the YAML file at
``actor_rollout_ref.rollout.agent.agent_loop_config_path``::

    - name: two_turn_agent                     # what extra_info.agent_name selects
      _target_: my_package.agents.TwoTurnAgent  # a dotted path to an AgentLoopBase subclass
      max_retries: 2                            # any other key: a keyword argument of the class

A sample picks its loop with ``extra_info["agent_name"]``; ``tool_agent`` (the default) and
``single_turn_agent`` are the built-in loops of :class:`verl.rollout.agent.AgentLoop`. An unknown
name is an error that lists the known ones, raised in the pre-flight when the data files name it.

A custom loop writes one conversation in :meth:`AgentLoopBase.run` (a coroutine) through the
:class:`Conversation` it is given: ``await conversation.generate()`` is one model turn (the
engine's own ids, in the loss), ``conversation.add_messages([...])`` a user or tool turn (the chat
template's rendering, tokenized as the built-in loop tokenizes tool turns, out of the loss). The
trajectory is token in, token out as the built-in loop's (docs/agents.md). All conversations of a
batch run concurrently; the model turns that are asked for together go to the engine in one call.

Agent programs (:mod:`verl.rollout.agent.endpoint`) are selected the same way: an async function
``async def run(client, sample) -> float | None`` registered with ``register_program("name")`` or
listed in the same YAML file (``{name, _target_: my_package.agents.run}``), or a command run per
sample (``{name, command: [python, my_agent.py]}``). They talk to the rollout engine through an
OpenAI-compatible endpoint instead of a :class:`Conversation`.

Departures from the reference: the reference's ``run(sampling_params, **kwargs)`` calls the
engine and builds its ``AgentLoopOutput`` itself; here the loop asks the :class:`Conversation`,
which keeps the ids, masks and log-probs, so a custom loop cannot break token-in/token-out. One
instance of a class serves every conversation (keep per-conversation state by
``conversation.instance_id``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from verl.rollout.agent.trajectory import Trajectory
from verl.rollout.agent.turns import ToolTurnEncoder
from verl.tools.base import _import_object

if TYPE_CHECKING:
    from verl.config.schema import RolloutMultiTurnConfig

__all__ = [
    "AGENT_LOOPS",
    "AGENT_PROGRAMS",
    "AgentProgram",
    "BUILTIN_AGENT_NAMES",
    "AgentLoopBase",
    "Conversation",
    "known_agent_names",
    "load_agent_loop_config",
    "register",
    "register_program",
]

BUILTIN_AGENT_NAMES = ("tool_agent", "single_turn_agent")
"""The agent loops of :class:`verl.rollout.agent.AgentLoop` itself (the reference's names)."""

AGENT_LOOPS: dict[str, type[AgentLoopBase]] = {}
"""Custom agent loops registered with :func:`register`, by name."""


AGENT_PROGRAMS: dict[str, AgentProgram] = {}
"""Agent programs registered with :func:`register_program`, by name."""


class AgentProgram:
    """A user's agent program (:mod:`verl.rollout.agent.endpoint`): an async function ``fn(client,
    sample) -> reward or None``, or a ``command`` (argument list) run once per sample."""

    def __init__(self, name: str, *, fn: Callable[..., Any] | None = None, command: Sequence[str] | None = None) -> None:
        if (fn is None) == (command is None):
            raise ValueError(f"agent program {name!r}: give exactly one of fn= (an async function) or command= (a list)")
        if fn is not None and not inspect.iscoroutinefunction(fn):
            raise ValueError(f"agent program {name!r}: {fn!r} must be `async def run(client, sample)`")
        if command is not None and (isinstance(command, str) or not command or not all(isinstance(c, str) for c in command)):
            raise ValueError(f"agent program {name!r}: command must be a non-empty list of strings, got {command!r}")
        self.name, self.fn = name, fn
        self.command = list(command) if command is not None else None


def register_program(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Function decorator: make ``async def run(client, sample)`` the agent program ``name``."""
    if name in BUILTIN_AGENT_NAMES:
        raise ValueError(f"register_program({name!r}): {name!r} is a built-in agent loop; choose another name")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        AGENT_PROGRAMS[name] = AgentProgram(name, fn=fn)
        return fn

    return decorator


class AgentLoopBase:
    """A custom agent loop (see the module docstring). Subclasses implement :meth:`run`; the YAML
    entry's keys other than ``name`` and ``_target_`` are the keyword arguments of the class."""

    def __init__(self, **config: Any) -> None:
        self.config = dict(config)

    async def run(self, conversation: Conversation) -> None:
        """Write one conversation: model turns with ``await conversation.generate()``, other turns
        with ``conversation.add_messages``; returning ends it (stop reason ``answer`` unless
        :meth:`Conversation.stop` or the budget set another)."""
        raise NotImplementedError  # abstract: an agent loop subclass writes run()


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make an :class:`AgentLoopBase` subclass the agent loop ``name``."""
    if name in BUILTIN_AGENT_NAMES:
        raise ValueError(f"register({name!r}): {name!r} is a built-in agent loop; choose another name")

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        _check_class(cls, f"register({name!r})")
        AGENT_LOOPS[name] = cls
        return cls

    return decorator


def _check_class(cls: Any, where: str) -> None:
    if not inspect.isclass(cls) or not issubclass(cls, AgentLoopBase):
        raise ValueError(f"{where}: {cls!r} is not a subclass of verl.rollout.agent.AgentLoopBase")
    if not inspect.iscoroutinefunction(cls.run) or cls.run is AgentLoopBase.run:
        raise ValueError(f"{where}: {cls.__qualname__} must define `async def run(self, conversation)`")


def known_agent_names(custom: Mapping[str, Any] | None = None) -> list[str]:
    """Every name ``extra_info.agent_name`` may take: the built-in loops, the registered ones and ``custom``."""
    return [*BUILTIN_AGENT_NAMES, *sorted(set(AGENT_LOOPS) | set(AGENT_PROGRAMS) | set(custom or {}))]


def load_agent_loop_config(path: str) -> dict[str, AgentLoopBase | AgentProgram]:
    """The agent loops of the YAML file ``path`` by name, each built with its entry's other keys
    (the reference layout: a list of ``{name, _target_, ...}``; ``agent_loops: [...]`` is also read).
    An entry whose ``_target_`` is an async function, or that has ``command`` instead, is an
    :class:`AgentProgram`."""
    import os

    import yaml

    where = f"agent loop config {path}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file (actor_rollout_ref.rollout.agent.agent_loop_config_path)")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not valid YAML ({exc})") from exc
    if isinstance(data, Mapping) and list(data) == ["agent_loops"]:
        data = data["agent_loops"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: expected a non-empty list of {{name, _target_}} entries, got {type(data).__name__}")
    out: dict[str, AgentLoopBase | AgentProgram] = {}
    for i, entry in enumerate(data):
        at = f"{where}, entry {i}"
        if not isinstance(entry, Mapping) or "name" not in entry or ("_target_" in entry) == ("command" in entry):
            raise ValueError(
                f"{at}: each entry is a mapping with name and _target_ (a dotted path to an AgentLoopBase subclass "
                "or an async agent program), or name and command (a list: an agent program run per sample)"
            )
        name = str(entry["name"])
        if name in BUILTIN_AGENT_NAMES:
            raise ValueError(f"{at}: {name!r} is a built-in agent loop; choose another name")
        if name in out:
            raise ValueError(f"{at}: a second agent loop named {name!r}; names must be distinct")
        if "command" in entry:
            try:
                out[name] = AgentProgram(name, command=entry["command"])
            except ValueError as exc:
                raise ValueError(f"{at}: {exc}") from exc
            continue
        cls = _import_object(str(entry["_target_"]), at, key="_target_", not_dotted="is not a dotted path (module.Class)")
        if inspect.iscoroutinefunction(cls):
            out[name] = AgentProgram(name, fn=cls)
            continue
        _check_class(cls, at)
        kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        try:
            out[name] = cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{at}: {entry['_target_']}(**{kwargs}) failed: {exc}; check its keys") from exc
    return out


class Conversation:
    """One conversation as a custom agent loop sees it: the sample's settings, the turns so far,
    and the two ways to extend them (:meth:`generate`, :meth:`add_messages`).

    Attributes: ``instance_id``, ``extra_info`` (the sample's), ``tools`` (the configured tools by
    name), ``tools_kwargs``, ``interaction`` and ``interaction_kwargs`` (its interaction, started
    before :meth:`AgentLoopBase.run`, or None), ``tokenizer``, ``config`` (``rollout.multi_turn``:
    its turn limits are the built-in loop's; a custom loop applies them as it sees fit).
    """

    def __init__(
        self,
        traj: Trajectory,
        ask: Callable[[Trajectory], Any],
        extra_info: Mapping[str, Any],
        *,
        tools: Mapping[str, Any],
        tokenizer: Any,
        config: RolloutMultiTurnConfig,
        encoder: ToolTurnEncoder,
        response_length: int,
    ) -> None:
        # Built by the agent loop with what the conversation reads of it; ``ask`` sends a model
        # turn's context to the loop's next engine call.
        self._traj, self._ask, self._encoder = traj, ask, encoder
        self._response_length = int(response_length)
        self._waiting = False
        self.instance_id = traj.instance_id
        self.extra_info = dict(extra_info)
        self.tools = dict(tools)
        self.tools_kwargs = traj.tools_kwargs
        self.interaction = traj.interaction
        self.interaction_kwargs = traj.interaction_kwargs
        self.tokenizer = tokenizer
        self.config = config

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's ids (with the interaction's opening turn when it returned one)."""
        return list(self._traj.prompt_ids)

    @property
    def response_ids(self) -> list[int]:
        """The response so far: sampled ids and the added turns' ids."""
        return list(self._traj.response_ids)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The turns after the dataset's prompt as text (never re-tokenized)."""
        return [dict(m) for m in self._traj.messages]

    @property
    def budget(self) -> int:
        """Response tokens left (``rollout.response_length`` minus the response so far)."""
        return self._response_length - len(self._traj.response_ids)

    @property
    def stopped(self) -> bool:
        """Whether the conversation ended (the budget, or :meth:`stop`)."""
        return bool(self._traj.stop_reason)

    async def generate(self) -> list[int]:
        """One model turn: the ids the engine sampled (appended to the response, in the loss, with
        their log-probs). A turn cut by the budget ends the conversation (stop ``length``)."""
        if self.stopped:
            raise ValueError(f"conversation {self.instance_id}: generate() after it ended ({self._traj.stop_reason})")
        if self._waiting:
            raise ValueError(f"conversation {self.instance_id}: generate() while another generate() of it is pending")
        self._waiting = True
        try:
            return list(await self._ask(self._traj))
        finally:
            self._waiting = False

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """A turn made of ``messages`` (``{"role": "user" | "tool", "content": str}``) after the
        model's last turn, then the next generation prompt: the chat template's rendering,
        tokenized on its own, out of the loss. False (and stop ``length``) when it does not fit
        with room for one more sampled token; it is then left out."""
        t = self._traj
        if self.stopped:
            raise ValueError(f"conversation {self.instance_id}: add_messages() after it ended ({t.stop_reason})")
        if not t.turns or t.turns[-1]["role"] != "assistant":
            raise ValueError(
                f"conversation {self.instance_id}: add_messages() follows a model turn (generate()); give several "
                "messages in one call instead of two calls in a row"
            )
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        if not messages:
            raise ValueError(f"conversation {self.instance_id}: add_messages() needs at least one message")
        if self._encoder.surely_over(messages, self.budget):  # left out without tokenizing all of it
            t.stop_reason = "length"
            return False
        ended = bool(t.response_ids) and t.response_ids[-1] == self._encoder.eos_token_id
        ids = self._encoder.encode(messages, model_ended_turn=ended)
        if len(ids) + 1 > self.budget:
            t.stop_reason = "length"
            return False
        t._append(ids, None, messages[0]["role"])
        t.messages.extend(messages)
        t.user_turns += 1
        return True

    def reward(self, value: float) -> None:
        """A reward for the model's last turn, at its last sampled token (``turn_scores``, folded into
        the token-level scores as ``multi_turn.interaction_reward`` says)."""
        last = max((j for j, m in enumerate(self._traj.loss_mask) if m), default=-1)
        if last < 0:
            raise ValueError(f"conversation {self.instance_id}: reward() before any model turn")
        self._traj.turn_scores.append((last, float(value)))

    def stop(self, reason: str = "answer") -> None:
        """End the conversation with ``reason`` (``agent/stop/<reason>``)."""
        self._traj.stop_reason = str(reason)
