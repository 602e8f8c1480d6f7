"""Tool calls: the format a model writes them in, the grammar that forces one (``tool_choice`` ``required`` or
a named function), and the parser that turns an answer (whole or streamed) into OpenAI's ``tool_calls``.

Two formats cover the families served, told apart by the chat template:
- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call: the JSON / Hermes style,
  which Granite 4.0's template asks for;
- ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``: Nemotron-H's (Nemotron Nano) template.
A template that does not read ``tools`` at all gets them in a system message of this server's own, in the
first format (``tool_prompt``), so any model can be asked to call tools; the grammar of ``required`` makes
even a model never trained for it answer with a call that parses.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from mambaserve.server.engine.request import BadRequest


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str
    listed: bool  # one JSON list of calls per block (else one call per block)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", listed=False)
NEMOTRON = ToolFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", listed=True)
FORMATS = {f.name: f for f in (HERMES, NEMOTRON)}


def detect(chat_template: str | None) -> ToolFormat:
    """The format a chat template asks for: Nemotron's where it names ``<TOOLCALL>``, else the JSON / Hermes one."""
    return NEMOTRON if chat_template and NEMOTRON.start in chat_template else HERMES


def reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tool_prompt(tools: list[dict], fmt: ToolFormat) -> str:
    """The system text for a template that ignores ``tools``."""
    example = '{"name": <function name>, "arguments": <arguments as a JSON object>}'
    how = (f"{fmt.start}[{example}, ...]{fmt.end}" if fmt.listed else f"{fmt.start}\n{example}\n{fmt.end}, one block per call")
    return ("You may call functions to answer. To call one, answer with " + how + ".\nThe functions:\n"
            + "\n".join(json.dumps(t["function"]) for t in tools))


def with_tool_prompt(messages: list[dict], tools: list[dict], fmt: ToolFormat) -> list[dict]:
    """``messages`` with the tools described in the (first) system message."""
    text = tool_prompt(tools, fmt)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _call_schema(fn: dict) -> dict:
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def special_tags(fmt: ToolFormat, tokenizer) -> dict[str, int]:
    """The format's tags that are tokens of their own (Granite's ``<tool_call>``): written as that token."""
    vocab = tokenizer.get_vocab()
    return {tag: vocab[tag] for tag in (fmt.start, fmt.end) if tag in vocab}


def grammar(tools: list[dict], fmt: ToolFormat, parallel: bool, tags: dict[str, int]) -> str:
    """A Lark grammar (llguidance's, with embedded JSON schemas) of an answer that is only calls to ``tools``:
    one, or with ``parallel`` one or more; ``tags``: ``special_tags``."""
    compact = {"whitespace_flexible": False}
    calls = [_call_schema(t["function"]) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start, end = (f"<[{tags[t]}]>" if t in tags else json.dumps(t) for t in (fmt.start, fmt.end))
    if fmt.listed:
        listed = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {start} body {end}\nbody: %json {json.dumps({**listed, 'x-guidance': compact})}\n"
    body = f"%json {json.dumps({**one, 'x-guidance': compact})}"
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: {start} "\\n" body "\\n" {end}\nbody: {body}\n'


def check_choice(tools: list[dict] | None, choice) -> str | None:
    """``tool_choice`` as ``none`` / ``auto`` / ``required`` / a function's name (BadRequest where it cannot be)."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools and choice != "none":
        raise BadRequest("tool_choice needs tools")
    if isinstance(choice, str):
        return choice
    name = choice["function"]["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools")
    return name


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls(body: str, fmt: ToolFormat, names: set[str]) -> list[dict] | None:
    """The calls of one block, OpenAI-shaped; None when it is not calls to known tools."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    items = data if fmt.listed and isinstance(data, list) else [data]
    out = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments", {}), dict)):
            return None
        out.append({"id": _new_id(), "type": "function",
                    "function": {"name": item["name"], "arguments": json.dumps(item.get("arguments", {}))}})
    return out


class ToolCallParser:
    """Splits an answer into content and tool calls as its text comes. ``feed`` returns ``(content, calls)``
    ready to send: text that may begin a call's opening tag (and whitespace, which may come before one) is held
    back until it cannot; a call is sent once its block is closed. The whitespace around calls is no content,
    and a block that is not a call to a known tool is. ``finish`` flushes what is left (an unclosed block is
    content). Fed whole or piece by piece, an answer gives the same content and calls."""

    def __init__(self, fmt: ToolFormat, tools: list[dict], parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.names = {t["function"]["name"] for t in tools}
        self.buffer, self.inside, self.after_call = "", False, False
        self.calls: list[dict] = []

    def _held(self) -> int:
        """Characters at the end of the buffer that may begin the opening tag, with the whitespace before them."""
        tag = self.fmt.start
        k = max((k for k in range(1, len(tag)) if self.buffer.endswith(tag[:k])), default=0)
        return len(self.buffer) - len(self.buffer[:len(self.buffer) - k].rstrip())

    def _content(self, text: str) -> str:
        if self.after_call:  # (the whitespace after a call)
            text = text.lstrip()
            self.after_call = not text
        return text

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, new = "", []
        while True:
            if not self.inside:
                i = self.buffer.find(self.fmt.start)
                if i < 0:
                    cut = len(self.buffer) - self._held()
                    content += self._content(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    break
                content += self._content(self.buffer[:i].rstrip())
                self.buffer, self.inside = self.buffer[i + len(self.fmt.start):], True
            j = self.buffer.find(self.fmt.end)
            if j < 0:
                break
            body, self.buffer, self.inside = self.buffer[:j], self.buffer[j + len(self.fmt.end):], False
            calls = _calls(body, self.fmt, self.names)
            if calls is None:  # not a call after all: its text is content
                content += self._content(self.fmt.start + body + self.fmt.end)
                continue
            if not self.parallel:  # (parallel_tool_calls: false) at most one
                calls = calls[:max(0, 1 - len(self.calls) - len(new))]
            new += calls
            self.after_call = True
        self.calls += new
        return content, new

    def finish(self) -> str:
        rest = self._content((self.fmt.start if self.inside else "") + self.buffer)
        self.buffer, self.inside = "", False
        return rest
