"""Tools that are wrong are refused where they are named, in one line (#58): a tool class without
``call()``, a schema without ``function.name`` (a raw KeyError before), a tool whose ``__init__``
raises (its traceback before), and ``extra_info.tools_kwargs`` naming a tool that is not offered."""

from __future__ import annotations

import pytest

from verl.rollout.agent import CalculatorTool, Tool, as_tools, load_tool_config


class NoCall(Tool):
    schema = {"type": "function", "function": {"name": "nocall", "description": "d", "parameters": {"type": "object"}}}


class NoName(Tool):
    schema = {"type": "function", "function": {"description": "d", "parameters": {"type": "object"}}}

    def call(self, instance_id, arguments):
        return "x"


class Breaks(Tool):
    def __init__(self, url: str = "") -> None:
        raise ConnectionError(f"cannot reach {url}")


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2"])


def _config(tmp_path, class_name: str, config: str = "{}") -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {class_name}\n    config: {config}\n")
    return str(path)


def test_a_tool_class_without_call_is_refused(tmp_path):
    path = _config(tmp_path, f"{__name__}.NoCall")
    with pytest.raises(ValueError) as exc:
        load_tool_config(path)
    assert str(exc.value) == (
        f"tool config {path}, tools[0] ({__name__}.NoCall): NoCall does not define call(self, instance_id, arguments) "
        "-> str, the method the agent loop runs for each of the model's calls: add it (or give a plain function as "
        "the tool)"
    )
    with pytest.raises(ValueError, match=r"tools\[0\]: NoCall does not define call"):
        as_tools([NoCall()])  # the Python API's RolloutOperator(tools=...)


def test_a_schema_without_a_function_name_is_refused_not_a_key_error(tmp_path):
    path = _config(tmp_path, f"{__name__}.NoName")
    with pytest.raises(ValueError) as exc:
        load_tool_config(path)
    assert str(exc.value) == (
        f"tool config {path}, tools[0] ({__name__}.NoName): NoName.schema: the tool's function name must be an "
        "identifier, got None"
    )
    with pytest.raises(ValueError, match=r"tools\[1\]: NoName.schema: the tool's function name"):
        as_tools([CalculatorTool(), NoName()])


def test_a_tool_whose_init_fails_is_named_in_one_line(tmp_path):
    path = _config(tmp_path, f"{__name__}.Breaks", "{url: 'http://nowhere'}")
    with pytest.raises(ValueError) as exc:
        load_tool_config(path)
    assert str(exc.value) == (
        f"tool config {path}, tools[0]: {__name__}.Breaks(**{{'url': 'http://nowhere'}}) raised ConnectionError: cannot "
        "reach http://nowhere; fix the tool's config or its __init__"
    )


def test_tools_kwargs_naming_a_tool_not_offered_is_refused_before_the_first_turn(tokenizer):
    from verl.config.schema import RolloutMultiTurnConfig
    from verl.rollout.agent import AgentLoop

    loop = AgentLoop(RolloutMultiTurnConfig(enable=True), [CalculatorTool()], tokenizer, response_length=20)
    with pytest.raises(ValueError) as exc:
        loop.run(None, [[1, 2]], None, tools_kwargs=[{"search": {"create_kwargs": {}}}])
    assert str(exc.value).startswith(
        "rollout: extra_info.tools_kwargs of prompt 0 names the tool(s) ['search'], which are not configured "
        "(tools: ['calculator']); add them"
    )
    bare = AgentLoop(RolloutMultiTurnConfig(enable=True), [], tokenizer, response_length=20)
    with pytest.raises(ValueError, match=r"multi_turn.enable=true, but no tool or interaction is configured"):
        bare.run(None, [[1, 2]], None)
