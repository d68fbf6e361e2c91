"""The agent loop (verl.rollout.agent): tools, Hermes parsing, token-in/token-out trajectories,
masks, stops, error turns; a scripted engine isolates the loop, the transformers engine runs it
for real on a tiny Qwen2."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from verl.config.schema import RolloutConfig, RolloutMultiTurnConfig
from verl.protocol import Batch
from verl.rollout.agent import (
    AgentLoop,
    CalculatorTool,
    FunctionTool,
    Tool,
    load_tool_config,
    parse_hermes,
    safe_calculate,
)
from verl.rollout.base import Sample, SamplingSpec, left_pad
from verl.testing.engines import WeightlessEngine

pytestmark = pytest.mark.timeout(120)

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2"])


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _chars(tok, text: str) -> list[int]:
    """``text`` as one token per character: valid ids, but not what the tokenizer would produce."""
    return [i for ch in text for i in _ids(tok, ch)]


class ScriptedEngine(WeightlessEngine):
    """An engine whose "samples" come from ``reply(context_ids) -> ids``; the logprob of the
    token at context length L is -L/1000, so every logprob names its position."""

    def __init__(self, tok, reply, *, eos: int) -> None:
        super().__init__(RolloutConfig(name="hf", response_length=64, prompt_length=64), pad_token_id=tok.pad_token_id)
        self.reply, self.eos, self.calls = reply, eos, []

    def _sample(self, prompts, spec: SamplingSpec):
        self.calls.append((list(map(list, prompts)), spec))
        out = []
        for p in prompts:
            for _ in range(spec.n):
                ids = list(self.reply(p))[: spec.max_tokens]
                stopped = bool(ids) and ids[-1] == self.eos
                lps = [-(len(p) + k) / 1000 for k in range(len(ids))]
                out.append(Sample(token_ids=ids, logprobs=lps, hit_length_limit=not stopped and len(ids) == spec.max_tokens))
        return out


def _spec(n: int = 1) -> SamplingSpec:
    return SamplingSpec(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64)


def _prompt(tok, question: str) -> list[int]:
    return _ids(tok, tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False))


def _loop(tok, tools=(CalculatorTool(),), response_length: int = 200, **cfg) -> AgentLoop:
    return AgentLoop(RolloutMultiTurnConfig(enable=True, **cfg), list(tools), tok, response_length=response_length)


# --------------------------------------------------------------------------- tools and parsing


def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert safe_calculate("1234*5678") == 7006652
    assert safe_calculate(" (2+3)*-4 ") == -20
    assert safe_calculate("7/2") == 3.5 and safe_calculate("7//2") == 3 and safe_calculate("2**10") == 1024
    assert CalculatorTool().call("x", {"expression": "6/3"}) == "2"
    for bad in ("__import__('os').system('true')", "x + 1", "abs(-1)", "[1] * 3", "1 if 1 else 2", "'a' * 3",
                "9**9**9", "10**200", "1/0", "(-8)**0.5", "1e308*10", "", "1 +"):
        with pytest.raises(ValueError):
            safe_calculate(bad)


def test_parse_hermes_calls_and_malformed_ones():
    text = (CALL.format(name="calculator", args='{"expression": "1+2"}') + " and "
            + '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            + "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"arguments\": {}}</tool_call>"
            + "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call><tool_call>open")
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "1+2"}), ("calculator", {"expression": "3"})]
    assert [c.error is not None for c in calls] == [False, False, True, True, True, True, True]
    assert "not valid JSON" in calls[2].error and "not closed" in calls[-1].error
    assert parse_hermes("no calls here <tool_response>") == []


def test_tool_config_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: calculator\n"
        "  - class_name: verl.tools.base.CalculatorTool\n"
        "    config: {type: native, name: calc2}\n"
        "  - class_name: verl.tools.base.safe_calculate\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: evaluate, description: d, parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}}\n"
    )
    tools = load_tool_config(str(path))
    assert [t.name for t in tools] == ["calculator", "calc2", "evaluate"]
    assert tools[2].call("i", {"expression": "2*3"}) == "6"
    bad = {
        "tools:\n  - class_name: calculator\n  - class_name: calculator\n": "both named",
        "tools:\n  - class_name: nope.Tool\n": "cannot import",
        "tools:\n  - class_name: calculator\n    confg: {}\n": "unknown key",
        "tools:\n  - class_name: calculator\n    config: {colour: 1}\n": "config keys",
        "tool: []\n": "'tools' list",
    }
    for text, words in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            load_tool_config(str(path))
    with pytest.raises(ValueError, match="no such file"):
        load_tool_config(str(tmp_path / "missing.yaml"))


def test_function_tool_schema_from_signature():
    def lookup(city: str, days: int = 1) -> str:
        """The weather of a city."""
        return f"{city}:{days}"

    tool = FunctionTool(lookup)
    fn = tool.schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "The weather of a city."
    assert fn["parameters"]["properties"] == {"city": {"type": "string"}, "days": {"type": "integer"}}
    assert fn["parameters"]["required"] == ["city"]

    def untyped(x):
        return x

    with pytest.raises(ValueError, match="annotation"):
        FunctionTool(untyped)


# --------------------------------------------------------------------------- token in, token out


def test_hand_checked_trajectory_masks_and_logprobs(tokenizer):
    """One tool round trip, every id and mask written out by hand."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 2+3?")
    turn1 = _ids(tok, CALL.format(name="calculator", args='{"expression": "2+3"}')) + [eos]
    # The chat template's tool role (ChatML), then the next generation prompt; the model sampled <|im_end|> itself.
    tool_turn = _ids(tok, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    turn2 = _chars(tok, "The answer is 5") + [eos]

    def reply(ctx):
        return turn1 if len(ctx) == len(prompt) else turn2

    engine = ScriptedEngine(tok, reply, eos=eos)
    [t] = _loop(tok).run(engine, [prompt], _spec())
    expected = turn1 + tool_turn + turn2
    assert t.response_ids == expected
    assert t.loss_mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    p, a, b = len(prompt), len(turn1), len(tool_turn)
    assert t.logprobs == ([-(p + k) / 1000 for k in range(a)] + [0.0] * b + [-(p + a + b + k) / 1000 for k in range(len(turn2))])
    assert t.stop_reason == "answer" and (t.assistant_turns, t.user_turns, t.num_turns) == (2, 1, 4)
    assert [(x["role"], x["start"], x["end"]) for x in t.turns] == [
        ("assistant", 0, a), ("tool", a, a + b), ("assistant", a + b, a + b + len(turn2))]
    # The second call's context is the prompt plus exactly the ids so far (no re-encoding).
    assert engine.calls[1][0] == [prompt + turn1 + tool_turn]
    # And the text is the template's rendering of the whole conversation.
    conv = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": CALL.format(name="calculator", args='{"expression": "2+3"}')},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5"}]
    assert tok.decode(prompt + expected) == tok.apply_chat_template(conv, tokenize=False).rstrip("\n")


def test_trajectory_keeps_sampled_ids_where_decode_encode_differs(tokenizer):
    """The engine's ids are kept as sampled; re-encoding their text would give other ids."""
    tok = tokenizer
    eos = tok.eos_token_id
    odd = _chars(tok, CALL.format(name="calculator", args='{"expression": "12*12"}')) + [eos]
    assert _ids(tok, tok.decode(odd)) != odd  # the case a decode + re-encode gets wrong
    final = _chars(tok, "so it is 144") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: odd if len(engine.calls) == 1 else final, eos=eos)
    [t] = _loop(tok).run(engine, [_prompt(tok, "12 times 12?")], _spec())
    tool_ids = t.response_ids[len(odd) : t.turns[1]["end"]]
    assert t.response_ids == odd + tool_ids + final
    assert "144" in tok.decode(tool_ids) and t.stop_reason == "answer"


