"""Which tool-call syntax a model was taught, read from its own chat template.

A chat template that takes `tools` renders them the way the model was trained to read them,
and the model answers a call in the syntax of that training. The template's text says which:

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the content
  (Qwen2.5, Qwen3, Hermes 2/3);
- "llama3_json": the whole answer is one or more `{"name": ..., "parameters": {...}}` objects,
  separated by ";", optionally after `<|python_tag|>` (Llama 3.1, 3.2, 3.3);
- "mistral": `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral 7B v0.3,
  Nemo, Small);
- "phi4_mini": `functools` then a JSON array of `{"name", "arguments"}` (Phi-4-mini).

A template that never mentions `tools` cannot show them to the model: the router then teaches
the Hermes syntax in a system message of its own (router/openai/tools.py) and reads Hermes
blocks back. router/openai/tool_formats.py holds the readers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    # The text that opens the calls: a special token the detokenizer must show rather than skip
    # (mistral's [TOOL_CALLS], llama's <|python_tag|>), or plain text.
    marker: str
    evidence: tuple[str, ...]  # strings in a chat template that name this format, any of them


# Most specific first: a Mistral or Llama template may also say "tool_call" in passing.
FORMATS = (
    ToolCallFormat("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
    ToolCallFormat("phi4_mini", "functools", ("functools",)),
    ToolCallFormat("llama3_json", "<|python_tag|>", ("<|python_tag|>", "ipython")),
    ToolCallFormat("hermes", "<tool_call>", ("<tool_call>",)),
)
HERMES = FORMATS[-1]
BY_NAME = {f.name: f for f in FORMATS}
_TAKES_TOOLS = re.compile(r"\btools\b")


def template_tool_format(template: str | None) -> ToolCallFormat | None:
    """The format a chat template teaches; None where the template takes no tools. A template that
    takes tools in a syntax of its own that no entry names is read as Hermes, the most common."""
    if template is None or not _TAKES_TOOLS.search(template):
        return None
    return next((f for f in FORMATS if any(e in template for e in f.evidence)), HERMES)
