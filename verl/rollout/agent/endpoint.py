"""The agent endpoint: a user's agent program drives the rollout through an OpenAI-compatible server.

For one rollout call, :class:`AgentEndpoint` serves ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``GET /v1/models`` on 127.0.0.1 (an ephemeral port) in front of the
rollout engine that call uses. Every sample is one *episode*: its program
(:class:`~verl.rollout.agent.agents.AgentProgram`) gets an ``openai.AsyncOpenAI`` client whose API
key is the episode's own random key (``Authorization: Bearer <key>``: that is how a request names
its episode; a command gets it as ``OPENAI_API_KEY``), and the sample (:func:`program_sample`). The
program returns a reward (added at the episode's last sampled token, as an interaction's reward)
or None (the reward step's scorers alone judge the response).

Token in, token out. The endpoint keeps each episode's ids so far (prompt, sampled ids, added
turns). A request *extends* them when

- chat: its messages are the conversation so far (the dataset's prompt messages, then each
  assistant turn exactly as this endpoint returned its text, and the turns the program added)
  followed by new user or tool messages; their ids are the chat template's rendering of those
  messages as a turn, tokenized on its own (:class:`~verl.rollout.agent.turns.ToolTurnEncoder`,
  as the agent loop adds tool turns), never a re-tokenization of earlier text;
- completions: its prompt (text, or a list of token ids) encodes to the ids so far plus more.

The first request of an episode that sends the sample's messages unchanged starts from the
dataset's prompt ids (rendered with the data's tools and system prompt); any other first request
starts from the template's rendering of its messages. A later request that does not extend the
episode (the program edited its history, or a template that is not append-only) is counted in
``agent/endpoint/prefix_mismatch`` and, by ``on_prefix_mismatch``, starts a new trajectory from
its own rendering (``split``) or is refused with a 400 that drops the episode (``refuse``).

A trajectory (:class:`~verl.rollout.agent.trajectory.Trajectory`) is then exactly
``[prompt ids] [sampled ids] [added ids] [sampled ids] ...``, its loss mask 1 on the sampled ids
only, their log-probs the engine's. Each answer also carries the ids (vLLM's names: the choice's
``token_ids``, the answer's ``prompt_token_ids``), so a program can send exact ids back through
``/v1/completions``. Every request is recorded (:class:`RequestRecord`: its prompt
ids, completion ids and log-probs), so the trained ids can be checked against what the engine saw.
A trajectory's prompt longer than the batch's prompt width keeps its first ``prompt_width`` ids in
the prompt and the rest at the head of the response, out of the loss. A response budget
(``rollout.response_length``) used up answers every later request of the trajectory with an empty
completion, ``finish_reason: "length"``.

Sampling is the rollout's (temperature, top-p, top-k of ``rollout`` or ``val_kwargs``), whatever a
request asks, so the log-probs are the policy's; a request's ``max_tokens`` (or
``max_completion_tokens``) caps its completion. ``n`` other than 1 and ``stream`` are refused.
Requests of running episodes are sampled together: the engine takes them as they come until every
running episode waits in one, or no program showed life (started, or sent a request) for
``batch_wait_ms``, then samples them in one call (on the thread that called
:meth:`AgentEndpoint.run`, the rollout's). Engines whose replicas must sample together (vLLM's
data-parallel replicas, which all-reduce at every engine step) get a ``lockstep`` group: the
endpoints of its ranks then call their engines in rounds, every rank each round (a rank with no
request samples one token of a one-token prompt), a round once every rank's requests are in by the
same rule, until no rank has an episode left. The programs' ``openai`` clients share one pool of
keep-alive connections per call (each with its episode's key), so a request costs no connection,
thread or TLS set-up.

Failures end one episode, never the step, each with one log line and a count in
``agent/endpoint/dropped/<reason>``: ``timeout`` (the program ran past ``episode_timeout_s``: its
task is cancelled, a command's process group killed), ``error`` (it raised, exited non-zero or
returned something other than a number or None), ``refused`` (a prefix mismatch under
``refuse``). A body above ``max_body_bytes`` gets a 413, an unknown model name a 404, a wrong key a
401; the program may handle those, else it raises and its episode is dropped. A dropped episode's
row keeps its prompt and an empty response (no loss). At most ``max_concurrent_episodes`` programs
run at once. When :meth:`AgentEndpoint.run` returns, the server, the programs' thread and every
command's process have ended. An async program that blocks its event loop (``time.sleep``) cannot
be ended from outside: run such code as a command.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verl.rollout.agent.agents import AgentProgram
from verl.rollout.agent.trajectory import Trajectory
from verl.rollout.agent.turns import ToolTurnEncoder
from verl.rollout.base import RolloutEngine, SamplingSpec

if TYPE_CHECKING:
    from verl.config.schema import AgentEndpointConfig

logger = logging.getLogger(__name__)

__all__ = ["AgentEndpoint", "Episode", "RequestRecord", "endpoint_metrics", "program_sample"]

DROP_REASONS = ("timeout", "error", "refused")


# ----------------------------------------------------------------------------------- request bodies
# Agent frameworks send fields this endpoint has no use for (tools, tool_choice, logprobs, user ...):
# they are accepted and ignored; the rollout's sampling settings apply whatever a request asks.
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _TextPart(_Lenient):
    type: Literal["text"]
    text: str


class _Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_turn(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": text}


class _Body(_Lenient):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False


class _ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None


class _CompletionBody(_Body):
    prompt: str | list[int]


class _Refusal(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# ----------------------------------------------------------------------------------- episodes
@dataclass(kw_only=True)
class RequestRecord:
    """One request of an episode as the engine served it."""

    segment: int
    """Which trajectory of the episode it extended (0 unless a prefix mismatch split it)."""
    prompt_ids: list[int]
    """The ids the engine was given."""
    completion_ids: list[int]
    """The ids it sampled (all of them in the trajectory, in the loss)."""
    logprobs: list[float]
    """The engine's log-prob of each sampled id."""
    route: str
    """``chat`` or ``completions``."""


