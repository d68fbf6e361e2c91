"""The agent endpoint (verl.rollout.agent.endpoint): agent programs drive a real transformers engine
on a tiny Qwen2 through a real server on 127.0.0.1 with the real ``openai`` client; the trained
ids of every episode equal the ids the engine saw, turn by turn; bad programs each end one episode."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch

from verl.config.schema import AgentEndpointConfig, RolloutConfig, RolloutMultiTurnConfig
from verl.protocol import Batch
from verl.rollout.agent import AgentLoop, AgentProgram, load_agent_loop_config
from verl.rollout.base import left_pad

pytestmark = pytest.mark.timeout(180)

R = 48  # response budget of a trajectory
QUESTIONS = ["What is 6*7?", "What is 2+2?"]


@pytest.fixture(scope="module")
def tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2"])


@pytest.fixture(scope="module")
def engine(tiny_models, tok, one_thread):
    from verl.rollout.hf_engine import HFRollout

    cfg = RolloutConfig(name="hf", n=1, temperature=1.0, prompt_length=64, response_length=R, seed=3)
    return HFRollout(cfg, tiny_models["qwen2"], tokenizer=tok, device="cpu")


def _chat_ids(tok, messages) -> list[int]:
    return list(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False))


def _batch(tok, programs: list[str], questions=QUESTIONS) -> Batch:
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [_chat_ids(tok, m) for m in messages]
    ids, mask = left_pad(prompts, 24, tok.pad_token_id)
    raw = np.empty(len(messages), dtype=object)
    raw[:] = messages
    extra = np.array([{"agent_name": p} for p in programs], dtype=object)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"raw_prompt": raw, "extra_info": extra})


def _loop(tok, programs: dict, **endpoint) -> AgentLoop:
    cfg = AgentEndpointConfig(**{"episode_timeout_s": 30.0, **endpoint})
    loops = {name: AgentProgram(name, fn=fn) if callable(fn) else AgentProgram(name, command=fn) for name, fn in programs.items()}
    return AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=R, agent_loops=loops, endpoint=cfg)


def _row_ids(out: Batch, i: int) -> tuple[list[int], list[int], list[float]]:
    """Row ``i``'s unpadded ids (prompt then response), and the response's loss mask and log-probs."""
    mask = out["attention_mask"][i].bool()
    ids = out["input_ids"][i][mask].tolist()
    k = int(mask[out["prompts"].shape[1]:].sum())
    return ids, out["response_mask"][i][:k].tolist(), out["rollout_log_probs"][i][:k].tolist()


def _check_turn_by_turn(out: Batch, i: int, episode, segment: int = -1) -> None:
    """Every request of the row's trajectory (the episode's ``segment``-th): its prompt is the row's
    ids up to it, its completion the row's next ids, in the loss exactly there, with the engine's
    log-probs; nothing else is in the loss."""
    ids, loss, lps = _row_ids(out, i)
    p = len(ids) - len(loss)
    sampled = [0] * len(loss)
    last = [r for r in episode.requests if r.segment == segment % len(episode.segments)]
    assert last, "the trajectory has no request"
    for r in last:
        start = len(r.prompt_ids)
        assert ids[:start] == r.prompt_ids  # the engine's context is the trained prefix
        assert ids[start : start + len(r.completion_ids)] == r.completion_ids
        for k in range(start - p, start - p + len(r.completion_ids)):
            sampled[k] = 1
        assert lps[start - p : start - p + len(r.completion_ids)] == pytest.approx(r.logprobs, abs=0)
    assert loss == sampled
    end = len(last[-1].prompt_ids) + len(last[-1].completion_ids)
    assert ids[:end] == last[-1].prompt_ids + last[-1].completion_ids


# --------------------------------------------------------------------------- programs
async def talker(client, sample):
    """Three chat turns (a tool answer, then a user turn), then a completion on the exact ids."""
    messages = list(sample["messages"])
    got = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=6)
    messages.append({"role": "assistant", "content": got.choices[0].message.content})
    messages.append({"role": "tool", "content": "42"})
    got = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=5)
    messages += [{"role": "assistant", "content": got.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    got = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=4)
    assert got.choices[0].finish_reason in ("stop", "length") and got.usage.completion_tokens >= 1
    return 0.5 + sample["index"]


async def editor(client, sample):
    """Edits its history between two requests: the second prompt is not the first plus new turns."""
    messages = list(sample["messages"])
    got = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=4)
    edited = [{"role": "user", "content": "Let me rephrase: " + messages[0]["content"]},
              {"role": "assistant", "content": got.choices[0].message.content}, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model=sample["model"], messages=edited, max_tokens=4)
    return 0.75


def test_episode_ids_equal_engine_ids_turn_by_turn(tok, engine, tiny_models):
    """Two episodes of three chat turns each through the real openai client: each row of the batch is
    exactly the ids the engine saw and sampled, the loss mask 1 exactly on sampled ids, the log-probs
    the engine's (which equal a plain forward pass), the program's reward at the last sampled token."""
    from transformers import AutoModelForCausalLM

    from verl.rollout.hf_engine import hf_response_logprobs

    loop = _loop(tok, {"talker": talker})
    out = loop.generate(engine, _batch(tok, ["talker", "talker"]), seed=7)
    episodes = loop.last_episodes
    assert [e.state for e in episodes] == ["done", "done"] and [len(e.requests) for e in episodes] == [3, 3]
    for i, ep in enumerate(episodes):
        _check_turn_by_turn(out, i, ep)
        assert ep.requests[0].prompt_ids == out["prompts"][i][out["attention_mask"][i][:24].bool()].tolist()
        roles = [t["role"] for t in out["agent_turns"][i]]
        assert roles == ["assistant", "tool", "assistant", "user", "assistant"], roles
        last = int(out["response_mask"][i].nonzero().max())
        assert out["interaction_scores"][i].nonzero().flatten().tolist() == [last]
        assert float(out["interaction_scores"][i, last]) == 0.5 + i
    m = loop.last_metrics
    assert 3 <= m["agent/endpoint/engine_calls"] <= 6 and m["agent/endpoint/requests"] == 6 and m["agent/endpoint/prefix_mismatch"] == 0 and m["agent/stop/answer"] == 1
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    actual = hf_response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=R)
    sampled = out["response_mask"].bool()
    # float32 with different padding per engine call: ~1e-6; 1e-4 still catches a shifted position or
    # a tool token scored as sampled (>= 1e-2 on this model).
    torch.testing.assert_close(actual[sampled], out["rollout_log_probs"][sampled], atol=1e-4, rtol=0)


async def closer(client, sample):
    """Closes its client after one turn, as ``async with client:`` does."""
    async with client:
        await client.chat.completions.create(model=sample["model"], messages=list(sample["messages"]), max_tokens=3)
    return None


def test_a_program_closing_its_client_leaves_the_others_theirs(tok, engine):
    """The programs' clients share one pool of connections: one that closes its client (after its
    only turn) does not close the others', which go on with their later turns."""
    loop = _loop(tok, {"closer": closer, "talker": talker})
    loop.generate(engine, _batch(tok, ["closer", "talker"]), seed=5)
    assert [(e.state, len(e.requests)) for e in loop.last_episodes] == [("done", 1), ("done", 3)]


