"""OpenAI's `tools` and `tool_choice` on the request side: the checks, the constraint a forced
call puts on the output, and the text that tells the model about its tools.

Where the model's chat template takes tools (engine/tool_call_format.py reads which syntax it
teaches), the tools and a conversation's earlier calls go to the template as structures
(`template_tools`, `template_calls`) and the model answers in its own syntax. Where it does not,
the tools reach the model as text in a system message, in the Hermes format (Qwen2.5's and
Hermes 2 Pro's chat templates render tools this very way): the signatures as JSON lines inside
<tools></tools>, and the instruction to answer with <tool_call>{"name": ..., "arguments":
...}</tool_call>. A conversation's earlier calls and their results are rendered the same way
(the assistant's calls as <tool_call> blocks, a tool's result as a <tool_response> block), so
the model reads back what it was taught to write.

tool_choice, as vLLM implements it:
- "none": no tools in the prompt, the output is plain text.
- "auto" (the default with tools): the model chooses; <tool_call> blocks in its output become
  tool calls (router/openai/tool_calls.py).
- "required": the output is constrained to a JSON array (at least one item) of
  {"name": <one of the tools>, "parameters": <that tool's schema>}.
- {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.fields import BadRequest, boolean, obj, string

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ANY_OBJECT: dict[str, object] = {"type": "object", "properties": {}}  # a tool without parameters
_MODES = ("none", "auto", "required")

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_INSTRUCTION = {
    "auto": (
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    ),
    "required": (
        "Call one or more of these functions: answer with a JSON array of the calls, each "
        '{"name": <function-name>, "parameters": <args-json-object>}.'
    ),
    "function": "Call the function {}: answer with its arguments as a JSON object.",
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Mapping[str, object] | None  # a JSON schema, as the client sent it


@dataclass(frozen=True)
class ToolChoice:
    """What the request asks of its tools (a tool_choice of "none" is no ToolChoice at all)."""

    mode: str  # "auto" | "required" | "function"
    tools: tuple[Tool, ...]
    function: str | None = None  # the forced function's name (mode "function")
    parallel: bool = True  # parallel_tool_calls: false allows one call at most
    # the syntax the model's chat template teaches (engine/tool_call_format.py's name), the tools
    # then rendered by that template; None: the router teaches Hermes blocks in a system message
    template_format: str | None = None


def parse_tool_choice(fields: dict[str, object]) -> ToolChoice | None:
    """The body's tools and tool_choice, checked; None when the model gets no tools."""
    tools = _tools(fields["tools"]) if "tools" in fields else ()
    parallel = (
        boolean(fields["parallel_tool_calls"], "parallel_tool_calls") if "parallel_tool_calls" in fields else True
    )
    choice = fields.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in _MODES:
            raise BadRequest(f"tool_choice: must be one of {_MODES} or a named function, got {choice[:32]!r}")
        if choice == "none":
            return None
        if not tools:
            raise BadRequest(f"tool_choice: {choice!r} needs tools")
        return ToolChoice(choice, tools, None, parallel)
    named = obj(choice, "tool_choice", {"type", "function"}, required=("type", "function"))
    if named["type"] != "function":
        raise BadRequest("tool_choice.type: must be 'function'")
    fn = obj(named["function"], "tool_choice.function", {"name"}, required=("name",))
    name = string(fn["name"], "tool_choice.function.name")
    if name not in {t.name for t in tools}:
        raise BadRequest(f"tool_choice.function.name: no tool named {name[:64]!r} in tools")
    return ToolChoice("function", tools, name, parallel)


def _tools(v: object) -> tuple[Tool, ...]:
    if not isinstance(v, list) or not v:
        raise BadRequest("tools: must be a non-empty list")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(v):
        tool = _tool(t, f"tools[{i}]")
        if tool.name in seen:
            raise BadRequest(f"tools[{i}].function.name: {tool.name!r} is already the name of tools[{seen[tool.name]}]")
        seen[tool.name] = i
        tools.append(tool)
    return tuple(tools)