def test_batch_assembly_masks_and_positions(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    prompts = [_prompt(tok, "What is 2+3?"), _prompt(tok, "Hi")]
    call = _ids(tok, CALL.format(name="calculator", args='{"expression": "2+3"}')) + [eos]
    done = _ids(tok, "5") + [eos]

    def reply(ctx):
        if ctx[: len(prompts[1])] == prompts[1]:
            return done
        return call if len(ctx) == len(prompts[0]) else done

    loop = _loop(tok, response_length=120)
    width = max(map(len, prompts))
    ids, mask = left_pad(prompts, width, tok.pad_token_id)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": np.array(["a", "b"], dtype=object)})
    engine = ScriptedEngine(tok, reply, eos=eos)
    out = loop.generate(engine, batch, seed=3)
    assert out["responses"].shape == (2, 120) and out["input_ids"].shape == (2, width + 120)  # n=1 from the cfg
    tool_len = len(_ids(tok, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"))
    t0 = len(call) + tool_len + len(done)
    assert [int(out["attention_mask"][i, width:].sum()) for i in range(2)] == [t0, len(done)]
    rm, am = out["response_mask"][0], out["attention_mask"][0, width:]
    assert rm[: len(call)].all() and not rm[len(call) : t0 - len(done)].any() and rm[t0 - len(done) : t0].all()
    assert am[:t0].all() and not am[t0:].any() and not rm[t0:].any()
    assert (out["rollout_log_probs"][0] != 0).eq(rm.bool()).all()
    pos = out["position_ids"][0]
    assert torch.equal(pos[width:], pos[width - 1] + torch.arange(1, 121))
    assert list(out["num_turns"]) == [4, 2] and out["agent_turns"][0][1]["calls"] == ["calculator"]
    assert list(out["uid"]) == ["a", "b"]
    m = loop.last_metrics
    assert m["num_turns/max"] == 4 and m["num_turns/min"] == 2 and m["num_turns/mean"] == 3
    assert m["agent/tool_calls/calculator"] == 1 and m["agent/tool_errors/calculator"] == 0
    share = tool_len / (t0 + len(done))
    assert m["agent/masked_token_share"] == pytest.approx(share)


# --------------------------------------------------------------------------- bad calls and stops


class _Raises(Tool):
    schema = {"type": "function", "function": {"name": "boom", "description": "", "parameters": {"type": "object", "properties": {}}}}

    def call(self, instance_id, arguments):
        raise RuntimeError("kaput")


class _Hangs(Tool):
    schema = {"type": "function", "function": {"name": "hang", "description": "", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self):
        self.release_event = threading.Event()

    def call(self, instance_id, arguments):
        self.release_event.wait(30)
        return "late"


def test_bad_calls_become_error_turns_and_the_run_goes_on(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    hang = _Hangs()
    bad = "".join([
        "<tool_call>{oops}</tool_call>",
        CALL.format(name="search", args="{}"),
        CALL.format(name="calculator", args='{"expr": "1"}'),
        CALL.format(name="boom", args="{}"),
        CALL.format(name="hang", args="{}"),
        CALL.format(name="calculator", args='{"expression": "1/0"}'),
        CALL.format(name="calculator", args='{"expression": "2+2"}'),
        CALL.format(name="calculator", args='{"expression": "3+3"}'),
    ])
    first = _ids(tok, bad) + [eos]
    final = _ids(tok, "ok") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: first if len(engine.calls) == 1 else final, eos=eos)
    loop = _loop(tok, tools=[CalculatorTool(), _Raises(), hang], response_length=2000, max_parallel_calls=7, tool_timeout_s=0.5)
    start = time.perf_counter()
    [t] = loop.run(engine, [_prompt(tok, "q")], _spec())
    took = time.perf_counter() - start
    hang.release_event.set()
    # The hanging tool would hold the loop until released (after this line); 0.5 s limit, ~1 s quiet,
    # and room for a loaded machine (two busy loops beside the suite: 10-15x slower runs).
    assert took < 30, f"a hanging tool held the loop {took:.1f} s"
    assert t.stop_reason == "answer" and t.response_ids[-len(final):] == final
    tool_text = tok.decode(t.response_ids[t.turns[1]["start"] : t.turns[1]["end"]])
    for words in ("not valid JSON", "no tool 'search'", "needs the argument(s) ['expression']", "RuntimeError: kaput",
                  "timed out after 0.5 s", "division by zero", "tool\n4<|im_end|>", "at most 7 tool call(s)"):
        assert words in tool_text, (words, tool_text)
    assert [(c.name, c.error) for c in t.calls] == [
        ("bad_format", True), ("unknown_tool", True), ("calculator", True), ("boom", True), ("hang", True),
        ("calculator", True), ("calculator", False), ("calculator", True)]


def test_max_assistant_turns_and_max_user_turns_stop_exactly(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    call = _ids(tok, CALL.format(name="calculator", args='{"expression": "1+1"}')) + [eos]
    engine = ScriptedEngine(tok, lambda ctx: call, eos=eos)
    [t] = _loop(tok, response_length=400, max_assistant_turns=3).run(engine, [_prompt(tok, "q")], _spec())
    assert (t.stop_reason, t.assistant_turns, t.user_turns) == ("max_assistant_turns", 3, 2)
    assert t.response_ids[-len(call):] == call and len(t.calls) == 2  # the third turn's call is not run
    [t] = _loop(tok, response_length=400, max_user_turns=2).run(engine, [_prompt(tok, "q")], _spec())
    assert (t.stop_reason, t.assistant_turns, t.user_turns) == ("max_user_turns", 3, 2)


def test_response_budget_stops_exactly(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    call = _ids(tok, CALL.format(name="calculator", args='{"expression": "1+1"}')) + [eos]
    tool_len = len(_ids(tok, "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"))
    engine = ScriptedEngine(tok, lambda ctx: call, eos=eos)
    # A model turn cut by the budget: exactly response_length ids, the cut turn's prefix last.
    budget = len(call) + tool_len + 5
    [t] = _loop(tok, response_length=budget).run(engine, [_prompt(tok, "q")], _spec())
    assert t.stop_reason == "length" and len(t.response_ids) == budget
    assert t.response_ids[-5:] == call[:5] and t.loss_mask[-5:] == [1] * 5
    # A tool turn that does not fit with one sampled token after it is left out ...
    budget = 2 * len(call) + 2 * tool_len
    [t] = _loop(tok, response_length=budget).run(engine, [_prompt(tok, "q")], _spec())
    assert t.stop_reason == "length" and t.turns[-1]["role"] == "assistant"
    assert len(t.response_ids) == 2 * len(call) + tool_len and len(t.calls) == 2  # the second call ran
    # ... one that leaves room for one token is kept, and that token ends the budget exactly.
    [t] = _loop(tok, response_length=budget + 1).run(engine, [_prompt(tok, "q")], _spec())
    assert t.stop_reason == "length" and len(t.response_ids) == budget + 1
    assert [x["role"] for x in t.turns] == ["assistant", "tool"] * 2 + ["assistant"] and t.loss_mask[-2:] == [0, 1]
    # The engine is asked for no more than the largest remaining budget.
    assert max(spec.max_tokens for _, spec in engine.calls) <= budget + 1


class _Counter(Tool):
    """A stateful tool: one counter per conversation, starting at create_kwargs' start."""

    schema = {"type": "function", "function": {"name": "count", "description": "", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self):
        self.state, self.released = {}, []

    def create(self, instance_id, start=0):
        self.state[instance_id] = start

    def call(self, instance_id, arguments):
        self.state[instance_id] += 1
        return str(self.state[instance_id])

    def release(self, instance_id):
        self.released.append(self.state.pop(instance_id))


def test_stateful_tool_per_conversation(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    call = _ids(tok, CALL.format(name="count", args="{}")) + [eos]
    counter = _Counter()
    engine = ScriptedEngine(tok, lambda ctx: call, eos=eos)
    loop = _loop(tok, tools=[counter], response_length=400, max_user_turns=3)
    trajs = loop.run(engine, [_prompt(tok, "a"), _prompt(tok, "b")], _spec(n=2),
                     tools_kwargs=[{"count": {"create_kwargs": {"start": 10}}}, None])
    assert len(trajs) == 4 and len(engine.calls) == 4  # all four conversations in each engine call
    answers = [[tok.decode(t.response_ids[x["start"]:x["end"]]).split("\n")[2].replace("<|im_end|>", "")
                for x in t.turns if x["role"] == "tool"] for t in trajs]
    assert answers == [["11", "12", "13"]] * 2 + [["1", "2", "3"]] * 2
    assert sorted(counter.released) == [3, 3, 13, 13] and counter.state == {}


# --------------------------------------------------------------------------- the transformers engine


def test_transformers_engine_multi_turn_logprobs_match_trainer(tiny_models, tokenizer):
    """Real samples after a tool turn: the engine's log-probs of every sampled token equal a plain
    forward pass over the assembled batch (so the context the engine saw is the trained sequence)."""
    from transformers import AutoModelForCausalLM

    from verl.rollout.hf_engine import HFRollout, hf_response_logprobs

    tok = tokenizer
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, prompt_length=32, response_length=160, seed=5)
    engine = HFRollout(cfg, tiny_models["qwen2"], tokenizer=tok, device="cpu")
    forced = _ids(tok, CALL.format(name="calculator", args='{"expression": "6*7"}')) + [tok.eos_token_id]
    real_sample, rounds = engine._sample, []

    def first_turn_forced(prompts, spec):  # the random model never writes a call itself
        rounds.append(len(prompts))
        if len(rounds) == 1:
            return [Sample(token_ids=forced, logprobs=[0.0] * len(forced), hit_length_limit=False) for _ in prompts]
        return real_sample(prompts, spec)

    engine._sample = first_turn_forced
    prompts = [_prompt(tok, "6 times 7?"), _prompt(tok, "hello")]
    width = max(map(len, prompts))
    ids, mask = left_pad(prompts, width, tok.pad_token_id)
    loop = _loop(tok, response_length=160, max_assistant_turns=3)
    out = loop.generate(engine, Batch.from_dict({"input_ids": ids, "attention_mask": mask}), seed=11)
    assert len(out) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    actual = hf_response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=160)
    real = out["response_mask"].bool().clone()
    real[:, : len(forced)] = False  # the forced first turn has no engine log-probs
    assert real.sum() > 0
    # float32, different padding per call: ~1e-6; 1e-4 still catches a shifted position (>= 1e-2).
    torch.testing.assert_close(actual[real], out["rollout_log_probs"][real], atol=1e-4, rtol=0)
    tool_rows = out["attention_mask"][:, width:].bool() & ~out["response_mask"].bool()
    assert tool_rows.any(dim=1).all() and "42" in tok.decode(out["responses"][0][tool_rows[0]])
    assert loop.last_metrics["agent/tool_calls/calculator"] >= 4


# --------------------------------------------------------------------------- a model that calls tools


@pytest.fixture(scope="module")
def tool_caller(tiny_models, tmp_path_factory) -> str:
    from tests.rollout.agent_model import make_tool_caller

    return make_tool_caller(tiny_models["qwen2"], str(tmp_path_factory.mktemp("tool-caller")))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_real_tool_calls_through_each_engine(name, tool_caller, one_thread):
    """The fine-tuned tiny model calls the calculator by itself; every sampled token's engine
    log-prob equals a plain forward pass over the assembled conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.rollout import build_rollout_engine
    from verl.rollout.hf_engine import hf_response_logprobs

    tok = AutoTokenizer.from_pretrained(tool_caller)
    cfg = RolloutConfig(name=name, n=2, temperature=0.7, prompt_length=32, response_length=120, seed=3,
                        dtype="float32", cpu_kv_cache_gib=0.25)
    engine = build_rollout_engine(cfg, tool_caller, tok)
    try:
        prompts = [_prompt(tok, f"What is {a}+{b}?") for a, b in ((3, 4), (2, 5), (8, 1), (6, 6))]
        width = max(map(len, prompts))
        ids, mask = left_pad(prompts, width, tok.pad_token_id)
        loop = _loop(tok, response_length=120, max_assistant_turns=3)
        out = loop.generate(engine, Batch.from_dict({"input_ids": ids, "attention_mask": mask}), seed=5)
    finally:
        engine.shutdown()
    m = loop.last_metrics
    assert m["agent/tool_calls/calculator"] >= 4 and m["num_turns/max"] >= 4, m
    model = AutoModelForCausalLM.from_pretrained(tool_caller, dtype=torch.float32)
    actual = hf_response_logprobs(
        model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=120, temperature=0.7
    )
    sampled = out["response_mask"].bool()
    # float32; vLLM's kernels against transformers': ~5e-7 measured (test_engines.py); a position
    # off by one or a tool token scored as sampled is off by >= 1e-2.
    torch.testing.assert_close(actual[sampled], out["rollout_log_probs"][sampled], atol=1e-4, rtol=0)
    tool_tokens = out["attention_mask"][:, width:].bool() & ~sampled
    assert tool_tokens.any(dim=1).sum() >= 4


def test_python_tool_keeps_state_per_conversation(tokenizer):
    """The sandboxed interpreter (verl.sandbox) as a tool: a name defined in one call is there in the next."""
    from verl.rollout.agent import PythonTool

    tok = tokenizer
    eos = tok.eos_token_id
    cells = ['<tool_call>{"name": "python", "arguments": {"code": "x = 6 * 7"}}</tool_call>',
             '<tool_call>{"name": "python", "arguments": {"code": "print(x)"}}</tool_call>', "done"]
    engine = ScriptedEngine(tok, lambda ctx: _ids(tok, cells[min(len(engine.calls), 3) - 1]) + [eos], eos=eos)
    tool = PythonTool(wall_time_s=20)
    [t] = _loop(tok, tools=[tool], response_length=400, tool_timeout_s=60).run(engine, [_prompt(tok, "q")], _spec())
    texts = [tok.decode(t.response_ids[x["start"]:x["end"]]) for x in t.turns if x["role"] == "tool"]
    assert "(no output)" in texts[0] and "\n42\n" in texts[1], texts
    assert t.stop_reason == "answer" and not any(c.error for c in t.calls) and tool._interpreters == {}


class _WhoAnswers(Tool):
    """Answers with the rank that ran it: not the same on every rank."""

    schema = {"type": "function", "function": {"name": "who", "description": "", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self):
        self.runs = 0

    def call(self, instance_id, arguments):
        import torch.distributed as dist

        self.runs += 1
        return f"rank{dist.get_rank()}"


def _replica_body(model_dir: str) -> tuple[list[int], int]:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from verl.rollout.agent.loop import ReplicaShare

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    call, done = _ids(tok, CALL.format(name="who", args="{}")) + [eos], _ids(tok, "ok") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: call if len(engine.calls) == 1 else done, eos=eos)
    who = _WhoAnswers()
    loop = _loop(tok, tools=[who], response_length=200)
    loop.replica = ReplicaShare(dist.group.WORLD, 0, leader=dist.get_rank() == 0)
    [t] = loop.run(engine, [_prompt(tok, "q")], _spec())
    return t.response_ids, who.runs


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_one_replica_of_two_ranks_runs_tools_once_and_shares_the_answers(tiny_models):
    """vLLM's TP' ranks must give the engine the same contexts: the replica's first rank runs the
    tools, the others take its answers."""
    from verl.testing.distributed import run_distributed

    first, second = run_distributed(_replica_body, 2, tiny_models["qwen2"], timeout=150)
    assert first[0] == second[0] and first[1] == 1 and second[1] == 0
    from transformers import AutoTokenizer

    assert "rank0" in AutoTokenizer.from_pretrained(tiny_models["qwen2"]).decode(first[0])


# --------------------------------------------------------------------------- interactions

RETRY = "Wrong, try again."


def _checker(**config):
    from verl.rollout.agent import AnswerCheckInteraction

    return {"check": AnswerCheckInteraction("check", retry_message=RETRY, **config)}


def test_interaction_retry_trajectory_exact_with_turn_rewards(tokenizer):
    """A wrong answer gets the checker's user turn (template user role, out of the loss), the
    retry is judged right and ends the conversation; each turn's reward sits at its last token."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 2+3?")
    wrong = _chars(tok, "Answer: 4") + [eos]
    right = _chars(tok, "Answer: 5") + [eos]
    user_turn = _ids(tok, f"\n<|im_start|>user\n{RETRY}<|im_end|>\n<|im_start|>assistant\n")
    engine = ScriptedEngine(tok, lambda ctx: wrong if len(ctx) == len(prompt) else right, eos=eos)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=120, interactions=_checker())
    [t] = loop.run(engine, [prompt], _spec(), interaction_kwargs=[{"name": "check", "ground_truth": "5"}])
    a, u = len(wrong), len(user_turn)
    assert t.response_ids == wrong + user_turn + right
    assert t.loss_mask == [1] * a + [0] * u + [1] * len(right)
    assert engine.calls[1][0] == [prompt + wrong + user_turn]  # the retry sees exactly those ids
    assert t.stop_reason == "interaction" and (t.assistant_turns, t.user_turns) == (2, 1)
    assert [x["role"] for x in t.turns] == ["assistant", "user", "assistant"]
    assert t.turn_scores == [(a - 1, 0.0), (a + u + len(right) - 1, 1.0)]
    assert [m["role"] for m in t.messages] == ["assistant", "user", "assistant"]
    assert t.messages[0]["content"] == "Answer: 4" and t.messages[1]["content"] == RETRY
    # The same answer from the start: one turn, done, reward 1; an always-wrong model stops at max_attempts.
    [t1] = loop.run(ScriptedEngine(tok, lambda ctx: right, eos=eos), [prompt], _spec(), interaction_kwargs=[{"ground_truth": "5"}])
    assert (t1.response_ids, t1.turn_scores, t1.stop_reason) == (right, [(len(right) - 1, 1.0)], "interaction")
    [t2] = loop.run(ScriptedEngine(tok, lambda ctx: wrong, eos=eos), [prompt], _spec(), interaction_kwargs=[{"ground_truth": "5"}])
    assert t2.response_ids == wrong + user_turn + wrong and [r for _, r in t2.turn_scores] == [0.0, 0.0]
    # A sample without interaction_kwargs runs with tools only: its answer simply ends it.
    [t3] = loop.run(ScriptedEngine(tok, lambda ctx: wrong, eos=eos), [prompt], _spec(), interaction_kwargs=[None])
    assert (t3.response_ids, t3.stop_reason, t3.turn_scores) == (wrong, "answer", [])


def test_interaction_limits_and_budget_stop_exactly(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 2+3?")
    wrong = _chars(tok, "Answer: 4") + [eos]
    user_turn = _ids(tok, f"\n<|im_start|>user\n{RETRY}<|im_end|>\n<|im_start|>assistant\n")
    kw = [{"ground_truth": "5"}]
    for cfg, reason, turns in (({"max_assistant_turns": 2}, "max_assistant_turns", 2), ({"max_user_turns": 1}, "max_user_turns", 2)):
        loop = AgentLoop(RolloutMultiTurnConfig(enable=True, **cfg), [], tok, response_length=200, interactions=_checker(max_attempts=9))
        [t] = loop.run(ScriptedEngine(tok, lambda ctx: wrong, eos=eos), [prompt], _spec(), interaction_kwargs=kw)
        assert (t.stop_reason, t.assistant_turns, len(t.turn_scores)) == (reason, turns, turns)
        assert t.response_ids == wrong + user_turn + wrong
    # A user turn that does not fit (with room for one more sampled token) is left out: stop "length".
    budget = len(wrong) + len(user_turn)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=budget, interactions=_checker(max_attempts=9))
    [t] = loop.run(ScriptedEngine(tok, lambda ctx: wrong, eos=eos), [prompt], _spec(), interaction_kwargs=kw)
    assert (t.response_ids, t.stop_reason, t.turn_scores) == (wrong, "length", [(len(wrong) - 1, 0.0)])


def test_interaction_rewards_in_the_batch_and_folded_into_scores(tokenizer):
    from verl.rollout.agent import fold_turn_scores

    tok = tokenizer
    eos = tok.eos_token_id
    prompts = [_prompt(tok, "What is 2+3?"), _prompt(tok, "Hi")]
    wrong, right = _chars(tok, "Answer: 4") + [eos], _chars(tok, "Answer: 5") + [eos]
    first = {len(p) for p in prompts}
    width = max(map(len, prompts))
    ids, mask = left_pad(prompts, width, tok.pad_token_id)
    extra = np.array([{"interaction_kwargs": {"name": "check", "ground_truth": "5"}}, {}], dtype=object)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": extra})
    u = len(_ids(tok, f"\n<|im_start|>user\n{RETRY}<|im_end|>\n<|im_start|>assistant\n"))
    a, end = len(wrong), len(wrong) + u + len(right)
    for mode, weight, where in (("per_turn", 1.0, {a - 1: 0.5, end - 1: 1.0}), ("final", 2.0, {end - 1: 3.0}), ("none", 1.0, {})):
        cfg = RolloutMultiTurnConfig(enable=True, interaction_reward=mode, interaction_reward_weight=weight)
        loop = AgentLoop(cfg, [], tok, response_length=100, interactions=_checker(wrong_reward=0.5))
        engine = ScriptedEngine(tok, lambda ctx: wrong if len(ctx) in first else right, eos=eos)
        out = loop.generate(engine, batch)
        assert [list(s) for s in out["turn_scores"]] == [[0.5, 1.0], []]
        want = torch.zeros(2, 100)
        for pos, value in where.items():
            want[0, pos] = value
        assert torch.equal(out["interaction_scores"], want), mode
        assert int(out["response_mask"][1].sum()) == a  # the sample without an interaction answered once
        base = torch.zeros(2, 100)
        base[0, end - 1] = 1.0  # the rule-based score at the last token
        folded, m = fold_turn_scores(out, base)
        assert torch.equal(folded, base + want) and m["reward/interaction/mean"] == pytest.approx(float(want.sum()) / 2)
        assert loop.last_metrics["interaction/reward/mean"] == 1.5 and loop.last_metrics["agent/stop/interaction"] == 0.5
    assert fold_turn_scores(Batch.from_dict({"x": torch.zeros(2, 3)}), base) == (base, {})


def test_interaction_config_yaml_and_reference_style_classes(tmp_path, tokenizer):
    from verl.rollout.agent import AnswerCheckInteraction, load_interaction_config

    cls = f"{__name__}.RefStyleInteraction"
    path = tmp_path / "interaction.yaml"
    path.write_text(
        "interaction:\n"
        "  - {name: check, class_name: answer_check, config: {max_attempts: 3, scorer: openai/gsm8k}}\n"
        f"  - {{name: echo, class_name: {cls}, config: {{reward: 0.25}}}}\n"
    )
    got = load_interaction_config(str(path))
    assert isinstance(got["check"], AnswerCheckInteraction) and got["check"].max_attempts == 3
    assert isinstance(got["echo"], RefStyleInteraction) and got["echo"].config == {"reward": 0.25}
    # The reference's async methods run to completion; its (done, text, score, extra) is read.
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "Hi")
    said = _chars(tok, "hello") + [eos]
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=200, interactions=got)
    [t] = loop.run(ScriptedEngine(tok, lambda ctx: said, eos=eos), [prompt], _spec(), interaction_kwargs=[{"name": "echo"}])
    assert (t.opening, t.prompt_ids, t.messages[0]["role"]) == (None, prompt, "assistant") and t.stop_reason == "interaction"
    assert [r for _, r in t.turn_scores] == [0.25, 0.25] and t.user_turns == 1
    assert RefStyleInteraction.finalized  # finalize_interaction ran at the end
    for text, needle in (
        ("interaction: []\n", "'interaction' list is empty"),
        ("tools: []\n", "a mapping with a 'interaction' list"),
        ("interaction:\n  - {class_name: answer_check, extra: 1}\n", "unknown key"),
        ("interaction:\n  - {class_name: answer_check, config: {max_atempts: 2}}\n", "check its config keys"),
        ("interaction:\n  - {class_name: no.such.Module}\n", "cannot import"),
        ("interaction:\n  - {class_name: answer_check}\n  - {class_name: answer_check}\n", "names must be distinct"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_interaction_config(str(path))
    with pytest.raises(ValueError, match="no such file"):
        load_interaction_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="is not configured"):
        loop.run(ScriptedEngine(tok, lambda ctx: said, eos=eos), [prompt], _spec(), interaction_kwargs=[{"name": "nope"}])
    with pytest.raises(ValueError, match="no 'name'"):
        loop.run(ScriptedEngine(tok, lambda ctx: said, eos=eos), [prompt], _spec(), interaction_kwargs=[{}])
    with pytest.raises(ValueError, match="interaction_config_path"):
        _loop(tok).run(ScriptedEngine(tok, lambda ctx: said, eos=eos), [prompt], _spec(), interaction_kwargs=[{"x": 1}])


class RefStyleInteraction:
    """The reference verl's shape: one config dict, async methods, (done, text, score, extra)."""

    finalized = False

    def __init__(self, config):
        self.config, self.turns = config, {}

    async def start_interaction(self, instance_id, **kwargs):
        self.turns[instance_id] = 0
        return instance_id  # the reference's return value: the instance id, not an opening text

    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == "hello"
        return self.turns[instance_id] >= 2, "say it again", self.config["reward"], {}

    async def finalize_interaction(self, instance_id):
        type(self).finalized = True


OPENING = "Show your work."


class _Opens:
    """Opens every conversation with ``OPENING`` (a user turn); the first answer ends it, reward 1."""

    name = "opens"

    def start_interaction(self, instance_id, **kwargs):
        return kwargs.get("opening", OPENING)

    def generate_response(self, instance_id, messages, **kwargs):
        return True, "", 1.0, {}


def _odd_prompt(tok, question: str) -> list[int]:
    """``question``'s prompt with the question one token per character: ids the tokenizer would
    not produce from the text, so a decode and re-encode of the prompt would change them."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    before, after = text.split(question)
    return _ids(tok, before) + _chars(tok, question) + _ids(tok, after)


def test_interaction_opening_is_a_user_turn_in_the_prompt_ids(tokenizer):
    """start_interaction's text: the template's user turn after the prompt, on the prompt side
    (the engine reads it, no loss on it); the dataset's prompt ids are kept as they are."""
    tok = tokenizer
    eos = tok.eos_token_id
    question = "What is 2+3?"
    prompt = _odd_prompt(tok, question)
    gen = _ids(tok, "<|im_start|>assistant\n")
    assert prompt[-len(gen):] == gen
    # ChatML: the prompt without its generation prompt, the user turn, the generation prompt again.
    expected_prompt = prompt[: -len(gen)] + _ids(tok, f"<|im_start|>user\n{OPENING}<|im_end|>\n<|im_start|>assistant\n")
    conv = [{"role": "user", "content": question}, {"role": "user", "content": OPENING}]
    assert tok.decode(expected_prompt) == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert _ids(tok, tok.decode(expected_prompt)) != expected_prompt  # a decode + re-encode would change them
    answer = _chars(tok, "Answer: 5") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: answer, eos=eos)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=60, interactions={"opens": _Opens()})
    [t] = loop.run(engine, [prompt], _spec(), interaction_kwargs=[{"name": "opens"}])
    assert t.prompt_ids == expected_prompt and t.opening == OPENING
    assert engine.calls[0][0] == [expected_prompt]  # the model's first turn reads the opening
    assert (t.response_ids, t.loss_mask) == (answer, [1] * len(answer))  # the response starts at the first sampled id
    assert t.messages[0] == {"role": "user", "content": OPENING} and t.messages[1]["role"] == "assistant"
    assert t.turn_scores == [(len(answer) - 1, 1.0)] and t.stop_reason == "interaction"
    # The instance id (the reference's return value), None and "" open nothing.
    for value in ("{id}", None, ""):
        class _Quiet(_Opens):
            def start_interaction(self, instance_id, **kwargs):
                return instance_id if value == "{id}" else value

        quiet = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=60, interactions={"q": _Quiet()})
        [t] = quiet.run(ScriptedEngine(tok, lambda ctx: answer, eos=eos), [prompt], _spec(), interaction_kwargs=[{}])
        assert (t.prompt_ids, t.opening, t.messages[0]["role"]) == (prompt, None, "assistant")


def test_interaction_opening_in_the_batch_prompt_columns(tokenizer):
    """The opened row's prompt columns hold its new prompt ids left-padded to the batch's width;
    the other row keeps the dataset's; a prompt the opening makes too long is refused before sampling."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompts = [_prompt(tok, "What is 2+3?"), _prompt(tok, "Hi")]
    width = max(map(len, prompts)) + 16
    ids, mask = left_pad(prompts, width, tok.pad_token_id)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    raw = np.empty(2, dtype=object)
    raw[0], raw[1] = list(prompts[0]), list(prompts[1])
    extra = np.array([{"interaction_kwargs": {"name": "opens"}}, {}], dtype=object)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, {"extra_info": extra, "raw_prompt_ids": raw})
    answer = _ids(tok, "5") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: answer, eos=eos)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=20, interactions={"opens": _Opens()})
    out = loop.generate(engine, batch)
    gen = _ids(tok, "<|im_start|>assistant\n")
    opened = prompts[0][: -len(gen)] + _ids(tok, f"<|im_start|>user\n{OPENING}<|im_end|>\n<|im_start|>assistant\n")
    k = len(opened)
    assert k <= width and out["prompts"].shape == (2, width)
    assert out["prompts"][0, width - k :].tolist() == opened and (out["prompts"][0, : width - k] == tok.pad_token_id).all()
    assert out["attention_mask"][0, :width].tolist() == [0] * (width - k) + [1] * k
    assert out["position_ids"][0, width - k : width].tolist() == list(range(k))
    assert out["position_ids"][0, width:].tolist() == list(range(k, k + 20))
    assert torch.equal(out["input_ids"][0, :width], out["prompts"][0]) and out["raw_prompt_ids"][0] == opened
    assert torch.equal(out["prompts"][1], ids[1]) and out["raw_prompt_ids"][1] == prompts[1]  # no interaction: as given
    assert engine.calls[0][0] == [opened, prompts[1]]
    assert out["response_mask"][0, : len(answer)].all() and int(out["response_mask"][0].sum()) == len(answer)
    long = {"interaction_kwargs": {"name": "opens", "opening": "word " * width}}
    too_long = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": np.array([long, {}], dtype=object)})
    calls = len(engine.calls)
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        loop.generate(engine, too_long)
    assert len(engine.calls) == calls  # refused before the engine was called


def test_transformers_engine_with_an_opening_logprobs_match_trainer(tiny_models, tokenizer):
    """Real samples after an opening turn: the engine's log-probs equal a plain forward pass over
    the assembled batch (whose prompt columns hold the opening)."""
    from transformers import AutoModelForCausalLM

    from verl.rollout.hf_engine import HFRollout, hf_response_logprobs

    tok = tokenizer
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, prompt_length=48, response_length=12, seed=5)
    engine = HFRollout(cfg, tiny_models["qwen2"], tokenizer=tok, device="cpu")
    prompts = [_prompt(tok, "6 times 7?"), _prompt(tok, "hello")]
    ids, mask = left_pad(prompts, 48, tok.pad_token_id)
    extra = np.array([{"interaction_kwargs": {}}, {}], dtype=object)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=12, interactions={"opens": _Opens()})
    out = loop.generate(engine, Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": extra}), seed=11)
    assert int(out["attention_mask"][0, :48].sum()) > len(prompts[0]) and int(out["attention_mask"][2, :48].sum()) == len(prompts[1])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    actual = hf_response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=12)
    sampled = out["response_mask"].bool()
    # float32, different padding per call: ~1e-6; 1e-4 still catches a shifted position (>= 1e-2).
    torch.testing.assert_close(actual[sampled], out["rollout_log_probs"][sampled], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- per-sample agent settings


def test_agent_name_per_sample(tokenizer):
    """``single_turn_agent`` samples stop after one model turn (its tool call is not run);
    ``tool_agent`` (and no name) run the loop; an unknown name is refused."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 2+3?")
    call = _ids(tok, CALL.format(name="calculator", args='{"expression": "2+3"}')) + [eos]
    done = _ids(tok, "5") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: call if len(ctx) == len(prompt) else done, eos=eos)
    one, loop_, plain = _loop(tok).run(
        engine, [prompt, prompt, prompt], _spec(), agent_names=["single_turn_agent", "tool_agent", None]
    )
    assert (one.response_ids, one.stop_reason, one.calls) == (call, "answer", [])
    for t in (loop_, plain):
        assert t.stop_reason == "answer" and t.user_turns == 1 and t.response_ids[-len(done):] == done
    with pytest.raises(ValueError, match="agent_name='react_agent'"):
        _loop(tok).run(engine, [prompt], _spec(), agent_names=["react_agent"])