class _RecordingEngine:
    """Stands in for the engine where only the prompts it gets matter: answers ``[7, 8, eos]``."""

    def __init__(self, eos: int, pad: int) -> None:
        self.cfg = RolloutConfig(name="hf", n=1, response_length=R)
        self.eos, self.pad_token_id, self.prompts = eos, pad, []

    def sample(self, prompts, spec, *, seed=None):
        from verl.rollout.base import Sample

        self.prompts.extend(list(p) for p in prompts)
        ids = [7, 8, self.eos][: spec.max_tokens]
        return [Sample(token_ids=ids, logprobs=[-0.5] * len(ids), hit_length_limit=False) for _ in prompts]


async def system_first(client, sample):
    """Starts with a system turn of its own (so the endpoint renders its first prompt), then a tool turn."""
    messages = [{"role": "system", "content": "Be brief."}, *sample["messages"]]
    got = await client.chat.completions.create(model=sample["model"], messages=messages)
    messages += [{"role": "assistant", "content": got.choices[0].message.content}, {"role": "tool", "content": "42"}]
    await client.chat.completions.create(model=sample["model"], messages=messages)


def test_qwen3_thinking_off_prompts_are_followed():
    """Prompts rendered with Qwen3's enable_thinking=false: the endpoint renders a program's own first
    prompt in that mode too, so every prompt the engine gets ends with the empty think block."""
    from tests.rollout.test_templates import family_tokenizer

    tok = family_tokenizer("qwen3")
    user = [{"role": "user", "content": QUESTIONS[0]}]
    render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False, enable_thinking=False)  # noqa: E731
    ids, mask = left_pad([list(tok.encode(render(user), add_special_tokens=False))], 64, tok.pad_token_id)
    raw = np.empty(1, dtype=object)
    raw[:] = [user]
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"raw_prompt": raw,
                            "extra_info": np.array([{"agent_name": "system_first"}], dtype=object)})
    engine = _RecordingEngine(tok.eos_token_id, tok.pad_token_id)
    _loop(tok, {"system_first": system_first}).generate(engine, batch, seed=0)
    first, second = engine.prompts
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert first == list(tok.encode(render(system), add_special_tokens=False))
    assert tok.decode(second).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def by_ids(client, sample):
    """/v1/completions on token ids: the second prompt is the first's ids, the completion's ids (the
    answer's ``token_ids``) and new ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sample["extra_info"]["tokenizer"])
    prompt = _chat_ids(tok, sample["messages"])
    got = await client.completions.create(model=sample["model"], prompt=prompt, max_tokens=5)
    ids = prompt + list(got.choices[0].token_ids) + tok.encode(" ok", add_special_tokens=False)
    await client.completions.create(model=sample["model"], prompt=ids, max_tokens=3)
    return None


def test_completions_route_extends_by_token_ids(tok, engine, tiny_models):
    """The trajectory of two completions requests on token ids: one trajectory, the added ids out of
    the loss, every request's ids in the row."""
    loop = _loop(tok, {"by_ids": by_ids})
    batch = _batch(tok, ["by_ids"], QUESTIONS[:1])
    batch.non_tensors["extra_info"][0]["tokenizer"] = tiny_models["qwen2"]
    out = loop.generate(engine, batch, seed=1)
    [ep] = loop.last_episodes
    assert ep.state == "done", ep.detail
    assert [r.route for r in ep.requests] == ["completions", "completions"] and len(ep.segments) == 1
    _check_turn_by_turn(out, 0, ep)