def _tool(v: object, field: str) -> Tool:
    t = obj(v, field, {"type", "function"}, required=("type", "function"))
    if t["type"] != "function":
        raise BadRequest(f"{field}.type: must be 'function'")
    fn = obj(t["function"], f"{field}.function", {"name", "description", "parameters", "strict"}, required=("name",))
    name = string(fn["name"], f"{field}.function.name")
    if not _NAME.fullmatch(name):
        raise BadRequest(f"{field}.function.name: must be 1-64 characters of A-Z a-z 0-9 _ . -")
    description = string(fn["description"], f"{field}.function.description") if "description" in fn else None
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"{field}.function.parameters: must be a JSON schema object")
    if "strict" in fn:
        boolean(fn["strict"], f"{field}.function.strict")
    return Tool(name, description, parameters)


def tool_grammar(choice: ToolChoice) -> pb.Grammar | None:
    """The constraint a forced call puts on the output ("auto" puts none)."""
    if choice.mode == "auto":
        return None
    if choice.mode == "function":
        tool = next(t for t in choice.tools if t.name == choice.function)
        schema = tool.parameters or _ANY_OBJECT
    else:
        schema = calls_schema(choice.tools, choice.parallel)
    return pb.Grammar(json_schema=json.dumps(schema, separators=(",", ":")))


def calls_schema(tools: tuple[Tool, ...], parallel: bool = True) -> dict[str, object]:
    """tool_choice "required": a JSON array of {"name", "parameters"}, one anyOf branch per tool, each
    tool's $defs lifted to the top (where its "#/$defs/..." references resolve), as vLLM builds it."""
    defs: dict[str, object] = {}
    branches = []
    for i, t in enumerate(tools):
        params = dict(t.parameters or _ANY_OBJECT)
        own = params.pop("$defs", None)
        if isinstance(own, dict):
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise BadRequest(f"tools[{i}].function.parameters.$defs: {key!r} differs from another tool's")
        branches.append(
            {
                "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_tools(choice: ToolChoice) -> list[dict[str, object]]:
    """The tools as OpenAI's list, what a chat template's `tools` holds (a missing description
    left out, missing parameters an object of none)."""
    out: list[dict[str, object]] = []
    for t in choice.tools:
        fn: dict[str, object] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.parameters or _ANY_OBJECT
        out.append({"type": "function", "function": fn})
    return out


def template_calls(calls: list[tuple[str, str, str]]) -> list[dict[str, object]]:
    """An assistant's earlier calls, (id, name, arguments as JSON text), as a chat template reads
    them: arguments that are JSON as the object (templates apply `tojson` to them, as vLLM hands
    them over), others as the string they are."""
    out = []
    for call_id, name, arguments in calls:
        try:
            args: object = json.loads(arguments)
        except (ValueError, RecursionError):
            args = arguments
        call: dict[str, object] = {"type": "function", "function": {"name": name, "arguments": args}}
        if call_id:
            call["id"] = call_id
        out.append(call)
    return out


def tools_prompt(choice: ToolChoice) -> str:
    """The system-prompt text that tells the model its tools and how to call them; with a template
    that renders the tools itself, only what a forced call asks ("" for "auto")."""
    instruction = _INSTRUCTION[choice.mode]
    if choice.mode == "function":
        instruction = instruction.format(choice.function)
    if choice.template_format is not None:
        return "" if choice.mode == "auto" else instruction
    lines = [json.dumps(t, ensure_ascii=False) for t in template_tools(choice)]
    return _TOOLS_HEADER + "\n".join(lines) + "\n</tools>\n\n" + instruction


def render_tool_calls(calls: list[tuple[str, str]]) -> str:
    """An assistant's earlier calls, (name, arguments as JSON text), as the <tool_call> blocks a model
    taught the Hermes format writes (arguments that are not JSON stay the string they are)."""
    blocks = []
    for name, arguments in calls:
        try:
            args: object = json.loads(arguments)
        except (ValueError, RecursionError):
            args = arguments
        blocks.append(
            "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
        )
    return "\n".join(blocks)


def render_tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
