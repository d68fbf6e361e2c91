"""The agent loop: multi-turn rollouts with tool calls (``actor_rollout_ref.rollout.multi_turn``).

- the tools (:mod:`verl.tools`, re-exported here): the ``Tool`` contract, plain functions as
  tools, the registry and YAML tool config, the calculator, the sandboxed Python interpreter and
  BM25 retrieval over a local collection;
- :mod:`~verl.rollout.agent.parser`: tool calls in the model's text (Hermes, Qwen3-Coder's XML, Llama 3's
  JSON, or your own parser: ``multi_turn.format``);
- :mod:`~verl.rollout.agent.templates`: the start-up check of the chat template (its family and quirks);
- :mod:`~verl.rollout.agent.loop`: ``AgentLoop``: conversations against a rollout engine, token
  in and token out, with the loss mask on sampled tokens only;
- :mod:`~verl.rollout.agent.trajectory` and :mod:`~verl.rollout.agent.turns`: one conversation as
  data (``Trajectory``) and the ids of the turns the loop adds (``ToolTurnEncoder``), shared by
  the loop and the custom loops' ``Conversation``;
- :mod:`~verl.rollout.agent.interaction`: environments that answer the model's turns (a checker,
  a simulated user) with per-turn rewards;
- :mod:`~verl.rollout.agent.agents`: custom agent loops, registered under the name a sample's
  ``extra_info["agent_name"]`` selects (``register("name")``, ``agent_loop_config_path``), and agent
  programs (``register_program("name")``);
- :mod:`~verl.rollout.agent.endpoint`: ``AgentEndpoint``: an OpenAI-compatible server in front of
  the rollout engine for one rollout call; agent programs talk to it, every request's ids recorded;
"""

from verl.rollout.agent.agents import (
    AGENT_LOOPS,
    AGENT_PROGRAMS,
    AgentLoopBase,
    AgentProgram,
    Conversation,
    known_agent_names,
    load_agent_loop_config,
    register,
    register_program,
)
from verl.rollout.agent.endpoint import AgentEndpoint
from verl.rollout.agent.images import ToolResponse
from verl.rollout.agent.interaction import (
    INTERACTIONS,
    AnswerCheckInteraction,
    Interaction,
    fold_turn_scores,
    load_interaction_config,
    register_interaction,
)
from verl.rollout.agent.loop import AgentLoop, agent_metrics, assemble_agent_rollout
from verl.rollout.agent.parser import (
    FORMATS,
    PARSERS,
    ToolCall,
    parse_hermes,
    parse_llama3_json,
    parse_qwen3_coder,
    tool_call_parser,
)
from verl.rollout.agent.templates import TemplateReport, check_template
from verl.rollout.agent.trajectory import Trajectory
from verl.rollout.agent.turns import ToolTurnEncoder
from verl.tools import (
    TOOLS,
    CalculatorTool,
    RetrievalTool,
    FunctionTool,
    PythonTool,
    Tool,
    ToolArgumentError,
    as_tools,
    check_arguments,
    load_tool_config,
    register_tool,
    safe_calculate,
)

__all__ = [
    "AGENT_LOOPS",
    "AGENT_PROGRAMS",
    "AgentEndpoint",
    "AgentProgram",
    "register_program",
    "AgentLoopBase",
    "Conversation",
    "known_agent_names",
    "load_agent_loop_config",
    "register",
    "INTERACTIONS",
    "FORMATS",
    "PARSERS",
    "AnswerCheckInteraction",
    "Interaction",
    "fold_turn_scores",
    "load_interaction_config",
    "register_interaction",
    "TOOLS",
    "AgentLoop",
    "CalculatorTool",
    "FunctionTool",
    "PythonTool",
    "RetrievalTool",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolResponse",
    "ToolTurnEncoder",
    "Trajectory",
    "agent_metrics",
    "as_tools",
    "assemble_agent_rollout",
    "check_arguments",
    "load_tool_config",
    "parse_hermes",
    "parse_llama3_json",
    "parse_qwen3_coder",
    "tool_call_parser",
    "check_template",
    "TemplateReport",
    "register_tool",
    "safe_calculate",
]