@pytest.mark.parametrize("policy", ["split", "refuse"])
def test_prefix_mismatch_splits_or_refuses(tok, engine, policy):
    """A program that edits its history: counted; ``split`` gives a second trajectory from the edited
    prompt, and in training each trajectory is a row (the second with its own prompt in the prompt
    columns), both of the prompt's group and scored as the episode; in validation the episode is
    one row, its last trajectory; ``refuse`` drops the episode."""
    from verl.rollout.agent.interaction import fold_turn_scores

    loop = _loop(tok, {"editor": editor, "talker": talker}, on_prefix_mismatch=policy)
    batch = _batch(tok, ["editor", "talker"])
    batch["uid"] = np.array(["a", "b"], dtype=object)
    out = loop.generate(engine, batch, seed=2)
    ep, other = loop.last_episodes
    assert ep.mismatches == 1 and loop.last_metrics["agent/endpoint/prefix_mismatch"] == 1
    if policy == "split":
        assert ep.state == "done" and len(ep.segments) == 2 and [r.segment for r in ep.requests] == [0, 1]
        assert len(out) == 3 and loop.last_rows_per_prompt == [2, 1]
        assert list(out["uid"]) == ["a", "a", "b"] and out["agent_trajectory"].tolist() == [0, 1, 0]
        assert out["agent_episode"][0] == out["agent_episode"][1] != out["agent_episode"][2]
        _check_turn_by_turn(out, 0, ep, segment=0)
        _check_turn_by_turn(out, 1, ep, segment=1)
        _check_turn_by_turn(out, 2, other)
        assert "Let me rephrase" not in tok.decode(_row_ids(out, 0)[0])
        assert "Let me rephrase" in tok.decode(_row_ids(out, 1)[0])
        # The episode's reward: a scorer's 1.0 on its last row plus the program's 0.75 there; the
        # earlier row's own score (0.25, which a scorer would give its text) is replaced by that total.
        scores = torch.zeros(out["responses"].shape)
        ends = [int(out["response_mask"][i].nonzero().max()) for i in range(3)]
        scores[0, ends[0]], scores[1, ends[1]], scores[2, ends[2]] = 0.25, 1.0, 0.5
        folded, _ = fold_turn_scores(out, scores)
        assert folded[0].nonzero().flatten().tolist() == [ends[0]] and float(folded[0, ends[0]]) == 1.75
        assert float(folded[1].sum()) == 1.75 and float(folded[2].sum()) == 2.0  # the talker: 0.5 and its program's 1.5
        val = loop.generate(engine, batch, seed=2, validate=True)
        assert len(val) == 2 and "Let me rephrase" in tok.decode(_row_ids(val, 0)[0])
    else:
        assert ep.state == "dropped" and ep.reason == "refused" and len(ep.requests) == 1
        assert loop.last_metrics["agent/endpoint/dropped/refused"] == 1 and len(out) == 2
        assert int(out["response_mask"][0].sum()) == 0 and int(out["attention_mask"][0, 24:].sum()) == 0


