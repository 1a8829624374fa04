"""OpenAI chat `messages` -> the (role, content) pairs the public request carries.

Accepted as OpenAI's clients send them: content as a string, or a list of text parts (joined
with newlines, as vLLM joins them); an assistant message with `tool_calls` (its content may be
null); a "tool" message with `tool_call_id`. The gRPC ChatMessage has only a role and a
content, so calls and results are rendered into the content in the Hermes format
(router/openai_tools.py), and the tools of the request go into the system message (appended
to the client's own, or a new first message). Keys OpenAI defines that change nothing here
(`name`, `refusal`, ...) are ignored, as before.
"""

from __future__ import annotations

from typing import Any

from splitserve.router.openai_fields import BadRequest, obj, string, unicode
from splitserve.router.openai_tools import ToolChoice, render_tool_calls, render_tool_response, tools_prompt


def chat_messages(messages: Any, tools: ToolChoice | None) -> list[tuple[str, str]]:
    """Every message checked and rendered; the tools' system prompt put in place."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list")
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    if tools is not None:
        prompt = unicode(tools_prompt(tools), "tools")  # a client's schema may hold a lone surrogate
        if out[0][0] == "system":
            out[0] = ("system", f"{out[0][1]}\n\n{prompt}")
        else:
            out.insert(0, ("system", prompt))
    return out


def _message(m: Any, field: str) -> tuple[str, str]:
    if not isinstance(m, dict):
        raise BadRequest(f"{field}: must be an object with string role and content")
    role = string(m.get("role"), f"{field}.role")
    content = _content(m.get("content"), f"{field}.content")
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = render_tool_calls(_tool_calls(m["tool_calls"], f"{field}.tool_calls"))
        content = f"{content}\n{calls}" if content else calls
    elif content is None:
        raise BadRequest(f"{field}.content: must be a string")
    if role == "tool":
        string(m.get("tool_call_id"), f"{field}.tool_call_id")
        content = render_tool_response(content)
    return role, unicode(content, f"{field}.content")


def _content(v: Any, field: str) -> str | None:
    if v is None or isinstance(v, str):
        return None if v is None else unicode(v, field)
    if not isinstance(v, list):
        raise BadRequest(f"{field}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadRequest(f"{field}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        texts.append(string(part.get("text"), f"{field}[{j}].text"))
    return "\n".join(texts)


def _tool_calls(v: Any, field: str) -> list[tuple[str, str]]:
    """An assistant's earlier calls as (name, arguments)."""
    if not isinstance(v, list):
        raise BadRequest(f"{field}: must be a list")
    calls = []
    for k, c in enumerate(v):
        call = obj(c, f"{field}[{k}]", {"id", "type", "function"}, required=("function",))
        if call.get("type", "function") != "function":
            raise BadRequest(f"{field}[{k}].type: must be 'function'")
        if "id" in call:
            string(call["id"], f"{field}[{k}].id")
        fn = obj(call["function"], f"{field}[{k}].function", {"name", "arguments"}, required=("name", "arguments"))
        name = string(fn["name"], f"{field}[{k}].function.name")
        calls.append((name, string(fn["arguments"], f"{field}[{k}].function.arguments")))
    return calls
