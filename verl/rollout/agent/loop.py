"""The agent loop: multi-turn rollouts with tool calls, token in and token out.

For every sample (``n`` per prompt) a conversation runs in rounds. In each round every live
conversation's context (prompt ids + response ids so far) goes to the engine in ONE ``sample``
call (the engine batches them: vLLM schedules them together, transformers pads them into one
``generate``); then the tool calls of all conversations run at once, each in its own thread with
a timeout; then each conversation gets its tool turn and, if it is still live, goes to the next
round.

Token in, token out: a trajectory's response is exactly

    [sampled ids of model turn 1] [ids of tool turn 1] [sampled ids of model turn 2] ...

where model-turn ids are the engine's own samples (never a decode and re-encode of their text,
which a BPE merge across a turn boundary or a template that rewrites earlier turns would change)
and tool-turn ids are the chat template's rendering of the tool messages (the template's tool
role, then the generation prompt of the next model turn), tokenized on their own. Tool turns
follow a special token (the model's end of turn, or the template's end-of-turn text that the loop
adds when the model stopped otherwise), so their tokenization does not depend on what precedes.

Masks (``assemble_agent_rollout``): ``response_mask`` (the loss mask) is 1 exactly on sampled
ids; ``attention_mask`` is 1 on every response id, tool turns included; ``rollout_log_probs`` are
the engine's log-probs on sampled ids and 0 on tool ids.

A conversation stops, with ``stop_reason``:

- ``answer``: a complete model turn with no tool call (and no interaction);
- ``interaction``: the conversation's interaction ended it (``done``) after a model turn;
- ``length``: the response budget (``rollout.response_length``) is used up: a model turn cut at
  the budget, or a tool turn that does not fit with room for one more sampled token (that tool
  turn is then left out, so no trajectory ever ends in a partial tool turn);
- ``max_assistant_turns``: the model's turn number ``max_assistant_turns`` called a tool (the call
  is not run);
- ``max_user_turns``: a tool call after ``max_user_turns`` tool turns (not run).

Interactions (``verl.rollout.agent.interaction``): a conversation whose sample has
``extra_info["interaction_kwargs"]`` gets its interaction's answer after every complete model
turn with no tool call: a reward for that turn and either the end or the next user turn (the
template's user role, tokenized like a tool turn, out of the loss). User turns count against
``max_user_turns`` as tool turns do; a model turn cut by the budget is not judged. An opening
text that ``start_interaction`` returns is a user turn after the dataset's prompt, on the prompt
side of the split: the conversation's prompt ids are the dataset's prompt without its trailing
generation prompt, then the template's user turn and the generation prompt
(``ToolTurnEncoder.open_with``); the response starts at the model's first sampled token, so the
opening is never in the loss, and the batch's prompt columns hold it, left-padded to the
prompt width (``data.max_prompt_length``; a longer prompt is refused before any sampling).

Bad calls never end a run: malformed JSON, an unknown tool name, arguments the schema refuses,
a tool that raises or runs past ``tool_timeout_s``, and calls beyond ``max_parallel_calls`` in
one turn each get an ``Error: ...`` tool message, counted in ``agent/tool_errors/*``. A tool that
hangs is abandoned in its (daemon) thread; the run goes on.

Images (``verl.rollout.agent.images``): with a vision-language policy on the transformers engine a
prompt's images stay in its conversation, and a tool may answer with images (a
``ToolResponse(text=..., image=[...])``); the tool turn's ids hold each image's vision span, its
pixels join the conversation's images after the prompt's, the engine generates every later turn
with all of them, and the rollout batch's ``mm_*`` columns carry them to the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl.protocol import Batch
from verl.protocol.images import MULTI_MODAL_KEYS, PIXEL_VALUES, model_image_inputs
from verl.rollout.agent.agents import (
    AGENT_LOOPS,
    AGENT_PROGRAMS,
    BUILTIN_AGENT_NAMES,
    AgentLoopBase,
    AgentProgram,
    Conversation,
    known_agent_names,
)
from verl.rollout.agent.images import ToolImages, ToolResponse, TurnImages, row_image_columns
from verl.rollout.agent.interaction import call_all as interaction_calls
from verl.rollout.agent.interaction import pick_interaction, turn_score_tensor
from verl.rollout.agent.parser import ToolCall, tool_call_parser
from verl.rollout.agent.trajectory import CallRecord, Trajectory
from verl.rollout.agent.turns import ToolTurnEncoder
from verl.tools.base import Tool, as_tools, check_arguments
from verl.rollout.base import RolloutEngine, SamplingSpec, prompt_token_lists, sampling_spec

if TYPE_CHECKING:
    from verl.config.schema import AgentEndpointConfig, RolloutMultiTurnConfig

logger = logging.getLogger(__name__)

__all__ = ["AgentLoop", "ReplicaShare", "ToolTurnEncoder", "Trajectory", "agent_metrics", "assemble_agent_rollout"]

AGENT_NAMES = BUILTIN_AGENT_NAMES
"""The built-in per-sample ``extra_info["agent_name"]`` values (the reference verl's agent loop
names): ``tool_agent`` (the default) runs the whole loop; ``single_turn_agent`` stops after one
model turn (no tool call is read, no interaction). Other names: custom agent loops
(``verl.rollout.agent.agents``)."""

STOP_REASONS = ("answer", "interaction", "length", "max_assistant_turns", "max_user_turns")

AGENT_EPISODE = "agent_episode"
"""Column of an agent rollout: each row's episode (conversation) id; the rows of a split agent-program episode share it."""
AGENT_TRAJECTORY = "agent_trajectory"
"""Column of an agent rollout: the row's trajectory in its episode, 0, 1, ... (the episode's last has the highest)."""


@dataclass
class _Job:
    """The calls of one conversation to one tool in one round (run in order, in one thread)."""

    tool: Tool
    traj: Trajectory
    arguments: list[dict[str, Any]]
    needs_create: bool
    results: list[tuple[str | ToolResponse, bool, float] | None] = field(default_factory=list)  # (answer, error, seconds)
    started: float | None = None  # when the call now running began
    current: int = 0