def _split_rows_body() -> list[int]:
    import torch.distributed as dist

    from verl.roles.rollout import Rollout

    class SplitAgent:
        """Stands in for the agent loop (the unit here is the rollout's gather): an even prompt k
        gives 2 rows, as an agent program's episode split once would, an odd one 1."""

        last_metrics: dict = {}

        def generate(self, engine, rows, *, validate=False, seed=None):
            counts = [2 - int(k) % 2 for k in rows["input_ids"][:, 0]]
            self.last_rows_per_prompt = counts
            return rows[[j for j, c in enumerate(counts) for _ in range(c)]]

    rollout = Rollout.__new__(Rollout)
    rollout.dp_group, rollout.agent, rollout.engine = dist.group.WORLD, SplitAgent(), None
    prompts = Batch.from_dict({"input_ids": torch.arange(3).unsqueeze(1)})  # 2 ranks: rank 1 pads with prompt 0
    return rollout._generate(prompts, seed=0, validate=False, greedy=False)["input_ids"][:, 0].tolist()


def test_split_episode_rows_are_gathered_whole_without_padding(run_dist):
    """Ranks whose agent rollouts give different numbers of rows per prompt: every rank gets every
    real prompt's rows, in order, and none of the padding prompt's (a copy of prompt 0, which splits:
    dropping n rows per padding prompt, as for plain rollouts, would keep one of its two)."""
    assert run_dist(_split_rows_body, 2, timeout=60) == [[0, 0, 1, 2, 2]] * 2


# --------------------------------------------------------------------------- bad programs
async def hangs(client, sample):
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=2)
    await asyncio.sleep(3600)


async def raises(client, sample):
    raise RuntimeError("the agent's own bug\nsecond line")


