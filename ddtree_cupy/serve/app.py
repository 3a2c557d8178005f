"""The OpenAI-compatible HTTP API over an ``engine.loop.EngineLoop`` (FastAPI; docs/SERVING.md).

Each request is checked (``protocol.py``), rendered to prompt ids (``chat.py`` or the tokenizer), submitted
to the loop, and answered from the tokens the loop delivers: decoded incrementally with ``stop`` strings
(``text.py``), split into reasoning / content / tool calls for chat (``parse.py``), streamed as server-sent
events or gathered into one JSON body. A client that goes away (a closed connection) cancels its stream;
the loop frees its pages at the next step boundary and no other stream notices.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, List, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Refused, Request
from ..engine.loop import EngineLoop
from .chat import encode_chat
from .metrics import ServerMetrics
from .parse import Delta, KimiOutputParser
from .protocol import (ApiError, ChatRequest, CompletionRequest, check_chat, check_common, parse_body,
                       stop_strings)
from .text import StreamText

DEFAULT_MAX_TOKENS = 4096
REFUSAL_STATUS = {"invalid": 400, "too_long": 413, "queue_full": 429, "shutdown": 503}


@dataclass
class ServerState:
    loop: EngineLoop
    tok: object                       # KimiTokenizer
    vocab_size: int
    max_positions: int
    model_name: str
    metrics: ServerMetrics
    api_key: Optional[str] = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    backend: str = "numpy"
    mode: str = "ddtree"


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ddtree_cupy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    def auth(request: HttpRequest) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if got != f"Bearer {state.api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise ApiError(404, f"model: {name!r} does not exist; this server serves {state.model_name!r}",
                           "model", type="not_found_error", code="model_not_found")

    @app.get("/health")
    async def health():
        if state.loop.error is not None:
            return JSONResponse({"status": "error", "error": str(state.loop.error)}, status_code=503)
        return {"status": "ok", "running": state.loop.running, "queued": state.loop.queued}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(state.loop), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        auth(request)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name}")
    async def model(name: str, request: HttpRequest):
        auth(request)
        check_model(name)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        auth(request)
        req = parse_body(ChatRequest, await _json(request))
        check_model(req.model)
        check_common(req, state.vocab_size, state.max_positions)
        check_chat(req)
        thinking = req.chat_template_kwargs.thinking if req.chat_template_kwargs else True
        tools = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        msgs = [dict(m.model_dump(exclude_none=True), role="system" if m.role == "developer" else m.role)
                for m in req.messages]
        ids = encode_chat(state.tok, msgs, tools, thinking)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = _Job(state, req, ids, max_tokens, "messages", KimiOutputParser(thinking, tools=tools is not None))
        return await job.respond(request)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        auth(request)
        req = parse_body(CompletionRequest, await _json(request))
        check_model(req.model)
        check_common(req, state.vocab_size, state.max_positions)
        if req.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt: one prompt per request (got {len(p)})", "prompt")
            p = p[0]
        if isinstance(p, str):
            ids = state.tok.encode(p)
        else:
            ids = [int(t) for t in p]
            bad = [t for t in ids if not 0 <= t < state.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token ids {bad[:8]} outside the vocabulary [0, {state.vocab_size})",
                               "prompt")
        if not ids:
            raise ApiError(400, "prompt: is empty", "prompt")
        job = _Job(state, req, ids, req.max_tokens, "prompt", None)
        if req.echo:
            job.echo = state.tok.decode(ids)
        return await job.respond(request)

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "ddtree_cupy",
            "max_model_len": state.max_positions}


async def _json(request: HttpRequest):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


class _Job:
    """One request's life: submit, gather or stream, finish."""

    def __init__(self, state: ServerState, req, ids: List[int], max_tokens: Optional[int], prompt_param: str,
                 parser: Optional[KimiOutputParser]):
        self.state, self.req, self.ids, self.parser = state, req, ids, parser
        self.chat = parser is not None
        self.prompt_param = prompt_param
        self.echo = ""
        if len(ids) >= state.max_positions:
            raise ApiError(413, f"{prompt_param}: the prompt has {len(ids)} tokens; the context length is "
                                f"{state.max_positions} and at least one token must remain for the answer",
                           prompt_param, code="context_length_exceeded")
        if max_tokens is None:     # admission reserves KV for all of it: never more than one stream holds
            room = state.loop.sched.pool.max_tokens_per_stream() - len(ids)
            max_tokens = max(1, min(state.default_max_tokens, state.max_positions - len(ids), room))
        temp = 1.0 if req.temperature is None else float(req.temperature)
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little")
        stop_ids = () if req.ignore_eos else state.tok.stop_ids
        self.request = Request(ids, int(max_tokens), tuple(stop_ids), temp,
                               1.0 if req.top_p is None else float(req.top_p),
                               max(0, req.top_k or 0), seed, 0)
        self.text = StreamText(state.tok, stop_ids, stop_strings(req))
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped_by_string = False

    # ---- submission --------------------------------------------------------------------------------------
    def _submit(self) -> None:
        aloop = asyncio.get_running_loop()
        q = self.queue

        def sink(h, toks, fin):      # loop thread -> this request's event loop
            aloop.call_soon_threadsafe(q.put_nowait, (list(toks), fin))
        try:
            self.handle = self.state.loop.submit(self.request, sink)
        except Refused as e:
            self.state.metrics.refused(e.kind)
            param = self.prompt_param if e.kind in ("invalid", "too_long") else None
            typ = {"queue_full": "rate_limit_error", "shutdown": "server_error"}.get(e.kind, "invalid_request_error")
            raise ApiError(REFUSAL_STATUS[e.kind], str(e), param, type=typ, code=e.kind) from None

    async def _events(self, request: HttpRequest) -> AsyncIterator[Delta]:
        """Deltas of text (parsed for chat) as the loop delivers tokens; ends when the stream ends."""
        while True:
            try:
                toks, fin = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.state.loop.cancel(self.handle)
                    raise asyncio.CancelledError
                continue
            if toks and not self.text.stopped:
                d = self._parse(self.text.feed(toks))
                if self.text.stopped:              # a stop string: end the stream now, drop the rest
                    self.stopped_by_string = True
                    self.state.loop.cancel(self.handle, "stop")
                if d:
                    yield d
            if fin is not None:
                d = self._parse(self.text.flush())
                if self.parser is not None:
                    tail = self.parser.flush()
                    d = Delta(d.reasoning + tail.reasoning, d.content + tail.content,
                              (d.tool_calls or []) + (tail.tool_calls or []) or None)
                if d:
                    yield d
                return

    def _parse(self, text: str) -> Delta:
        if self.parser is None:
            return Delta(content=text)
        return self.parser.feed(text) if text else Delta()

    def finish_reason(self) -> str:
        st = self.handle.stream
        if st.finish_reason == "error":             # the engine failed (refusals happen before submission)
            raise ApiError(500, st.error or "engine error", type="server_error")
        if self.stopped_by_string or st.finish_reason == "stop":
            return "tool_calls" if self.parser is not None and self.parser.calls else "stop"
        if st.finish_reason == "cancelled":
            return "abort"
        return "length"                             # 'length' and 'context'

    def usage(self) -> dict:
        n = len(self.handle.stream.output_ids)
        return {"prompt_tokens": len(self.ids), "completion_tokens": n, "total_tokens": len(self.ids) + n}

    def extension(self) -> dict:
        st = self.handle.stream
        ext = {"mean_accept_len": st.mean_accept_len, "steps": st.steps, "backend": self.state.backend,
               "mode": self.state.mode, "malformed_tool_calls": self.parser.malformed if self.parser else 0}
        if self.req.return_token_ids:
            ext["prompt_token_ids"] = list(self.ids)
            ext["token_ids"] = list(st.output_ids)
        return ext

    # ---- answers -----------------------------------------------------------------------------------------
    async def respond(self, request: HttpRequest):
        self._submit()
        if self.req.stream:
            return StreamingResponse(self._sse(request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            reasoning, content, calls = "", self.echo, []
            async for d in self._events(request):
                reasoning += d.reasoning
                content += d.content
                calls += d.tool_calls or []
        except asyncio.CancelledError:
            self.state.loop.cancel(self.handle)
            raise
        fin = self.finish_reason()
        if self.chat:
            msg = {"role": "assistant", "content": content if (content or not calls) else None}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = [_call_json(c, with_index=False) for c in calls]
            choice = {"index": 0, "message": msg, "finish_reason": fin, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "finish_reason": fin, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": [choice], "usage": self.usage(), "ddtree": self.extension()}

    def _chunk(self, choice: Optional[dict], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": [choice] if choice is not None else []}
        body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _delta_choice(self, d: Delta) -> dict:
        if not self.chat:
            return {"index": 0, "text": d.content, "finish_reason": None, "logprobs": None}
        delta = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [_call_json(c, with_index=True) for c in d.tool_calls]
        return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}

    async def _sse(self, request: HttpRequest) -> AsyncIterator[str]:
        done = False
        try:
            if self.chat:
                yield self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                   "logprobs": None})
            elif self.echo:
                yield self._chunk({"index": 0, "text": self.echo, "finish_reason": None, "logprobs": None})
            async for d in self._events(request):
                yield self._chunk(self._delta_choice(d))
            try:
                fin = self.finish_reason()
            except ApiError as e:           # the stream has started: report in-band, as OpenAI does
                yield f"data: {json.dumps(e.body())}\n\n"
                done = True
                return
            last = ({"index": 0, "delta": {}, "finish_reason": fin, "logprobs": None} if self.chat
                    else {"index": 0, "text": "", "finish_reason": fin, "logprobs": None})
            yield self._chunk(last, ddtree=self.extension())
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._chunk(None, usage=self.usage())
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:                    # the client went away mid-stream
                self.state.loop.cancel(self.handle)


def _call_json(c, with_index: bool) -> dict:
    out = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    if with_index:
        out["index"] = c.index
    return out