EPISODE_STATES = ("waiting", "running", "done", "dropped")


class Episode:
    """One sample's agent-program run and what it made (see the module docstring).

    State, shared by three threads: ``waiting`` -> ``running`` (the programs' thread, when the
    program starts) -> ``done`` or ``dropped`` (the programs' thread when it ends, the server's on a
    refusal, the caller's at the hard deadline); the first end wins (:meth:`end`). The server's
    thread alone writes :attr:`segments` and :attr:`requests`, one request at a time per episode.
    """

    def __init__(
        self, index: int, sample: Mapping[str, Any], prompt_ids: Sequence[int], *, program: AgentProgram,
        instance_id: str, prompt_width: int, response_length: int,
    ) -> None:
        self.index = index
        self.key = f"ep-{secrets.token_hex(16)}"
        self.sample = dict(sample)
        self.prompt_ids = list(prompt_ids)
        self.program = program
        self.instance_id = instance_id
        self.prompt_width, self.response_length = int(prompt_width), int(response_length)
        self.segments: list[Trajectory] = []
        """The episode's trajectories: one, or one per prefix mismatch under ``split``."""
        self.requests: list[RequestRecord] = []
        self.mismatches = 0
        self.reward: float | None = None
        self.reason = ""
        """Why it was dropped (:data:`DROP_REASONS`), with :attr:`detail` its one line."""
        self.detail = ""
        self._state = "waiting"
        self._lock = threading.Lock()
        self._busy = False
        # The conversation so far as the endpoint knows it: its ids (the current trajectory's
        # prompt and response) and, while only chat requests extend it, its messages.
        self._ids: list[int] = []
        self._messages: list[dict[str, str]] | None = None
        self._ended = True  # the last sampled id was the end-of-turn token

    @property
    def state(self) -> str:
        return self._state

    def start(self) -> bool:
        """``waiting`` -> ``running``; False when it was ended before its turn (the step's deadline)."""
        with self._lock:
            if self._state != "waiting":
                return False
            self._state = "running"
            return True

    def end(self, state: str, reason: str = "", detail: str = "") -> bool:
        """``running`` -> ``done`` or ``dropped``; False when it had ended already."""
        assert state in ("done", "dropped") and (state == "done") == (not reason), (state, reason)
        with self._lock:
            if self._state not in ("waiting", "running"):
                return False
            self._state, self.reason, self.detail = state, reason, detail
            return True

    def claim(self) -> None:
        """Begin one request (the server's thread); a second concurrent request of the episode is a 409."""
        with self._lock:
            if self._state != "running":
                raise _Refusal(409, f"episode {self.index} has ended ({self._state} {self.reason})".rstrip(), kind="conflict")
            if self._busy:
                raise _Refusal(409, f"episode {self.index}: one request at a time per episode", kind="conflict")
            self._busy = True

    def release(self) -> None:
        with self._lock:
            self._busy = False

    @property
    def room(self) -> int:
        """Response tokens the current trajectory has left."""
        t = self.segments[-1]
        return self.response_length - len(t.response_ids)

    def _start_segment(self, ids: list[int], messages: list[dict[str, str]] | None) -> None:
        """A new trajectory from ``ids``: its first ``prompt_width`` ids are the prompt, the rest
        (a long split-off history) the head of the response, out of the loss."""
        width = self.prompt_width
        t = Trajectory(prompt_ids=ids[:width], instance_id=f"{self.instance_id}-{len(self.segments)}",
                       agent_name=self.program.name)
        if len(ids) > width:
            t._append(ids[width:], None, "context")
        self.segments.append(t)
        self._ids, self._messages = list(ids), messages

    def _extend(self, ids: list[int], role: str, messages: list[dict[str, str]] | None) -> None:
        t = self.segments[-1]
        t._append(ids, None, role)
        t.user_turns += 1
        self._ids.extend(ids)
        if self._messages is not None and messages is not None:
            self._messages.extend(messages)
            t.messages.extend(messages)
        else:
            self._messages = None

    def _mismatch(self, policy: str, what: str) -> None:
        self.mismatches += 1
        if policy == "refuse":
            line = f"{what}; on_prefix_mismatch=refuse drops the episode"
            self.end("dropped", "refused", line)
            raise _Refusal(400, f"the request does not extend episode {self.index}'s conversation: {line}", param="messages")

    def chat_prompt(self, messages: list[dict[str, str]], tools: Any, encoder: ToolTurnEncoder, policy: str) -> list[int]:
        """The ids a chat request gives the engine, its new ids added to the episode (see the module docstring)."""
        if not self.segments:
            if messages == self.sample["messages"] and not tools:
                self._start_segment(list(self.prompt_ids), [dict(m) for m in messages])
            else:
                self._start_segment(_render(encoder, messages, tools), [dict(m) for m in messages])
            return list(self._ids)
        known = self._messages
        if known is not None and len(messages) > len(known) and messages[: len(known)] == known:
            new = messages[len(known):]
            if all(m["role"] in ("user", "tool") for m in new):
                ids = encoder.encode(new, model_ended_turn=self._ended)
                if len(ids) + 1 > self.room:
                    return []  # no room left: the caller answers "length"
                self._extend(ids, new[0]["role"], new)
                return list(self._ids)
            what = "the new messages include an assistant or system turn"
        elif known is None:
            what = "a chat request after a completions request that changed the text"
        else:
            what = "its messages are not the conversation so far (an earlier turn was edited, dropped or re-sent)"
        self._mismatch(policy, what)
        self._start_segment(_render(encoder, messages, tools), [dict(m) for m in messages])
        return list(self._ids)

    def completion_prompt(self, ids: list[int], policy: str) -> list[int]:
        """The ids a completions request gives the engine, its new ids added to the episode."""
        if not self.segments:
            self._start_segment(ids, None)
            return list(self._ids)
        k = len(self._ids)
        if len(ids) > k and ids[:k] == self._ids:
            if len(ids) - k + 1 > self.room:
                return []
            self._extend(ids[k:], "user", None)
            return list(self._ids)
        self._mismatch(policy, "its prompt ids are not the episode's ids so far plus new ones")
        self._start_segment(ids, None)
        return list(self._ids)

    def record(self, prompt: list[int], ids: list[int], logprobs: list[float], *, cut: bool, eos: int | None, text: str,
               route: str) -> None:
        """The engine's sample for ``prompt``: in the trajectory, in the loss."""
        t = self.segments[-1]
        t._append(ids, list(logprobs), "assistant")
        t.assistant_turns += 1
        self._ids.extend(ids)
        self._ended = bool(ids) and ids[-1] == eos
        if self._messages is not None:
            turn = {"role": "assistant", "content": text}
            self._messages.append(turn)
            t.messages.append(turn)
        if cut:
            t.stop_reason = "length"
        self.requests.append(RequestRecord(segment=len(self.segments) - 1, prompt_ids=prompt, completion_ids=list(ids),
                                           logprobs=list(logprobs), route=route))


