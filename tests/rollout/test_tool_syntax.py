"""Tool-call syntaxes (verl.rollout.agent.parser): Hermes, Qwen3-Coder's XML, Llama 3's JSON and a
user's parser, chosen by multi_turn.format or by the chat template's family; malformed calls are
answered to the model, never a crash. And interactions answer all conversations at once."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from verl.config.schema import RolloutMultiTurnConfig
from verl.rollout.agent import AgentLoop, AgentLoopBase, FunctionTool, ToolCall
from verl.rollout.agent.parser import FORMATS, parse_hermes, parse_llama3_json, parse_qwen3_coder, tool_call_parser
from verl.rollout.base import Sample, SamplingSpec
from tests.rollout.test_templates import TOOLS, Scripted, family_tokenizer

pytestmark = pytest.mark.timeout(120)

SPEC = SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64)


def test_hermes_the_familys_own_examples():
    text = (
        "I will look both up.\n<tool_call>\n"
        '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}'
        "\n</tool_call>\n<tool_call>\n"
        '{"name": "get_temperature_date", "arguments": "{\\"location\\": \\"Paris\\", \\"date\\": \\"2024-10-01\\"}"}'
        "\n</tool_call><|im_end|>"
    )
    assert parse_hermes(text) == [
        ToolCall(name="get_current_temperature", arguments={"location": "San Francisco, CA, USA", "unit": "celsius"}),
        ToolCall(name="get_temperature_date", arguments={"location": "Paris", "date": "2024-10-01"}),
    ]
    assert parse_hermes("The answer is 4.") == []
    bad = parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call><tool_call>{"arguments": {}}</tool_call><tool_call>{"name"')
    assert [c.name for c in bad] == [None, None, None] and all(c.error for c in bad)
    assert "not valid JSON" in bad[0].error and "no \"name\"" in bad[1].error and "not closed" in bad[2].error


SCHEMAS = {
    "get_weather": {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"}, "hours": {"type": "array"},
    }}}},
    "write_file": {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"},
    }}}},
}


def test_qwen3_coder_xml_the_familys_own_examples():
    text = (
        "Let me check the weather and save a script.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=write_file>\n<parameter=path>\n007.py\n</parameter>\n"
        "<parameter=content>\ndef f():\n    return 1\n\n</parameter>\n</function>\n</tool_call><|im_end|>"
    )
    got = parse_qwen3_coder(text, SCHEMAS)
    assert got == [
        ToolCall(name="get_weather", arguments={"city": "San Francisco", "days": 3, "detailed": True, "hours": [9, 12]}),
        # A string parameter stays as written ("007" is not a number; the body keeps its own last newline).
        ToolCall(name="write_file", arguments={"path": "007.py", "content": "def f():\n    return 1\n"}),
    ]
    # Without a schema, JSON-looking values are read as JSON and the rest kept as text.
    assert parse_qwen3_coder(text)[0].arguments == {"city": "San Francisco", "days": 3, "detailed": True, "hours": [9, 12]}
    # A value that does not read as its schema type is kept as text (the argument check answers it).
    assert parse_qwen3_coder("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>", SCHEMAS)[0].arguments == {"days": "three"}
    for bad, why in (
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", "not closed with </parameter>"),
        ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", "no <function=name>"),
        ("<tool_call>\n<function=get_weather>\n</function>\nmore\n</tool_call>", "text besides"),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>", "given twice"),
        ("<tool_call>\n<function=get_weather>\n", "not closed with </tool_call>"),
    ):
        [call] = parse_qwen3_coder(bad, SCHEMAS)
        assert call.arguments is None and why in call.error, (bad, call)


def test_llama3_json_the_familys_own_examples():
    one = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}<|eot_id|>'
    assert parse_llama3_json(one) == [ToolCall(name="get_current_conditions", arguments={"location": "San Francisco, CA", "unit": "Fahrenheit"})]
    tagged = '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "arguments": {"a": 4, "b": 5}}\n<|eom_id|>'
    assert parse_llama3_json(tagged) == [ToolCall(name="add", arguments={"a": 2, "b": 3}), ToolCall(name="add", arguments={"a": 4, "b": 5})]
    assert parse_llama3_json("The answer is 45.<|eot_id|>") == []
    [cut] = parse_llama3_json('{"name": "add", "parameters": {"a": 2,')
    assert cut.name is None and "not valid JSON" in cut.error
    [nameless] = parse_llama3_json('{"function": "add", "parameters": {}}')
    assert "no \"name\"" in nameless.error
    [ok, trailing] = parse_llama3_json('{"name": "add", "parameters": {"a": 1, "b": 2}} and then I will multiply')
    assert ok.error is None and "after a tool call" in trailing.error


def my_parser(text):
    """A user's syntax: ``CALL name a=1 b=2`` lines."""
    out = []
    for line in text.splitlines():
        if line.startswith("CALL "):
            name, *pairs = line[5:].split()
            out.append({"name": name, "arguments": {k: int(v) for k, v in (p.split("=") for p in pairs)}})
    return out