# --------------------------------------------------------------------------- custom agent loops

FOLLOW_UP = "Are you sure?"

from verl.rollout.agent import AgentLoopBase, register  # noqa: E402 - the registered class below needs them


@register("two_turn_agent")
class TwoTurnAgent(AgentLoopBase):
    """Answers, hears a fixed user turn, answers again; reward 1 on a complete second answer."""

    def __init__(self, follow_up: str = FOLLOW_UP) -> None:
        super().__init__(follow_up=follow_up)
        self.follow_up = follow_up

    async def run(self, conversation) -> None:
        await conversation.generate()
        if conversation.stopped or not conversation.add_messages([{"role": "user", "content": self.follow_up}]):
            return
        await conversation.generate()
        if not conversation.stopped:  # a second answer the budget cut earns nothing
            conversation.reward(1.0)


def test_custom_agent_loop_trajectory_exact(tokenizer):
    """A registered loop, selected per sample by agent_name: its model turns are the engine's ids
    (asked for together in one engine call per round), its user turn the template's, out of the loss."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 2+3?")
    first, second = _chars(tok, "Answer: 4") + [eos], _chars(tok, "Answer: 5") + [eos]
    user_turn = _ids(tok, f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n")
    engine = ScriptedEngine(tok, lambda ctx: first if len(ctx) == len(prompt) else second, eos=eos)
    custom, builtin = _loop(tok).run(engine, [prompt, prompt], _spec(n=1), agent_names=["two_turn_agent", None])
    a, u = len(first), len(user_turn)
    assert custom.response_ids == first + user_turn + second
    assert custom.loss_mask == [1] * a + [0] * u + [1] * len(second)
    p = len(prompt)
    assert custom.logprobs == [-(p + k) / 1000 for k in range(a)] + [0.0] * u + [-(p + a + u + k) / 1000 for k in range(len(second))]
    assert [x["role"] for x in custom.turns] == ["assistant", "user", "assistant"]
    assert custom.turn_scores == [(a + u + len(second) - 1, 1.0)] and custom.stop_reason == "answer"
    assert (custom.assistant_turns, custom.user_turns, custom.agent_name) == (2, 1, "two_turn_agent")
    assert builtin.response_ids == first and builtin.stop_reason == "answer"
    # Two custom conversations: each round's two contexts go to the engine in one call.
    engine = ScriptedEngine(tok, lambda ctx: first if len(ctx) == len(prompt) else second, eos=eos)
    both = _loop(tok).run(engine, [prompt], _spec(n=2), agent_names=["two_turn_agent"])
    assert [t.response_ids for t in both] == [first + user_turn + second] * 2
    assert [len(c[0]) for c in engine.calls] == [2, 2] and engine.calls[1][0] == [prompt + first + user_turn] * 2
    # The budget cuts the second answer: stop "length", no reward.
    [cut] = _loop(tok, response_length=a + u + 3).run(
        ScriptedEngine(tok, lambda ctx: first if len(ctx) == len(prompt) else second, eos=eos), [prompt], _spec(),
        agent_names=["two_turn_agent"])
    assert (cut.response_ids, cut.stop_reason, cut.turn_scores) == (first + user_turn + second[:3], "length", [])


def test_custom_agent_loop_through_the_transformers_engine(tiny_models, tokenizer):
    """The registered loop on the tiny Qwen2 through ``AgentLoop.generate`` (agent_name from
    extra_info): engine log-probs equal a plain forward pass over the assembled batch; the user
    turn is out of the loss; the loop's rewards reach ``interaction_scores``."""
    from transformers import AutoModelForCausalLM

    from verl.rollout.hf_engine import HFRollout, hf_response_logprobs

    tok = tokenizer
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, prompt_length=32, response_length=40, seed=5)
    engine = HFRollout(cfg, tiny_models["qwen2"], tokenizer=tok, device="cpu")
    prompts = [_prompt(tok, "6 times 7?"), _prompt(tok, "hello")]
    ids, mask = left_pad(prompts, 32, tok.pad_token_id)
    extra = np.array([{"agent_name": "two_turn_agent"}, {"agent_name": "single_turn_agent"}], dtype=object)
    real_sample = engine._sample

    def short_turns(prompts_, spec):  # the random model rarely ends a turn: each turn ends after 8 sampled tokens
        return [Sample(token_ids=x.token_ids[:8], logprobs=x.logprobs[:8], hit_length_limit=False) for x in real_sample(prompts_, spec)]

    engine._sample = short_turns
    loop = _loop(tok, response_length=40)
    out = loop.generate(engine, Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": extra}), seed=11)
    assert list(out["num_turns"]) == [4, 4, 2, 2]
    user_turn = _ids(tok, f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n")
    for row in range(2):
        turns = out["agent_turns"][row]
        assert [x["role"] for x in turns] == ["assistant", "user", "assistant"]
        span = out["responses"][row, turns[1]["start"] : turns[1]["end"]].tolist()
        assert span[-len(user_turn):] == user_turn and not out["response_mask"][row, turns[1]["start"] : turns[1]["end"]].any()
        assert out["interaction_scores"][row, turns[2]["end"] - 1] == 1.0 and float(out["interaction_scores"][row].sum()) == 1.0
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    actual = hf_response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], response_length=40)
    sampled = out["response_mask"].bool()
    # float32, different padding per call: ~1e-6; 1e-4 still catches a shifted position (>= 1e-2).
    torch.testing.assert_close(actual[sampled], out["rollout_log_probs"][sampled], atol=1e-4, rtol=0)
    assert loop.last_metrics["num_turns/max"] == 4 and loop.last_metrics["interaction/reward/mean"] == 1.0