def _render(encoder: ToolTurnEncoder, messages: list[dict[str, str]], tools: Any) -> list[int]:
    """The template's rendering of a request's messages, in the mode the encoder follows (Qwen3's
    ``enable_thinking``, read from the batch's prompts), so its generation prompt is the one the
    dataset's prompts and the tool turns end with."""
    tok = encoder.tokenizer
    try:
        text = tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                                       **encoder.template_kwargs)
    except Exception as exc:  # noqa: BLE001 - a template's refusal is the request's fault
        raise _Refusal(400, f"the chat template refuses these messages: {exc}", param="messages") from None
    return list(tok.encode(text, add_special_tokens=False))


def program_sample(
    index: int, messages: Sequence[Mapping[str, Any]], model: str, row: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a program gets as ``sample`` (a command: as JSON on its stdin): ``index`` (the row),
    ``messages`` (the dataset's prompt messages), ``model`` (the name to send), and the row's
    ``extra_info``, ``data_source`` and ``ground_truth`` (``reward_model.ground_truth``) when it has them."""
    row = dict(row or {})
    out: dict[str, Any] = {
        "index": int(index),
        "messages": [{"role": str(m["role"]), "content": str(m["content"])} for m in messages],
        "model": model,
        "extra_info": dict(row.get("extra_info") or {}),
    }
    if row.get("data_source") is not None:
        out["data_source"] = str(row["data_source"])
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        out["ground_truth"] = reward_model["ground_truth"]
    return out


# ----------------------------------------------------------------------------------- the endpoint
@dataclass
class _Job:
    episode: Episode
    prompt: list[int]
    max_tokens: int
    future: Future = field(default_factory=Future)


class AgentEndpoint:
    """One rollout call's endpoint and programs (see the module docstring).

    Args:
        engine: the rollout engine the call uses.
        tokenizer: the policy's tokenizer (its chat template renders the messages).
        cfg: ``actor_rollout_ref.rollout.agent.endpoint``.
        spec: the call's sampling (``n`` and ``max_tokens`` are the endpoint's own).
        response_length: each trajectory's response budget; prompt_width: its prompt's (``data.max_prompt_length``).
        encoder: the agent loop's turn encoder (made from ``tokenizer`` when None).
        lockstep: the process group of ranks whose engines must sample together (None: this
            engine samples alone).
    """

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, cfg: AgentEndpointConfig, spec: SamplingSpec, *,
        response_length: int, prompt_width: int, encoder: ToolTurnEncoder | None = None, lockstep: Any = None,
    ) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.spec = spec
        self.response_length, self.prompt_width = int(response_length), int(prompt_width)
        self.encoder = encoder or ToolTurnEncoder(tokenizer)
        self.lockstep = lockstep
        self.episodes: list[Episode] = []
        self._by_key: dict[str, Episode] = {}
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._server: Any = None
        self._http: Any = None
        self._stir = 0.0
        """When a program last showed life (started, or sent a request): a monotonic time, written
        by the programs' and the server's threads, read by the caller's (one float: no lock)."""
        self.url = ""
        self.engine_calls = 0

    # ---------------------------------------------------------------- the app
    def _app(self) -> Any:
        from pydantic import ValidationError
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def error(exc: _Refusal) -> JSONResponse:
            body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": None}}
            headers = {"connection": "close"} if exc.status == 413 else None
            return JSONResponse(body, status_code=exc.status, headers=headers)

        async def handle(request: Any, body_type: type[_Body], serve: Any) -> Any:
            self._stir = time.monotonic()
            try:
                episode = self._episode_of(request)
                raw = await self._read_body(request)
                try:
                    body = body_type.model_validate(json.loads(raw))
                except (ValueError, ValidationError) as exc:
                    raise _Refusal(400, f"bad request body: {str(exc).splitlines()[0]}", param="body") from None
                if body.model != self.cfg.model_name:
                    raise _Refusal(404, f"model {body.model!r} is not served here; this endpoint serves "
                                        f"{self.cfg.model_name!r}", param="model", kind="not_found_error")
                if (body.n or 1) != 1:
                    raise _Refusal(400, "n must be 1: each request is one turn of its episode", param="n")
                if body.stream:
                    raise _Refusal(400, "stream is not supported by the agent endpoint; send stream=false", param="stream")
                episode.claim()
                try:
                    return JSONResponse(await serve(episode, body))
                finally:
                    episode.release()
            except _Refusal as exc:
                return error(exc)

        async def models(request: Any) -> Any:
            try:
                self._episode_of(request)
            except _Refusal as exc:
                return error(exc)
            model = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "verl"}
            return JSONResponse({"object": "list", "data": [model]})

        async def chat(request: Any) -> Any:
            return await handle(request, _ChatBody, self._serve_chat)

        async def completions(request: Any) -> Any:
            return await handle(request, _CompletionBody, self._serve_completion)

        return Starlette(routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ])

    async def _read_body(self, request: Any) -> bytes:
        """The body, refused with a 413 past ``max_body_bytes``. An over-long body is read on and
        dropped (up to 16 times the limit, then the connection closes) before the 413 goes out: a
        client still writing would see a broken connection instead of the answer."""
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length", "").strip()
        chunks, size = [], 0
        over = declared.isdigit() and int(declared) > limit
        async for chunk in request.stream():
            size += len(chunk)
            if size > 16 * limit:
                break
            if not over and size > limit:
                over, chunks = True, []
            if not over:
                chunks.append(chunk)
        if over:
            what = f"{int(declared)} bytes" if declared.isdigit() else f"more than {limit} bytes"
            raise _Refusal(413, f"the request body is {what}; this endpoint takes at most {limit} "
                                "(actor_rollout_ref.rollout.agent.endpoint.max_body_bytes)", param="body")
        return b"".join(chunks)

    def _episode_of(self, request: Any) -> Episode:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        episode = self._by_key.get(token.strip()) if scheme.lower() == "bearer" else None
        if episode is None:
            raise _Refusal(401, "missing or unknown episode key; use the client the program was given",
                           param="Authorization", kind="authentication_error")
        return episode

    async def _serve_chat(self, episode: Episode, body: _ChatBody) -> dict[str, Any]:
        messages = [m.as_turn() for m in body.messages]
        prompt = episode.chat_prompt(messages, body.tools, self.encoder, self.cfg.on_prefix_mismatch)
        text, finish, ids = await self._complete(episode, prompt, body.max_completion_tokens or body.max_tokens, "chat")
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish,
                  "token_ids": ids}
        return self._answer("chat.completion", "chatcmpl", [choice], prompt, ids)

    async def _serve_completion(self, episode: Episode, body: _CompletionBody) -> dict[str, Any]:
        if isinstance(body.prompt, str):
            ids = list(self.tokenizer.encode(body.prompt, add_special_tokens=False))
        else:
            ids = list(body.prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= i < vocab for i in ids):
                raise _Refusal(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise _Refusal(400, "prompt is empty", param="prompt")
        prompt = episode.completion_prompt(ids, self.cfg.on_prefix_mismatch)
        text, finish, out = await self._complete(episode, prompt, body.max_tokens, "completions")
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": out}
        return self._answer("text_completion", "cmpl", [choice], prompt, out)

    def _answer(self, kind: str, prefix: str, choices: list[dict[str, Any]], prompt: list[int], ids: list[int]) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.cfg.model_name,
            "choices": choices, "prompt_token_ids": prompt,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
        }

    async def _complete(self, episode: Episode, prompt: list[int], wanted: int | None, route: str) -> tuple[str, str, list[int]]:
        room = episode.room if prompt else 0
        if room < 1 or episode.segments[-1].stop_reason == "length":
            episode.segments[-1].stop_reason = "length"
            return "", "length", []
        budget = min(wanted or room, room)
        job = _Job(episode, prompt, budget)
        self._jobs.put(job)
        ids, logprobs, cut = await asyncio.wrap_future(job.future)
        eos = self.encoder.eos_token_id
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.record(prompt, ids, logprobs, cut=len(ids) >= room and not (ids and ids[-1] == eos), eos=eos, text=text,
                       route=route)
        stopped = bool(ids) and (ids[-1] == eos or ids[-1] in self.spec.stop_token_ids) and not cut
        return text, ("stop" if stopped else "length"), ids

    # ---------------------------------------------------------------- the engine
    def _running(self) -> int:
        """The episodes whose programs run, or will as soon as the programs' thread starts them."""
        live = sum(e.state in ("waiting", "running") for e in self.episodes)
        return min(live, self.cfg.max_concurrent_episodes)

    def _sample_jobs(self, jobs: list[_Job], seed: int | None) -> None:
        """One engine call for ``jobs``; each keeps the prefix of its sample that fits its own budget
        (the engine draws token k without regard to max_tokens, as the agent loop relies on). No
        jobs: one token of a one-token prompt (a lockstep round this rank has nothing for)."""
        import dataclasses

        self.engine_calls += 1
        if not jobs:
            call = dataclasses.replace(self.spec, n=1, max_tokens=1)
            self.engine.sample([[int(self.encoder.eos_token_id or 0)]], call, seed=seed)
            return
        call = dataclasses.replace(self.spec, n=1, max_tokens=max(j.max_tokens for j in jobs))
        try:
            samples = self.engine.sample([j.prompt for j in jobs], call, seed=seed)
        except Exception as exc:  # noqa: BLE001 - answered to every waiting request, then raised
            for j in jobs:
                j.future.set_exception(exc)
            raise
        for j, s in zip(jobs, samples):
            ids, lps = list(s.token_ids[: j.max_tokens]), list(s.logprobs[: j.max_tokens])
            j.future.set_result((ids, lps, len(s.token_ids) > j.max_tokens or s.hit_length_limit))

    def _take_jobs(self, pending: list[_Job], timeout: float) -> bool:
        """Move the requests that have come into ``pending``, waiting up to ``timeout`` for the
        first; a request of an episode that has ended meanwhile is answered 409. True when any came."""
        try:
            got = [self._jobs.get(timeout=timeout) if timeout > 0 else self._jobs.get_nowait()]
        except queue.Empty:
            return False
        while True:
            try:
                got.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for j in got:
            if j.episode.state == "running":
                pending.append(j)
            else:
                j.future.set_exception(_Refusal(409, f"episode {j.episode.index} has ended", kind="conflict"))
        return True

    def _drive(self, done: threading.Event, seed: int | None, deadline: float) -> None:
        """Sample the requests as they come (this thread) until every program has ended (on every
        rank of ``lockstep``).

        A rank is *ready* when every running episode waits in a request, or none came for
        ``batch_wait_ms`` (since the last request, or the last engine call); then its waiting
        requests go to the engine in one call. With ``lockstep`` a round starts when some rank has
        requests and every rank is ready, so the ranks' turns of one conversation step share a
        round instead of spreading over several (each round costs every rank an engine call)."""
        wait = self.cfg.batch_wait_ms / 1000.0
        pending: list[_Job] = []
        last = time.monotonic()  # the last request or engine call: a quiet spell since then ends the wait
        rnd = 0
        while True:
            left = wait - (time.monotonic() - max(last, self._stir))
            if self._take_jobs(pending, min(max(left, 0.001), 0.005) if pending else 0.005):
                last = time.monotonic()
            pending = [j for j in pending if j.episode.state == "running" or self._refuse_ended(j)]
            now = time.monotonic()
            over = (done.is_set() and self._jobs.empty()) or now > deadline
            ready = over or len(pending) >= self._running() or now - max(last, self._stir) >= wait
            if self.lockstep is None:
                if not pending:
                    if over:
                        return
                    continue
                if not ready:
                    continue
            else:
                import torch
                import torch.distributed as dist

                flags = torch.tensor([int(bool(pending)), int(not over or bool(pending)), int(not ready)], dtype=torch.int32)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.lockstep)
                if not flags[1]:
                    return  # no rank has an episode left
                if not flags[0] or flags[2]:
                    continue  # no rank has a request yet, or some rank's requests are still coming
            jobs, pending = pending, []
            self._sample_jobs(jobs, None if seed is None else (int(seed) * 1_000_003 + 200_000 + rnd) % (2**31 - 1))
            last = time.monotonic()
            rnd += 1

    @staticmethod
    def _refuse_ended(job: _Job) -> bool:
        job.future.set_exception(_Refusal(409, f"episode {job.episode.index} has ended", kind="conflict"))
        return False

    # ---------------------------------------------------------------- the programs
    async def _run_episode(self, episode: Episode, gate: asyncio.Semaphore) -> None:
        async with gate:
            if not episode.start():
                return
            self._stir = time.monotonic()
            timeout = self.cfg.episode_timeout_s
            name = episode.program.name
            try:
                if episode.program.fn is not None:
                    reward = await self._run_function(episode, timeout)
                else:
                    reward = await self._run_command(episode, timeout)
            except _Ended as exc:
                if episode.end("dropped", exc.reason, exc.line):
                    logger.warning("agent program %s, episode %d: %s; episode dropped", name, episode.index, exc.line)
                return
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
                line = f"returned {type(reward).__name__} {reward!r:.80}; return a finite number or None"
                if episode.end("dropped", "error", line):
                    logger.warning("agent program %s, episode %d: %s; episode dropped", name, episode.index, line)
                return
            episode.reward = None if reward is None else float(reward)
            episode.end("done")

    async def _run_function(self, episode: Episode, timeout: float) -> Any:
        import openai

        # The episode's own key on the call's one pool of keep-alive connections (a client of its own
        # would build an SSL context and open a connection per episode: most of a step's time here).
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=episode.key, max_retries=0, timeout=timeout,
                                    http_client=self._http)
        task = asyncio.ensure_future(episode.program.fn(client, dict(episode.sample)))
        finished, _ = await asyncio.wait({task}, timeout=timeout)
        if not finished:
            task.cancel()  # not awaited: a program that swallows the cancel cannot hold the step
            raise _Ended("timeout", f"ran past episode_timeout_s={timeout:g} s; cancelled")
        exc = task.exception()
        if exc is not None:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise _Ended("error", f"raised {type(exc).__name__}: {first}")
        return task.result()

    async def _run_command(self, episode: Episode, timeout: float) -> Any:
        env = dict(os.environ)
        env.update({"OPENAI_BASE_URL": f"{self.url}/v1", "OPENAI_API_KEY": episode.key, "VERL_AGENT_MODEL": self.cfg.model_name})
        proc = await asyncio.create_subprocess_exec(
            *episode.program.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(episode.sample).encode()), timeout)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            raise _Ended("timeout", f"ran past episode_timeout_s={timeout:g} s; its process group was killed") from None
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid)
                await proc.wait()
        if proc.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
            raise _Ended("error", f"exited with status {proc.returncode}: {last}")
        lines = out.decode(errors="replace").strip().splitlines()
        last = lines[-1].strip() if lines else ""
        if last in ("", "null", "None"):
            return None
        try:
            return float(last)
        except ValueError:
            raise _Ended("error", f"printed {last[:80]!r} last; print the reward (a number) or nothing") from None

    def _programs_thread(self, done: threading.Event) -> threading.Thread:
        def main() -> None:
            loop = asyncio.new_event_loop()
            try:
                gate = asyncio.Semaphore(self.cfg.max_concurrent_episodes)

                async def all_episodes() -> None:
                    self._http = _shared_http_client(self.cfg.max_concurrent_episodes)
                    try:
                        await asyncio.gather(*(self._run_episode(e, gate) for e in self.episodes))
                    finally:
                        await self._http.close_pool()

                loop.run_until_complete(all_episodes())
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:  # cancelled programs still unwinding: give them a moment, not the step
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
            except Exception:  # noqa: BLE001 - a failure here must not leave the caller waiting
                logger.exception("agent endpoint: the programs' thread failed")
            finally:
                done.set()
                loop.close()

        return threading.Thread(target=main, name="verl-agent-programs", daemon=True)

    def run(self, samples: Sequence[Mapping[str, Any]], prompt_ids: Sequence[Sequence[int]],
            programs: Sequence[AgentProgram], *, seed: int | None = None, tag: str = "") -> list[Episode]:
        """Run one episode per sample (``program_sample`` dicts, with the dataset's ``prompt_ids``
        and each one's program); returns them when every program has ended and the server is down."""
        if not (len(samples) == len(prompt_ids) == len(programs)):
            raise ValueError(f"AgentEndpoint.run: {len(samples)} samples, {len(prompt_ids)} prompts, {len(programs)} programs")
        tag = tag or uuid.uuid4().hex[:8]
        self.episodes = [
            Episode(i, s, p, program=prog, instance_id=f"{tag}-{i}", prompt_width=self.prompt_width,
                    response_length=self.response_length)
            for i, (s, p, prog) in enumerate(zip(samples, prompt_ids, programs))
        ]
        self._by_key = {e.key: e for e in self.episodes}
        if not self.episodes:
            return []
        for name in ("httpx", "httpx2"):  # the programs' clients log every request at INFO: hundreds a step
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        server = _Server(self._app())
        self.url = server.url
        done = threading.Event()
        thread = self._programs_thread(done)
        waves = math.ceil(len(self.episodes) / self.cfg.max_concurrent_episodes)
        deadline = time.monotonic() + waves * (self.cfg.episode_timeout_s + 5.0) + 30.0
        try:
            thread.start()
            self._drive(done, seed, deadline)
        finally:
            for e in self.episodes:  # only where a program blocked its event loop past every limit
                if e.end("dropped", "timeout", "its program blocked the programs' event loop past the step's deadline"):
                    logger.warning("agent program %s, episode %d: %s; episode dropped", e.program.name, e.index, e.detail)
            while not self._jobs.empty():
                job = self._jobs.get_nowait()
                if not job.future.done():
                    job.future.set_exception(_Refusal(503, "the rollout step has ended", kind="server_error"))
            thread.join(timeout=5.0)
            if thread.is_alive():
                logger.warning("agent endpoint: the programs' thread is still blocked after the step; it is left behind")
            server.stop()
        return self.episodes


