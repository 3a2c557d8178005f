"""The OpenAI request bodies this server accepts (pydantic), and its OpenAI-style errors.

Field types are strict (``"5"`` is not an integer, ``true`` is not a number), ranges are checked here, and
every error names the field (``param``) the way OpenAI's do: ``{"error": {"message", "type", "param",
"code"}}``. Fields OpenAI defines that this server does not implement (``logprobs``, penalties, ``n > 1``)
are refused with a clear message when set to anything but their neutral value, never silently ignored;
unknown fields are ignored (clients send vendor extensions).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

MAX_STOP_STRINGS = 16
TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


class ApiError(Exception):
    """An OpenAI-style error with its HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, type: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Num = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Body):
    name: StrictStr
    arguments: Union[StrictStr, Dict[str, Any]] = "{}"


class ToolCallIn(_Body):
    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[List[ToolCallIn]] = None
    tool_call_id: Optional[StrictStr] = None


class FunctionDef(_Body):
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChatTemplateKwargs(_Body):
    thinking: StrictBool = True


class _Sampling(_Body):
    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Num] = None
    top_p: Optional[Num] = None
    top_k: Optional[StrictInt] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[StrictBool, StrictInt]] = None
    presence_penalty: Optional[Num] = None
    frequency_penalty: Optional[Num] = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False        # extension: the generated ids in the response's "ddtree" field


class ChatRequest(_Sampling):
    messages: List[Message]
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[StrictStr, Dict[str, Any]]] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    top_logprobs: Optional[StrictInt] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None


def parse_body(model, data) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        msg = err["msg"]
        if any(_is_union_tag(p) for p in err["loc"]):       # the first of several accepted types failed
            msg = f"{type(err.get('input')).__name__} value {str(err.get('input'))[:40]!r} has the wrong type"
        raise ApiError(400, f"{param}: {msg}", param=param or None) from None


def _is_union_tag(p) -> bool:
    """pydantic puts the Union alternative it tried ('str', 'list[int]', ...) in the location: not a field."""
    return isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "dict"))


def check_common(req: _Sampling, vocab_size: int, max_positions: int) -> None:
    """Range checks shared by both endpoints (the engine's Request.validate repeats the essential ones)."""
    if req.n != 1:
        raise ApiError(400, f"n: only n = 1 is supported, got {req.n}", "n")
    if req.max_tokens is not None and not 1 <= req.max_tokens <= max_positions:
        raise ApiError(400, f"max_tokens: must be in [1, {max_positions}] (the context length), got "
                            f"{req.max_tokens}", "max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise ApiError(400, f"temperature: must be in [0, 2], got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise ApiError(400, f"top_p: must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and not (req.top_k == -1 or 0 <= req.top_k <= vocab_size):
        raise ApiError(400, f"top_k: must be -1 or 0 (off) or in [1, {vocab_size}], got {req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2 ** 64:
        raise ApiError(400, f"seed: must be in [0, 2^64), got {req.seed}", "seed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    if req.logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs: not supported by this server", "logprobs")
    for nm in ("presence_penalty", "frequency_penalty"):
        if getattr(req, nm) not in (None, 0, 0.0):
            raise ApiError(400, f"{nm}: not supported by this server (only 0)", nm)


def check_chat(req: ChatRequest) -> None:
    if not req.messages:
        raise ApiError(400, "messages: must hold at least one message", "messages")
    if req.max_completion_tokens is not None and req.max_tokens is not None \
            and req.max_completion_tokens != req.max_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree", "max_completion_tokens")
    if req.top_logprobs not in (None, 0):
        raise ApiError(400, "top_logprobs: not supported by this server", "top_logprobs")
    for i, m in enumerate(req.messages):
        p = f"messages.{i}"
        if m.role == "assistant":
            if m.content is None and not m.tool_calls:
                raise ApiError(400, f"{p}: an assistant message needs content or tool_calls", f"{p}.content")
        elif m.content is None:
            raise ApiError(400, f"{p}.content: a {m.role} message needs content", f"{p}.content")
        elif m.tool_calls:
            raise ApiError(400, f"{p}.tool_calls: only assistant messages carry tool calls", f"{p}.tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(400, f"{p}.tool_call_id: a tool message must name the call it answers",
                           f"{p}.tool_call_id")
    names = set()
    for i, t in enumerate(req.tools or []):
        p = f"tools.{i}.function"
        if not TOOL_NAME.match(t.function.name):
            raise ApiError(400, f"{p}.name: must be 1-64 of a-z, A-Z, 0-9, _ and -, got {t.function.name!r}",
                           f"{p}.name")
        if t.function.name in names:
            raise ApiError(400, f"{p}.name: {t.function.name!r} is declared twice", f"{p}.name")
        names.add(t.function.name)
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError(400, f"{p}.parameters: must be a JSON Schema of type 'object'", f"{p}.parameters")
    tc = req.tool_choice
    if tc is not None and tc not in ("none", "auto"):
        if isinstance(tc, str):
            raise ApiError(400, f"tool_choice: {tc!r} is not supported (use 'auto' or 'none'; this server "
                                f"does not force a call)", "tool_choice")
        raise ApiError(400, "tool_choice: naming a function is not supported (use 'auto' or 'none')",
                       "tool_choice")
    if tc is not None and tc != "none" and not req.tools:
        raise ApiError(400, "tool_choice: given without tools", "tool_choice")


def stop_strings(req: _Sampling) -> List[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