def my_parser_with_schemas(text, schemas):
    return [ToolCall(name=name, arguments={}) for name in schemas if name in text]


def broken_parser(text):
    raise RuntimeError("my regex is wrong")


def test_format_chosen_by_key_or_template_and_a_users_parser():
    assert FORMATS == ("auto", "hermes", "qwen3_coder", "llama3_json")
    assert tool_call_parser("auto", template_format="llama3_json")[0] == "llama3_json"
    assert tool_call_parser("auto")[0] == "hermes"
    assert tool_call_parser("qwen3_coder", template_format="llama3_json")[0] == "qwen3_coder"  # the key wins
    name, parse = tool_call_parser(f"{__name__}.my_parser")
    assert name == f"{__name__}.my_parser"
    assert parse("CALL add a=2 b=3\nthen", {}) == [ToolCall(name="add", arguments={"a": 2, "b": 3})]
    assert tool_call_parser(f"{__name__}.my_parser_with_schemas")[1]("use mul", {"mul": {}, "add": {}}) == [ToolCall(name="mul", arguments={})]
    [bad] = tool_call_parser(f"{__name__}.broken_parser")[1]("anything", {})
    assert bad.arguments is None and "RuntimeError: my regex is wrong" in bad.error
    with pytest.raises(ValueError, match=r"multi_turn.format='xml' is not a tool-call format; use one of"):
        tool_call_parser("xml")
    with pytest.raises(ValueError, match=r"multi_turn.format.*cannot import 'no_such_module'"):
        tool_call_parser("no_such_module.parse")
    with pytest.raises(ValueError, match="is not callable"):
        tool_call_parser(f"{__name__}.SPEC")
    # The config default follows the template; the key's validation runs in the pre-flight too.
    assert RolloutMultiTurnConfig().format == "auto"


@pytest.mark.parametrize(
    ("family", "turn"),
    [
        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\ntwo\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"),
        ("llama3", '{"name": "add", "parameters": {"a": 2, "b": '),
        ("qwen2.5", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}\n</tool_call>'),
    ],
)
def test_malformed_call_is_answered_to_the_model(family, turn):
    """Through the loop with format=auto: the malformed call gets an ``Error: ...`` tool turn (in the
    template's tool role), the model turns after it run, nothing raises."""
    tok = family_tokenizer(family)
    encode = functools.partial(tok.encode, add_special_tokens=False)
    prompt = encode(tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False))
    engine = Scripted(tok, [encode(turn) + [tok.eos_token_id], encode("5") + [tok.eos_token_id]])
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), TOOLS, tok, response_length=300)
    [t] = loop.run(engine, [prompt], SPEC)
    assert t.stop_reason == "answer" and t.assistant_turns == 2 and [c.error for c in t.calls] == [True]
    tool_turn = t.messages[1]
    assert tool_turn["role"] == "tool" and tool_turn["content"].startswith("Error: "), tool_turn
    rendered = tok.decode(t.response_ids, skip_special_tokens=False)
    assert tool_turn["content"] in rendered or f'"{tool_turn["content"]}"'[:40] in rendered


# --------------------------------------------------------------------------- interactions at once

SLEEP = 0.3


class SlowJudge:
    """A plain interaction that waits (a judge model, a web environment): ``SLEEP`` s per answer."""

    name = "slow"

    def __init__(self):
        self.active = self.peak = 0
        self.lock = threading.Lock()

    def start_interaction(self, instance_id, **kwargs):
        return None

    def generate_response(self, instance_id, messages, **kwargs):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(SLEEP)
        with self.lock:
            self.active -= 1
        return True, "", float(len(messages)), {}


class AsyncSlowJudge:
    """The reference's kind: coroutine methods."""

    name = "slow_async"

    async def start_interaction(self, instance_id, **kwargs):
        await asyncio.sleep(SLEEP)
        return None

    async def generate_response(self, instance_id, messages, **kwargs):
        await asyncio.sleep(SLEEP)
        return True, "", 1.0, {}

    async def finalize_interaction(self, instance_id):
        await asyncio.sleep(SLEEP)