async def sends_10mb(client, sample):
    import openai

    try:
        await client.chat.completions.create(model=sample["model"], messages=[{"role": "user", "content": "x" * (10 << 20)}])
    except openai.APIStatusError as exc:
        raise RuntimeError(f"status {exc.status_code}") from None


async def wrong_model(client, sample):
    import openai

    try:
        await client.chat.completions.create(model="gpt-4o", messages=sample["messages"], max_tokens=2)
    except openai.NotFoundError as exc:
        raise RuntimeError(f"status {exc.status_code}") from None


HANG_COMMAND = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(3600)"]
GOOD_COMMAND = [sys.executable, "-c", """
import json, os, sys, urllib.request
sample = json.load(sys.stdin)
body = json.dumps({"model": os.environ["VERL_AGENT_MODEL"], "messages": sample["messages"], "max_tokens": 3}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
                             {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
json.load(urllib.request.urlopen(req))
print(0.25)
"""]


def test_bad_programs_each_end_one_episode(tok, engine, caplog):
    """A program that hangs (a coroutine, and a command), raises, sends 10 MB, or names a model that is
    not served: each episode ends with one log line, the good ones finish, and nothing is left running
    (no endpoint or programs thread, the port closed, the commands' processes gone)."""
    import logging

    programs = {"talker": talker, "hangs": hangs, "raises": raises, "sends_10mb": sends_10mb, "wrong_model": wrong_model,
                "hang_command": HANG_COMMAND, "good_command": GOOD_COMMAND}
    names = list(programs)
    loop = _loop(tok, programs, episode_timeout_s=6.0)  # the good ones finish in ~1 s; a loaded machine needs room
    seen: list = []
    from verl.rollout.agent import endpoint as mod

    real_start = mod._Server.__init__

    def remember(self, app, *a, **k):
        real_start(self, app, *a, **k)
        seen.append(self.url)

    before = {t.ident for t in threading.enumerate()}
    # Children there before (the pooled workers of an earlier multi-rank test in this process) are
    # not this test's: only new ones count as left running.
    children_before = _children()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="verl.rollout.agent.endpoint"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod._Server, "__init__", remember)
        out = loop.generate(engine, _batch(tok, names, [QUESTIONS[0]] * len(names)), seed=4)
    took = time.monotonic() - start
    by = {ep.program.name: ep for ep in loop.last_episodes}
    assert by["talker"].state == "done" and by["good_command"].state == "done" and by["good_command"].reward == 0.25
    assert {n: (by[n].state, by[n].reason) for n in names if n not in ("talker", "good_command")} == {
        "hangs": ("dropped", "timeout"), "hang_command": ("dropped", "timeout"), "raises": ("dropped", "error"),
        "sends_10mb": ("dropped", "error"), "wrong_model": ("dropped", "error"),
    }
    assert "413" in by["sends_10mb"].detail and "404" in by["wrong_model"].detail
    assert "second line" not in by["raises"].detail
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("\n" not in line and "episode dropped" in line for line in lines), lines
    m = loop.last_metrics
    assert (m["agent/endpoint/dropped/timeout"], m["agent/endpoint/dropped/error"], m["agent/stop/dropped"]) == (2, 3, 5 / 7)
    assert int(out["response_mask"][names.index("hangs")].sum()) == 0  # its one turn is not trained on
    assert took < 6.0 + 15.0  # the hanging ones end at their limit, not the step's
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("verl-agent")]
    assert left == []
    host, port = seen[0].removeprefix("http://").split(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()
    assert _children() - children_before == set()


def _children() -> set[str]:
    import os

    return {p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid()}


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_agent_loop_config_lists_programs(tmp_path):
    """The YAML file of agent loops lists programs: an async function by dotted path, a command; a
    plain function or an entry with both is refused in one line naming the entry."""
    path = tmp_path / "agents.yaml"
    path.write_text(
        "- {name: by_function, _target_: tests.rollout.test_agent_endpoint.talker}\n"
        f"- {{name: by_command, command: {json.dumps(GOOD_COMMAND[:2])}}}\n"
    )
    loops = load_agent_loop_config(str(path))
    assert loops["by_function"].fn is talker and loops["by_command"].command == GOOD_COMMAND[:2]
    path.write_text("- {name: plain, _target_: tests.rollout.test_agent_endpoint._parent}\n")
    with pytest.raises(ValueError, match="entry 0.*not a subclass"):
        load_agent_loop_config(str(path))
    path.write_text("- {name: both, _target_: x.y, command: [a]}\n")
    with pytest.raises(ValueError, match="entry 0: each entry is a mapping with name and _target_.*or name and command"):
        load_agent_loop_config(str(path))


# --------------------------------------------------------------------------- engines that sample together
class _PairedEngine:
    """Stands in for vLLM's data-parallel replicas: every ``sample`` all-reduces across the ranks
    (as vLLM's engine step does), so an unpaired call hangs; answers ``[7, 8, eos]``."""

    def __init__(self, eos: int) -> None:
        self.eos, self.calls = eos, []

    def sample(self, prompts, spec, *, seed=None):
        import torch.distributed as dist

        from verl.rollout.base import Sample

        dist.all_reduce(torch.zeros(1))
        self.calls.append(len(prompts))
        ids = [7, 8, self.eos][: spec.max_tokens]
        return [Sample(token_ids=ids, logprobs=[-0.5] * len(ids), hit_length_limit=len(ids) < 3) for _ in prompts]


async def turns_by_rank(client, sample):
    """Rank 1's episodes take three turns with pauses, rank 0's one: their engines' calls differ."""
    import torch.distributed as dist

    messages = list(sample["messages"])
    for _ in range(3 if dist.get_rank() == 1 else 1):
        got = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=3)
        messages += [{"role": "assistant", "content": got.choices[0].message.content}, {"role": "user", "content": "more"}]
        await asyncio.sleep(0.1)
    return 1.0


