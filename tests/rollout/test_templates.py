"""Token-exact multi-turn rollouts for each chat-template family (verl.rollout.agent.templates,
verl.rollout.agent.turns).

No model hub here: each family's chat template is written below from what the family's published
template does (ChatML turns, Qwen's <tool_response> user turns, Qwen3's dropped reasoning and
thinking switch, Llama 3.1's header turns, dated system turn and JSON-encoded ipython results,
SmolLM2's default system turn), with a tiny byte-level BPE tokenizer made here holding the
family's special tokens and its pre-tokenizer pattern. transformers' ``apply_chat_template``
renders them; the agent loop's trajectories are compared with those renderings.

The scripted conversation of every family: a prompt; a model turn with two tool calls; a tool
turn of two consecutive tool messages; a model turn with one call; a tool turn; the answer.
"""

from __future__ import annotations

import functools
import json
import logging

import pytest

from verl.config.schema import RolloutConfig, RolloutMultiTurnConfig
from verl.rollout.agent import AgentLoop, FunctionTool
from verl.rollout.agent.templates import check_template, detect_family
from verl.rollout.agent.turns import ToolTurnEncoder
from verl.rollout.base import Sample, SamplingSpec
from verl.testing.engines import WeightlessEngine

pytestmark = pytest.mark.timeout(120)

# --------------------------------------------------------------------------- the families' templates

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

QWEN3_CODER = (
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if tools is iterable and tools | length > 0 %}{{- '<|im_start|>system\\n' }}"
    "{%- if system_message is defined %}{{- system_message + '\\n\\n' }}"
    "{%- else %}{{- 'You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{%- set f = tool.function %}{{- '\\n<function>\\n<name>' + f.name + '</name>' }}"
    "{{- '\\n<parameters>' }}{%- for name, p in f.parameters.properties.items() %}"
    "{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + p.type + '</type>\\n</parameter>' }}{%- endfor %}"
    "{{- '\\n</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif system_message is defined %}{{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content | trim }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n<function=' + tc.name + '>\\n' }}"
    "{%- for k, v in tc.arguments.items() %}{{- '<parameter=' + k + '>\\n' }}"
    "{%- if v is string %}{{- v }}{%- else %}{{- v | tojson }}{%- endif %}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role in ['user', 'system', 'assistant'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA31 = (
    "{{- bos_token }}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools_in_user_message and not tools is none %}"
    "{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{{- raise_exception('Cannot put tools in the first user message when there is no first user message!') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call ' }}"
    "{{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}"
    "{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>'}}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The families' pre-tokenizer patterns (Llama 3 groups up to three digits, Qwen2 one).
_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
_LLAMA_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]