class _Server:
    """uvicorn on a daemon thread, on 127.0.0.1 and a free port; :meth:`stop` ends it."""

    def __init__(self, app: Any, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="verl-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the agent endpoint did not start on 127.0.0.1 (see the log above)")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)


def _shared_http_client(connections: int) -> Any:
    """The HTTP client every episode's ``openai`` client of one call sends through: keep-alive
    connections to 127.0.0.1 for up to ``connections`` episodes at once, no proxy from the
    environment. A program that closes its client (``async with client:``) leaves the pool open for
    the others; the endpoint closes it when every program has ended (:meth:`close_pool`)."""
    import importlib

    import openai

    base = openai.DefaultAsyncHttpxClient  # the openai client's own httpx flavour and defaults
    httpx = importlib.import_module(next(c for c in base.__mro__ if c.__name__ == "AsyncClient").__module__.split(".")[0])

    class SharedClient(base):
        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    n = max(int(connections), 1)
    # Plain HTTP to 127.0.0.1: no TLS, so no certificate store to load (verify=True costs ~0.1 s a call).
    return SharedClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), trust_env=False, verify=False)


class _Ended(Exception):
    def __init__(self, reason: str, line: str) -> None:
        super().__init__(line)
        self.reason, self.line = reason, line


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def endpoint_metrics(episodes: Sequence[Episode], engine_calls: int = 0) -> dict[str, float]:
    """``agent/endpoint/*``: episodes, requests, engine calls (this rank's), trajectories per
    episode, prefix mismatches, dropped episodes by reason, mean program reward."""
    count = max(len(episodes), 1)
    m: dict[str, float] = {
        "agent/endpoint/episodes": float(len(episodes)),
        "agent/endpoint/engine_calls": float(engine_calls),
        "agent/endpoint/requests": float(sum(len(e.requests) for e in episodes)),
        "agent/endpoint/prefix_mismatch": float(sum(e.mismatches for e in episodes)),
        "agent/endpoint/trajectories_per_episode": sum(len(e.segments) for e in episodes) / count,
        "agent/endpoint/no_request": float(sum(e.state == "done" and not e.requests for e in episodes)),
    }
    for reason in DROP_REASONS:
        m[f"agent/endpoint/dropped/{reason}"] = float(sum(e.reason == reason for e in episodes))
    rewards = [e.reward for e in episodes if e.reward is not None]
    if rewards:
        m["agent/endpoint/reward/mean"] = sum(rewards) / len(rewards)
    return m