@pytest.mark.parametrize("judge", [SlowJudge, AsyncSlowJudge])
def test_interactions_answer_every_conversation_at_once(judge):
    """8 conversations whose interaction waits 0.3 s per call: one round of answers takes about one
    wait, not eight (one after another it would take 8 x 0.3 = 2.4 s per round)."""
    tok = family_tokenizer("chatml")
    encode = functools.partial(tok.encode, add_special_tokens=False)
    prompt = encode(tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False))
    interaction = judge()
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=50, interactions={"j": interaction})
    engine = Scripted(tok, [encode("5") + [tok.eos_token_id]])
    start = time.perf_counter()
    trajs = loop.run(engine, [prompt] * 8, SPEC, interaction_kwargs=[{}] * 8)
    seconds = time.perf_counter() - start
    waits = 1 if judge is SlowJudge else 3  # the async judge also waits in start and finalize
    assert all(t.stop_reason == "interaction" and len(t.turn_scores) == 1 for t in trajs)
    # Bound: the waits of one conversation plus 0.6 s for a loaded 2-core machine; serial would be 8x the waits.
    assert seconds < waits * SLEEP + 0.6, f"{seconds:.2f} s for 8 conversations"
    if judge is SlowJudge:
        assert interaction.peak == 8


def test_preflight_names_a_bad_format():
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_checks import _multi_turn_problems

    def problems(fmt: str) -> list[str]:
        cfg = load_config(PPOConfig, config_file="grpo_tiny_cpu", world_size=2, overrides=[
            "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.format={fmt}"])
        return [p for p in _multi_turn_problems(cfg) if "format" in p]

    assert problems("llama3_json") == [] and problems(f"{__name__}.my_parser") == []
    [bad] = problems("pythonic")
    assert bad.startswith("actor_rollout_ref.rollout.multi_turn.format='pythonic' is not a tool-call format")


# --------------------------------------------------------------------------- custom loops in the same engine calls


class AskAgain(AgentLoopBase):
    """A custom loop: a model turn, a fixed user follow-up, a second model turn."""

    async def run(self, conversation) -> None:
        await conversation.generate()
        if not conversation.stopped and conversation.add_messages([{"role": "user", "content": "Sure?"}]):
            await conversation.generate()


def test_custom_loops_share_the_engine_calls_of_the_built_in_loop():
    """A built-in conversation (a call, then the answer) and two custom ones (two model turns each):
    both rounds are ONE engine call holding all three contexts (one after another it took four)."""
    tok = family_tokenizer("chatml")
    encode = functools.partial(tok.encode, add_special_tokens=False)
    prompt = encode(tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False))
    call = encode('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>') + [tok.eos_token_id]
    answer = encode("5") + [tok.eos_token_id]
    calls = []

    class Recording(Scripted):
        def _sample(self, prompts, spec):
            calls.append([list(p) for p in prompts])
            # The built-in conversation (first in the call) calls the tool in round 1; every other turn answers.
            turns = [call if (len(calls) == 1 and i == 0) else answer for i in range(len(prompts))]
            return [Sample(token_ids=ids, logprobs=[-0.5] * len(ids), hit_length_limit=False) for ids in turns]

    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), TOOLS, tok, response_length=200, agent_loops={"ask_again": AskAgain()})
    trajs = loop.run(Recording(tok, [answer]), [prompt, prompt, prompt], SPEC, agent_names=[None, "ask_again", "ask_again"])
    assert len(calls) == 2 and [len(c) for c in calls] == [3, 3]
    built_in, custom = trajs[0], trajs[1:]
    assert [c.name for c in built_in.calls] == ["add"] and built_in.assistant_turns == 2 and built_in.stop_reason == "answer"
    for t in custom:
        assert t.assistant_turns == 2 and t.user_turns == 1 and t.stop_reason == "answer"
    # Every context of the second call is its conversation's trajectory up to that turn.
    for t, ctx in zip(trajs, calls[1]):
        assert (t.prompt_ids + t.response_ids)[: len(ctx)] == ctx


def test_preflight_refuses_a_chat_template_the_loop_cannot_use(tiny_models, tmp_path):
    """Before any engine is built: a template without a generation prompt, with multi_turn on."""
    import json
    import shutil

    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_checks import _model_folder_problems

    model = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for f in model.glob("chat_template.j*"):
        f.unlink()

    def problems(multi_turn: bool) -> list[str]:
        cfg = load_config(PPOConfig, config_file="grpo_tiny_cpu", world_size=2, overrides=[
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.multi_turn.enable={str(multi_turn).lower()}"])
        return [p for p in _model_folder_problems(cfg) if "chat template" in p]

    assert problems(False) == []
    [bad] = problems(True)
    assert bad.startswith(f"actor_rollout_ref.model.tokenizer_path={model}: the chat template's generation prompt")