FAMILIES = {
    # name: (template, special tokens, added plain tokens, bos, eos, pad, digits pattern, template kwargs)
    "qwen2.5": (QWEN25, _CHATML_SPECIALS, _QWEN_ADDED, None, "<|im_end|>", "<|endoftext|>", "", {}),
    "qwen3": (QWEN3, _CHATML_SPECIALS, _QWEN_ADDED, None, "<|im_end|>", "<|endoftext|>", "", {}),
    "qwen3_coder": (QWEN3_CODER, _CHATML_SPECIALS, _QWEN_ADDED, None, "<|im_end|>", "<|endoftext|>", "", {}),
    "llama3": (LLAMA31, _LLAMA_SPECIALS, [], "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "{1,3}", {}),
    "chatml": (SMOLLM2, _CHATML_SPECIALS, [], None, "<|im_end|>", "<|endoftext|>", "", {}),
}


@functools.lru_cache(maxsize=None)
def family_tokenizer(family: str):
    """A tiny byte-level BPE tokenizer with ``family``'s special tokens, pre-tokenizer and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, added, bos, eos, pad, digits, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_PATTERN % digits), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "What is (2+3)*(4+5)? Let me add first, then multiply. The answer is 45.",
        'Call a tool: {"name": "add", "arguments": {"a": 2, "b": 3}} or {"name": "mul", "parameters": {"a": 5, "b": 9}}',
        "<function=add>\n<parameter=a>\n2\n</parameter>\n</function> You are a helpful assistant. Are you sure? Yes.",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=None,
        additional_special_tokens=[t for t in specials if t not in (bos, eos, pad)], chat_template=template,
        model_max_length=None, clean_up_tokenization_spaces=False,
    )
    if added:
        out.add_tokens(added)  # Qwen's <tool_call>, <think>...: added tokens, not special ones
    return out


# --------------------------------------------------------------------------- a scripted engine


class Scripted(WeightlessEngine):
    """Answers model turn k with ``turns[k]`` (ids); records every context it is given. The
    log-prob of a sampled token names its place: -(context length + k) / 1000."""

    def __init__(self, tok, turns) -> None:
        super().__init__(RolloutConfig(name="hf", response_length=64, prompt_length=64), pad_token_id=tok.pad_token_id)
        self.turns, self.contexts, self.samples = [list(t) for t in turns], [], []

    def _sample(self, prompts, spec: SamplingSpec):
        out = []
        for p in prompts:
            ids = self.turns[len(self.samples)] if len(self.samples) < len(self.turns) else self.turns[-1]
            ids = ids[: spec.max_tokens]
            self.contexts.append(list(p))
            self.samples.append(ids)
            lps = [-(len(p) + k) / 1000 for k in range(len(ids))]
            out.append(Sample(token_ids=ids, logprobs=lps, hit_length_limit=False))
        return out


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def mul(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


TOOLS = [FunctionTool(add), FunctionTool(mul)]
SCHEMAS = [t.schema for t in TOOLS]
QUESTION = "What is (2+3)*(4+5)?"


def call_text(family: str, calls: list[tuple[str, dict]]) -> str:
    """The model's text for ``calls`` in its family's syntax, as its template writes an assistant turn's calls."""
    if family == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if family == "qwen3_coder":
        return "\n".join(
            f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
            for n, a in calls
        )
    return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


def script(family: str, *, thinking: bool = False) -> list[str]:
    """The three model turns' texts (what the model writes after the generation prompt, end token excluded)."""
    think = (lambda r: f"<think>\n{r}\n</think>\n\n") if thinking else (lambda r: "")
    return [
        think("Two sums first.") + call_text(family, [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]),
        think("Now the product.") + call_text(family, [("mul", {"a": 5, "b": 9})]),
        think("Done.") + "The answer is 45.",
    ]


def conversation(texts: list[str]) -> list[dict]:
    """The whole conversation as chat messages (assistant turns as their raw text)."""
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "9"},
        {"role": "assistant", "content": texts[1]},
        {"role": "tool", "content": "45"},
        {"role": "assistant", "content": texts[2]},
    ]


MODEL_TURNS = (1, 4, 6)  # where the model's turns are in conversation()


def run_family(family: str, texts: list[str], **template_kwargs):
    """The scripted conversation through the agent loop: (trajectory, engine, tokenizer)."""
    tok = family_tokenizer(family)
    encode = functools.partial(tok.encode, add_special_tokens=False)
    prompt = encode(tok.apply_chat_template(conversation(texts)[:1], tools=SCHEMAS, add_generation_prompt=True, tokenize=False, **template_kwargs))
    engine = Scripted(tok, [encode(t) + [tok.eos_token_id] for t in texts])
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True, max_parallel_calls=2, format="auto"), TOOLS, tok, response_length=400)
    [traj] = loop.run(engine, [prompt], SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64))
    return traj, engine, tok, loop


def check_ids_and_mask(traj, engine) -> None:
    """The trajectory is exactly the ids the engine saw and sampled; the loss mask is 1 on sampled ids only."""
    assert len(engine.contexts) == 3, engine.contexts
    full = traj.prompt_ids + traj.response_ids
    assert engine.contexts[0] == traj.prompt_ids
    for k in range(3):
        ctx, ids = engine.contexts[k], engine.samples[k]
        assert full[: len(ctx) + len(ids)] == ctx + ids, f"model turn {k}: the trajectory differs from what the engine saw"
        if k + 1 < 3:  # the next context extends this one: nothing dropped, nothing re-tokenized
            assert engine.contexts[k + 1][: len(ctx) + len(ids)] == ctx + ids
    assert full == engine.contexts[-1] + engine.samples[-1]
    expected_mask = [0] * len(traj.response_ids)
    for ctx, ids in zip(engine.contexts, engine.samples):
        start = len(ctx) - len(traj.prompt_ids)
        expected_mask[start : start + len(ids)] = [1] * len(ids)
        assert traj.logprobs[start : start + len(ids)] == [-(len(ctx) + j) / 1000 for j in range(len(ids))]
    assert traj.loss_mask == expected_mask
    assert [c.error for c in traj.calls] == [False, False, False] and traj.stop_reason == "answer"


