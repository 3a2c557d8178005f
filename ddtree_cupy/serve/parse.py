"""Kimi output -> OpenAI fields, incrementally: reasoning, content and tool calls.

Kimi K2.5 / K2.6 write their reasoning first and close it with ``</think>``; the generation prompt already
opened the ``<think>`` block (``thinking=True``), so the parser starts inside the reasoning and does not wait
for an opening tag (a stray ``<think>`` at the very start is dropped). With ``thinking=False`` the prompt
closed the block and everything is content.

After the reasoning, a turn may hold a tool-call section::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

Each call becomes an OpenAI tool call (id = Kimi's ``functions.NAME:IDX``, name NAME, arguments the JSON
text) once its ``<|tool_call_end|>`` arrives. A call whose header is not ``functions.NAME:IDX`` or whose
arguments are not a JSON object is not a tool call: its raw text goes to ``content`` and it is counted in
``malformed`` (the response reports it instead of failing). Text that could be the start of a tag is held
back until it is decided, so no tag is ever split over two deltas.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional

from .text import split_held

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_HEADER = re.compile(r"^\s*(?:functions\.)?([A-Za-z0-9_\-.]{1,64}):(\d+)\s*$")


@dataclass
class ToolCall:
    index: int              # position among this response's tool calls
    id: str
    name: str
    arguments: str


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: Optional[List[ToolCall]] = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class KimiOutputParser:
    def __init__(self, thinking: bool = True, tools: bool = True):
        self.state = "reasoning" if thinking else "content"
        self.at_start = True            # a leading <think> may still come
        self.tools = tools
        self.buf = ""
        self.calls: List[ToolCall] = []
        self.malformed = 0

    # every tag the current state reacts to
    def _tags(self):
        if self.state == "reasoning":
            return (THINK_CLOSE, THINK_OPEN) if self.at_start else (THINK_CLOSE,)
        if self.state == "content":
            return (SECTION_BEGIN,) if self.tools else ()
        if self.state == "section":
            return (CALL_BEGIN, SECTION_END)
        return (CALL_END,)              # inside one call

    def feed(self, text: str) -> Delta:
        self.buf += text
        d = Delta()
        while True:
            tags = self._tags()
            hits = [(self.buf.find(t), t) for t in tags]
            hits = [(i, t) for i, t in hits if i >= 0]
            if not hits:
                break
            i, tag = min(hits)
            before, self.buf = self.buf[:i], self.buf[i + len(tag):]
            self._on_tag(before, tag, d)
        if self.state in ("reasoning", "content") and self.buf:
            keep = split_held(self.buf, tags) if tags else 0
            out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            if out.strip():
                self.at_start = False
            self._emit(d, out)
        return d

    def _emit(self, d: Delta, text: str) -> None:
        if not text:
            return
        if self.state == "reasoning":
            d.reasoning += text
        else:
            d.content += text

    def _on_tag(self, before: str, tag: str, d: Delta) -> None:
        if self.state == "reasoning":
            if tag == THINK_OPEN:                      # the model re-opened the block the prompt opened
                self._emit(d, before)
                self.at_start = False
                return
            self._emit(d, before)
            self.state, self.at_start = "content", False
        elif self.state == "content":                  # SECTION_BEGIN
            self._emit(d, before)
            self.state = "section"
        elif self.state == "section":
            if before.strip():
                self._emit_content(d, before)
            self.state = "call" if tag == CALL_BEGIN else "content"
        else:                                          # CALL_END: one whole call in ``before``
            self._call(before, d)
            self.state = "section"

    def _emit_content(self, d: Delta, text: str) -> None:
        d.content += text

    def _call(self, body: str, d: Delta) -> None:
        header, sep, args = body.partition(ARG_BEGIN)
        m = _HEADER.match(header) if sep else None
        ok = m is not None
        if ok:
            try:
                ok = isinstance(json.loads(args), dict)
            except ValueError:
                ok = False
        if not ok:
            self.malformed += 1
            self._emit_content(d, CALL_BEGIN + body + CALL_END)
            return
        call = ToolCall(len(self.calls), header.strip() if header.strip().startswith("functions.")
                        else f"functions.{header.strip()}", m.group(1), args.strip())
        self.calls.append(call)
        d.tool_calls = (d.tool_calls or []) + [call]

    def flush(self) -> Delta:
        """At the end of the output: what was held back. An unfinished call is malformed (content)."""
        d = Delta()
        rest, self.buf = self.buf, ""
        if self.state == "call":
            self.malformed += 1
            d.content = CALL_BEGIN + rest
        elif self.state == "section":
            d.content = rest if rest.strip() else ""
        else:
            self._emit(d, rest)
        return d
