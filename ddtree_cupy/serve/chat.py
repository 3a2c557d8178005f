"""OpenAI chat messages (and tools) -> Kimi chat prompt ids.

The same turns as ``KimiTokenizer.encode_chat`` (``<|im_system|>`` / ``<|im_user|>`` / ``<|im_assistant|>``
role ``<|im_middle|>`` text ``<|im_end|>``, then the generation prompt ``<|im_assistant|>assistant
<|im_middle|><think>`` and, without thinking, ``</think>``), plus what Kimi's chat template adds for tools:

* ``tools`` -> one ``<|im_system|>tool_declare<|im_middle|>[...]<|im_end|>`` turn first, the OpenAI tool list
  as compact JSON;
* an assistant message with ``tool_calls`` -> its content, then ``<|tool_calls_section_begin|>``, one
  ``<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`` per call (ID = Kimi's
  ``functions.NAME:IDX``), ``<|tool_calls_section_end|>``;
* a ``tool`` message -> ``<|im_system|>tool<|im_middle|>## Return of ID\\n`` + its content.

Tags are special ids where the tokenizer names them (Kimi's does), else their text. Message text never
becomes a special id (a user cannot type ``<|im_end|>`` into the prompt).
"""
from __future__ import annotations

import json
from typing import Iterator, List, Optional, Sequence, Tuple

from ..tokenizer import generation_prompt_pieces

ROLE_TAG = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
            "tool": "<|im_system|>"}


def message_text(content) -> str:
    """OpenAI content: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def chat_pieces(messages: Sequence[dict], tools: Optional[list], thinking: bool,
                add_generation_prompt: bool = True) -> Iterator[Tuple[str, bool]]:
    """(piece, is_tag) in prompt order."""
    if tools:
        yield "<|im_system|>", True
        yield "tool_declare", False
        yield "<|im_middle|>", True
        yield json.dumps(tools, separators=(",", ":"), ensure_ascii=False), False
        yield "<|im_end|>", True
    for m in messages:
        role = m["role"]
        yield ROLE_TAG[role], True
        yield role, False
        yield "<|im_middle|>", True
        text = message_text(m.get("content"))
        if role == "tool":
            yield f"## Return of {m.get('tool_call_id') or ''}\n", False
        if text:
            yield text, False
        if role == "assistant" and m.get("tool_calls"):
            yield "<|tool_calls_section_begin|>", True
            for i, tc in enumerate(m["tool_calls"]):
                fn = tc["function"]
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
                tid = tc.get("id") or f"functions.{fn['name']}:{i}"
                yield "<|tool_call_begin|>", True
                yield tid, False
                yield "<|tool_call_argument_begin|>", True
                yield args, False
                yield "<|tool_call_end|>", True
            yield "<|tool_calls_section_end|>", True
        yield "<|im_end|>", True
    if add_generation_prompt:
        yield from generation_prompt_pieces(thinking)


def encode_chat(tok, messages: Sequence[dict], tools: Optional[list] = None, thinking: bool = True) -> List[int]:
    ids: List[int] = []
    for piece, is_tag in chat_pieces(messages, tools, thinking):
        if is_tag and piece in tok.special_to_id:
            ids.append(tok.special_to_id[piece])
        else:
            ids.extend(tok.encode(piece))
    return ids