# --------------------------------------------------------------------------- the judged conversations


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "qwen3_coder", "llama3", "chatml"])
def test_append_only_families_token_exact(family):
    """Every engine context is the template's rendering of the conversation so far, tokenized whole:
    a separator dropped or doubled anywhere (the newline after <|im_end|>, a header's blank line,
    the gap between two tool messages) would differ in ids."""
    texts = script(family, thinking=family == "qwen3")
    traj, engine, tok, loop = run_family(family, texts)
    check_ids_and_mask(traj, engine)
    assert loop.format == {"qwen3_coder": "qwen3_coder", "llama3": "llama3_json"}.get(family, "hermes")
    messages = conversation(texts)
    for k, at in enumerate(MODEL_TURNS):
        text = tok.apply_chat_template(messages[:at], tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
        assert engine.contexts[k] == tok.encode(text, add_special_tokens=False), f"{family}: context of model turn {k}"
    whole = tok.apply_chat_template(messages, tools=SCHEMAS, tokenize=False)
    sampled_end = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert whole.startswith(sampled_end) and whole[len(sampled_end) :] in ("", "\n")  # ChatML's newline after the last <|im_end|>


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "qwen3_coder"])
def test_model_syntax_is_what_the_template_writes_for_structured_calls(family):
    """The scripted calls are the family's own: the template rendering an assistant message with
    structured ``tool_calls`` writes exactly the model's text (two calls in one turn)."""
    tok = family_tokenizer(family)
    texts = script(family)
    calls = [{"type": "function", "function": {"name": "add", "arguments": a}} for a in ({"a": 2, "b": 3}, {"a": 4, "b": 5})]
    raw = tok.apply_chat_template(conversation(texts)[:2], tokenize=False)
    structured = tok.apply_chat_template([conversation(texts)[0], {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False)
    assert raw == structured


def test_qwen3_thinking_off_keeps_the_empty_think_block_of_every_turn():
    """enable_thinking=false: every generation prompt (the prompt's and each tool turn's) ends with
    the empty think block, read from the prompt. Re-rendering the conversation would drop the
    earlier turns' blocks (the template keeps none on turns that are not last), so the trajectory is
    the engine's view, written out here by hand."""
    texts = script("qwen3")
    traj, engine, tok, _ = run_family("qwen3", texts, enable_thinking=False)
    check_ids_and_mask(traj, engine)
    empty = "<think>\n\n</think>\n\n"
    calls1, calls2 = call_text("qwen3", [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]), call_text("qwen3", [("mul", {"a": 5, "b": 9})])
    response = (
        f"{calls1}<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{empty}{calls2}<|im_end|>\n<|im_start|>user\n<tool_response>\n45\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{empty}The answer is 45.<|im_end|>"
    )
    assert tok.decode(traj.response_ids, skip_special_tokens=False) == response
    assert tok.decode(traj.prompt_ids, skip_special_tokens=False).endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{empty}")
    # The tool turns' ids are their text tokenized on its own (each starts after <|im_end|>).
    tool_turn = [i for i, m in zip(traj.response_ids, traj.loss_mask) if not m][: len(tok.encode("\n<|im_start|>user\n<tool_response>\n5", add_special_tokens=False))]
    assert tok.decode(tool_turn, skip_special_tokens=False) == "\n<|im_start|>user\n<tool_response>\n5"
    rerendered = tok.apply_chat_template(conversation(texts), tools=SCHEMAS, tokenize=False, enable_thinking=False)
    # A re-rendering keeps the block on the last turn only; the engine saw it before every turn.
    assert rerendered.count(empty) == 1 and tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False).count(empty) == 3


def test_qwen3_new_user_turn_keeps_earlier_reasoning_in_the_trajectory():
    """An interaction's user turn after a thinking turn: Qwen3's template would now drop that turn's
    reasoning from a re-rendering; the trajectory keeps what the engine saw and the user turn is
    exactly the template's (the empty line, the user header, the generation prompt)."""
    tok = family_tokenizer("qwen3")
    encode = functools.partial(tok.encode, add_special_tokens=False)

    class AskTwice:
        name = "ask"

        def start_interaction(self, instance_id, **kwargs):
            return None

        def generate_response(self, instance_id, messages, **kwargs):
            return len(messages) > 2, "Are you sure?", 0.5, {}

    first, second = "<think>\nEasy.\n</think>\n\n4", "<think>\nYes.\n</think>\n\nYes, 4."
    prompt = encode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False))
    engine = Scripted(tok, [encode(first) + [tok.eos_token_id], encode(second) + [tok.eos_token_id]])
    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tok, response_length=200, interactions={"ask": AskTwice()})
    [t] = loop.run(engine, [prompt], SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64), interaction_kwargs=[{}])
    assert tok.decode(t.response_ids, skip_special_tokens=False) == (
        f"{first}<|im_end|>\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n{second}<|im_end|>"
    )
    assert engine.contexts[1] == t.prompt_ids + t.response_ids[: len(engine.contexts[1]) - len(t.prompt_ids)]
    assert t.loss_mask == [1] * len(engine.samples[0]) + [0] * (len(engine.contexts[1]) - len(engine.contexts[0]) - len(engine.samples[0])) + [1] * len(engine.samples[1])
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": first}, {"role": "user", "content": "Are you sure?"}]
    assert "Easy." not in tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# --------------------------------------------------------------------------- the start-up check