def test_agent_loop_config_yaml_and_unknown_names(tmp_path, tokenizer):
    from verl.rollout.agent import known_agent_names, load_agent_loop_config

    path = tmp_path / "agents.yaml"
    path.write_text(f"- name: polite\n  _target_: {__name__}.TwoTurnAgent\n  follow_up: Please check again.\n")
    got = load_agent_loop_config(str(path))
    assert isinstance(got["polite"], TwoTurnAgent) and got["polite"].follow_up == "Please check again."
    assert known_agent_names(got)[:2] == ["tool_agent", "single_turn_agent"] and {"polite", "two_turn_agent"} <= set(known_agent_names(got))
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "Hi")
    said = _chars(tok, "hello") + [eos]
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=80, agent_loops=got)
    [t] = loop.run(ScriptedEngine(tok, lambda ctx: said, eos=eos), [prompt], _spec(), agent_names=["polite"])
    assert t.messages[1] == {"role": "user", "content": "Please check again."} and t.assistant_turns == 2
    for text, needle in (
        ("- name: x\n", "name and _target_"),
        ("- {name: tool_agent, _target_: a.B}\n", "built-in agent loop"),
        ("- {name: x, _target_: no.such.Agent}\n", "cannot import 'no.such'"),
        (f"- {{name: x, _target_: {__name__}.TwoTurnAgent}}\n- {{name: x, _target_: {__name__}.TwoTurnAgent}}\n", "names must be distinct"),
        (f"- {{name: x, _target_: {__name__}._Opens}}\n", "not a subclass of verl.rollout.agent.AgentLoopBase"),
        (f"- {{name: x, _target_: {__name__}.TwoTurnAgent, follow_ups: 1}}\n", "check its keys"),
        ("[]\n", "non-empty list"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_agent_loop_config(str(path))
    with pytest.raises(ValueError, match="no such file"):
        load_agent_loop_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="built-in agent loop"):
        register("single_turn_agent")
    with pytest.raises(ValueError, match="async def run"):
        register("sync_agent")(type("SyncAgent", (AgentLoopBase,), {"run": lambda self, c: None}))
    # An unknown name is refused before the engine is called, naming every known loop.
    engine = ScriptedEngine(tok, lambda ctx: said, eos=eos)
    with pytest.raises(ValueError, match=r"agent_name='react_agent'.*known: \['tool_agent', 'single_turn_agent', .*'polite'.*'two_turn_agent'"):
        loop.run(engine, [prompt, prompt], _spec(), agent_names=[None, "react_agent"])
    assert engine.calls == []


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_data_tool_config_path_renders_schemas_into_prompts(tiny_models, tokenizer, tmp_path):
    """``data.tool_config_path``: prompts go through ``apply_chat_template(tools=...)`` when the
    template writes tools; a template that ignores them leaves the prompts as they were."""
    from transformers import AutoTokenizer

    from verl.data.io import write_parquet
    from verl.data.rl_dataset import RLPromptDataset

    tok = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    tok.chat_template = TOOLS_TEMPLATE
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    write_parquet(
        [{"prompt": messages, "data_source": "verl/arithmetic", "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 0}}],
        str(tmp_path / "d.parquet"),
    )
    with_tools = tok.apply_chat_template(messages, tools=[CalculatorTool().schema], add_generation_prompt=True, tokenize=False)
    plain = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert '"calculator"' in with_tools and with_tools.endswith(plain)

    def prompt_ids(t, path):
        return list(RLPromptDataset(str(tmp_path / "d.parquet"), t, max_prompt_length=400, tool_config_path=path)[0]["raw_prompt_ids"])

    assert prompt_ids(tok, str(tools)) == _ids(tok, with_tools)
    assert prompt_ids(tok, None) == _ids(tok, plain)
    # The tiny model's own template has no tools block: prompts stay as without the file.
    assert prompt_ids(tokenizer, str(tools)) == _prompt(tokenizer, "What is 2+3?")
    with pytest.raises(ValueError, match="data.tool_config_path: .*no such file"):
        prompt_ids(tok, str(tmp_path / "no.yaml"))


# --------------------------------------------------------------------------- retrieval (BM25)

CORPUS = [
    {"contents": '"Paris"\nParis is the capital of France.'},
    {"title": "Berlin", "text": "Berlin is the capital of Germany and its largest city."},
    {"contents": "Rome was not built in a day."},
]


def _corpus(tmp_path) -> str:
    import json

    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in CORPUS) + "\n")
    return str(path)


def test_retrieval_tool_bm25_ranks_as_hand_worked(tmp_path):
    pytest.importorskip("rank_bm25")
    import math

    from verl.rollout.agent import RetrievalTool

    tool = RetrievalTool(corpus_path=_corpus(tmp_path), top_k=2)
    assert [t for t, _ in tool.docs] == ["Paris", "Berlin", ""]
    # "germany" is in document 1 only: Okapi BM25 with k1=1.5, b=0.75 by hand.
    lengths = [7, 11, 7]  # terms of title + text per document
    avgdl, n_docs, k1, b = sum(lengths) / 3, 3, 1.5, 0.75
    idf = math.log((n_docs - 1 + 0.5) / (1 + 0.5))
    want = idf * (1 * (k1 + 1)) / (1 + k1 * (1 - b + b * lengths[1] / avgdl))
    [(i, score)] = tool.search("Germany?")
    assert i == 1 and score == pytest.approx(want, rel=1e-9)  # float64 rounding only
    out = tool.call("c", {"query": "capital of Germany"})
    assert out.splitlines()[0].startswith("Doc 1 (Title: Berlin) Berlin is the capital")
    assert out.splitlines()[1].startswith("Doc 2 (Title: Paris)") and len(out.splitlines()) == 2
    assert tool.call("c", {"query": "zebra"}) == "No documents match the query."
    assert tool.call("c", {"query": "?!"}) == "No documents match the query."
    # Through the YAML config under its registered name, and the loop's argument check.
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(f"tools:\n  - class_name: retrieval\n    config: {{corpus_path: {_corpus(tmp_path)}, top_k: 1, name: wiki}}\n")
    [wiki] = load_tool_config(str(cfg))
    assert wiki.name == "wiki" and wiki.call("c", {"query": "Rome"}) == "Doc 1 Rome was not built in a day."
    for bad, needle in (("nope.jsonl", "is not a file"), ("bad.jsonl", "line 1 is not JSON")):
        (tmp_path / "bad.jsonl").write_text("{oops\n")
        with pytest.raises(ValueError, match=needle):
            RetrievalTool(corpus_path=str(tmp_path / bad))


def test_retrieval_tool_refused_without_rank_bm25(tmp_path, monkeypatch):
    import sys

    from verl.rollout.agent import RetrievalTool

    monkeypatch.setitem(sys.modules, "rank_bm25", None)  # import rank_bm25 now raises ImportError
    with pytest.raises(ValueError, match=r"rank_bm25 library, which is not installed: pip install 'verl\[retrieval\]'"):
        RetrievalTool(corpus_path=_corpus(tmp_path))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(f"tools:\n  - class_name: retrieval\n    config: {{corpus_path: {_corpus(tmp_path)}}}\n")
    with pytest.raises(ValueError, match="not installed"):
        load_tool_config(str(cfg))


def test_reward_steps_fold_interaction_scores_once():
    """The three places that write ``token_level_scores`` add an agent batch's
    ``interaction_scores`` exactly once (MultiRewardScorer: not once per weighted part)."""
    import contextlib
    import types

    from verl.roles.reward_model import RewardResult
    from verl.trainer.step.ops import MultiRewardScorer, RewardOperator
    from verl.trainer.step.pieces import StepPieces

    base = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    extra = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = Batch.from_dict({"responses": torch.zeros(2, 3, dtype=torch.long), "response_mask": torch.ones(2, 3),
                             "interaction_scores": extra})
    fake = types.SimpleNamespace(
        reward=types.SimpleNamespace(score=lambda b: RewardResult(token_level_scores=base.clone(), scores=base.sum(-1))),
        phase=lambda name: contextlib.nullcontext(), global_step=0,
    )
    fake.place_scores = lambda b, scores: StepPieces.place_scores(fake, b, scores)  # (each path ends in it)
    out, m = StepPieces.compute_reward(fake, batch)
    assert torch.equal(out["token_level_scores"], base + extra) and m["reward/interaction/mean"] == 0.25

    class Fixed(RewardOperator):
        def _score(self, b):
            return base.clone(), {}, {}

    op = Fixed(name="fixed")
    op._trainer = fake
    out, m = op.process(batch)
    assert torch.equal(out["token_level_scores"], base + extra) and m["reward_mean"] == 1.75
    multi = MultiRewardScorer([(Fixed(name="a"), 0.5), (Fixed(name="b"), 0.5)])
    multi._trainer = fake
    out, m = multi.process(batch)
    assert torch.equal(out["token_level_scores"], base + extra) and m["reward_mean"] == 1.75


# --------------------------------------------------------------------------- answers of megabytes (#58)

_HUGE = "".join(f"line {i}: some words of a tool's log\n" for i in range(300_000))  # ~10 MB


class _Huge(Tool):
    schema = {"type": "function", "function": {"name": "dump", "description": "", "parameters": {"type": "object", "properties": {}}}}

    def call(self, instance_id, arguments):
        return _HUGE


@pytest.fixture
def encoded_lengths(tokenizer, monkeypatch):
    """The length of every text the tokenizer encodes while the test runs."""
    lengths, encode = [], tokenizer.encode

    def recording(text, *args, **kwargs):
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return lengths


def _reference_truncate(tok, text: str, limit: int, side: str) -> str:
    """The cut as it was before #58: the whole text tokenized, then cut."""
    ids, mark, dec = tok.encode(text, add_special_tokens=False), "...(truncated)...", tok.decode
    if len(ids) <= limit:
        return text
    if side == "left":
        return mark + dec(ids[-limit:])
    if side == "right":
        return dec(ids[:limit]) + mark
    head = limit // 2
    return dec(ids[:head]) + mark + dec(ids[len(ids) - (limit - head) :])


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_a_10_mb_tool_answer_is_cut_before_it_is_tokenized(tokenizer, encoded_lengths, side):
    """#58: the whole answer was tokenized before the cut (6.6 s and +1.4 GB per call)."""
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "q")
    call = _ids(tok, CALL.format(name="dump", args="{}")) + [eos]
    done = _ids(tok, "ok") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: call if len(ctx) == len(prompt) else done, eos=eos)
    loop = _loop(tok, tools=[_Huge()], response_length=1024, tool_response_truncate_side=side)
    start = time.perf_counter()
    [t] = loop.run(engine, [prompt], _spec())
    took = time.perf_counter() - start
    # At most limit * max_chars_per_token characters of each kept end were tokenized, never the answer.
    span = loop.cfg.max_tool_response_length * loop.encoder.max_chars_per_token
    assert max(encoded_lengths) <= span < len(_HUGE) // 10, (max(encoded_lengths), span)
    assert took < 30, f"{took:.1f} s"  # ~0.2 s quiet; room for a loaded machine (the uncut answer: 6.6 s quiet)
    assert t.stop_reason == "answer" and [x["role"] for x in t.turns] == ["assistant", "tool", "assistant"]
    text = t.messages[1]["content"]  # the answer's kept ends around the mark (the cut itself: the test below)
    head, tail = text.split("...(truncated)...")
    assert _HUGE.startswith(head) and _HUGE.endswith(tail) and 0 < len(head + tail) < 10_000
    assert (head == "", tail == "") == (side == "left", side == "right")
    # Token-exact: the tool turn's ids are the template's rendering of the cut text, and the engine's
    # next context is the prompt plus exactly the trajectory's ids.
    turn = t.response_ids[t.turns[1]["start"] : t.turns[1]["end"]]
    assert turn == loop.encoder.encode([{"role": "tool", "content": text}], model_ended_turn=True)
    assert len(turn) <= loop.cfg.max_tool_response_length + 32 and len(t.response_ids) <= 1024
    assert engine.calls[1][0] == [prompt + call + turn]