class ReplicaShare:
    """The ranks of one engine replica (vLLM's TP' ranks): the first runs the tools, :meth:`share`
    gives its answers to the others (a broadcast over ``group``)."""

    def __init__(self, group: Any, src: int, *, leader: bool) -> None:
        self.group, self.src, self.leader = group, src, leader

    def share(self, obj: Any) -> Any:
        """``obj`` of the first rank, on every rank of the replica (collective)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


class _CustomLoops:
    """The custom agent loops' conversations of one :meth:`AgentLoop.run`: ``asyncio`` tasks on a
    private event loop, stepped by the run's rounds. :meth:`settle` runs them until every live one
    waits in ``Conversation.generate()`` and returns those conversations; the round samples their
    turns in the same engine call as the built-in loops' turns; :meth:`answer` hands them the ids.
    Leaving the ``with`` block cancels what still runs and closes the event loop."""

    def __init__(self, owner: AgentLoop, trajs: list[Trajectory], infos: list[Mapping[str, Any]]) -> None:
        import asyncio

        self.trajs = trajs
        self.requests: list[tuple[Trajectory, Any]] = []  # (conversation, future of its sampled ids)
        self.tasks: list[Any] = []
        self.loop = asyncio.new_event_loop() if trajs else None
        if self.loop is None:
            return
        self.wake = asyncio.Event()
        for t, info in zip(trajs, infos):
            conversation = Conversation(
                t, self._ask, info, tools=owner.tools, tokenizer=owner.tokenizer, config=owner.cfg, encoder=owner.encoder,
                response_length=owner.response_length,
            )
            task = self.loop.create_task(owner.agent_loops[t.agent_name].run(conversation))
            task.add_done_callback(lambda _: self.wake.set())
            self.tasks.append(task)

    def _ask(self, t: Trajectory) -> Any:
        future = self.loop.create_future()
        self.requests.append((t, future))
        self.wake.set()
        return future

    async def _until_all_wait(self) -> None:
        while True:
            for task in self.tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            if len(self.requests) == sum(not task.done() for task in self.tasks):
                return
            self.wake.clear()
            await self.wake.wait()

    def settle(self) -> list[Trajectory]:
        """Run the conversations until each live one waits for a model turn; those conversations."""
        if self.loop is None:
            return []
        self.loop.run_until_complete(self._until_all_wait())
        return [t for t, _ in self.requests]

    def answer(self, sampled: list[list[int]]) -> None:
        """The sampled ids of the turns :meth:`settle` returned, in its order."""
        batch, self.requests = self.requests, []
        for (_, future), ids in zip(batch, sampled):
            future.set_result(ids)

    def __enter__(self) -> _CustomLoops:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.loop is None:
            return
        import asyncio

        try:
            for task in self.tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*self.tasks, return_exceptions=True))
        finally:
            self.loop.close()
        if exc_type is None:
            for t in self.trajs:
                t.stop_reason = t.stop_reason or "answer"


def _opening_text(value: Any, t: Trajectory) -> str | None:
    """The opening text ``start_interaction`` returned for ``t``, or None. The reference verl's
    ``start_interaction`` returns the instance id it was given; that is not an opening."""
    if value is None or value == "" or value == t.instance_id:
        return None
    if not isinstance(value, str):
        raise ValueError(
            f"interaction {getattr(t.interaction, 'name', t.interaction)!r}: start_interaction returned "
            f"{type(value).__name__} {value!r:.100}; return the opening text (str) or None"
        )
    return value


def _round_seed(seed: int | None, rnd: int) -> int | None:
    """Each round of a seeded call draws from its own stream (same seed -> same conversations)."""
    return None if seed is None else (int(seed) * 1_000_003 + rnd) % (2**31 - 1)


class AgentLoop:
    """Runs conversations against a rollout engine (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.rollout.multi_turn``.
        tools: the tools offered (Tool objects or plain functions); names distinct.
        tokenizer: the policy's tokenizer (its chat template renders tool turns).
        response_length: the response budget of a whole conversation (``rollout.response_length``).
        interactions: the interactions by name (``multi_turn.interaction_config_path``), picked
            per sample by ``interaction_kwargs["name"]``.
        agent_loops: custom agent loops and agent programs by name
            (``rollout.agent.agent_loop_config_path``); the classes registered with
            ``verl.rollout.agent.register`` (functions with ``register_program``) are found by name too.
        endpoint: ``rollout.agent.endpoint``, the settings of the endpoint agent programs talk to
            (``verl.rollout.agent.endpoint``); None: its defaults.
    """

    def __init__(
        self,
        cfg: RolloutMultiTurnConfig,
        tools: Sequence[Any],
        tokenizer: Any,
        *,
        response_length: int,
        interactions: Mapping[str, Any] | None = None,
        agent_loops: Mapping[str, AgentLoopBase | AgentProgram] | None = None,
        endpoint: AgentEndpointConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.tools = {t.name: t for t in as_tools(list(tools))}
        self.tokenizer = tokenizer
        self.encoder = ToolTurnEncoder(tokenizer)
        # multi_turn.format (auto: the template family's syntax); parsers read the offered tools' schemas.
        self.format, parse = tool_call_parser(cfg.format, template_format=self.encoder.report.tool_format)
        self.parse = lambda text: parse(text, {name: tool.schema for name, tool in self.tools.items()})
        self.response_length = int(response_length)
        self.interactions = dict(interactions or {})
        loops = dict(agent_loops or {})
        self.agent_loops: dict[str, AgentLoopBase] = {k: v for k, v in loops.items() if not isinstance(v, AgentProgram)}
        self.programs: dict[str, AgentProgram] = {k: v for k, v in loops.items() if isinstance(v, AgentProgram)}
        if endpoint is None:
            from verl.config.schema import AgentEndpointConfig

            endpoint = AgentEndpointConfig()
        self.endpoint_cfg = endpoint
        self.last_episodes: list[Any] = []
        """The agent programs' episodes of the last :meth:`run` (``verl.rollout.agent.endpoint.Episode``)."""
        self.last_engine_calls = 0
        self.last_metrics: dict[str, float] = {}
        self.last_rows_per_prompt: list[int] = []
        """Rows of the last :meth:`generate`'s batch per prompt row: ``n``, more where an agent
        program's episode was split (each of its trajectories a row in training)."""
        self.default_agent_loop: str | None = None
        """``rollout.agent.default_agent_loop``: the agent of samples whose extra_info names none."""
        self.lockstep: Any = None
        """The group of ranks whose engines must sample together (vLLM's data-parallel replicas):
        agent programs' engine calls then run in rounds across it (``verl.rollout.agent.endpoint``)."""
        self.replica: ReplicaShare | None = None
        """Set when several ranks drive one engine (vLLM tensor parallel): tools run on its first rank."""
        self.vision: ToolImages | None = None
        """The policy's image processor for tool images; None: built from the engine's model directory
        when the engine runs a vision-language model (``HFRollout.image_token_id``)."""
        self._vision: ToolImages | None = None  # of the engine of the current run(); None: a text policy

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's ``tools=`` when prompts are rendered."""
        return [t.schema for t in self.tools.values()]

    # ------------------------------------------------------------------ the conversations
    def _check_tools_kwargs(self, names: Sequence[str], tools_kwargs: Sequence[Mapping[str, Any] | None] | None) -> None:
        """Before anything runs: every tool a prompt's ``extra_info.tools_kwargs`` names is offered,
        and a ``tool_agent`` conversation has a tool or an interaction to go beyond one turn."""
        for i, kwargs in enumerate(tools_kwargs or ()):
            unknown = sorted(str(k) for k, v in (kwargs or {}).items() if v is not None and k not in self.tools)
            if unknown:
                raise ValueError(
                    f"rollout: extra_info.tools_kwargs of prompt {i} names the tool(s) {unknown}, which are not "
                    f"configured (tools: {sorted(self.tools) or 'none'}); add them "
                    "(actor_rollout_ref.rollout.multi_turn.tool_config_path or RolloutOperator(tools=...)) or fix the "
                    "names in the data"
                )
        if not self.tools and not self.interactions and "tool_agent" in names:
            raise ValueError(
                "rollout: actor_rollout_ref.rollout.multi_turn.enable=true, but no tool or interaction is configured: "
                "the agent loop would sample one plain response per prompt. Give tools "
                "(actor_rollout_ref.rollout.multi_turn.tool_config_path or RolloutOperator(tools=...)), an interaction "
                "(multi_turn.interaction_config_path) or an agent loop (extra_info.agent_name), or set "
                "multi_turn.enable=false"
            )

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[Sequence[int]],
        spec: SamplingSpec,
        *,
        seed: int | None = None,
        tools_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
        interaction_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
        agent_names: Sequence[str | None] | None = None,
        prompt_width: int | None = None,
        extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
        samples: Sequence[Mapping[str, Any] | None] | None = None,
        images: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> list[Trajectory]:
        """``len(prompts) * spec.n`` conversations (prompt-major) from unpadded prompt ids.

        ``spec.max_tokens`` is ignored: the budget is ``response_length`` for a whole
        conversation. ``tools_kwargs``: one mapping per prompt (or None) of per-tool settings;
        ``interaction_kwargs``: one per prompt (or None: no interaction for it); ``agent_names``:
        one per prompt (:data:`AGENT_NAMES` or a custom loop's; None: ``tool_agent``);
        ``extra_infos``: each prompt's ``extra_info`` (what a custom loop sees). ``prompt_width``: the
        longest prompt the batch holds (``data.max_prompt_length``); a prompt that an
        interaction's opening turn makes longer is refused before anything is sampled.
        ``samples``: each prompt's row for an agent program (``messages``, the prompt's chat messages,
        and ``data_source``, ``reward_model``, ``extra_info``: :func:`~verl.rollout.agent.endpoint.program_sample`);
        needed when a prompt's agent is a program, whose episodes run through the agent endpoint.
        ``images``: each prompt's images (``pixel_values`` [p, D], ``image_grid_thw`` [k, 3]) or None, for
        a vision-language policy; every conversation of the prompt starts with them.
        """

        if tools_kwargs is not None and len(tools_kwargs) != len(prompts):
            raise ValueError(f"AgentLoop.run: {len(tools_kwargs)} tools_kwargs for {len(prompts)} prompts")
        if interaction_kwargs is not None and len(interaction_kwargs) != len(prompts):
            raise ValueError(f"AgentLoop.run: {len(interaction_kwargs)} interaction_kwargs for {len(prompts)} prompts")
        if agent_names is not None and len(agent_names) != len(prompts):
            raise ValueError(f"AgentLoop.run: {len(agent_names)} agent_names for {len(prompts)} prompts")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"AgentLoop.run: {len(images)} image entries for {len(prompts)} prompts")
        names = [(agent_names[i] if agent_names is not None else None) or "tool_agent" for i in range(len(prompts))]
        for i, name in enumerate(names):
            self._agent_loop(name, i)  # every name is known before anything runs
        self._check_tools_kwargs(names, tools_kwargs)
        self.encoder.follow_prompts(prompts)  # Qwen3: tool turns in the prompts' thinking mode
        picked = [
            None if names[i] == "single_turn_agent" else pick_interaction(self.interactions, interaction_kwargs[i] if interaction_kwargs is not None else None)
            for i in range(len(prompts))
        ]
        tag = uuid.uuid4().hex[:8]
        trajs = [
            Trajectory(
                prompt_ids=list(p),
                instance_id=f"{tag}-{i}-{k}",
                tools_kwargs=dict((tools_kwargs[i] if tools_kwargs is not None else None) or {}),
                agent_name=names[i],
                interaction=picked[i],
                interaction_kwargs=dict((interaction_kwargs[i] if picked[i] is not None else None) or {}),
                images=[images[i]] if images is not None and images[i] is not None else [],
            )
            for i, p in enumerate(prompts)
            for k in range(spec.n)
        ]
        created: set[tuple[str, str]] = set()
        self._vision = self._vision_for(engine)
        active = [t for t in trajs if t.agent_name in AGENT_NAMES]
        programs = [i for i, t in enumerate(trajs) if self._program(t.agent_name) is not None]
        custom = [(t, i) for i, t in enumerate(trajs) if t.agent_name not in AGENT_NAMES and i not in set(programs)]
        talking = [t for t in trajs if t.interaction is not None]
        runs_env = self.replica is None or self.replica.leader
        try:
            self._open(talking, prompt_width, leader=runs_env)
            infos = [((extra_infos[i // spec.n] if extra_infos is not None else None) or {}) for _, i in custom]
            with _CustomLoops(self, [t for t, _ in custom], infos) as loops:
                for rnd in itertools.count():
                    waiting = loops.settle()  # the custom loops' conversations that ask for a model turn
                    if not active and not waiting:
                        break
                    # One engine call for the built-in and the custom loops' model turns of this round.
                    got = self._sample_turns(engine, active + waiting, spec, seed=_round_seed(seed, rnd))
                    loops.answer(got[len(active) :])
                    self._tool_turns(self._model_turns(active, got[: len(active)]), created)
                    active = [t for t in active if not t.stop_reason]
            self.last_episodes = []
            if programs:
                self._run_programs(engine, trajs, programs, samples, spec, seed=seed, prompt_width=prompt_width, tag=tag)
        finally:
            self._release(created)
            if runs_env:
                self._finalize(talking)
        return trajs

    def _vision_for(self, engine: RolloutEngine) -> ToolImages | None:
        """The policy's image processor when ``engine`` runs a vision-language model and generates with
        images (built once from its model directory); None otherwise."""
        if getattr(engine, "image_token_id", None) is None or not hasattr(engine, "with_images"):
            return None
        if self.vision is None:
            from verl.data.vlm import ImagePromptEncoder

            self.vision = ToolImages(ImagePromptEncoder.from_pretrained(engine.model_path, tokenizer=self.tokenizer))
        return self.vision

    def _agent_loop(self, name: str, prompt: int) -> AgentLoopBase | None:
        """The custom loop ``name`` (None for a built-in one); a registered class is built on first use."""
        if name in AGENT_NAMES or self._program(name) is not None:
            return None
        if name not in self.agent_loops and name in AGENT_LOOPS:
            self.agent_loops[name] = AGENT_LOOPS[name]()
        if name not in self.agent_loops:
            raise ValueError(
                f"extra_info.agent_name={name!r} (prompt {prompt}) is not an agent loop here; known: "
                f"{known_agent_names(self.agent_loops)} (register one with verl.rollout.agent.register or list it in "
                "actor_rollout_ref.rollout.agent.agent_loop_config_path)"
            )
        return self.agent_loops[name]

    def _program(self, name: str) -> AgentProgram | None:
        """The agent program ``name`` (listed in the config, or registered), or None."""
        return self.programs.get(name) or (AGENT_PROGRAMS.get(name) if name not in self.agent_loops else None)

    def _run_programs(
        self, engine: RolloutEngine, trajs: list[Trajectory], rows: list[int], samples: Sequence[Mapping[str, Any] | None] | None,
        spec: SamplingSpec, *, seed: int | None, prompt_width: int | None, tag: str,
    ) -> None:
        """The agent programs' episodes through one agent endpoint (``verl.rollout.agent.endpoint``);
        each row's trajectory becomes its episode's last one (an empty response when it was dropped),
        the episode's earlier ones (a split episode's) in its :attr:`Trajectory.earlier`."""
        from verl.rollout.agent.endpoint import AgentEndpoint, program_sample

        if self.replica is not None:
            raise ValueError(
                "agent programs (extra_info.agent_name) need one engine per rank: set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
            )
        name = self.endpoint_cfg.model_name
        given = []
        for i in rows:
            row = samples[i // spec.n] if samples is not None else None
            if not row or not row.get("messages"):
                raise ValueError(
                    f"agent program {trajs[i].agent_name!r} (prompt {i // spec.n}): the prompt's chat messages are "
                    "missing; set data.return_raw_chat=true so the batch carries them (raw_prompt)"
                )
            given.append(program_sample(i, row["messages"], name, row))
        endpoint = AgentEndpoint(
            engine, self.tokenizer, self.endpoint_cfg, dataclasses.replace(spec, n=1),
            response_length=self.response_length, prompt_width=prompt_width or max(len(trajs[i].prompt_ids) for i in rows),
            encoder=self.encoder, lockstep=self.lockstep,
        )
        episodes = endpoint.run(given, [trajs[i].prompt_ids for i in rows],
                                [self._program(trajs[i].agent_name) for i in rows], seed=seed, tag=tag)
        self.last_episodes = episodes
        self.last_engine_calls = endpoint.engine_calls
        for i, ep in zip(rows, episodes):
            t = trajs[i]
            if ep.state == "done" and ep.segments:
                for seg in ep.segments:
                    seg.own_prompt = seg.prompt_ids != t.prompt_ids
                *earlier, last = ep.segments
                for seg in earlier:
                    seg.stop_reason = "split"
                last.earlier = earlier
                last.stop_reason = last.stop_reason or "answer"
                sampled = [j for j, m in enumerate(last.loss_mask) if m]
                if ep.reward is not None and sampled:
                    last.turn_scores.append((sampled[-1], ep.reward))
                trajs[i] = last
            else:
                t.stop_reason = "dropped" if ep.state == "dropped" else "no_request"

    def _open(self, talking: list[Trajectory], prompt_width: int | None, *, leader: bool) -> None:
        """Start each conversation's interaction; an opening text it returns becomes a user turn
        at the end of the conversation's prompt ids (:meth:`ToolTurnEncoder.open_with`). In a
        replica of several ranks the first rank starts the interactions and shares the texts."""
        openings: list[str | None] = [None] * len(talking)
        if leader:  # all conversations' interactions start concurrently
            got = interaction_calls([(t.interaction.start_interaction, (t.instance_id,), t.interaction_kwargs) for t in talking])
            openings = [_opening_text(value, t) for value, t in zip(got, talking)]
        if self.replica is not None and talking:
            openings = self.replica.share(openings)
        for t, text in zip(talking, openings):
            if text is None:
                continue
            t.prompt_ids = self.encoder.open_with(t.prompt_ids, text)
            t.opening = text
            t.messages.append({"role": "user", "content": text})
            if prompt_width is not None and len(t.prompt_ids) > prompt_width:
                raise ValueError(
                    f"interaction {t.interaction.name!r}: the prompt with its opening turn is {len(t.prompt_ids)} "
                    f"tokens, more than data.max_prompt_length={prompt_width}; raise data.max_prompt_length or "
                    "shorten the opening text"
                )

    def _finalize(self, talking: list[Trajectory]) -> None:
        talking = [t for t in talking if callable(getattr(t.interaction, "finalize_interaction", None))]  # optional
        done = interaction_calls([(t.interaction.finalize_interaction, (t.instance_id,), {}) for t in talking], return_exceptions=True)
        for t, value in zip(talking, done):
            if isinstance(value, Exception):  # a failed clean-up must not lose the rollout
                logger.error("finalizing interaction %s of conversation %s failed: %r", t.interaction.name, t.instance_id, value)

    def _model_turns(self, active: list[Trajectory], sampled: list[list[int]]) -> list[tuple[Trajectory, list[ToolCall] | None, bool]]:
        """Read the model turn every live conversation just had (``sampled``, already appended by
        :meth:`_sample_turns`); returns those that called tools (with their calls) or await their
        interaction's answer (calls None)."""
        pending = []
        for t, ids in zip(active, sampled):
            if t.stop_reason:
                continue
            if t.agent_name == "single_turn_agent":
                t.stop_reason = "answer"
                continue
            calls = self.parse(self.tokenizer.decode(ids, skip_special_tokens=False))
            if not calls and t.interaction is not None:
                pending.append((t, None, bool(ids) and ids[-1] == self.encoder.eos_token_id))
            elif not calls:
                t.stop_reason = "answer"
            elif self.cfg.max_assistant_turns is not None and t.assistant_turns >= self.cfg.max_assistant_turns:
                t.stop_reason = "max_assistant_turns"
            elif self.cfg.max_user_turns is not None and t.user_turns >= self.cfg.max_user_turns:
                t.stop_reason = "max_user_turns"
            elif self.response_length - len(t.response_ids) < 2:
                t.stop_reason = "length"  # no room for a tool turn and a sampled token after it
            else:
                ended = bool(ids) and ids[-1] == self.encoder.eos_token_id
                pending.append((t, calls, ended))
        return pending

    def _sample_turns(
        self, engine: RolloutEngine, trajs: list[Trajectory], spec: SamplingSpec, *, seed: int | None
    ) -> list[list[int]]:
        """One model turn of each conversation in ONE engine call: its sampled ids, appended (in the
        loss, with log-probs); a turn cut by the budget sets stop ``length``."""
        budgets = [self.response_length - len(t.response_ids) for t in trajs]
        # One call for all: a conversation with less budget than the call's keeps the prefix of
        # its sample that fits (the engine draws token k without regard to max_tokens, so the
        # prefix is exactly what a call with its own budget would have sampled from that stream).
        call = dataclasses.replace(spec, n=1, max_tokens=max(budgets))
        contexts = [t.prompt_ids + t.response_ids for t in trajs]
        if any(t.images for t in trajs):
            if not hasattr(engine, "with_images"):
                raise ValueError(
                    f"rollout: the agent loop's conversations hold images, but the {type(engine).__name__} engine takes "
                    "token ids only here; use actor_rollout_ref.rollout.name=hf for a vision-language policy"
                )
            with engine.with_images(row_image_columns([t.images for t in trajs])):  # one row per context (n=1)
                samples = engine.sample(contexts, call, seed=seed)
        else:
            samples = engine.sample(contexts, call, seed=seed)
        out = []
        for t, s, budget in zip(trajs, samples, budgets):
            ids, lps = list(s.token_ids[:budget]), s.logprobs[:budget]
            t._append(ids, lps, "assistant")
            t.assistant_turns += 1
            t.messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
            if len(s.token_ids) > budget or s.hit_length_limit:
                t.stop_reason = "length"
            out.append(ids)
        return out

    def _tool_turns(
        self, pending: list[tuple[Trajectory, list[ToolCall] | None, bool]], created: set[tuple[str, str]]
    ) -> None:
        """Run every pending call (concurrently), then append each conversation's tool turn.

        In a replica of several ranks (:attr:`replica`) only its first rank runs the tools; the
        answers reach the others, so every rank gives the engine the same contexts (vLLM's
        tensor-parallel ranks must) even where a tool is not deterministic (a timeout, a clock).
        """
        calling = [p for p in pending if p[1] is not None]
        talking = [p for p in pending if p[1] is None]
        answers = replies = None
        if self.replica is None or self.replica.leader:
            # Each answer cut before it is shared or tokenized whole (a tool may return megabytes).
            answers = [
                [(self._cut(answer, self.response_length - len(t.response_ids)), record) for answer, record in out]
                for (t, _, _), out in zip(calling, self._answers(calling, created))
            ]
            replies = self._replies(talking)
        if self.replica is not None:
            answers, replies = self.replica.share((answers, replies))
        for (t, _, ended), out in zip(calling, answers):
            messages, images = self._tool_messages(out)
            for _, record in out:
                t.calls.append(record)
            pads = [n for got in images for n in got.pads]
            expand = functools.partial(self._vision.expand, pads=pads) if pads else None
            ids = self.encoder.encode(messages, model_ended_turn=ended, expand=expand)
            if len(ids) + 1 > self.response_length - len(t.response_ids):
                t.stop_reason = "length"
                continue
            t._append(ids, None, "tool")
            t.images.extend((got.pixel_values, got.image_grid_thw) for got in images)
            t.turns[-1]["calls"] = [record.name for _, record in out]
            t.messages.extend(messages)
            t.user_turns += 1
        for (t, _, ended), (done, text, reward) in zip(talking, replies):
            t.turn_scores.append((t.turns[-1]["end"] - 1, float(reward)))
            if done:
                t.stop_reason = "interaction"
                continue
            if self.cfg.max_assistant_turns is not None and t.assistant_turns >= self.cfg.max_assistant_turns:
                t.stop_reason = "max_assistant_turns"
                continue
            if self.cfg.max_user_turns is not None and t.user_turns >= self.cfg.max_user_turns:
                t.stop_reason = "max_user_turns"
                continue
            message = {"role": "user", "content": text}
            room = self.response_length - len(t.response_ids)
            if self.encoder.surely_over([message], room):  # left out without tokenizing all of it
                t.stop_reason = "length"
                continue
            ids = self.encoder.encode([message], model_ended_turn=ended)
            if len(ids) + 1 > room:
                t.stop_reason = "length"
                continue
            t._append(ids, None, "user")
            t.messages.append(message)
            t.user_turns += 1

    def _cut(self, answer: str | ToolResponse, room: int) -> str | ToolResponse:
        """:meth:`_truncate` of an answer's text (a :class:`ToolResponse` keeps its images)."""
        if isinstance(answer, ToolResponse):
            return dataclasses.replace(answer, text=self._truncate(answer.text, room))
        return self._truncate(answer, room)

    def _tool_messages(self, out: list[tuple[str | ToolResponse, CallRecord]]) -> tuple[list[dict[str, Any]], list[TurnImages]]:
        """The tool messages of one turn's answers and their images, in order. An image that cannot be
        read or is over the pixel budget, or a VLM's answer whose text spells a vision token, makes its
        answer an error message (the record marks the error)."""
        messages: list[dict[str, Any]] = []
        images: list[TurnImages] = []
        for answer, record in out:
            text = answer.text if isinstance(answer, ToolResponse) else answer
            vision_text = self._vision.vision_tokens_in(text) if self._vision is not None else None
            if vision_text:  # would be image slots without images in the trained row
                record.error = True
                messages.append({"role": "tool", "content": f"Error: the answer of tool {record.name!r} holds the "
                                 f"vision token text {vision_text}; a tool returns images as ToolResponse(image=[...])"})
                continue
            if not isinstance(answer, ToolResponse) or not answer.image:
                messages.append({"role": "tool", "content": text})
                continue
            if self._vision is None:
                raise ValueError(
                    f"tool {record.name!r} answered with {len(answer.image)} image(s), but the policy is not a "
                    "vision-language model run by an engine that takes images (actor_rollout_ref.rollout.name=hf); "
                    "return text from the tool or train a VLM"
                )
            try:
                got = self._vision.prepare(answer.image, where=f"tool {record.name!r}")
            except ValueError as exc:  # the tool's bad image is the model's error turn, like a raising tool
                record.error = True
                messages.append({"role": "tool", "content": f"Error: {exc}"})
                continue
            images.append(got)
            messages.append(ToolImages.message(answer.text, len(answer.image)))
        return messages, images

    def _replies(self, talking: list[tuple[Trajectory, list[ToolCall] | None, bool]]) -> list[tuple[bool, str, float]]:
        """Each conversation's interaction answer to its last model turn: (done, next user turn, reward)."""
        out = []
        got = interaction_calls(  # every conversation's interaction answers at once
            [(t.interaction.generate_response, (t.instance_id, [dict(m) for m in t.messages]), t.interaction_kwargs) for t, _, _ in talking]
        )
        for (t, _, _), reply in zip(talking, got):
            if not (isinstance(reply, tuple) and len(reply) in (3, 4)):
                raise ValueError(
                    f"interaction {t.interaction.name!r}: generate_response must return (done, text, reward[, extra]), "
                    f"got {reply!r:.200}"
                )
            out.append((bool(reply[0]), str(reply[1] or ""), float(reply[2] or 0.0)))
        return out

    def _answers(
        self, pending: list[tuple[Trajectory, list[ToolCall] | None, bool]], created: set[tuple[str, str]]
    ) -> list[list[tuple[str | ToolResponse, CallRecord]]]:
        """Each pending conversation's answers, one (text or ToolResponse, record) per call, in call order."""
        answers: list[list[tuple[str, CallRecord] | None]] = []
        jobs: list[_Job] = []
        where: list[list[tuple[_Job, int] | None]] = []
        for t, calls, _ in pending:
            out: list[tuple[str, CallRecord] | None] = []
            slots: list[tuple[_Job, int] | None] = []
            by_tool: dict[str, _Job] = {}
            for k, c in enumerate(calls):
                refused = self._refusal(c, k)
                if refused is not None:
                    out.append(refused)
                    slots.append(None)
                    continue
                tool = self.tools[c.name]
                job = by_tool.get(tool.name)
                if job is None:
                    key = (tool.name, t.instance_id)
                    job = by_tool[tool.name] = _Job(tool=tool, traj=t, arguments=[], needs_create=key not in created)
                    created.add(key)
                    jobs.append(job)
                job.arguments.append(c.arguments)
                out.append(None)
                slots.append((job, len(job.arguments) - 1))
            answers.append(out)
            where.append(slots)
        self._execute(jobs)
        for out, slots in zip(answers, where):
            for k, slot in enumerate(slots):
                if slot is not None:
                    job, i = slot
                    text, error, seconds = job.results[i]
                    out[k] = (text, CallRecord(name=job.tool.name, error=error, seconds=seconds))
        return answers  # type: ignore[return-value]  # every slot is filled now

    def _refusal(self, call: ToolCall, k: int) -> tuple[str, CallRecord] | None:
        """The error turn of a call that is not run (unreadable, unknown tool, over the per-turn limit)."""
        if call.error is not None and call.name is None:
            return f"Error: {call.error}", CallRecord(name="bad_format", error=True)
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"Error: there is no tool {call.name!r} (tools: {known})", CallRecord(name="unknown_tool", error=True)
        if call.error is not None:
            return f"Error: {call.error}", CallRecord(name=call.name, error=True)
        if k >= self.cfg.max_parallel_calls:
            return (
                f"Error: at most {self.cfg.max_parallel_calls} tool call(s) per turn; this call was not run",
                CallRecord(name=call.name, error=True),
            )
        return None

    def _execute(self, jobs: list[_Job]) -> None:
        """Run the jobs in daemon threads; a call past ``tool_timeout_s`` gets an error and the rest
        of its job is not run (its tool may be stuck). Blocks until every call has an answer."""
        timeout = self.cfg.tool_timeout_s
        wake = threading.Event()
        lock = threading.Lock()

        def work(job: _Job) -> None:
            for i, args in enumerate(job.arguments):
                with lock:
                    if len(job.results) > i:  # timed out meanwhile: the rest was answered already
                        return
                    job.current, job.started = i, time.perf_counter()
                begin = job.started
                try:
                    if job.needs_create and i == 0:
                        job.tool.create(job.traj.instance_id, **dict(job.traj.tools_kwargs.get(job.tool.name, {}).get("create_kwargs", {})))
                    text, error = job.tool.call(job.traj.instance_id, check_arguments(job.tool.schema, args)), False
                    if not isinstance(text, (str, ToolResponse)):
                        text, error = f"Error: the tool returned {type(text).__name__}, not text or a ToolResponse", True
                except Exception as exc:  # noqa: BLE001 - any failure of a tool is the model's error turn
                    text, error = f"Error: {type(exc).__name__}: {exc}", True
                with lock:
                    if len(job.results) > i:
                        return
                    job.results.append((text, error, time.perf_counter() - begin))
                    wake.set()

        for job in jobs:
            threading.Thread(target=work, args=(job,), daemon=True, name=f"verl-tool-{job.tool.name}").start()
        while True:
            with lock:
                now = time.perf_counter()
                waiting = [j for j in jobs if len(j.results) < len(j.arguments)]
                for job in waiting:
                    if job.started is not None and job.current == len(job.results) and now - job.started > timeout:
                        logger.warning("tool %s timed out after %.1f s (conversation %s)", job.tool.name, timeout, job.traj.instance_id)
                        job.results.append((f"Error: the call to {job.tool.name} timed out after {timeout:g} s", True, now - job.started))
                        while len(job.results) < len(job.arguments):
                            job.results.append((f"Error: not run, an earlier call to {job.tool.name} timed out", True, 0.0))
                waiting = [j for j in waiting if len(j.results) < len(j.arguments)]
                if not waiting:
                    return
                next_deadline = min(
                    (j.started + timeout - now if j.started is not None else timeout for j in waiting), default=timeout
                )
                wake.clear()
            wake.wait(timeout=max(next_deadline, 0.0) + 0.001)

    def _release(self, created: set[tuple[str, str]]) -> None:
        for name, instance_id in created:
            try:
                self.tools[name].release(instance_id)
            except Exception:  # noqa: BLE001 - a failed clean-up must not lose the rollout
                logger.exception("releasing tool %s of conversation %s failed", name, instance_id)

    def _truncate(self, text: str, room: int) -> str:
        """``text`` cut to ``max_tool_response_length`` tokens on ``tool_response_truncate_side``, or
        to ``room`` (the tokens the conversation has left) when fewer: a turn with more could not be
        kept (it is left out, stop ``length``, as it would be uncut).

        Only the ends that can be kept are tokenized: ``limit`` tokens span at most ``limit *
        max_chars_per_token`` characters, so a longer text is over the limit and that many
        characters of each kept end hold the kept tokens (a 10 MB answer is not tokenized whole).
        The text returned is what the tool turn's ids are then made from, so the trajectory stays
        token-exact whatever the cut."""
        limit = max(1, min(self.cfg.max_tool_response_length, room))
        side, mark, dec = self.cfg.tool_response_truncate_side, "...(truncated)...", self.tokenizer.decode
        span = limit * self.encoder.max_chars_per_token
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        if len(text) <= span:
            head_ids = tail_ids = encode(text)
            if len(head_ids) <= limit:
                return text
        else:
            head_ids = encode(text[:span]) if side != "left" else []
            tail_ids = encode(text[-span:]) if side != "right" else []
        if side == "left":
            return mark + dec(tail_ids[-limit:])
        if side == "right":
            return dec(head_ids[:limit]) + mark
        head = limit // 2
        return dec(head_ids[:head]) + mark + dec(tail_ids[len(tail_ids) - (limit - head) :])

    # ------------------------------------------------------------------ batches
    def generate(self, engine: RolloutEngine, prompts: Batch, *, validate: bool = False, seed: int | None = None) -> Batch:
        """``RolloutEngine.generate`` through the agent loop: a batch of left-padded prompts in, the
        rollout batch out (:func:`assemble_agent_rollout`); metrics in :attr:`last_metrics`.

        Per-sample settings come from ``extra_info`` where the batch has it: ``tools_kwargs``,
        ``interaction_kwargs`` and ``agent_name``.
        """
        for key in ("input_ids", "attention_mask"):
            if key not in prompts:
                raise ValueError(f"rollout: the prompt batch has no {key!r} column (columns: {prompts.keys()})")
        spec = sampling_spec(engine.cfg, validate=validate)
        token_lists = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"])
        kwargs = talk = names = infos = rows = None
        if "extra_info" in prompts:
            infos = [e if isinstance(e, Mapping) else {} for e in prompts["extra_info"]]
            kwargs = [e.get("tools_kwargs") for e in infos]
            talk = [e.get("interaction_kwargs") for e in infos]
            names = [e.get("agent_name") for e in infos]
        if self.default_agent_loop is not None:
            names = [(n if n else self.default_agent_loop) for n in (names or [None] * len(prompts))]
        if "raw_prompt" in prompts:  # the chat messages an agent program starts from
            columns = [c for c in ("data_source", "reward_model") if c in prompts]
            rows = [
                {"messages": list(prompts["raw_prompt"][i]), "extra_info": infos[i] if infos else {},
                 **{c: prompts[c][i] for c in columns}}
                for i in range(len(prompts))
            ]
        images = None
        if PIXEL_VALUES in prompts:  # each prompt row's own images ({} for a row without)
            images = [model_image_inputs({k: prompts[k][i : i + 1] for k in MULTI_MODAL_KEYS}) for i in range(len(prompts))]
            images = [(got["pixel_values"], got["image_grid_thw"]) if got else None for got in images]
        start = time.perf_counter()
        trajs = self.run(
            engine,
            token_lists,
            spec,
            seed=seed,
            tools_kwargs=kwargs,
            interaction_kwargs=talk,
            agent_names=names,
            prompt_width=int(prompts["input_ids"].shape[1]),
            extra_infos=infos,
            samples=rows,
            images=images,
        )
        seconds = time.perf_counter() - start
        self.last_metrics = agent_metrics(trajs, seconds=seconds, tool_names=list(self.tools))
        if self.last_episodes:
            from verl.rollout.agent.endpoint import endpoint_metrics

            self.last_metrics.update(endpoint_metrics(self.last_episodes, self.last_engine_calls))
        if validate:  # validation scores episodes: one row each, its last trajectory
            for t in trajs:
                t.earlier = []
        self.last_rows_per_prompt = [sum(len(t.earlier) + 1 for t in trajs[i * spec.n : (i + 1) * spec.n]) for i in range(len(prompts))]
        return assemble_agent_rollout(
            prompts,
            trajs,
            n=spec.n,
            response_length=self.response_length,
            pad_token_id=engine.pad_token_id,
            interaction_reward=self.cfg.interaction_reward,
            interaction_reward_weight=self.cfg.interaction_reward_weight,
        )


def assemble_agent_rollout(
    prompts: Batch,
    trajs: Sequence[Trajectory],
    *,
    n: int,
    response_length: int,
    pad_token_id: int,
    interaction_reward: str = "per_turn",
    interaction_reward_weight: float = 1.0,
) -> Batch:
    """The rollout batch of ``B * n`` conversations (prompt-major), with the keys and shapes of
    ``verl.rollout.base.assemble_rollout`` except that ``response_mask`` is the loss mask (1 on
    sampled ids only) while the response part of ``attention_mask`` covers tool turns too.
    Adds the non-tensor columns ``num_turns`` and ``agent_turns`` (each turn's role and span).

    A conversation with :attr:`~Trajectory.earlier` trajectories (a split agent-program episode)
    gives a row for each, before its own, all with its prompt row's columns (its ``uid``: one GRPO
    group); ``agent_episode`` (the episode's id) and ``agent_trajectory`` (0, 1, ... in the episode)
    say which rows are one episode, so the reward step gives them the episode's reward
    (:func:`~verl.rollout.agent.interaction.fold_turn_scores`). The batch then has more than
    ``B * n`` rows.
    When a conversation had an interaction: ``turn_scores`` (each sample's interaction rewards,
    the reference verl's column) and ``interaction_scores`` [B*n, R] (those rewards placed as
    ``interaction_reward`` says, times the weight; the reward step adds them to
    ``token_level_scores``, ``verl.rollout.agent.interaction.fold_turn_scores``)."""
    b, r = len(prompts), response_length
    assert len(trajs) == b * n, f"{len(trajs)} trajectories for {b} prompts x n={n}"
    source = [i for i, t in enumerate(trajs) for _ in range(len(t.earlier) + 1)]  # each row's conversation
    episode = np.array([trajs[i].instance_id for i in source], dtype=object)
    within = np.array([k for t in trajs for k in range(len(t.earlier) + 1)], dtype=np.int64)
    trajs = [seg for t in trajs for seg in (*t.earlier, t)]
    rows = len(trajs)
    responses = torch.full((rows, r), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, r), dtype=torch.long)
    filled = torch.zeros((rows, r), dtype=torch.long)
    logprobs = torch.zeros((rows, r), dtype=torch.float32)
    for i, t in enumerate(trajs):
        k = len(t.response_ids)
        assert k <= r and len(t.loss_mask) == len(t.logprobs) == k, f"trajectory {i}: {k} ids, budget {r}"
        responses[i, :k] = torch.tensor(t.response_ids, dtype=torch.long)
        loss_mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.long)
        logprobs[i, :k] = torch.tensor(t.logprobs, dtype=torch.float32)
        filled[i, :k] = 1
    out = prompts.repeat(n, interleave=True)
    if rows != b * n:
        out = out[source]
    if any(t.opening is not None or t.own_prompt for t in trajs):
        _with_openings(out, trajs, pad_token_id)
    if any(t.images for t in trajs):  # every image of each conversation, the prompt's first
        for key, column in row_image_columns([t.images for t in trajs]).items():
            out[key] = column.to(out["input_ids"].device)
    prompt_ids = out["input_ids"]  # [B*n, P]
    prompt_mask = out["attention_mask"].to(torch.long)
    prompt_pos = out["position_ids"] if "position_ids" in out else (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, r + 1, dtype=prompt_pos.dtype)  # [B*n, R]
    device = prompt_ids.device
    out["prompts"] = prompt_ids
    out["responses"] = responses.to(device)
    out["response_mask"] = loss_mask.to(device)
    out["rollout_log_probs"] = logprobs.to(device)
    out["input_ids"] = torch.cat([prompt_ids, out["responses"]], dim=1)
    mask_dtype = out["attention_mask"].dtype
    out["attention_mask"] = torch.cat([prompt_mask.to(mask_dtype), filled.to(device=device, dtype=mask_dtype)], dim=1)
    out["position_ids"] = torch.cat([prompt_pos, response_pos.to(prompt_pos.device)], dim=1)
    out["num_turns"] = np.array([t.num_turns for t in trajs], dtype=np.int64)
    out["agent_turns"] = [[dict(turn) for turn in t.turns] for t in trajs]
    out[AGENT_EPISODE] = episode
    out[AGENT_TRAJECTORY] = within
    if any(t.interaction is not None or t.turn_scores for t in trajs):
        last = [max((j for j, m in enumerate(t.loss_mask) if m), default=-1) for t in trajs]
        out["turn_scores"] = [[r for _, r in t.turn_scores] for t in trajs]
        out["interaction_scores"] = turn_score_tensor(
            [t.turn_scores for t in trajs],
            last,
            response_length=r,
            mode=interaction_reward,
            weight=interaction_reward_weight,
        ).to(device)
    return out


def _with_openings(out: Batch, trajs: Sequence[Trajectory], pad_token_id: int) -> None:
    """The prompt columns of the rows an interaction opened (their prompt ids: the dataset's prompt
    and the opening turn) or an agent program's episode started elsewhere (``own_prompt``),
    left-padded to the batch's width P; position ids from the mask."""

    ids = out["input_ids"].clone()  # [B*n, P]
    mask = out["attention_mask"].clone()
    width = ids.shape[1]
    rows = [i for i, t in enumerate(trajs) if t.opening is not None or t.own_prompt]
    for i in rows:
        k = len(trajs[i].prompt_ids)
        if k > width:
            raise ValueError(f"conversation {i}: its prompt with the opening turn is {k} tokens, more than the batch's {width}")
        ids[i] = pad_token_id
        ids[i, width - k :] = torch.tensor(trajs[i].prompt_ids, dtype=ids.dtype)
        mask[i] = 0
        mask[i, width - k :] = 1
    out["input_ids"], out["attention_mask"] = ids, mask
    if "position_ids" in out:
        pos = out["position_ids"].clone()
        if pos.ndim != 2:
            raise ValueError(f"position_ids of shape {tuple(pos.shape)}: an interaction's opening needs [B, P] positions")
        for i in rows:
            pos[i] = (mask[i].to(torch.long).cumsum(0) - 1).clamp(min=0).to(pos.dtype)
        out["position_ids"] = pos
    if "raw_prompt_ids" in out:
        raw = np.empty(len(trajs), dtype=object)
        for i in range(len(trajs)):
            raw[i] = out["raw_prompt_ids"][i]
        for i in rows:
            raw[i] = list(trajs[i].prompt_ids)
        out["raw_prompt_ids"] = raw


def agent_metrics(trajs: Sequence[Trajectory], *, seconds: float, tool_names: Sequence[str] = ()) -> dict[str, float]:
    """Metrics of one agent rollout: ``num_turns/{mean,max,min}`` (the reference verl's keys), the
    ``rollout/*`` length and throughput keys (over sampled tokens for throughput, whole responses
    for lengths), per-tool ``agent/tool_calls/<name>``, ``agent/tool_errors/<name>`` and
    ``agent/tool_latency_s/<name>`` (``bad_format`` and ``unknown_tool`` for calls that name no
    tool), ``agent/masked_token_share`` (share of response tokens that are tool turns, out of
    the loss) and ``agent/stop/<reason>`` shares."""
    count = max(len(trajs), 1)
    turns = [t.num_turns for t in trajs] or [0]
    lengths = [len(t.response_ids) for t in trajs] or [0]
    sampled = sum(sum(t.loss_mask) for t in trajs)
    total = sum(lengths)
    m: dict[str, float] = {
        "num_turns/mean": sum(turns) / count,
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
        "rollout/tokens_per_s": sampled / seconds if seconds > 0 else 0.0,
        "rollout/time_s": seconds,
        "rollout/num_sequences": float(len(trajs)),
        "rollout/num_tokens": float(sampled),
        "rollout/response_length/mean": total / count,
        "rollout/response_length/max": float(max(lengths)),
        "rollout/response_length/min": float(min(lengths)),
        "rollout/clip_ratio": sum(t.stop_reason == "length" for t in trajs) / count,
        "agent/masked_token_share": (total - sampled) / total if total else 0.0,
        "agent/assistant_turns/mean": sum(t.assistant_turns for t in trajs) / count,
    }
    for reason in dict.fromkeys([*STOP_REASONS, *(t.stop_reason for t in trajs)]):
        m[f"agent/stop/{reason}"] = sum(t.stop_reason == reason for t in trajs) / count
    records = [c for t in trajs for c in t.calls]
    names = list(dict.fromkeys([*tool_names, *(c.name for c in records)]))
    for name in names:
        mine = [c for c in records if c.name == name]
        m[f"agent/tool_calls/{name}"] = float(len(mine))
        m[f"agent/tool_errors/{name}"] = float(sum(c.error for c in mine))
        ran = [c.seconds for c in mine if c.seconds > 0]
        m[f"agent/tool_latency_s/{name}"] = sum(ran) / len(ran) if ran else 0.0
    talking = [t for t in trajs if t.interaction is not None or t.turn_scores]
    if talking:
        m["interaction/reward/mean"] = sum(sum(r for _, r in t.turn_scores) for t in talking) / len(talking)
        m["interaction/turns/mean"] = sum(len(t.turn_scores) for t in talking) / len(talking)
    m["agent/tool_calls"] = float(len(records))
    m["agent/tool_errors"] = float(sum(c.error for c in records))
    return m
