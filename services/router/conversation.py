"""One conversation, whatever API it came through (OpenAI Chat Completions, OpenAI Responses, Anthropic
Messages): its turns, its tools, and what the model must produce, checked once here and rendered into
the prompt the model sees.

Turns are plain dicts in the chat-template convention: {"role", "content", "tool_calls": [{"id", "name",
"arguments"}], "tool_call_id"}. Rendering (`render_prompt`):
- a template that knows tools (it reads `tools`) gets them, and the calls in the history, in Hugging Face's
  shape;
- any other (SmolLM2's, `tiny`'s) gets moorage's own, documented in the README: the tool list in the system
  prompt in Hermes' words, earlier calls as `<tool_call>` blocks, and tool results as `<tool_response>`
  blocks in a user turn.
Either way the same request renders the same text every turn, so a returning turn's cached prefix covers
its system prompt and tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.router.schemas import OpenAIError
from services.router.tool_calls import ToolFormat
from shared.engine.tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"   # auto | none | required | named
    name: str = ""       # named: the tool


def tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """A tool definition, checked: a 400 naming `where` when it is malformed."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise OpenAIError(400, f"{where}.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                          param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise OpenAIError(400, f"{where}.description must be a string", param=f"{where}.description")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise OpenAIError(400, f"{where} parameters must be a JSON schema of type 'object'", param=where)
    return Tool(name, description or "", parameters)


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_schema: dict | None = None   # the answer must be JSON matching this (json_object: {"type": "object"})

    def check(self) -> None:
        """What no API's own schema can see: names unique, a named choice among the tools, every tool result
        answering a call made earlier in the conversation."""
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools: two tools have the same name", param="tools")
        if self.tool_choice.mode in ("required", "named") and not self.tools:
            raise OpenAIError(400, f"tool_choice {self.tool_choice.mode!r} needs tools", param="tool_choice")
        if self.tool_choice.mode == "named" and self.tool_choice.name not in names:
            raise OpenAIError(400, f"tool_choice names {self.tool_choice.name!r}, which is not in tools",
                              param="tool_choice")
        if self.response_schema is not None and self.tool_choice.mode in ("required", "named"):
            raise OpenAIError(400, "response_format cannot be combined with a required tool call",
                              param="response_format")
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            called.update(c["id"] for c in m.get("tool_calls") or ())
            if m["role"] == "tool" and m.get("tool_call_id") not in called:
                raise OpenAIError(400, f"messages[{i}].tool_call_id {m.get('tool_call_id')!r} answers no tool call "
                                       "made earlier in the conversation", param=f"messages[{i}].tool_call_id")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)


def _template_has_tools(tokenizer: Tokenizer) -> bool:
    return "tools" in tokenizer.chat_template


def _hf_turn(m: dict) -> dict:
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
                             for c in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id", "")
    return out


def _own_turns(conv: Conversation, fmt: ToolFormat) -> list[dict]:
    """The conversation for a template without tools: tools in the system prompt, calls and results as text."""
    turns: list[dict] = []
    if conv.tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in conv.tools))
        if conv.messages and conv.messages[0]["role"] == "system":
            turns.append({"role": "system", "content": f"{conv.messages[0]['content']}\n\n{block}"})
            rest = conv.messages[1:]
        else:
            turns.append({"role": "system", "content": block})
            rest = conv.messages
    else:
        rest = conv.messages
    for m in rest:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if turns and turns[-1].get("_tool_results"):  # consecutive results share one user turn
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response, "_tool_results": True})
            continue
        content = m.get("content") or ""
        calls = [fmt.render_call(c["name"], c["arguments"]) for c in m.get("tool_calls") or ()]
        turns.append({"role": m["role"], "content": "\n".join(([content] if content else []) + calls)})
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def render_prompt(tokenizer: Tokenizer, conv: Conversation, fmt: ToolFormat) -> str:
    """The prompt text of the conversation (with the generation prompt)."""
    try:
        if _template_has_tools(tokenizer):
            return tokenizer.render_chat([_hf_turn(m) for m in conv.messages],
                                         tools=[t.openai() for t in conv.tools] or None)
        return tokenizer.render_chat(_own_turns(conv, fmt))
    except OpenAIError:
        raise
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise OpenAIError(400, f"messages could not be rendered with the chat template: {e}",
                          param="messages") from None