def test_a_10_mb_answer_over_the_remaining_budget_is_left_out_without_tokenizing_it(tokenizer, encoded_lengths):
    """max_tool_response_length above the budget: the cut is the budget's, and the turn (which could
    not fit) is left out, stop ``length``, as it was when the whole answer was tokenized."""
    tok = tokenizer
    eos = tok.eos_token_id
    call = _ids(tok, CALL.format(name="dump", args="{}")) + [eos]
    engine = ScriptedEngine(tok, lambda ctx: call, eos=eos)
    loop = _loop(tok, tools=[_Huge()], response_length=300, max_tool_response_length=1_000_000)
    [t] = loop.run(engine, [_prompt(tok, "q")], _spec())
    assert max(encoded_lengths) <= 300 * loop.encoder.max_chars_per_token
    assert t.stop_reason == "length" and t.response_ids == call and [x["role"] for x in t.turns] == ["assistant"]
    assert [c.name for c in t.calls] == ["dump"]  # the call ran; its turn did not fit


@pytest.mark.parametrize("side", ["left", "middle", "right"])
@pytest.mark.parametrize("limit", [1, 7, 40])
def test_the_cut_of_a_long_answer_equals_the_whole_answers_cut(tokenizer, side, limit):
    """Tokenizing only the kept ends gives the cut that tokenizing everything gave (on text longer
    than ``limit * max_chars_per_token``, where only the ends are tokenized)."""
    rng = np.random.default_rng(limit)
    words = ["alpha", "beta", " ", "\n", "ü", "数据", "1234", "{\"k\": [1, 2]}", "\t\t", "tokenizer", "!!"]
    loop = _loop(tokenizer, max_tool_response_length=limit, tool_response_truncate_side=side)
    span = limit * loop.encoder.max_chars_per_token
    text = ""
    while len(text) <= 3 * span:
        text += "".join(rng.choice(words, size=2000))
    expected = _reference_truncate(tokenizer, text, limit, side)
    actual = loop._truncate(text, room=10_000)
    assert actual == expected
    short = text[: span // 4]  # tokenized whole, as before
    assert loop._truncate(short, room=10_000) == _reference_truncate(tokenizer, short, limit, side)


def test_a_custom_loops_10_mb_message_is_left_out_without_tokenizing_it(tokenizer, encoded_lengths):
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = _prompt(tok, "q")
    first = _ids(tok, "4") + [eos]
    engine = ScriptedEngine(tok, lambda ctx: first, eos=eos)
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [CalculatorTool()], tok, response_length=1024,
                     agent_loops={"huge": TwoTurnAgent(follow_up=_HUGE)})
    [t] = loop.run(engine, [prompt], _spec(), agent_names=["huge"])
    assert max(encoded_lengths) < 100_000
    assert (t.response_ids, t.stop_reason, t.user_turns) == (first, "length", 0)