def _lockstep_body(model_dir: str) -> tuple[list[str], int, list[int]]:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from verl.rollout.agent.endpoint import AgentEndpoint, program_sample
    from verl.rollout.base import SamplingSpec

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = _PairedEngine(tok.eos_token_id)
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=R)
    endpoint = AgentEndpoint(engine, tok, AgentEndpointConfig(episode_timeout_s=60.0), spec, response_length=R,
                             prompt_width=24, lockstep=dist.group.WORLD)
    messages = [{"role": "user", "content": q} for q in QUESTIONS]
    samples = [program_sample(i, [m], "policy") for i, m in enumerate(messages)]
    program = AgentProgram("turns_by_rank", fn=turns_by_rank)
    episodes = endpoint.run(samples, [_chat_ids(tok, [m]) for m in messages], [program] * 2, seed=0)
    return [e.state for e in episodes], sum(len(e.requests) for e in episodes), engine.calls


def test_lockstep_ranks_sample_together(run_dist, tiny_models):
    """Two ranks whose engines must sample together (vLLM's data-parallel replicas), one with more
    turns than the other: both finish, the same number of engine calls on each (the idle rank
    samples a one-token placeholder)."""
    [(s0, r0, c0), (s1, r1, c1)] = run_dist(_lockstep_body, 2, tiny_models["qwen2"], timeout=120)
    assert s0 == s1 == ["done", "done"] and (r0, r1) == (2, 6)
    assert len(c0) == len(c1) >= 3 and 1 in c0  # rank 0's placeholder calls