def test_start_up_check_names_each_family_and_its_quirks(caplog):
    expected = {
        "qwen2.5": ["a system turn the messages did not give", "consecutive tool messages in one turn", "<tool_response> inside a user turn"],
        "qwen3": ["consecutive tool messages in one turn", "reasoning of earlier turns dropped after a new user turn (kept within a tool chain)", "enable_thinking=false adds '<think>\\n\\n</think>\\n\\n'"],
        "qwen3_coder": ["consecutive tool messages in one turn", "<tool_response> inside a user turn"],
        "llama3": ["the template writes the bos token itself", "a system turn the messages did not give", "one turn per tool message", "ipython role", "tool results JSON-encoded"],
        "chatml": ["a system turn the messages did not give", "one turn per tool message"],
    }
    for family, needles in expected.items():
        tok = family_tokenizer(family)
        report = check_template(tok)
        assert report.family == detect_family(tok.chat_template) == family
        line = report.line()
        for needle in needles:
            assert needle in line, f"{family}: {needle!r} not in {line!r}"
        assert "reasoning" not in line or family == "qwen3"
    assert check_template(family_tokenizer("qwen3")).generation_prompt == "<|im_start|>assistant\n"
    assert check_template(family_tokenizer("llama3")).turn_end == "<|eot_id|>"
    with caplog.at_level(logging.INFO, logger="verl.rollout.agent.templates"):
        from verl.rollout.agent import templates

        templates._logged.clear()
        ToolTurnEncoder(family_tokenizer("qwen2.5"))
        ToolTurnEncoder(family_tokenizer("qwen2.5"))  # once per template
    lines = [r.getMessage() for r in caplog.records if r.name == "verl.rollout.agent.templates"]
    assert len(lines) == 1 and lines[0].startswith("chat template: family qwen2.5 (tool calls: hermes)")


def test_start_up_check_refuses_templates_the_loop_cannot_use():
    tok = family_tokenizer("chatml")
    original = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no generation prompt
        with pytest.raises(ValueError, match="generation prompt"):
            check_template(tok)
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
        with pytest.raises(ValueError, match="does not write the assistant's content"):
            check_template(tok)
        tok.chat_template = None
        with pytest.raises(ValueError, match="has none"):
            check_template(tok)
    finally:
        tok.chat_template = original


def test_prompts_of_both_thinking_modes_are_refused():
    tok = family_tokenizer("qwen3")
    encoder = ToolTurnEncoder(tok)
    encode = functools.partial(tok.encode, add_special_tokens=False)
    user = [{"role": "user", "content": "hi"}]
    on = encode(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False))
    off = encode(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, enable_thinking=False))
    encoder.follow_prompts([off, off])
    assert encoder.template_kwargs == {"enable_thinking": False}
    encoder.follow_prompts([on])
    assert encoder.template_kwargs == {"enable_thinking": True}
    with pytest.raises(ValueError, match="enable_thinking both true and false"):
        encoder.follow_prompts([on, off])
