"""OpenAI chat `messages` -> the chat messages the public request carries.

Accepted as OpenAI's clients send them: content as a string, or a list of text parts (joined
with newlines, as vLLM joins them); an assistant message with `tool_calls` (its content may be
null); a "tool" message with `tool_call_id`. Keys OpenAI defines that change nothing here
(`name`, `refusal`, ...) are ignored, as before.

Tools reach the model one of two ways (`ToolChoice.template_format`):
- the model's chat template takes tools: the tools, the earlier calls and the results travel as
  structures (ChatMessages.tools_json, ChatMessage.tool_calls_json and tool_call_id) and the
  template renders them as the model was trained to read them;
- it does not: calls and results are rendered into the content in the Hermes format
  (router/openai/tools.py), and the tools go into the system message (appended to the client's
  own, or a new first message).
"""

from __future__ import annotations

import json

from splitserve.router.openai.fields import BadRequest, obj, string, unicode
from splitserve.router.openai.tools import (
    ToolChoice,
    render_tool_calls,
    render_tool_response,
    template_calls,
    tools_prompt,
)


def chat_messages(messages: object, tools: ToolChoice | None) -> list[dict[str, str]]:
    """Every message checked and rendered (ChatMessage's fields); the tools' prompt put in place."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list")
    native = tools is not None and tools.template_format is not None
    out = [_message(m, f"messages[{i}]", native) for i, m in enumerate(messages)]
    prompt = None if tools is None else tools_prompt(tools)
    if prompt:
        prompt = unicode(prompt, "tools")  # a client's schema may hold a lone surrogate
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _message(m: object, field: str, native: bool) -> dict[str, str]:
    if not isinstance(m, dict):
        raise BadRequest(f"{field}: must be an object with string role and content")
    role = string(m.get("role"), f"{field}.role")
    content = _content(m.get("content"), f"{field}.content")
    out: dict[str, str] = {"role": role}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = _tool_calls(m["tool_calls"], f"{field}.tool_calls")
        if native:
            text = json.dumps(template_calls(calls), ensure_ascii=False)
            out["tool_calls_json"] = unicode(text, f"{field}.tool_calls")
            content = content or ""
        else:
            rendered = render_tool_calls([(name, args) for _, name, args in calls])
            content = f"{content}\n{rendered}" if content else rendered
    elif content is None:
        raise BadRequest(f"{field}.content: must be a string")
    if role == "tool":
        call_id = string(m.get("tool_call_id"), f"{field}.tool_call_id")
        if native:
            out["tool_call_id"] = unicode(call_id, f"{field}.tool_call_id")
        else:
            content = render_tool_response(content)
    out["content"] = unicode(content, f"{field}.content")
    return out


def _content(v: object, field: str) -> str | None:
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


def _tool_calls(v: object, field: str) -> list[tuple[str, str, str]]:
    """An assistant's earlier calls as (id, name, arguments)."""
    if not isinstance(v, list):
        raise BadRequest(f"{field}: must be a list")
    calls = []
    for k, c in enumerate(v):
        call = obj(c, f"{field}[{k}]", {"id", "type", "function"}, required=("function",))
        if call.get("type", "function") != "function":
            raise BadRequest(f"{field}[{k}].type: must be 'function'")
        call_id = string(call["id"], f"{field}[{k}].id") if "id" in call else ""
        fn = obj(call["function"], f"{field}[{k}].function", {"name", "arguments"}, required=("name", "arguments"))
        name = string(fn["name"], f"{field}[{k}].function.name")
        calls.append((call_id, name, string(fn["arguments"], f"{field}[{k}].function.arguments")))
    return calls