def test_preflight_names_an_unknown_default_agent_and_missing_chat_messages(tmp_path):
    """Before any model is built: ``rollout.agent.default_agent_loop`` must name a loop or program,
    and a program needs ``data.return_raw_chat`` (it starts from the prompts' messages)."""
    from verl.config import PPOConfig, load_config
    from verl.data.io import write_parquet
    from verl.trainer.ppo_checks import _multi_turn_problems

    write_parquet([{"prompt": [{"role": "user", "content": "hi"}], "extra_info": {"index": 0}}], str(tmp_path / "train.parquet"))
    loops = tmp_path / "agents.yaml"
    loops.write_text(f"- {{name: talker, _target_: {__name__}.talker}}\n")

    def problems(*overrides: str) -> list[str]:
        cfg = load_config(PPOConfig, config_file="grpo_tiny_cpu", world_size=2, overrides=[
            "actor_rollout_ref.rollout.multi_turn.enable=true", f"data.train_files={tmp_path}/train.parquet",
            "data.val_files=null", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}", *overrides])
        return _multi_turn_problems(cfg)

    [unknown] = problems("actor_rollout_ref.rollout.agent.default_agent_loop=nobody")
    assert "default_agent_loop='nobody' is not an agent loop or program" in unknown and "'talker'" in unknown
    [raw] = problems("actor_rollout_ref.rollout.agent.default_agent_loop=talker")
    assert "agent program(s) ['talker']" in raw and "data.return_raw_chat=true" in raw
    assert problems("actor_rollout_ref.rollout.agent.default_agent_loop=talker", "data.return_raw_chat=true") == []


# --------------------------------------------------------------------------- the recipe's program
def _recipe_program():
    """``calculator_program`` of launch/agent_program_tiny_cpu.sh (its imports, the call pattern and
    the function, without running the launcher)."""
    import ast
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "agent_program_tiny_cpu.sh")
    tree = ast.parse(open(path, encoding="utf-8").read())
    keep = [n for n in tree.body if (isinstance(n, ast.Import) and n.names[0].name in ("json", "re"))
            or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CALL")
            or (isinstance(n, ast.AsyncFunctionDef) and n.name == "calculator_program")]
    space: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), space)  # noqa: S102 - our own launcher
    return space["calculator_program"]


@pytest.fixture(scope="module")
def tool_caller(tiny_models, tmp_path_factory) -> str:
    from tests.rollout.agent_model import make_tool_caller

    return make_tool_caller(tiny_models["qwen2"], str(tmp_path_factory.mktemp("tool-caller")))


def test_recipe_program_trains_on_the_engines_ids(tool_caller, one_thread):
    """The recipe's own program against a tiny model that calls the calculator: it runs the calls,
    and every episode's trained ids are the engine's, turn by turn, the tool answers out of the loss."""
    from transformers import AutoTokenizer

    from verl.rollout.hf_engine import HFRollout
    from verl.tools import safe_calculate

    tok = AutoTokenizer.from_pretrained(tool_caller)
    engine = HFRollout(RolloutConfig(name="hf", n=2, temperature=0.7, prompt_length=32, response_length=R, seed=3),
                       tool_caller, tokenizer=tok, device="cpu")
    loop = _loop(tok, {"calculator_program": _recipe_program()})
    questions = ["What is 3+4?", "What is 2+5?"]
    batch = _batch(tok, ["calculator_program"] * 2, questions)
    out = loop.generate(engine, batch, seed=5)
    assert len(out) == 4 and all(e.state == "done" for e in loop.last_episodes)
    calls = 0
    for i, ep in enumerate(loop.last_episodes):
        _check_turn_by_turn(out, i, ep)
        turns = out["agent_turns"][i]
        calls += sum(t["role"] == "tool" for t in turns)
        for before, t in zip(turns, turns[1:]):
            if t["role"] == "tool":  # the calculator's answer to the expression the model wrote
                call = json.loads(re.search(r"<tool_call>(.*?)</tool_call>", tok.decode(out["responses"][i][before["start"]:before["end"]])).group(1))
                text = tok.decode(out["responses"][i][t["start"]:t["end"]])
                assert f"tool\n{safe_calculate(call['arguments']['expression']):g}<" in text, (call, text)
    assert calls >= 2 and loop.last_metrics["agent/endpoint/prefix_mismatch"] == 0
